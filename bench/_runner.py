"""Measuring the specs of a plan: one case or one end-to-end batch size → its table rows.

On CUDA (and on CPU with ``--in-process``) every spec runs in the calling process
(:func:`measure_in_process`, :func:`_e2e.e2e_measure`). On CPU each spec otherwise runs in a
fresh Python process — this file run as a script with the spec as JSON — which measures it
with :func:`_measure.measure_cpu` (peak RSS beyond the inputs, with the high-water mark reset
after a warm-up) under :func:`_measure.worker_env`'s malloc settings. A spec that fails, or
whose process dies, becomes a row with an error; an implementation that ran out of memory or
time is not tried at larger N.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
from _alternatives import ALTERNATIVES, PACKAGES, check, check_error, unavailable, version
from _cases import from_spec
from _e2e import e2e_measure
from _measure import (MIB, add_throughput, answer_as_worker, cuda_peak, cuda_time, matmul_limit,
                      measure_cpu, run_fresh_process, sync, worker_env)

FAILURE_STOPS_LARGER_N = ("out of memory", "timed out", "killed", "OutOfMemoryError")


def measure_in_process(spec: dict, device: str, warmup_ms: float, rep_ms: float) -> dict:
    """One case in this process. On CUDA: time (``do_bench``, or CUDA events for calls over
    50 ms) and allocator peak; on CPU (``--in-process``): time only."""
    import torch

    case = None
    try:
        checked = checked_first(spec, device)
        if not checked.get("check_ok", True):
            return {"ok": False, **checked, "error": check_error(checked)}
        case = from_spec(spec, device)
        out = {"backend": case.backend, "flops": case.flops, "note": case.note, **checked}
        sync(device)
        t0 = time.perf_counter()
        result = case.step()                               # compilation / autotuning
        sync(device)
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
        sync(device)
        est = time.perf_counter() - t0
        out["loss"] = float(result.detach()) if result.dim() == 0 else None
        del result
        if device == "cuda" and est < 0.05:
            out.update(cuda_time(case.step, case.leaves, warmup_ms, rep_ms))
        else:
            times, cpu = [], []
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
                    t0, c0 = time.perf_counter(), time.process_time()
                    r = case.step()
                    times.append(time.perf_counter() - t0)
                    cpu.append(time.process_time() - c0)
                del r
            out.update(median_s=statistics.median(times), times_s=times,
                       timing_method=("CUDA events (median of 3 calls of 50 ms or more)"
                                      if device == "cuda" else "time.perf_counter (median)"))
            if cpu:     # the process's CPU time: what a loaded machine's wall time hides
                out["cpu_median_s"] = statistics.median(cpu)
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


def checked_first(spec: dict, device: str) -> dict:
    """The check of :func:`_alternatives.check` (loss and gradients against the float64
    reference) for every implementation but the reference itself; {} where there is none
    (the noise update, which has no loss; a check size of 0)."""
    if spec["impl"] == "reference" or spec["objective"] == "noise" or not spec.get("check_n", 1):
        return {}
    out = check(spec, device, spec.get("check_n") or 1024)
    gc.collect()
    if device == "cuda":
        import torch
        torch.cuda.empty_cache()
    return out


def worker(spec: dict) -> dict:
    """A fresh CPU process: one case (or one end-to-end batch size). A case is checked
    against the reference first (:func:`checked_first`) and timed only if it passes."""
    import torch

    torch.set_num_threads(spec["threads"])
    if spec["kind"] == "e2e":
        return {"ok": True, "rows": e2e_measure(spec, "cpu", spec["repeats"])}
    checked = checked_first(spec, "cpu")
    if not checked.get("check_ok", True):
        return {"ok": False, **checked, "error": check_error(checked)}
    case = from_spec(spec, "cpu")
    out = measure_cpu(case.step, case.leaves, spec["repeats"])
    out.update(backend=case.backend, flops=case.flops, note=case.note, **checked)
    return out


class Runner:
    """Runs the specs of one benchmark run; remembers the failures that stop larger N and the
    matmul limit measured per shape (``mm``, in the report)."""

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
                "input_checks": not args.no_input_checks,
                "check_n": getattr(args, "check_n", 1024)}
        if spec["kind"] == "case":
            spec.setdefault("compile_dynamic", True if self.device == "cuda" else False)
            if spec.get("chunk_size") is None:
                spec["chunk_size"] = args.chunk_size
            if spec["impl"] in ALTERNATIVES:     # which package version is measured
                spec.update(package=PACKAGES[spec["impl"]], package_version=version(spec["impl"]))
            why = unavailable(spec["impl"], spec["objective"], self.device)
            if why:
                return [{**spec, "ok": False, "skipped": True, "device": self.device, "error": why}]
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
            cmd = [sys.executable, os.path.abspath(__file__), json.dumps(spec)]
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
            add_throughput(row, mm)
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
            + (f", {row['pct_of_matmul']:.1f}% of mm" if row.get("pct_of_matmul") is not None else "")
            + (f" (checked at N={row['check_n']}: loss {row['check_loss_rel']:.0e}, grads "
               f"{row['check_grad_rel']:.0e})" if row.get("check_ok") else ""))


if __name__ == "__main__":      # a CPU worker: one spec, given as JSON
    sys.exit(answer_as_worker(sys.argv[1], worker))
