"""``run.py --targets``: the Triton kernels' acceptance targets, each measured, compared with
its goal and printed PASS/FAIL with its numbers as soon as it is measured (``run.py``'s
docstring lists them)."""

from __future__ import annotations

import time

from _cases import num_candidates
from _plan import split_list
from _runner import Runner, status_line


def run_targets(args, runner: Runner, device: str, rows: list, targets: list, save) -> None:
    """The Triton kernels' targets, each measured, compared with its goal and printed at once.
    Rows and targets are appended to the lists given, and ``save()`` runs after each, so that
    a run cut short keeps what it measured."""
    dtype = args.target_dtype or ("bfloat16" if device == "cuda" else "float32")
    d, n, big = args.target_d, args.target_n, args.target_big_n
    t0 = time.perf_counter()

    def left():
        return None if args.time_budget is None else args.time_budget - (time.perf_counter() - t0)

    def case(objective, impl, nn, **extra):
        spec = {"kind": "case", "objective": objective, "impl": impl, "n": nn,
                "m": num_candidates(objective, nn), "d": d, "dtype": dtype, **extra}
        row = runner.run(spec)[0]
        rows.append(row)
        print("  " + ("" if extra.get("chunk_size") is None else f"chunk_size={extra['chunk_size']}: ")
              + status_line(row), flush=True)
        save()
        return row

    def target(name, goal, value=None, ok=False, detail="", result=None):
        targets.append({"target": name, "value": value, "goal": goal,
                        "result": result or ("ERROR" if value is None else "PASS" if ok else "FAIL"),
                        "detail": detail})
        print(targets_text(targets[-1:]), flush=True)
        save()

    def failure(*measured):
        return next((r.get("error") for r in measured if not r.get("ok")), "not measured")

    # 1. fused infonce at N=M=big as a fraction of the dense matmul throughput
    name = f"fused infonce fwd+bwd, N=M={big}, as a fraction of {dtype} matmul throughput"
    goal = f">= {args.goal_fraction:.0%}"
    fused_big = case("infonce", "fastcl", big)
    mm3 = runner.matmul(big, big, d, dtype, calls=3)
    if fused_big.get("ok") and mm3.get("ok"):
        frac = mm3["median_s"] / fused_big["median_s"]      # same FLOP count: 6·N·M·d
        target(name, goal, frac, frac >= args.goal_fraction,
               f"{fused_big['backend']}: {fused_big['median_s'] * 1e3:.2f} ms = "
               f"{fused_big['tflops']:.3g} TFLOP/s useful vs 3 torch.mm (N×d)@(d×M) in "
               f"{mm3['median_s'] * 1e3:.2f} ms = {mm3['tflops']:.3g} TFLOP/s")
    else:
        target(name, goal, detail=failure(fused_big, mm3))

    # 2, 3. speed and memory against the eager reference at N=M=n
    fused = case("infonce", "fastcl", n)
    ref = case("infonce", "reference", n)
    name, goal = f"speed vs eager reference, infonce N=M={n}", f">= {args.goal_speedup:g}x"
    if fused.get("ok") and ref.get("ok"):
        speed = ref["median_s"] / fused["median_s"]
        target(name, goal, speed, speed >= args.goal_speedup,
               f"{fused['median_s'] * 1e3:.2f} ms vs {ref['median_s'] * 1e3:.2f} ms")
    else:
        target(name, goal, detail=failure(fused, ref))
    name, goal = f"peak memory vs eager reference, infonce N=M={n}", f">= {args.goal_memory:g}x"
    fm, rm = fused.get("peak_beyond_inputs_mib"), ref.get("peak_beyond_inputs_mib")
    if fm is not None and rm is not None:
        ratio = rm / max(fm, 1e-9)
        target(name, goal, ratio, ratio >= args.goal_memory,
               f"{fm:.1f} MiB vs {rm:.1f} MiB ({fused.get('memory_method')})")
    else:
        target(name, goal, detail=failure(fused, ref) if not (fused.get("ok") and ref.get("ok"))
               else "memory not measured")

    # 4. the DCLR noise update against its own FLOP floor (its useful FLOPs at matmul speed)
    name = f"DCLR noise update (4 steps, K=N={n}) / its FLOP floor at {dtype} matmul throughput"
    goal = f"<= {args.goal_noise:g}x"
    noise = case("noise", "fastcl", n)
    mm = runner.matmul(n, n, d, dtype)
    if noise.get("ok") and mm.get("ok"):
        floor_s = noise["flops"] / (mm["tflops"] * 1e12)
        ratio = noise["median_s"] / floor_s
        target(name, goal, ratio, ratio <= args.goal_noise,
               f"{noise['median_s'] * 1e3:.2f} ms vs floor {floor_s * 1e3:.2f} ms "
               f"({noise['flops'] / 1e12:.3g} TFLOP at {mm['tflops']:.3g} TFLOP/s)")
    else:
        target(name, goal, detail=failure(noise, mm))

    # 5. against torch.compile of the reference (static shapes: its best case; compile excluded)
    name, goal = f"speed vs torch.compile(reference), infonce N=M={n}", f">= {args.goal_compiled:g}x"
    if left() is not None and left() < args.compile_reserve:
        target(name, goal, result="SKIPPED",
               detail=f"{left():.0f} s of the time budget left, --compile-reserve {args.compile_reserve:g} s")
    else:
        compiled = case("infonce", "compiled", n, compile_dynamic=False)
        if fused.get("ok") and compiled.get("ok"):
            speed = compiled["median_s"] / fused["median_s"]
            target(name, goal, speed, speed >= args.goal_compiled,
                   f"{fused['median_s'] * 1e3:.2f} ms vs {compiled['median_s'] * 1e3:.2f} ms "
                   f"(compile {compiled.get('compile_s') or 0:.1f} s)")
        else:
            target(name, goal, detail=failure(fused, compiled))

    # 6. Matryoshka over 5 widths against one full-width loss, both fastcl's choice of backend;
    #    on a GPU also the tiled one pass over d, the alternative to a fused call per width
    name, goal = (f"Matryoshka (5 widths) / one full-width loss, N=M={n}",
                  f"<= {args.goal_matryoshka:g}x")
    if left() is not None and left() <= 0:
        target(name, goal, result="SKIPPED", detail="time budget spent")
    else:
        mat = case("matryoshka", "fastcl", n)
        if fused.get("ok") and mat.get("ok"):
            ratio = mat["median_s"] / fused["median_s"]
            target(name, goal, ratio, ratio <= args.goal_matryoshka,
                   f"{mat['backend']}: {mat['median_s'] * 1e3:.2f} ms vs {fused['median_s'] * 1e3:.2f} ms")
        else:
            target(name, goal, detail=failure(fused, mat))
        if device == "cuda" and mat.get("backend") != "tiled" and (left() is None or left() > 0):
            case("matryoshka", "tiled", n)["note"] = "the tiled one pass over d"

    # 7. the chunk size trades memory for GEMM efficiency and launch overhead: a few rows, no
    #    goal (bench/ab.py compares the chunk sizings themselves)
    chunks = args.target_chunks
    if chunks is None:
        chunks = "1024,2048,4096" if device == "cuda" else ""
    for nn in (n, big):
        for chunk in (int(c) for c in split_list([chunks], None, "--target-chunks")):
            if left() is not None and left() <= 0:
                print(f"  chunk_size={chunk}, N={nn}: skipped (time budget spent)", flush=True)
                continue
            case("infonce", "fastcl", nn, chunk_size=chunk)["note"] = f"chunk_size={chunk}"
    save()


def targets_text(targets) -> str:
    lines = []
    for t in targets:
        v = t["value"]
        shown = ("—" if v is None else f"{100 * v:.1f}%" if "fraction" in t["target"] else f"{v:.2f}x")
        lines.append(f"  [{t['result']:<7}] {t['target']}: {shown} (goal {t['goal']})\n"
                     f"            {t['detail']}")
    return "\n".join(lines)

