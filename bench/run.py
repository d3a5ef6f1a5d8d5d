#!/usr/bin/env python
"""fastcl benchmark: time, memory and matmul efficiency of every implementation, side by side.

    python bench/run.py              # CPU defaults: a few minutes on a 2-core machine
    python bench/run.py --quick      # a small sweep, under a minute
    python bench/run.py --full       # GPU: N = 256 … 131072, bf16 and fp32, d ∈ {384, 768, 1024}
    python bench/run.py --targets    # GPU: the Triton kernels' acceptance targets
    python bench/run.py --objective infonce,dclr --n 1024,4096 --d 768 --impl fastcl,reference
    python bench/run.py --objective infonce --n 16384 --d 768 --impl tiled,reference --repeats 3
                                     # CPU: fresh-process peak memory and time at one size
    python bench/run.py --explain 32768   # any machine: the cost model of one GPU call
    python bench/run.py --env        # versions, GPU, mixed-precision GEMM support; no benchmark

What runs (one table row per case, all implementations on the same inputs; ``_cases.py``
defines the objectives, implementations, inputs and FLOP counts):

* every implementation is first checked against the float64 reference, loss and gradients,
  on the same inputs at ``min(N, --check-n)`` rows (``_alternatives.check``); one outside the
  tolerances is a row saying "wrong", not timed;
* the alternatives a user would pick instead (``_alternatives.py``): ``torch-lce`` (PyTorch's
  chunked ``linear_cross_entropy``), ``cce`` (Cut Cross-Entropy), ``memeff`` and ``inf-cl``
  (CUDA only), each on the objectives it expresses; a missing package, an objective it
  cannot express or a CPU-only machine is a row saying so. The JSON has their versions;
* implementations ``fastcl`` (``backend="auto"``: Triton on CUDA, tiled elsewhere; the
  ``ran`` column says which), ``tiled`` (on GPU; on CPU it is what ``fastcl`` runs),
  ``reference`` (eager, full N×M), ``compiled`` (``torch.compile`` of the reference) and
  ``mnrl`` (sentence-transformers' ``MultipleNegativesRankingLoss`` on the same
  embeddings). A case that fails — out of memory, a timeout, a missing package — is a row
  saying so, and the same implementation is not tried at larger N;
* objectives infonce, infonce-hard, focal, dclr (weighting + noise), escl, the DCLR
  noise update on its own, and infonce-learnable (the temperature a tensor that takes its
  gradient);
* end to end: one unsupervised SimCSE training step (one forward of the duplicated batch,
  the loss, backward; ``_e2e.py``) on a
  BERT-shaped encoder with random weights at a few batch sizes, and the share of the step
  spent in the loss.

Figures per case: the median time of a call (forward + ``backward()``) over repeated calls
after a warm-up (``time.perf_counter`` on CPU, ``--repeats`` calls; ``triton.testing.do_bench``
on GPU), the time of the first call (compilation, autotuning: for ``compiled`` this is the
compile time), peak memory beyond the inputs, achieved TFLOP/s of useful FLOPs, and that as a
percentage of the matmul throughput measured in the same run on the same shape (``torch.mm``
of (N×d)@(d×M) in the same dtype: the physical limit of the computation).

Memory on GPU: the ``torch.cuda.max_memory_allocated`` delta over one call. On CPU every case
runs in a fresh Python process (``_runner.py``, measuring with ``_measure.measure_cpu``): the
resident set size once the inputs exist is the baseline; one warm-up call, its gradients
dropped and freed heap pages returned to the OS (``malloc_trim``); then the kernel's peak-RSS
counter is reset (``5`` written to ``/proc/self/clear_refs``) and the peak (``VmHWM``) is read
after the first measured call. Reported: that peak minus the baseline (``peak MiB``, also in
units of one N×M float32 matrix), and the part of it the warm-up left resident (``warm-up
MiB``: library code, allocator caches, thread pools). Where the counter cannot be reset the
first call of the process is the memory run (the legend and each row's ``memory_method`` say
which). Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (unless ``--system-malloc`` or the
variable is set already): every block of 1 MiB or more gets its own mapping, so a freed
tensor leaves the RSS at once; glibc's adaptive default makes the peak depend on allocation
history. ``--in-process`` runs the CPU cases in this process instead (times only).

``compiled``: on CPU every case is a fresh process and compiles its own static graph; on GPU
all cases share one process and ``torch.compile(..., dynamic=True)``, so the first N's first
call holds the compile time and later N reuse the graph. With ``--time-budget`` the sweep stops
starting cases once the budget is spent (they become rows saying so); the built-in sweeps
are ordered most important first.

``--targets`` measures the Triton kernels' acceptance targets (bf16, d=768 on GPU), each
printed PASS/FAIL with its numbers as soon as it is measured:

* fused infonce forward+backward at N=M=32768: at least 80 % of the throughput of three
  (N×d)@(d×M) ``torch.mm`` of the same FLOP count (``--goal-fraction``);
* at N=M=16384: at least 1.5× faster than the eager reference (``--goal-speedup``), 1.1×
  faster than ``torch.compile`` of the reference (static shapes, compile time excluded;
  ``--goal-compiled``), and at least 12× less peak memory than the eager reference
  (``--goal-memory``);
* the DCLR noise update (4 steps, K=N=16384) within 1.15× of its own FLOP floor: its useful
  FLOPs at the bf16 ``torch.mm`` throughput measured in the same run (``--goal-noise``);
* Matryoshka over five widths (``matryoshka_dims=(d, 2d/3, d/3, d/6, d/12)``) within 1.5×
  one full-width fused loss at N=M=16384 (``--goal-matryoshka``), with the row of the tiled
  one pass beside it on a GPU (where fastcl runs a fused call per width);
* rows without a goal: fused infonce at each ``--target-chunks`` chunk size (GPU default
  1024, 2048, 4096 at both N; ``--target-chunks ''`` for none), skipped once
  ``--time-budget`` is spent, as is ``torch.compile`` with less than ``--compile-reserve``
  seconds left.

A missed target does not change the exit status (a measurement that fails does). The JSON is
rewritten after every case, so a run cut short keeps the targets it measured.

``--explain N`` prints fastcl's analytic cost model of one GPU infonce forward+backward at
N=M (``bench/_explain.py``: per-chunk stages, launches, bytes and predicted time of the design
as built, on ``--explain-device``, with ``--target-d`` and ``--target-dtype``). It is a model, not
a measurement, and needs no GPU. Below it: the gradient-filtering fractions measured on real
embeddings (``bench/grad_filter.py``'s ``bench/results/cpu-grad-filter.json``) and the FLOPs
skipping those tiles would save at that N.

Outputs: a table (with a progress bar while it runs), ``<out>/<device>-<date>.json``
and ``.csv`` (device, CPU/GPU model, versions, the exact command) and PNG plots
``…-time.png``, ``…-memory.png``, ``…-pct.png``. ``--quick`` and ``--targets`` add that word
to the file names. ``<out>`` is ``--out`` (default ``runs/bench/``, untracked: a results file
is committed only when asked for, ``--out bench/results``). The JSON is rewritten after every case, so an interrupted run
(Ctrl-C, SIGTERM) keeps what it measured and still writes its table and plots.

The code: this file is the command line and the run; ``_plan.py`` the sweeps, ``_cases.py``
and ``_e2e.py`` the cases, ``_runner.py`` measures one spec (and is the CPU worker process),
``_measure.py`` how, ``_targets.py`` the targets, ``_env.py`` the environment and
``_report.py`` the tables, JSON, CSV and plots.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (fastcl and fastcl.kernels importable from a bare checkout)
from _cases import IMPLS, OBJECTIVES
from _e2e import ENCODERS
from _env import busy_warning, device_slug, environment, loadavg
from _measure import default_threads, malloc_settings, worker_env
from _plan import DTYPES, custom_plan, default_plan, split_list
from _report import headline_text, legend, print_tables, write_outputs
from _runner import Runner, status_line
from _targets import run_targets, targets_text

HERE = Path(__file__).resolve().parent


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(f"received {signal.Signals(signum).name}")


def explain(args) -> int:
    """``--explain N``: the analytic cost model of ``bench/_explain.py`` (no GPU, no benchmark)."""
    try:
        from _explain import explain_text
    except ModuleNotFoundError as exc:
        if exc.name != "_explain":
            raise
        raise SystemExit("--explain needs bench/_explain.py (fastcl's cost model), which this "
                         "checkout does not have") from None
    except ImportError as exc:
        raise SystemExit(f"--explain: bench/_explain.py has no explain_text ({exc})") from None
    dtype = args.target_dtype or (split_list(args.dtype, DTYPES, "--dtype")[0] if args.dtype
                                  else "bfloat16")
    print(explain_text(args.explain, d=args.target_d, dtype=dtype, device=args.explain_device,
                       memory_budget_mib=args.explain_budget_mib))
    print("\n" + grad_filter_text(args.explain, args.target_d, dtype))
    return 0


def grad_filter_text(n: int, d: int, dtype: str, path=None) -> str:
    """The measured gradient-filtering figures (``bench/grad_filter.py``'s JSON) and what
    skipping the tiles they count would save at N=M=n, width d."""
    from grad_filter import DEFAULT_OUT, UNIT_ROUNDOFF, summary_lines

    path = Path(path or DEFAULT_OUT)
    if not path.exists():
        return (f"Gradient filtering: not measured in this checkout ({path} is absent; "
                "python bench/grad_filter.py writes it)")
    report = json.loads(path.read_text())
    lines = summary_lines(report)
    unit = dtype if dtype in UNIT_ROUNDOFF else "bfloat16"
    row = min(report["rows"], key=lambda r: abs(r["n"] - n))
    f = row[unit]["bounded_fraction"]
    useful = 6.0 * n * n * d
    lines.append(f"  at N=M={n}, d={d}, {unit}: with the fraction measured at N={row['n']} "
                 f"({100 * f:.1f}%), skipping saves {f * 4 * n * n * d / 1e12:.2f} of the "
                 f"{useful / 1e12:.2f} TFLOP of a call ({100 * 2 * f / 3:.1f}%); the dropped "
                 f"softmax mass per row is up to {row[unit]['dropped_mass_max']:.1e} "
                 f"(u = {UNIT_ROUNDOFF[unit]:.1e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a small sweep (under a minute on CPU)")
    mode.add_argument("--full", action="store_true",
                      help="the full sweep (meant for a GPU; on CPU the same as the default)")
    mode.add_argument("--targets", action="store_true", help="measure the Triton kernels' targets")
    mode.add_argument("--explain", type=int, metavar="N", default=None,
                      help="print the cost model of one GPU infonce call at N=M (no GPU needed)")
    mode.add_argument("--env", action="store_true",
                      help="print the environment (with --out-stem: also <stem>.json) and exit")
    p.add_argument("--explain-device", choices=("h200", "h100", "a100"), default="h200")
    p.add_argument("--explain-budget-mib", type=float, default=None,
                   help="--explain: chunk memory budget (default: fastcl's CUDA default)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--objective", action="append", help=f"comma list of {', '.join(OBJECTIVES)} "
                   "(replaces the built-in sweep)")
    p.add_argument("--impl", action="append", help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--n", action="append", help="comma list of batch sizes N")
    p.add_argument("--d", action="append", help="comma list of embedding widths")
    p.add_argument("--dtype", action="append", help=f"comma list of {', '.join(DTYPES)}")
    p.add_argument("--e2e-n", action="append", help="end-to-end batch sizes for a custom sweep")
    p.add_argument("--e2e-encoder", choices=tuple(ENCODERS), default=None)
    p.add_argument("--e2e-seq", type=int, default=32)
    p.add_argument("--no-e2e", action="store_true", help="leave out the end-to-end steps")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per case on CPU (median)")
    p.add_argument("--warmup-ms", type=float, default=25, help="do_bench warm-up (GPU)")
    p.add_argument("--rep-ms", type=float, default=100, help="do_bench measuring time (GPU)")
    p.add_argument("--threads", type=int, default=default_threads(),
                   help="torch threads on CPU (default: all usable cores)")
    p.add_argument("--chunk-size", type=int, default=None, help="fastcl chunk rows (default: budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-input-checks", action="store_true",
                   help="fastcl.set_input_checks(False) (default: on, as users get it)")
    p.add_argument("--case-timeout", type=float, default=600,
                   help="seconds per CPU case (x3 for torch.compile)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: cases not started by then are skipped (rows say so)")
    p.add_argument("--compile-reserve", type=float, default=90,
                   help="with --time-budget: seconds that must be left to start a compiled case")
    p.add_argument("--system-malloc", action="store_true",
                   help="CPU workers keep glibc's adaptive mmap threshold (noisier peaks)")
    p.add_argument("--in-process", action="store_true",
                   help="CPU: run every case in this process (times only; checks the GPU driver's flow)")
    p.add_argument("--out", "--out-dir", dest="out_dir", default=str(HERE.parent / "runs" / "bench"),
                   help="folder of the outputs (default runs/bench, untracked; the committed "
                        "results: --out bench/results)")
    p.add_argument("--check-n", type=int, default=1024,
                   help="rows of the check against the float64 reference that every "
                        "implementation passes before it is timed (min(N, this); 0: no check)")
    p.add_argument("--tag", default=None, help="appended to the output file names")
    p.add_argument("--out-stem", default=None,
                   help="output path without extension (overrides --out-dir/--tag naming)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--list", action="store_true", help="print the planned cases and exit")
    g = p.add_argument_group("targets (--targets)")
    g.add_argument("--target-n", type=int, default=16384, help="N=M of the speed/memory/noise targets")
    g.add_argument("--target-big-n", type=int, default=32768, help="N=M of the matmul-fraction target")
    g.add_argument("--target-d", type=int, default=768)
    g.add_argument("--target-dtype", choices=DTYPES, default=None,
                   help="default bf16 on GPU, fp32 on CPU (--explain: bf16)")
    g.add_argument("--target-chunks", default=None,
                   help="comma list of chunk sizes for rows without a goal (GPU default "
                        "1024,2048,4096; '' for none)")
    g.add_argument("--goal-fraction", type=float, default=0.8,
                   help="fraction of matmul throughput to reach at --target-big-n (default 0.8)")
    g.add_argument("--goal-speedup", type=float, default=1.5, help="x faster than eager (1.5)")
    g.add_argument("--goal-compiled", type=float, default=1.1,
                   help="x faster than torch.compile of the reference (1.1)")
    g.add_argument("--goal-memory", type=float, default=12.0, help="x less memory than eager (12)")
    g.add_argument("--goal-noise", type=float, default=1.15,
                   help="noise update time over its FLOP floor at matmul throughput (1.15)")
    g.add_argument("--goal-matryoshka", type=float, default=1.5,
                   help="Matryoshka over 5 widths over one full-width loss, same run (1.5)")
    args = p.parse_args(argv)

    if args.explain is not None:
        return explain(args)

    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("--repeats and --threads must be positive")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    torch.set_num_threads(args.threads)
    if args.env:
        env_info = environment(device, args.threads)
        print(json.dumps(env_info, indent=1))
        if args.out_stem:
            Path(args.out_stem).parent.mkdir(parents=True, exist_ok=True)
            Path(f"{args.out_stem}.json").write_text(json.dumps(env_info, indent=1) + "\n")
        return 0
    mode_name = "quick" if args.quick else "full" if args.full else "targets" if args.targets else "default"
    custom = any([args.objective, args.impl, args.n, args.d, args.dtype])
    plan = [] if args.targets else (custom_plan(args, device) if custom else default_plan(device, mode_name))
    if args.no_e2e:
        plan = [s for s in plan if s["kind"] != "e2e"]
    if args.list:
        for s in plan:
            print(json.dumps(s))
        print(f"{len(plan)} specs")
        return 0

    stamp = datetime.date.today().isoformat()
    suffix = "" if mode_name in ("default", "full") and not custom else (
        "-custom" if custom else f"-{mode_name}")
    stem = (Path(args.out_stem) if args.out_stem else Path(args.out_dir) / (
        f"{device_slug(device)}-{stamp}{suffix}" + (f"-{args.tag}" if args.tag else "")))
    env_info = environment(device, args.threads)
    report = {
        "benchmark": "fastcl: forward+backward time, memory and matmul efficiency per implementation",
        "mode": mode_name + (" (custom sweep)" if custom else ""),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "argv": sys.argv,
        "device": device,
        "in_process": bool(args.in_process),
        "environment": env_info,
        "settings": vars(args),
        "malloc_env": malloc_settings(worker_env(args.system_malloc)) if device == "cpu" else None,
        "interrupted": False,
    }
    runner = Runner(args, device)
    report["matmul_cache"] = runner.mm
    warning = busy_warning(env_info)
    if warning:
        report["warning"] = warning
        print(warning, flush=True)
    print(f"fastcl bench | {device}: {env_info.get('gpu_model') or env_info['cpu_model']} | torch "
          f"{env_info['torch']} | triton {env_info['triton']} | {args.threads} threads | mode "
          f"{report['mode']}" + ("" if args.targets else f" | {len(plan)} cases"), flush=True)

    signal.signal(signal.SIGTERM, _on_signal)
    rows: list[dict] = []
    t_start = time.perf_counter()
    code = 0
    try:
        if args.targets:
            report["targets"] = targets = []
            print("Targets (" + ", ".join(f"{k}={getattr(args, k)}" for k in
                                         ("target_n", "target_big_n", "target_d")) + ")", flush=True)
            run_targets(args, runner, device, rows, targets,
                        save=lambda: write_outputs(report, rows, stem, plots=False))
            print("\nTargets:\n" + targets_text(targets))
            code = 1 if any(t["result"] == "ERROR" for t in targets) else 0
        else:
            try:
                from tqdm import tqdm
                bar = tqdm(total=len(plan), unit="case", dynamic_ncols=True, file=sys.stderr)
                say = bar.write
            except ImportError:
                bar, say = None, print
            for i, spec in enumerate(plan):
                elapsed = time.perf_counter() - t_start
                left = None if args.time_budget is None else args.time_budget - elapsed
                # a torch.compile case (Cut Cross-Entropy's too, off CUDA) may spend a minute
                # compiling: only with that much left
                compiles = spec.get("impl") == "compiled" or (spec.get("impl") == "cce"
                                                              and device != "cuda")
                if left is not None and (left <= 0 or (compiles and left < args.compile_reserve)):
                    new = [{**spec, "ok": False, "skipped": True, "device": device,
                            "error": f"time budget of {args.time_budget:g} s spent"}]
                    if spec["kind"] == "e2e":
                        new = [{**new[0], "impl": impl} for impl in spec["impls"]]
                else:
                    if bar is not None:
                        bar.set_description(f"{spec.get('objective', 'e2e')} {spec.get('impl', '')} "
                                            f"N={spec['n']}")
                    new = runner.run(spec)
                rows.extend(new)
                for r in new:
                    if not r.get("skipped") or "time budget" not in str(r.get("error")):
                        say(status_line(r))
                if bar is not None:
                    bar.update(1)
                report["elapsed_s"] = time.perf_counter() - t_start
                write_outputs(report, rows, stem, plots=False)    # keep what is measured
            if bar is not None:
                bar.close()
    except (Interrupted, KeyboardInterrupt) as exc:
        report["interrupted"] = str(exc) or "KeyboardInterrupt"
        print(f"\ninterrupted ({report['interrupted']}): writing what was measured", flush=True)
        code = 130
    report["elapsed_s"] = time.perf_counter() - t_start
    report["load_average_at_end"] = loadavg()

    if rows and not args.targets:
        print_tables(rows)
        print("\n" + legend(device, args.in_process, rows, report["malloc_env"]))
    written = write_outputs(report, rows, stem, plots=not args.no_plots and not args.targets)
    if report.get("headline"):
        print("\nHeadline (fastcl vs the eager reference at the largest N where both ran):")
        print(headline_text(report["headline"]))
    if warning:
        print("\n" + warning)
    print(f"\n{report['elapsed_s']:.0f} s; wrote " + ", ".join(str(w) for w in written))
    return code


if __name__ == "__main__":
    sys.exit(main())
