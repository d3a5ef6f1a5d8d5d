"""How the benchmarks measure: fresh-process peak RSS and wall time on CPU, CUDA timing
and allocator peaks on GPU, and the matmul limit. Shared by ``run.py`` (its runner,
``_runner.py``), ``ab.py`` and ``profile_step.py``.

CPU memory (one fresh Python process per case, see :func:`measure_cpu`):

1. the inputs exist; the resident set size (``VmRSS`` in ``/proc/self/status``) is the
   *baseline*;
2. one warm-up call (one-off costs: lazy library initialisation, ``torch.compile``),
   then the gradients are dropped and freed heap pages go back to the OS
   (``malloc_trim``);
3. the kernel's peak-RSS counter is reset (``5`` written to ``/proc/self/clear_refs``
   sets ``VmHWM`` back to the current RSS), ``repeats`` timed calls run, and the peak
   (``VmHWM``) is read after the first of them.

*Peak beyond the inputs* = that peak − baseline: resident memory of the whole process,
not a count of tensor bytes; what the warm-up left resident is reported on its own
(``retained_after_warmup_mib``). If the counter cannot be reset, the very first call of
the process is the memory run (the row says so in ``memory_method``).

GPU (in one process, see ``_runner.measure_in_process``): the median of
``triton.testing.do_bench`` (:func:`cuda_time`: CUDA events around each call, L2 flushed
between calls; plain CUDA events if Triton is missing) and ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``, minus the allocation before the call (inputs only, their
gradients dropped; :func:`cuda_peak`).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

RESULT_PREFIX = "FASTCL_BENCH_RESULT "
MIB = 2**20


# --------------------------------------------------------------------------- /proc helpers

def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1))


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS; return whether the kernel actually did it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # Allow a little slack: RSS can grow by a few pages between the two reads.
    return peak_rss_bytes() <= rss_bytes() + MIB


def trim_heap() -> None:
    """Give freed heap pages back to the OS so they do not count as resident."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def select_device(device: str, threads: int):
    """The device a run uses ("auto": CUDA when there is one) with torch's CPU threads set;
    returns ``(device, on_gpu)``."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(threads)
    return device, device == "cuda"


def worker_env(system_malloc: bool = False) -> dict:
    """Environment of the CPU workers. ``MALLOC_MMAP_THRESHOLD_=1 MiB`` (unless asked not to
    or already set): glibc then gives every block of 1 MiB or more its own mapping, so a
    freed tensor leaves the RSS at once; with glibc's adaptive default the peak depends on
    allocation history (run to run it varied by about two N×M matrices at N=2048)."""
    env = dict(os.environ)
    if not system_malloc:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MIB))
    return env


def malloc_settings(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith("MALLOC_")}


# --------------------------------------------------------------------------- CPU

def _scalar(out):
    """The loss value of a call's result (None when the result is not a scalar)."""
    try:
        return float(out.detach()) if out is not None and out.dim() == 0 else None
    except (AttributeError, RuntimeError, TypeError):
        return None


def measure_cpu(step, leaves, repeats: int) -> dict:
    """Peak RSS beyond the inputs and wall times of ``step()`` in this (fresh) process.

    ``step`` runs one call (forward + ``backward()`` for a loss) and returns its result;
    ``leaves`` are the tensors that receive gradients (dropped between calls)."""
    out = {}
    trim_heap()
    baseline = rss_bytes()
    times = []
    if reset_peak_rss():
        out["memory_method"] = "clear_refs: VmHWM reset after one warm-up run"
        t0 = time.perf_counter()
        result = step()                                   # warm-up
        out["first_call_s"] = time.perf_counter() - t0
        for x in leaves:
            x.grad = None
        del result
        trim_heap()
        before = rss_bytes()
        reset_peak_rss()
        first_run_is_memory_run = True
    else:
        # No way to reset the high-water mark: measure the very first run of this
        # process instead (it includes one-off initialisation), then time the rest.
        out["memory_method"] = ("first run in a fresh process (VmHWM could not be reset: "
                                "includes one-off initialisation)")
        before = baseline
        t0 = time.perf_counter()
        result = step()
        out["first_call_s"] = time.perf_counter() - t0
        first_run_is_memory_run = False
        peak = peak_rss_bytes()
        del result

    value = None
    for i in range(repeats):
        t0 = time.perf_counter()
        result = step()
        times.append(time.perf_counter() - t0)
        if i == 0 and first_run_is_memory_run:
            peak = peak_rss_bytes()
        value = _scalar(result)
        del result

    out.update(
        ok=True,
        loss=value,
        times_s=times,
        median_s=statistics.median(times),
        baseline_rss_mib=baseline / MIB,
        retained_after_warmup_mib=(before - baseline) / MIB,
        peak_rss_mib=peak / MIB,
        peak_beyond_inputs_mib=(peak - baseline) / MIB,
    )
    return out


