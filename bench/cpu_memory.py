"""Forward+backward peak memory and time of the fastcl implementations on CPU.

For each objective and implementation this script starts a fresh Python process
(this file in a hidden ``--worker`` mode) that

1. builds the inputs with a fixed seed and records the resident set size
   (``VmRSS`` in ``/proc/self/status``): the *baseline*;
2. runs one warm-up forward + ``loss.backward()`` (one-off costs: lazy library
   initialisation, ``torch.compile``), drops the gradients and returns freed heap
   pages to the OS (``malloc_trim``);
3. resets the kernel's peak-RSS counter (writes ``5`` to ``/proc/self/clear_refs``,
   which sets ``VmHWM`` back to the current RSS), runs ``--repeats`` timed
   forward + backward passes and reads the peak RSS (``VmHWM``) after the first one.

Reported: *peak RSS beyond the inputs* = ``VmHWM`` after the first measured run −
baseline, and the median wall time over the repeats (``time.perf_counter``). This is
resident memory of the whole process, not a count of tensor bytes: it includes
anything the first pass left resident (library code pages, allocator caches), which
is reported separately as ``retained_after_warmup_mib``. A fresh process per case
keeps one implementation's high-water mark or heap from leaking into another's.

Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (unless ``--system-malloc`` is
given or the variable is already set): glibc then serves every block of 1 MiB or more
with its own mapping, so a freed tensor leaves the RSS at once. With glibc's adaptive
default, freed blocks may stay on the heap and the peak depends on allocation history
(run to run it varied by about two N×M matrices at N=2048).

If the peak counter cannot be reset on this kernel, the worker falls back to
measuring the warm-up run itself (the first run in the fresh process, baseline taken
just before it); the JSON says which method was used (``memory_method``).

Implementations: ``reference`` (``backend="reference"``: full N×M matrices through
autograd), ``tiled`` (``backend="tiled"``: chunked, gradients formed in the forward
pass) and, with ``--compile``, ``compiled`` (``torch.compile`` of the function in
:mod:`fastcl.reference`). A case that fails or whose process dies (for example
killed when out of memory) becomes a row with an error instead of stopping the run.

Example::

    python bench/cpu_memory.py --objective infonce,dclr --n 4096 --d 768
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from pathlib import Path

from _measure import (MIB, answer_as_worker, cpu_model, default_threads, malloc_settings, measure_cpu,
                      run_fresh_process, worker_env)

OBJECTIVES = ("infonce", "infonce-hard", "focal", "dclr", "escl")
IMPLS = ("reference", "tiled", "compiled")
DTYPES = ("float32", "float64", "bfloat16", "float16")


# --------------------------------------------------------------------------- worker

def num_candidates(objective: str, n: int) -> int:
    """M: positives, plus N hard negatives (infonce-hard) or N noise negatives (dclr)."""
    return 2 * n if objective in ("infonce-hard", "dclr") else n


def build_case(objective: str, impl: str, n: int, d: int, dtype, seed: int, chunk_size):
    """Inputs and a closure running forward + backward. Returns ``(step, leaves)``;
    ``leaves`` are the tensors that get gradients."""
    import torch

    import fastcl
    from fastcl import reference

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, grad=True):
        x = torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
        return x.requires_grad_(grad)

    anchors, positives = randn(n, d), randn(n, d)
    leaves = [anchors, positives]
    args, kwargs = (anchors, positives), {}

    if objective in ("infonce", "infonce-hard"):
        name = "infonce"
        if objective == "infonce-hard":
            negatives = randn(n, d)
            leaves.append(negatives)
            args, kwargs = (anchors, positives, negatives), {"hard_negative_weight": 1.0}
    elif objective == "focal":
        name = "focal_infonce"
    elif objective == "dclr":
        name = "dclr_loss"
        # The frozen complementary model is a different, smaller encoder: 384 wide, no grad.
        complementary = (randn(n, 384, grad=False), randn(n, 384, grad=False))
        noise_gen = torch.Generator()
        kwargs = {"complementary": complementary, "phi": 0.9, "noise_steps": 4,
                  "generator": noise_gen}  # noise_ratio=1.0: K = N noise negatives
    elif objective == "escl":
        name = "escl_loss"
        sensitive = randn(n, d)
        leaves.append(sensitive)
        args = (anchors, positives, sensitive)
    else:
        raise ValueError(objective)

    if impl == "compiled":
        fn = torch.compile(getattr(reference, name))
    else:
        fn = getattr(fastcl, name)
        kwargs = {**kwargs, "backend": impl}
        if impl == "tiled" and chunk_size is not None:
            kwargs["chunk_size"] = chunk_size

    def step():
        # Gradients are dropped, not zeroed, so every pass allocates them as a first one does.
        if objective == "dclr":
            noise_gen.manual_seed(seed + 1)  # same noise every run
        for x in leaves:
            x.grad = None
        loss = fn(*args, **kwargs)
        loss.backward()
        return loss

    return step, leaves


def worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    dtype = getattr(torch, spec["dtype"])
    step, leaves = build_case(spec["objective"], spec["impl"], spec["n"], spec["d"],
                              dtype, spec["seed"], spec["chunk_size"])
    out = measure_cpu(step, leaves, spec["repeats"])
    out["nm_matrix_mib"] = spec["n"] * spec["m"] * 4 / MIB
    return out


def run_worker(spec: dict, timeout, env: dict) -> dict:
    """Run one case in a fresh interpreter; any failure becomes an error row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    return run_fresh_process(cmd, dict(spec), timeout, env)


