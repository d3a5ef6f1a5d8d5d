#!/usr/bin/env python
"""fastcl benchmark: time, memory and matmul efficiency of every implementation, side by side.

    python bench/run.py              # CPU defaults: a few minutes on a 2-core machine
    python bench/run.py --quick      # a small sweep, under a minute
    python bench/run.py --full       # GPU: N = 256 … 131072, bf16 and fp32, d ∈ {384, 768, 1024}
    python bench/run.py --targets    # GPU: the Triton kernels' acceptance targets
    python bench/run.py --objective infonce,dclr --n 1024,4096 --d 768 --impl fastcl,reference
    python bench/run.py --explain 32768   # any machine: the cost model of one GPU call
    python bench/run.py --env        # versions, GPU, mixed-precision GEMM support; no benchmark

What runs (one table row per case, all implementations on the same inputs; ``_cases.py``
defines the objectives, implementations and FLOP counts):

* implementations ``fastcl`` (``backend="auto"``: Triton on CUDA, tiled elsewhere; the
  ``ran`` column says which), ``tiled`` (on GPU; on CPU it is what ``fastcl`` runs),
  ``reference`` (eager, full N×M), ``compiled`` (``torch.compile`` of the reference) and
  ``mnrl`` (sentence-transformers' ``MultipleNegativesRankingLoss`` on the same
  embeddings). A case that fails — out of memory, a timeout, a missing package — is a row
  saying so, and the same implementation is not tried at larger N;
* objectives infonce, infonce-hard, focal, dclr (weighting + noise), escl, and the DCLR
  noise update on its own;
* end to end: one training step of a BERT-shaped encoder with random weights (forward,
  loss, backward) at a few batch sizes, and the share of the step spent in the loss.

Figures per case: the median time of a call (forward + ``backward()``) over repeated calls
after a warm-up (``time.perf_counter`` on CPU; ``triton.testing.do_bench`` on GPU), the
time of the first call (compilation, autotuning: for ``compiled`` this is the compile
time), peak memory beyond the inputs (CPU: peak RSS of a fresh process per case; GPU:
``torch.cuda.max_memory_allocated`` delta), achieved TFLOP/s of useful FLOPs, and that as
a percentage of the matmul throughput measured in the same run on the same shape
(``torch.mm`` of (N×d)@(d×M) in the same dtype: the physical limit of the computation).

``compiled``: on CPU every case is a fresh process and compiles its own static graph; on GPU
all cases share one process and ``torch.compile(..., dynamic=True)``, so the first N's first
call holds the compile time and later N reuse the graph. With ``--time-budget`` the sweep stops
starting cases once the budget is spent (they become rows saying so); the built-in sweeps
are ordered most important first.

``--targets`` measures the Triton kernels' acceptance targets (bf16, d=768 on GPU), each
printed PASS/FAIL with its numbers as soon as it is measured:

* fused infonce forward+backward at N=M=32768: at least 60 % of the throughput of three
  (N×d)@(d×M) ``torch.mm`` of the same FLOP count (``--goal-fraction``);
* at N=M=16384: at least 1.5× faster than the eager reference (``--goal-speedup``), faster
  than ``torch.compile`` of the reference (static shapes, compile time excluded;
  ``--goal-compiled``), and at least 10× less peak memory than the eager reference
  (``--goal-memory``);
* the DCLR noise update (4 steps, K=N=16384) within 1.15× of its own FLOP floor: its useful
  FLOPs at the bf16 ``torch.mm`` throughput measured in the same run (``--goal-noise``);
* rows without a goal: fused infonce at each ``--target-chunks`` chunk size (GPU default
  1024, 2048, 4096 at both N; ``--target-chunks ''`` for none), skipped once
  ``--time-budget`` is spent, as is ``torch.compile`` with less than ``--compile-reserve``
  seconds left.

A missed target does not change the exit status (a measurement that fails does). The JSON is
rewritten after every case, so a run cut short keeps the targets it measured.

``--explain N`` prints fastcl's analytic cost model of one GPU infonce forward+backward at
N=M (``bench/_explain.py``: per-chunk stages, launches, bytes and predicted time of the old
and the new design on ``--explain-device``, with ``--target-d`` and ``--target-dtype``). It is a
model, not a measurement, and needs no GPU.

Outputs: a table (with a progress bar while it runs), ``bench/results/<device>-<date>.json``
and ``.csv`` (device, CPU/GPU model, versions, the exact command) and PNG plots
``…-time.png``, ``…-memory.png``, ``…-pct.png``. ``--quick`` and ``--targets`` add that word
to the file names. The JSON is rewritten after every case, so an interrupted run
(Ctrl-C, SIGTERM) keeps what it measured and still writes its table and plots.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (fastcl and fastcl.kernels importable from a bare checkout)
from _cases import (IMPLS, MNRL_OBJECTIVES, OBJECTIVES, auto_backend, bert_config, build,
                    num_candidates)
from _measure import (MIB, answer_as_worker, cpu_model, cuda_peak, cuda_time, default_threads,
                      malloc_settings, matmul_limit, measure_cpu, run_fresh_process, worker_env)

HERE = Path(__file__).resolve().parent
DTYPES = ("float32", "bfloat16", "float16", "float64")
FAILURE_STOPS_LARGER_N = ("out of memory", "timed out", "killed", "OutOfMemoryError")


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(f"received {signal.Signals(signum).name}")


# --------------------------------------------------------------------------- plans

def _sweep(objectives, impls, ns, ds, dtypes, **extra):
    """Specs ordered by N so that an interrupted sweep has every implementation at small N."""
    out = []
    for dtype in dtypes:
        for d in ds:
            for objective in objectives:
                for n in ns:
                    for impl in impls:
                        if impl == "mnrl" and objective not in MNRL_OBJECTIVES:
                            continue
                        out.append({"kind": "case", "objective": objective, "impl": impl, "n": n,
                                    "m": num_candidates(objective, n), "d": d, "dtype": dtype,
                                    **extra})
    return out


def _e2e(encoder, ns, seq, dtype, impls):
    return [{"kind": "e2e", "encoder": encoder, "n": n, "seq": seq, "dtype": dtype,
             "impls": impls} for n in ns]


def default_plan(device: str, mode: str) -> list[dict]:
    """The built-in sweeps, most important first (a time budget cuts from the end)."""
    others = ["infonce-hard", "focal", "dclr", "escl"]
    if device == "cpu":
        cpu = ["fastcl", "reference"]
        if mode == "quick":
            return (_sweep(["infonce"], cpu, [256, 1024], [384], ["float32"])
                    + _sweep(["infonce"], ["mnrl"], [1024], [384], ["float32"])
                    + _sweep(others + ["noise"], cpu, [512], [384], ["float32"])
                    + _e2e("tiny", [16], 32, "float32", cpu))
        return (_sweep(["infonce"], cpu + ["mnrl"], [256, 1024, 4096, 8192], [768], ["float32"])
                + _sweep(["infonce"], ["compiled"], [1024, 4096], [768], ["float32"])
                + _sweep(others + ["noise"], cpu, [1024, 4096], [768], ["float32"])
                + _sweep(["infonce-hard"], ["mnrl"], [1024, 4096], [768], ["float32"])
                + _sweep(["infonce"], cpu, [4096], [384, 1024], ["float32"])
                + _e2e("small", [16, 64], 32, "float32", cpu))
    gpu = ["fastcl", "tiled", "reference"]
    if mode == "quick":
        return (_sweep(["infonce"], gpu + ["mnrl", "compiled"], [1024, 4096, 16384], [768], ["bfloat16"])
                + _sweep(others + ["noise"], gpu, [4096], [768], ["bfloat16"])
                + _e2e("base", [256], 32, "bfloat16", ["fastcl", "reference"]))
    if mode == "default":
        return (_sweep(["infonce"], gpu + ["mnrl", "compiled"], [256, 1024, 4096, 16384, 32768],
                       [768], ["bfloat16"])
                + _sweep(others + ["noise"], gpu, [1024, 4096, 16384], [768], ["bfloat16"])
                + _e2e("base", [128, 512], 32, "bfloat16", ["fastcl", "reference"]))
    big = [256, 1024, 4096, 16384, 32768, 65536, 131072]
    # torch.compile last among the bf16 cases: its compile time must not starve the rest
    return (_sweep(["infonce"], gpu + ["mnrl"], big, [768], ["bfloat16"])
            + _sweep(["noise"], gpu, [1024, 4096, 16384, 65536], [768], ["bfloat16"])
            + _sweep(others, gpu + ["mnrl"], [1024, 4096, 16384, 65536], [768], ["bfloat16"])
            + _e2e("base", [256, 1024, 4096], 32, "bfloat16", ["fastcl", "reference"])
            + _sweep(["infonce"], ["compiled"], big, [768], ["bfloat16"])
            + _sweep(["infonce"], gpu, [1024, 4096, 16384, 65536], [768], ["float32"])
            + _sweep(["infonce"], ["fastcl", "reference"], [4096, 32768], [384, 1024], ["bfloat16"]))


def custom_plan(args, device) -> list[dict]:
    objectives = split_list(args.objective or ["infonce"], OBJECTIVES, "--objective")
    impls = split_list(args.impl or ["fastcl,reference" + (",tiled" if device == "cuda" else "")],
                       IMPLS, "--impl")
    ns = [int(x) for x in split_list(args.n or ["1024"], None, "--n")]
    ds = [int(x) for x in split_list(args.d or ["768"], None, "--d")]
    dtypes = split_list(args.dtype or ["bfloat16" if device == "cuda" else "float32"], DTYPES, "--dtype")
    plan = _sweep(objectives, impls, ns, ds, dtypes)
    if args.e2e_n:
        plan += _e2e(args.e2e_encoder or ("base" if device == "cuda" else "small"),
                     [int(x) for x in split_list(args.e2e_n, None, "--e2e-n")], args.e2e_seq,
                     dtypes[0], [i for i in impls if i in ("fastcl", "reference", "tiled")])
    return plan


def split_list(values, allowed, flag):
    items = [v.strip() for value in values for v in str(value).split(",") if v.strip()]
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise SystemExit(f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))


# --------------------------------------------------------------------------- one case

def _sync(device):
    import torch
    if device == "cuda":
        torch.cuda.synchronize()


def _build(spec: dict, device: str):
    return build(spec["objective"], spec["impl"], spec["n"], spec["d"], spec["dtype"], device,
                 seed=spec.get("seed", 0), compile_dynamic=spec.get("compile_dynamic"),
                 chunk_size=spec.get("chunk_size"), input_checks=spec.get("input_checks", True))


def measure_in_process(spec: dict, device: str, warmup_ms: float, rep_ms: float) -> dict:
    """One case in this process. On CUDA: time (``do_bench``, or CUDA events for calls over
    50 ms) and allocator peak; on CPU (``--in-process``): time only."""
    import torch

    case = None
    try:
        case = _build(spec, device)
        out = {"backend": case.backend, "flops": case.flops, "note": case.note}
        _sync(device)
        t0 = time.perf_counter()
        result = case.step()                               # compilation / autotuning
        _sync(device)
        out["first_call_s"] = time.perf_counter() - t0
        del result
        t0 = time.perf_counter()
        if device == "cuda":
            peak, result = cuda_peak(case.step, case.leaves)
            out["peak_beyond_inputs_mib"] = peak / MIB
            out["memory_method"] = "torch.cuda.max_memory_allocated delta over one call"
        else:
            result = case.step()
            out["peak_beyond_inputs_mib"] = None
            out["memory_method"] = "not measured (in-process on CPU)"
        _sync(device)
        est = time.perf_counter() - t0
        out["loss"] = float(result.detach()) if result.dim() == 0 else None
        del result
        if device == "cuda" and est < 0.05:
            out.update(cuda_time(case.step, case.leaves, warmup_ms, rep_ms))
        else:
            times = []
            for _ in range(3 if est >= 0.05 else max(3, int(rep_ms / 1e3 / max(est, 1e-6)))):
                if device == "cuda":
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    r = case.step()
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end) / 1e3)
                else:
                    t0 = time.perf_counter()
                    r = case.step()
                    times.append(time.perf_counter() - t0)
                del r
            out.update(median_s=statistics.median(times), times_s=times,
                       timing_method=("CUDA events (median of 3 calls of 50 ms or more)"
                                      if device == "cuda" else "time.perf_counter (median)"))
        out["ok"] = True
        return out
    except Exception as exc:  # every failure is a row
        oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc)
        msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return {"ok": False, "error": ("out of memory: " + msg) if oom else msg}
    finally:
        if case is not None:
            case.leaves.clear()
            case.step = None
        del case
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def e2e_measure(spec: dict, device: str, repeats: int) -> list[dict]:
    """One training step of a BERT-shaped encoder with random weights: the duplicated batch
    (two dropout views, as unsupervised SimCSE) → [CLS] embeddings → InfoNCE → backward.

    The step is timed in three parts per iteration — encoder forward, the loss (forward and
    backward on the detached embeddings, once per implementation on the same embeddings),
    encoder backward (from the first implementation's gradient) — which together are exactly
    one step. The share of the loss is its median over the median step. On CUDA each
    implementation also runs whole steps for the peak memory (allocator delta beyond the
    weights and the token ids)."""
    import contextlib

    import torch
    from transformers import BertModel

    import fastcl

    n, seq = spec["n"], spec["seq"]
    fastcl.set_input_checks(spec.get("input_checks", True))
    torch.manual_seed(spec.get("seed", 0))
    config = bert_config(spec["encoder"])
    model = BertModel(config, add_pooling_layer=False).to(device)
    model.train()                                           # dropout on: the two views differ
    gen = torch.Generator(device=device).manual_seed(spec.get("seed", 0))
    ids = torch.randint(1000, config.vocab_size, (n, seq), generator=gen, device=device)
    batch = torch.cat([ids, ids])
    mask = torch.ones_like(batch)
    use_autocast = device == "cuda" and spec["dtype"] in ("bfloat16", "float16")
    autocast = (lambda: torch.autocast("cuda", dtype=getattr(torch, spec["dtype"]))) if use_autocast \
        else contextlib.nullcontext
    impls = spec["impls"]
    backends = {"fastcl": "auto", "tiled": "tiled", "reference": "reference"}

    def loss_of(impl, e):
        return fastcl.infonce(e[:n], e[n:], backend=backends[impl])

    def clock():
        if device == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def span(a, b):
        return a.elapsed_time(b) / 1e3 if device == "cuda" else b - a

    parts = {"fwd": [], "bwd": [], **{i: [] for i in impls}}
    emb_dtype = None
    warm = 2 if device == "cuda" else 1                     # warm-up steps (not timed)
    for it in range(warm + repeats):
        model.zero_grad(set_to_none=True)
        t_fwd = clock()
        with autocast():
            emb = model(input_ids=batch, attention_mask=mask).last_hidden_state[:, 0]
        t_loss = [clock()]
        grads = {}
        order = impls[it % len(impls):] + impls[:it % len(impls)]   # no implementation always first
        for impl in order:
            e = emb.detach().requires_grad_(True)
            loss_of(impl, e).backward()
            grads[impl] = e.grad
            t_loss.append(clock())
        emb.backward(grads[order[0]])
        t_end = clock()
        _sync(device)
        emb_dtype = str(emb.dtype).replace("torch.", "")
        if it >= warm:
            parts["fwd"].append(span(t_fwd, t_loss[0]))
            for k, impl in enumerate(order):
                parts[impl].append(span(t_loss[k], t_loss[k + 1]))
            parts["bwd"].append(span(t_loss[-1], t_end))
        del emb, grads

    med = {k: statistics.median(v) for k, v in parts.items()}
    rows = []
    for impl in impls:
        step = med["fwd"] + med[impl] + med["bwd"]
        row = {"ok": True, "impl": impl, "backend": None, "embedding_dtype": emb_dtype,
               "encoder_params": sum(p.numel() for p in model.parameters()),
               "hidden": config.hidden_size, "layers": config.num_hidden_layers,
               "encoder_forward_s": med["fwd"], "loss_s": med[impl], "encoder_backward_s": med["bwd"],
               "step_s": step, "loss_share": med[impl] / step, "loss_times_s": parts[impl],
               "autocast": spec["dtype"] if use_autocast else None, "repeats": repeats}
        probe = torch.zeros(2, 2, device=device, dtype=getattr(torch, emb_dtype))
        row["backend"] = ("reference" if impl == "reference" else
                          auto_backend(probe) if impl == "fastcl" else impl)
        if device == "cuda":
            model.zero_grad(set_to_none=True)
            gc.collect()

            def whole_step():
                with autocast():
                    e = model(input_ids=batch, attention_mask=mask).last_hidden_state[:, 0]
                loss = loss_of(impl, e)
                loss.backward()
                return loss

            peak, loss = cuda_peak(whole_step)
            row["peak_beyond_inputs_mib"] = peak / MIB
            row["memory_method"] = "torch.cuda.max_memory_allocated delta over one whole step"
            del loss
            model.zero_grad(set_to_none=True)
        else:
            row["peak_beyond_inputs_mib"] = None
            row["memory_method"] = "not measured on CPU (one process for both implementations)"
        rows.append(row)
    return rows


def worker(spec: dict) -> dict:
    """A fresh CPU process: one case (or one end-to-end batch size)."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["kind"] == "e2e":
        return {"ok": True, "rows": e2e_measure(spec, "cpu", spec["repeats"])}
    case = _build(spec, "cpu")
    out = measure_cpu(case.step, case.leaves, spec["repeats"])
    out.update(backend=case.backend, flops=case.flops, note=case.note)
    return out


# --------------------------------------------------------------------------- environment

def environment(device: str, threads: int) -> dict:
    import torch

    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
           "platform": platform.platform(), "cpu_model": cpu_model(), "cpu_threads": threads,
           "usable_cores": default_threads(), "load_average_at_start": _loadavg(),
           "fastcl_from": _checkout.HOW}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from importlib import metadata
    for pkg in ("fastcl", "sentence-transformers", "transformers", "numpy", "matplotlib"):
        try:
            env[pkg.replace("-", "_")] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg.replace("-", "_")] = None
    import fastcl
    env["fastcl"] = env["fastcl"] or getattr(fastcl, "__version__", None)
    try:
        root = _checkout.ROOT
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "fastcl", "kernels"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["git_commit"] = (commit + (" (fastcl/ or kernels/ modified)" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu_model=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   gpu_sms=p.multi_processor_count, cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        try:
            env["gpu_driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["gpu_driver"] = None
    env["mixed_gemm"] = mixed_gemm_support(device)
    return env


def mixed_gemm_support(device: str) -> dict:
    """Whether 16-bit GEMMs can write float32 directly on ``device`` (what the chunk driver
    uses when it can): "ok", or the error, per form."""
    import torch

    a = torch.randn(64, 32, device=device).bfloat16()
    b = torch.randn(32, 48, device=device).bfloat16()
    want = a.float() @ b.float()
    forms = {
        "mm(bf16, bf16, out_dtype=float32)": lambda: torch.mm(a, b, out_dtype=torch.float32),
        "addmm(float32, bf16, bf16, out_dtype=float32)":
            lambda: torch.addmm(torch.zeros_like(want), a, b, out_dtype=torch.float32),
        "addmm(..., out_dtype=float32, out=input) (in place)":
            lambda: (lambda c: torch.addmm(c, a, b, out_dtype=torch.float32, out=c))(
                torch.zeros_like(want)),
    }
    out = {}
    for name, fn in forms.items():
        try:
            got = fn()
            err = (got.float() - want).abs().max().item()
            out[name] = ("ok" if got.dtype == torch.float32 and err < 1e-2
                         else f"wrong result: dtype {got.dtype}, max error {err:.3g}")
        except Exception as exc:  # unsupported here: say why
            out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return out


def _loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def busy_warning(env: dict) -> str | None:
    """CPU timings with other work running are not reliable (threads wait for each other)."""
    load = env.get("load_average_at_start")
    if env.get("device") == "cpu" and load and load[0] > 0.5 * env["usable_cores"]:
        return (f"WARNING: load average {load[0]:.2f} on {env['usable_cores']} cores at the start: "
                "other work is running, CPU timings will be slow and noisy")
    return None


def device_slug(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") or "cuda"


# --------------------------------------------------------------------------- runner

class Runner:
    def __init__(self, args, device):
        self.args, self.device = args, device
        self.env = worker_env(args.system_malloc)
        self.failed = {}            # (objective, impl, d, dtype) -> N of a fatal failure
        self.mm = {}

    def matmul(self, n, m, d, dtype, calls=1):
        import torch
        key = (n, m, d, dtype, calls)
        if key not in self.mm:
            try:
                self.mm[key] = {"ok": True, **matmul_limit(n, m, d, getattr(torch, dtype), self.device,
                                                           calls=calls)}
            except Exception as exc:
                self.mm[key] = {"ok": False, "n": n, "m": m, "d": d, "dtype": dtype,
                                "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
            if self.device == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
        return self.mm[key]

    def run(self, spec: dict) -> list[dict]:
        """Measure one spec; returns its rows (several for an end-to-end spec)."""
        args = self.args
        spec = {**spec, "seed": args.seed, "threads": args.threads, "repeats": args.repeats,
                "input_checks": not args.no_input_checks}
        if spec["kind"] == "case":
            spec.setdefault("compile_dynamic", True if self.device == "cuda" else False)
            if spec.get("chunk_size") is None:
                spec["chunk_size"] = args.chunk_size
            key = (spec["objective"], spec["impl"], spec["d"], spec["dtype"])
            if key in self.failed and spec["n"] > self.failed[key]:
                return [{**spec, "ok": False, "skipped": True,
                         "error": f"failed at N={self.failed[key]} (not tried at larger N)"}]
        if self.device == "cuda" or args.in_process:
            if spec["kind"] == "e2e":
                try:
                    rows = e2e_measure(spec, self.device, args.repeats)
                    result = {"ok": True, "rows": rows}
                except Exception as exc:
                    result = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
                finally:
                    gc.collect()
                    if self.device == "cuda":
                        import torch
                        torch.cuda.empty_cache()
            else:
                result = measure_in_process(spec, self.device, args.warmup_ms, args.rep_ms)
            row = {**spec, **result}
        else:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
            timeout = args.case_timeout * (3 if spec.get("impl") == "compiled" else 1)
            row = run_fresh_process(cmd, spec, timeout, self.env)
        row.update(device=self.device)
        if spec["kind"] == "e2e":
            if not row.get("ok"):
                return [{**spec, **row, "kind": "e2e", "impl": i} for i in spec["impls"]]
            base = {k: v for k, v in spec.items() if k not in ("impls",)}
            return [{**base, "device": self.device, **r} for r in row["rows"]]
        if row.get("ok"):
            mm = self.matmul(spec["n"], spec["m"], spec["d"], spec["dtype"])
            row["tflops"] = row["flops"] / row["median_s"] / 1e12
            if mm.get("ok"):
                row["matmul_tflops"] = mm["tflops"]
                row["pct_of_matmul"] = 100.0 * row["tflops"] / mm["tflops"]
            if row.get("impl") == "compiled" and row.get("first_call_s") is not None:
                row["compile_s"] = max(0.0, row["first_call_s"] - row["median_s"])
        else:
            err = str(row.get("error", ""))
            if any(s in err for s in FAILURE_STOPS_LARGER_N):
                key = (spec["objective"], spec["impl"], spec["d"], spec["dtype"])
                self.failed[key] = min(spec["n"], self.failed.get(key, spec["n"]))
        row["nm_matrix_mib"] = spec["n"] * spec["m"] * 4 / MIB
        return [row]


def status_line(row) -> str:
    what = (f"{row.get('objective', 'e2e ' + str(row.get('encoder')))} {row.get('impl')} "
            f"N={row['n']}" + (f" d={row['d']}" if row.get("d") else "") + f" {row.get('dtype')}")
    if not row.get("ok"):
        return f"{what}: {'skipped' if row.get('skipped') else 'ERROR'}: {row.get('error')}"
    if row.get("kind") == "e2e":
        return f"{what}: step {row['step_s'] * 1e3:.1f} ms, loss {100 * row['loss_share']:.2f}%"
    mem = row.get("peak_beyond_inputs_mib")
    return (f"{what}: {row['median_s'] * 1e3:.2f} ms" + (f", {mem:.1f} MiB" if mem is not None else "")
            + (f", {row['pct_of_matmul']:.1f}% of mm" if row.get("pct_of_matmul") is not None else ""))


def headline(rows) -> list[dict]:
    """Per objective: at the largest N where both ran, fastcl vs the eager reference."""
    out = []
    for objective in OBJECTIVES:
        for dtype in DTYPES:
            both = [r for r in rows if r.get("kind") == "case" and r["objective"] == objective
                    and r["impl"] == "fastcl" and r["dtype"] == dtype and r.get("ok")
                    and r.get("speedup_vs_reference") is not None]
            if not both:
                continue
            d_main = max({r["d"] for r in both}, key=lambda d: sum(r["d"] == d for r in both))
            r = max((r for r in both if r["d"] == d_main), key=lambda r: r["n"])
            fast = [x for x in rows if x.get("kind") == "case" and x["objective"] == objective
                    and x["impl"] == "fastcl" and x["dtype"] == dtype and x.get("ok")]
            largest = max(fast, key=lambda x: x["n"])
            out.append({"objective": objective, "dtype": dtype, "d": r["d"], "n": r["n"],
                        "backend": r.get("backend"),
                        "speedup_vs_reference": r["speedup_vs_reference"],
                        "memory_ratio_vs_reference": r.get("memory_ratio_vs_reference"),
                        "pct_of_matmul": r.get("pct_of_matmul"),
                        "best_pct_of_matmul": max((x.get("pct_of_matmul") or 0) for x in fast),
                        "largest_n_fastcl": largest["n"]})
    return out


def headline_text(items) -> str:
    lines = []
    for h in items:
        mem = h.get("memory_ratio_vs_reference")
        lines.append(f"  {h['objective']:<12} {h['dtype']:<8} d={h['d']} N={h['n']} ({h['backend']}): "
                     f"{h['speedup_vs_reference']:.2f}x the eager reference's speed"
                     + (f", {mem:.1f}x less memory" if mem else "")
                     + (f", {h['pct_of_matmul']:.1f}% of matmul" if h.get("pct_of_matmul") else "")
                     + f"; best {h['best_pct_of_matmul']:.1f}% of matmul; ran up to N={h['largest_n_fastcl']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- outputs

def write_outputs(report: dict, rows: list[dict], stem: Path, plots: bool) -> list[Path]:
    import _report

    _report.add_ratios(rows)
    report["results"] = rows
    report["headline"] = headline(rows)
    report["matmul"] = list(report.get("matmul_cache", {}).values())
    written = []
    stem.parent.mkdir(parents=True, exist_ok=True)
    js = Path(f"{stem}.json")
    tmp = Path(f"{stem}.json.tmp")
    tmp.write_text(json.dumps({k: v for k, v in report.items() if k != "matmul_cache"}, indent=1,
                              default=str) + "\n")
    tmp.replace(js)
    written.append(js)
    if rows:
        csv_path = Path(f"{stem}.csv")
        _report.write_csv(rows, csv_path)
        written.append(csv_path)
    if plots and any(r.get("kind") == "case" and r.get("ok") for r in rows):
        env = report["environment"]
        label = (env.get("gpu_model") if report["device"] == "cuda"
                 else f"{env.get('cpu_model')}, threads={env.get('cpu_threads')}")
        mem_label = ("torch.cuda.max_memory_allocated delta" if report["device"] == "cuda"
                     else "peak RSS of a fresh process per case")
        if report.get("in_process") and report["device"] != "cuda":
            mem_label = "not measured (in-process)"
        for metric in ("time", "memory", "pct"):
            if metric == "memory" and report.get("in_process") and report["device"] != "cuda":
                continue
            path = Path(f"{stem}-{metric}.png")
            try:
                if _report.plot(rows, path, metric, label, mem_label):
                    written.append(path)
            except Exception as exc:  # a plot must never lose the measurements
                print(f"plot {metric} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return written


def print_tables(rows):
    import _report
    _report.add_ratios(rows)
    print()
    print(_report.case_table(rows))
    e2e = _report.e2e_table(rows)
    if e2e:
        print("\nEnd to end: one training step (encoder forward, loss forward+backward, encoder backward)")
        print(e2e)


def legend(device, in_process):
    mem = ("peak MiB = torch.cuda.max_memory_allocated during one call minus the allocation before it "
           "(inputs)" if device == "cuda" else
           "peak MiB = not measured (in-process)" if in_process else
           "peak MiB = peak RSS of a fresh process beyond its RSS once the inputs exist")
    return ("median ms = median forward+backward time; 1st call s = the first call of the case "
            "(compilation, autotuning, lazy init);\n" + mem + ";\nTFLOP/s = useful FLOPs "
            "(6·N·M·d per loss; DCLR adds the mask and the noise update) / median time; % mm = that / "
            "torch.mm throughput on (N×d)@(d×M) in the same dtype, measured in this run;\n"
            "x faster, x less mem = the eager reference's time and memory over this row's; "
            "loss = the value of the last call")


# --------------------------------------------------------------------------- targets

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
    name, goal = f"speed vs torch.compile(reference), infonce N=M={n}", f"> {args.goal_compiled:g}x"
    if left() is not None and left() < args.compile_reserve:
        target(name, goal, result="SKIPPED",
               detail=f"{left():.0f} s of the time budget left, --compile-reserve {args.compile_reserve:g} s")
    else:
        compiled = case("infonce", "compiled", n, compile_dynamic=False)
        if fused.get("ok") and compiled.get("ok"):
            speed = compiled["median_s"] / fused["median_s"]
            target(name, goal, speed, speed > args.goal_compiled,
                   f"{fused['median_s'] * 1e3:.2f} ms vs {compiled['median_s'] * 1e3:.2f} ms "
                   f"(compile {compiled.get('compile_s') or 0:.1f} s)")
        else:
            target(name, goal, detail=failure(fused, compiled))

    # 6. the chunk size trades memory for GEMM efficiency and launch overhead: a few rows, no
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


# --------------------------------------------------------------------------- main

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
    return 0


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
    p.add_argument("--e2e-encoder", choices=("tiny", "small", "base"), default=None)
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
    p.add_argument("--out-dir", default=str(HERE / "results"))
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
    g.add_argument("--goal-fraction", type=float, default=0.6,
                   help="fraction of matmul throughput to reach at --target-big-n (default 0.6)")
    g.add_argument("--goal-speedup", type=float, default=1.5, help="x faster than eager (1.5)")
    g.add_argument("--goal-compiled", type=float, default=1.0,
                   help="x faster than torch.compile of the reference (more than 1.0)")
    g.add_argument("--goal-memory", type=float, default=10.0, help="x less memory than eager (10)")
    g.add_argument("--goal-noise", type=float, default=1.15,
                   help="noise update time over its FLOP floor at matmul throughput (1.15)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker is not None:
        return answer_as_worker(args.worker, worker)
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
        "settings": {k: v for k, v in vars(args).items() if k != "worker"},
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
                # a torch.compile case may spend a minute compiling: only with that much left
                if left is not None and (left <= 0 or (spec.get("impl") == "compiled"
                                                       and left < args.compile_reserve)):
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
    report["load_average_at_end"] = _loadavg()

    if rows and not args.targets:
        print_tables(rows)
        print("\n" + legend(device, args.in_process))
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