def run_fresh_process(cmd: list[str], row: dict, timeout, env: dict) -> dict:
    """Run one worker command; it prints ``RESULT_PREFIX + json`` as its last result line.
    Any failure (exception, kill, timeout) becomes an error row, never an exception."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**row, "ok": False, "error": f"timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return {**row, **json.loads(line[len(RESULT_PREFIX):])}
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode).name
        why = f"worker killed by {sig}" + (" (likely out of memory)" if sig == "SIGKILL" else "")
    else:
        why = f"worker exited with status {proc.returncode}"
    tail = proc.stderr.strip().splitlines()[-3:]
    return {**row, "ok": False, "error": "; ".join([why, *tail])}


def print_result(result: dict) -> None:
    """The worker side of :func:`run_fresh_process`."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    sys.stdout.flush()


def answer_as_worker(spec_json: str, worker) -> int:
    """A script's hidden ``--worker`` mode: run one case and print its result for the parent.
    An exception becomes an error row (labelled when it is an out-of-memory), not a crash."""
    try:
        result = worker(json.loads(spec_json))
    except Exception as exc:  # reported as a row by the parent
        oom = "out of memory" in str(exc) or isinstance(exc, MemoryError)
        result = {"ok": False, "error": ("out of memory: " if oom else "")
                  + f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    print_result(result)
    return 0


# --------------------------------------------------------------------------- GPU

def sync(device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cuda_time(fn, leaves=(), warmup_ms: float = 25, rep_ms: float = 100) -> dict:
    """Median (and 20/80 % quantiles) of ``fn`` in seconds on the current CUDA device."""
    import torch

    leaves = list(leaves) or None
    try:
        from triton.testing import do_bench
        q20, q50, q80 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=leaves,
                                 quantiles=[0.2, 0.5, 0.8])
        return {"median_s": q50 / 1e3, "q20_s": q20 / 1e3, "q80_s": q80 / 1e3,
                "timing_method": "triton.testing.do_bench (median; L2 flushed between calls)"}
    except ImportError:
        pass
    # CUDA events, one pair per call, after a time-bounded warm-up.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    est = max(time.perf_counter() - t0, 1e-6)
    for _ in range(max(1, int(warmup_ms / 1e3 / est))):
        fn()
    times = []
    for _ in range(max(3, int(rep_ms / 1e3 / est))):
        for x in leaves or ():
            x.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    pick = lambda q: times[min(len(times) - 1, int(q * len(times)))]
    return {"median_s": statistics.median(times), "q20_s": pick(0.2), "q80_s": pick(0.8),
            "timing_method": "CUDA events (median)"}


def cuda_peak(step, leaves=()) -> tuple[float, object]:
    """Bytes allocated at the peak of one ``step()`` beyond what was allocated before it
    (the inputs; their gradients are dropped first). Returns ``(bytes, result)``."""
    import torch

    for x in leaves:
        x.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, result


# --------------------------------------------------------------------------- matmul limit

def add_throughput(row: dict, mm: dict) -> None:
    """Useful TFLOP/s of a measured row and, when the matmul limit ``mm`` of its shape was
    measured, that as a percentage of the ``torch.mm`` throughput."""
    row["tflops"] = row["flops"] / row["median_s"] / 1e12
    if mm.get("ok"):
        row["matmul_tflops"] = mm["tflops"]
        row["pct_of_matmul"] = 100.0 * row["tflops"] / mm["tflops"]


def matmul_limit(n: int, m: int, d: int, dtype, device, calls: int = 1, repeats: int = 3,
                 max_block_elems: int = 2**28) -> dict:
    """Time ``calls`` matrix products (n×d)@(d×m) in ``dtype``: the physical limit of a
    computation of the same FLOP count. Columns go in blocks of at most ``max_block_elems``
    outputs into one reused buffer (the same FLOPs, without an N×M output at large N).
    Returns the median seconds and the throughput."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1234)
    a = torch.randn(n, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
    bt = torch.randn(m, d, generator=gen, device=device, dtype=torch.float32).to(dtype)
    block = max(1, min(m, max_block_elems // max(n, 1)))
    out = torch.empty(n, block, device=device, dtype=dtype)
    tail = torch.empty(n, m % block, device=device, dtype=dtype) if m % block else None

    def fn():
        for _ in range(calls):
            for j in range(0, m, block):
                w = min(block, m - j)
                torch.mm(a, bt[j:j + w].T, out=out if w == block else tail)

    flops = 2.0 * n * m * d * calls
    if torch.device(device).type == "cuda":
        timing = cuda_time(fn)
    else:
        fn()                                               # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        timing = {"median_s": statistics.median(times), "times_s": times,
                  "timing_method": "time.perf_counter (median)"}
    return {"n": n, "m": m, "d": d, "dtype": str(dtype).replace("torch.", ""), "calls": calls,
            "block_columns": block, "flops": flops, **timing,
            "tflops": flops / timing["median_s"] / 1e12}


# --------------------------------------------------------------------------- long calls

def timed_call(fn, device) -> tuple[float, object]:
    """``(seconds, result)`` of one ``fn()``: CUDA events around the call on a GPU (waiting
    for its end), ``time.perf_counter`` on CPU. For calls of a second or more (one training
    step, one loss at N = 10⁶), where ``do_bench``'s own repetitions would not fit."""
    import torch

    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, result
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result