# --------------------------------------------------------------------------- parent

def table(rows: list[dict]) -> str:
    head = ("objective", "impl", "N", "M", "d", "dtype", "median s", "peak MiB",
            "x N·M", "warm-up MiB", "time/ref", "ref mem/mem")
    ref = {r["objective"]: r for r in rows if r["impl"] == "reference" and r.get("ok")}
    body = []
    for r in rows:
        cells = [r["objective"], r["impl"], str(r["n"]), str(r["m"]), str(r["d"]), r["dtype"]]
        if not r.get("ok"):
            body.append((cells, "ERROR: " + r.get("error", "unknown")))
            continue
        base = ref.get(r["objective"])
        t_ratio = m_ratio = ""
        if base is not None and r is not base:
            t_ratio = f"{r['median_s'] / base['median_s']:.2f}"
            m_ratio = f"{base['peak_beyond_inputs_mib'] / max(r['peak_beyond_inputs_mib'], 1e-9):.1f}"
        cells += [f"{r['median_s']:.3f}", f"{r['peak_beyond_inputs_mib']:.1f}",
                  f"{r['peak_beyond_inputs_mib'] / r['nm_matrix_mib']:.2f}",
                  f"{r['retained_after_warmup_mib']:.1f}", t_ratio, m_ratio]
        body.append((cells, None))
    widths = [max([len(h)] + [len(c[i]) for c, _ in body if i < len(c)]) for i, h in enumerate(head)]

    def fmt(cells):  # text columns left-aligned, numbers right-aligned
        return "  ".join(c.rjust(w) if i >= 2 and i != 5 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(cells) + ("  " + err if err else "") for cells, err in body]
    return "\n".join(lines)


def split_list(values, allowed, flag):
    items = [v.strip() for value in values for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", action="append", default=None,
                   help=f"repeatable or comma list of {', '.join(OBJECTIVES)} (default infonce)")
    p.add_argument("--n", type=int, default=16384, help="batch size N (= number of positives)")
    p.add_argument("--d", type=int, default=768, help="embedding width")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; time is their median")
    p.add_argument("--impl", action="append", default=None,
                   help="comma list of reference, tiled, compiled (default reference,tiled)")
    p.add_argument("--compile", action="store_true",
                   help="also measure torch.compile of the reference function (slow to compile)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch.set_num_threads in each worker (default: all usable cores)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="tiled rows per chunk (default: fastcl's memory budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--system-malloc", action="store_true",
                   help="keep glibc's adaptive mmap threshold (noisier peaks; see above)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per case (default none)")
    p.add_argument("--out", default=None, help="JSON output (default bench/results/cpu-memory-<date>.json)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker is not None:
        return answer_as_worker(args.worker, worker)

    objectives = split_list(args.objective or ["infonce"], OBJECTIVES, "--objective")
    impls = split_list(args.impl or ["reference,tiled"], IMPLS, "--impl")
    if args.compile and "compiled" not in impls:
        impls.append("compiled")
    if args.n < 1 or args.d < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("--n, --d, --repeats and --threads must be positive")

    import torch

    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    default_out = Path(__file__).resolve().parent / "results" / f"cpu-memory-{stamp}.json"
    out_path = Path(args.out) if args.out else default_out
    command = shlex.join([sys.executable, *sys.argv])
    print(f"torch {torch.__version__} | {cpu_model()} | {args.threads} threads | N={args.n} d={args.d} "
          f"{args.dtype} | {args.repeats} repeats | one fresh process per case", flush=True)

    env = worker_env(args.system_malloc)
    malloc_env = malloc_settings(env)

    rows = []
    for objective in objectives:
        for impl in impls:
            spec = {"objective": objective, "impl": impl, "n": args.n,
                    "m": num_candidates(objective, args.n), "d": args.d,
                    "dtype": args.dtype, "repeats": args.repeats, "threads": args.threads,
                    "seed": args.seed, "chunk_size": args.chunk_size}
            row = run_worker(spec, args.timeout, env)
            status = f"{row['median_s']:.3f} s" if row.get("ok") else row.get("error")
            print(f"  {objective:<12} {impl:<9} {status}", flush=True)
            rows.append(row)

    print()
    print(table(rows))
    methods = sorted({r["memory_method"] for r in rows if r.get("memory_method")})
    print("\npeak MiB = peak RSS of a fresh process beyond its RSS once the inputs exist; "
          "x N·M = that in units of one N×M float32 matrix;\nwarm-up MiB = part of it already "
          "resident before the measured run (left by the warm-up: libraries, thread pools)")
    print("memory method: " + "; ".join(methods or ["none (no case succeeded)"])
          + " | malloc: " + (" ".join(f"{k}={v}" for k, v in malloc_env.items()) or "glibc defaults"))

    report = {
        "benchmark": "fastcl CPU forward+backward peak RSS and time",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpu_model": cpu_model(),
        "threads": args.threads,
        "malloc_env": malloc_env,
        "settings": {**{k: v for k, v in vars(args).items() if k != "worker"},
                     "objective": objectives, "impl": impls, "out": str(out_path)},
        "results": rows,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
