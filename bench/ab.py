#!/usr/bin/env python
"""A/B: fastcl's fast path against a variant of itself, or against another commit.

    python bench/ab.py                     # GPU: infonce N=M=32768 and 16384, noise K=N=16384
    python bench/ab.py --device cpu --n 256 --noise-n 128 --d 64     # a tiny CPU run
    python bench/ab.py --device cpu --objectives infonce,matryoshka --n 2048 --noise-n ""
    git worktree add /tmp/base HEAD~1 && python bench/ab.py --base /tmp/base   # two commits

Variants of this checkout, measured one after the other on the same inputs in one process:
``new`` (the default), ``autotune=0`` (``FASTCL_AUTOTUNE=0``: the first config of each
autotune list), ``chunk=R`` (``chunk_size=R`` anchor rows per chunk) and
``no-input-checks`` (``fastcl.set_input_checks(False)``: no NaN/Inf scan of the inputs, whose
result the host waits for). A performance change is compared between commits, not kept
behind a switch: ``--base DIR`` (a checkout of the other commit, e.g. a ``git worktree``)
measures each case in two fresh processes, one importing fastcl from ``DIR`` (variant
``base``) and one from this checkout, alternately.

Per case and variant: the median forward+backward time (``triton.testing.do_bench`` on
GPU; on CPU also the process's CPU time, which a machine loaded by other work leaves
steadier than the wall time), the first call (autotuning and compilation), the peak memory beyond the inputs (GPU),
useful TFLOP/s as a percentage of the ``torch.mm`` throughput measured once per shape, what
autotuning chose, and the result against the default's: the loss (relative difference), or
for the noise update the distance between the two noises over the largest distance the
ascent can move them (steps · lr · √K). A variant that fails is a row saying so; the JSON is
rewritten after every row, so a run cut short keeps what it measured.

Outputs: a table, ``<stem>.json`` and ``<stem>.csv`` (default stem
``bench/results/<device>-<date>-ab``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _autotune
import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
import _report
from _cases import NOISE_STEPS, OBJECTIVES, from_spec, num_candidates
from _env import device_slug, environment
from _measure import add_throughput, default_threads, matmul_limit, select_device, sync
from _runner import measure_in_process

HERE = Path(__file__).resolve().parent
#: The variants run by default (``--variants``), besides ``new``.
DEFAULT_VARIANTS = ("chunk=4096", "chunk=6144", "no-input-checks")
#: The environment variables a ``NAME=VALUE`` variant may set (``FASTCL_NAME=VALUE``).
OPT_IN = ("FASTCL_AUTOTUNE",)


#: The variant that switches fastcl's input checks off (the current design otherwise).
NO_CHECKS = "no-input-checks"


def apply_variant(spec: dict, variant: str) -> dict:
    """The spec for ``variant`` ("" for the default; ``chunk=R``, ``no-input-checks``, or
    ``NAME=VALUE`` for ``FASTCL_NAME=VALUE``), with the environment set for it."""
    for name in OPT_IN:
        os.environ.pop(name, None)
    if variant == NO_CHECKS:
        return {**spec, "input_checks": False}
    if variant.startswith("chunk="):
        return {**spec, "chunk_size": int(variant.split("=", 1)[1])}
    if "=" in variant:
        name, value = (part.strip() for part in variant.split("=", 1))
        if f"FASTCL_{name.upper()}" not in OPT_IN:
            raise ValueError(f"unknown variant {variant!r}: NAME=VALUE sets one of {OPT_IN}")
        os.environ[f"FASTCL_{name.upper()}"] = value
    elif variant:
        raise ValueError(f"unknown variant {variant!r}")
    return spec


def record_autotuning() -> None:
    """Keep what autotuning chooses and measures from here on (``_autotune.record``)."""
    try:
        _autotune.record()
    except Exception:  # no Triton, or a broken import: chosen_configs() says which
        pass


def chosen_configs(what: str = "chosen_configs"):
    """What autotuning picked so far in this process (``_autotune.chosen_configs()``; with
    ``what="autotune_timings"`` every config's time), or a string saying why that is not
    available."""
    try:
        from fastcl.kernels import contrastive  # noqa: F401
    except Exception as exc:  # no Triton, or a broken import: report it
        return f"not available: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    fn = getattr(_autotune, what)
    try:
        return json.loads(json.dumps(fn(), default=str))
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}".splitlines()[0][:200]


# --------------------------------------------------------------------------- one variant

def noise_result(spec: dict, device: str):
    """The noise the update returns for this spec (one more call, for the comparison)."""
    case = from_spec(spec, device)
    z = case.step().detach().float()
    sync(device)
    return z


def compare(row: dict, base: dict | None, z, z_base, spec: dict) -> None:
    """Fill ``rel_diff`` and ``same`` of ``row`` against the current design's row."""
    tol = 1e-2 if spec["dtype"] in ("bfloat16", "float16") else 1e-4
    row["tolerance"] = tol
    if spec["objective"] == "noise":
        if z is None or z_base is None:
            return
        import fastcl
        lr = inspect.signature(fastcl.dclr_noise).parameters["lr"].default
        reach = NOISE_STEPS * lr * math.sqrt(z.shape[0])
        row["rel_diff"] = float((z - z_base).norm()) / reach
        row["compared"] = "‖z − z_new‖ / (steps·lr·√K)"
    elif base is not None and row.get("loss") is not None and base.get("loss") is not None:
        row["rel_diff"] = abs(row["loss"] - base["loss"]) / max(abs(base["loss"]), 1e-12)
        row["compared"] = "loss"
    if "rel_diff" in row:
        row["same"] = row["rel_diff"] < tol


def measure_variant(spec, variant, device, args, mm) -> tuple[dict, object]:
    try:
        spec = apply_variant(spec, variant)
    except ValueError as exc:
        return {**spec, "variant": variant, "ok": False, "error": str(exc)}, None
    row = {**spec, "variant": variant or "new",
           **{name.lower(): os.environ[name] for name in OPT_IN if name in os.environ}}
    row.update(measure_in_process(spec, device, args.warmup_ms, args.rep_ms))
    z = None
    if row.get("ok"):
        add_throughput(row, mm)
        if spec["objective"] == "noise":
            try:
                z = noise_result(spec, device)
            except Exception as exc:
                row["compare_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    row["chosen_configs"] = chosen_configs()
    return row, z


def measure_checkout(checkout: Path, spec, device, args, mm) -> tuple[dict, object]:
    """One case in a fresh process importing fastcl from ``checkout`` (this script's worker
    mode); the noise comes back as a file."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(HERE / "ab.py"), "--worker", json.dumps(
            {"spec": spec, "device": device, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
             "threads": args.threads, "noise": str(Path(tmp) / "z.pt")})]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(checkout), str(checkout / "bench"), str(HERE)]
            + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
        for name in OPT_IN:
            env.pop(name, None)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(checkout),
                              timeout=args.case_timeout)
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            row = {"ok": False, "error": f"worker exit {proc.returncode}: "
                   + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        z = torch.load(Path(tmp) / "z.pt") if (Path(tmp) / "z.pt").exists() else None
    row = {**spec, **row, "variant": "base" if checkout != HERE.parent else "new",
           "checkout": str(checkout)}
    if row.get("ok"):
        add_throughput(row, mm)
    return row, z


def worker(job: dict) -> dict:
    """``--worker``: one case in this process (fastcl from ``PYTHONPATH``)."""
    import torch

    import fastcl
    torch.set_num_threads(job["threads"])
    record_autotuning()
    row = {"fastcl_file": fastcl.__file__, **measure_in_process(
        job["spec"], job["device"], job["warmup_ms"], job["rep_ms"])}
    if row.get("ok") and job["spec"]["objective"] == "noise":
        torch.save(noise_result(job["spec"], job["device"]).cpu(), job["noise"])
    row["chosen_configs"] = chosen_configs()
    return row


# --------------------------------------------------------------------------- output

HEAD = ("case", "variant", "ran", "median ms", "x new", "1st call s", "peak MiB", "TFLOP/s",
        "% mm", "loss", "rel diff", "same")


def table(rows) -> str:
    new = {r["case"]: r for r in rows if r["variant"] == "new" and r.get("ok")}
    body = []
    for r in rows:
        cells = [r["case"], r["variant"], r.get("backend") or ""]
        if not r.get("ok"):
            body.append((cells, ("SKIPPED: " if r.get("skipped") else "ERROR: ") + str(r.get("error"))))
            continue
        base = new.get(r["case"])
        fmt = lambda v, f: "" if v is None else format(v, f)
        cells += [f"{r['median_s'] * 1e3:.2f}",
                  fmt(base and r["median_s"] / base["median_s"], ".3f"),
                  fmt(r.get("first_call_s"), ".2f"), fmt(r.get("peak_beyond_inputs_mib"), ".1f"),
                  fmt(r.get("tflops"), ".3g"), fmt(r.get("pct_of_matmul"), ".1f"),
                  fmt(r.get("loss"), ".6g"), fmt(r.get("rel_diff"), ".2e"),
                  {True: "yes", False: "NO"}.get(r.get("same"), "")]
        body.append((cells, None))
    return _report._render(HEAD, body, right=set(range(3, len(HEAD))))


def autotune_lines(timed) -> list:
    """Every config autotuning timed in the process (``_autotune.autotune_timings()``), fastest
    first per list and key: what the tile lists are chosen by on a GPU."""
    lines = []
    for configs, keys in (timed if isinstance(timed, dict) else {}).items():
        for key, times in keys.items():
            lines.append(f"{configs}  key {key}")
            best = min(times.values()) if times else None
            for config, ms in sorted(times.items(), key=lambda kv: kv[1]):
                config = ", ".join(p for p in config.split(", ")
                                   if not p.startswith(("num_ctas", "maxnreg")))
                lines.append(f"  {ms:9.4f} ms  {ms / best:5.2f}x  {config}")
    return lines


def status(row, base) -> str:
    what = f"{row['case']} {row['variant']}"
    if not row.get("ok"):
        return f"{what}: {'skipped' if row.get('skipped') else 'ERROR'}: {row.get('error')}"
    mem = row.get("peak_beyond_inputs_mib")
    return (f"{what}: {row['median_s'] * 1e3:.2f} ms"
            + (f" ({row['median_s'] / base['median_s']:.3f}x new)" if base and base is not row else "")
            + (f", {mem:.1f} MiB" if mem is not None else "")
            + (f", CPU time {row['cpu_median_s'] * 1e3:.2f} ms"
               + (f" ({row['cpu_median_s'] / base['cpu_median_s']:.3f}x new)"
                  if base and base is not row and base.get("cpu_median_s") else "")
               if row.get("cpu_median_s") is not None else "")
            + (f", {row['pct_of_matmul']:.1f}% of mm" if row.get("pct_of_matmul") is not None else "")
            + (f", rel diff {row['rel_diff']:.1e}" + ("" if row["same"] else " MISMATCH")
               if row.get("rel_diff") is not None else ""))


def write(report, stem: Path) -> None:
    stem.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(f"{stem}.json")
    if report["rows"]:
        _report.write_csv([{k: v for k, v in r.items() if k != "chosen_configs"}
                           for r in report["rows"]], Path(f"{stem}.csv"))


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--n", default=None, help="comma list of N (GPU default 32768,16384)")
    p.add_argument("--objectives", default="infonce",
                   help="comma list of _cases.OBJECTIVES measured at each --n (default infonce)")
    p.add_argument("--noise-n", default=None, help="comma list of noise-update K=N (GPU default "
                   "16384; '' for none)")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--variants", default=",".join(("new",) + DEFAULT_VARIANTS),
                   help="comma list: new (the default), NAME=VALUE (FASTCL_NAME=VALUE: "
                        f"autotune=0), chunk=R (chunk_size=R), {NO_CHECKS}")
    p.add_argument("--base", type=Path, default=None,
                   help="a checkout of another commit: each case runs in two fresh processes, "
                        "fastcl from DIR (base) and from this checkout (new); --variants ignored")
    p.add_argument("--case-timeout", type=float, default=600, help="seconds per --base process")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--warmup-ms", type=float, default=10, help="do_bench warm-up (GPU)")
    p.add_argument("--rep-ms", type=float, default=50, help="do_bench measuring time (GPU)")
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads on CPU")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: variants not started by then are rows saying so")
    p.add_argument("--out-stem", default=None, help="output path without extension")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker)), default=str))
        return 0
    if args.base is not None and not (args.base / "fastcl" / "__init__.py").exists():
        p.error(f"--base {args.base}: not a fastcl checkout (no fastcl/__init__.py)")

    import torch

    device, gpu = select_device(args.device, args.threads)
    record_autotuning()
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    ns = [int(x) for x in (args.n or ("32768,16384" if gpu else "256")).split(",") if x.strip()]
    noise_ns = [int(x) for x in (args.noise_n if args.noise_n is not None
                                 else "16384" if gpu else "128").split(",") if x.strip()]
    objectives = [o.strip() for o in args.objectives.split(",") if o.strip()]
    unknown = sorted(set(objectives) - set(OBJECTIVES))
    if unknown:
        p.error(f"--objectives: unknown {unknown} (one of {', '.join(OBJECTIVES)})")
    cases = [(o, n) for o in objectives for n in ns] + [("noise", n) for n in noise_ns]
    variants = ["" if v.strip() == "new" else v.strip() for v in args.variants.split(",") if v.strip()]
    if args.base is not None:                       # this checkout, then the other commit's
        variants = ["", "base"]
    stem = Path(args.out_stem) if args.out_stem else (
        HERE / "results" / f"{device_slug(device)}-{datetime.date.today().isoformat()}-ab")

    saved = {name: os.environ.get(name) for name in OPT_IN}
    report = {"benchmark": "fastcl A/B: the default design against its variants"
              + (f" and the checkout {args.base}" if args.base is not None else ""),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "device": device,
              "environment": environment(device, args.threads),
              "settings": vars(args), "matmul": [], "rows": []}
    print(f"fastcl A/B | {device} | {dtype} d={args.d} | cases "
          + ", ".join(f"{o} N={n}" for o, n in cases) + " | variants "
          + ", ".join(v or "new" for v in variants), flush=True)
    t0 = time.perf_counter()
    try:
        for objective, n in cases:
            spec = {"kind": "case", "objective": objective, "impl": "fastcl", "n": n,
                    "m": num_candidates(objective, n), "d": args.d, "dtype": dtype, "seed": 0}
            name = f"{objective} N={n}"
            try:
                mm = {"ok": True, **matmul_limit(n, spec["m"], args.d, getattr(torch, dtype), device)}
            except Exception as exc:
                mm = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            report["matmul"].append(mm)
            base, z_base = None, None
            for variant in variants:
                if args.time_budget is not None and time.perf_counter() - t0 > args.time_budget:
                    row, z = {**spec, "variant": variant or "new", "ok": False, "skipped": True,
                              "error": f"time budget of {args.time_budget:g} s spent"}, None
                elif args.base is not None:
                    row, z = measure_checkout(args.base if variant else HERE.parent, spec, device,
                                              args, mm)
                else:
                    row, z = measure_variant(spec, variant, device, args, mm)
                row["case"] = name
                if variant == "":
                    base, z_base = (row, z) if row.get("ok") else (None, None)
                elif row.get("ok"):
                    compare(row, base, z, z_base, spec)
                report["rows"].append(row)
                report["autotune_ms"] = chosen_configs("autotune_timings")
                report["elapsed_s"] = time.perf_counter() - t0
                write(report, stem)
                print("  " + status(row, base), flush=True)
                del z
                gc.collect()
                if gpu:
                    torch.cuda.empty_cache()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    print("\n" + table(report["rows"]))
    bad = [r for r in report["rows"] if r.get("same") is False]
    print(f"\nx new = time over the default's; rel diff = against the default "
          f"(loss; noise: ‖Δz‖/(steps·lr·√K)); {len(bad)} variant(s) disagree beyond tolerance")
    lines = autotune_lines(report.get("autotune_ms"))
    print("\nautotune: median ms of each config tried (Triton's benchmark, per list and key)\n"
          + ("\n".join(lines) if lines else "no config was timed (one config a list, or no GPU)"))
    print(f"{time.perf_counter() - t0:.0f} s; wrote {stem}.json, {stem}.csv")
    return 1 if any(not r.get("ok") and not r.get("skipped") for r in report["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
