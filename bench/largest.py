#!/usr/bin/env python
"""The largest loss one GPU holds: fastcl's infonce forward+backward at N = M = 262,144 and
1,048,576 (bf16, d = 768), its time, its memory, and its loss checked in float64.

    python bench/largest.py --out /tmp/largest.json                    # GPU: N = 262144,1048576
    python bench/largest.py --dry-run --out /tmp/largest-dry.json      # CPU: N = 2048,4096, d 64, fp32

Per size N (``--n``, a comma list, run in that order; M = N):

* inputs generated on the device in ``--dtype``: standard normal anchors h and positives
  h⁺ = h + 3·noise (cosine ≈ 0.3, the inputs of ``bench/_cases.py``), both requiring grad;
* one untimed first call (compilation; Triton autotunes per M, so a warm-up at another size
  would not cover it: ``first_call_s``), then up to ``--repeats`` timed calls of
  ``fastcl.infonce(h, h⁺).backward()`` (default backend, τ = 0.05; CUDA events on GPU,
  ``time.perf_counter`` on CPU), fewer once they add up to ``--max-timed-s``; useful TFLOP/s
  = 6·N·M·d / median;
* peak memory beyond the inputs: ``torch.cuda.max_memory_allocated`` during a timed call
  minus what was allocated before it (the inputs, their gradients dropped: the gradients
  are part of the peak), max over the timed calls; the inputs' own size beside it;
* the check: a contiguous block of ``--check-rows`` anchor rows at a random offset o. Its
  exact per-row losses ``lse_i − l_{i,o+i}`` against all M candidates in float64 (the bf16
  inputs are exact in float64), candidates in chunks of ``--check-chunk`` so the check
  itself fits; fastcl's loss on the same block,
  ``fastcl.infonce(h[o:o+B], h⁺, anchor_offset=o)`` (the anchors as rows [o, o+B) of the
  batch: the same M candidates, the positive of row i at column o+i) must match their mean
  to ``--rtol`` (default 1e-4 for float32, 1e-3 for 16-bit inputs: the similarity GEMMs
  read the 16-bit inputs as they are and accumulate in float32, the forward's max and sum
  stay float32, so the expected error is far smaller — on CPU 1e-7 — and 1e-3 leaves room
  for the GPU's exp and summation order while catching a wrong or missing block of
  candidates of a few per cent of M, or any indexing overflow). Beside it the
  full-size loss against the block's float64 mean, which estimates it: the difference in
  units of the block's standard error (``z``), passing when within 5 standard errors plus
  ``rtol``.

An out-of-memory (while generating the inputs, in a call, in the check) is a row saying so,
and the larger sizes after it are skipped; so is a size the time budget cannot hold.

``--time-budget SECONDS`` (from the start of the script): a size starts only when its
estimate (the previous size's call time × (N/N_prev)², for a first call and one timed call)
fits in the time left, a timed call only when one more call does. The JSON (``--out``) is
rewritten after every size and on SIGTERM. Keys: ``environment``, ``settings``, ``rows`` (one
per size), ``elapsed_s``, ``interrupted``. Exit status 1 if a size failed other than by
running out of memory or a check failed.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: F401,E402  (fastcl importable from a bare checkout)
from _cases import useful_flops  # noqa: E402
from _env import environment  # noqa: E402
from _measure import MIB, cuda_peak, default_threads, select_device, sync, timed_call  # noqa: E402

GPU_DEFAULTS = dict(n="262144,1048576", d=768, dtype="bfloat16", check_rows=4096,
                    check_chunk=65536, repeats=3)
DRY_DEFAULTS = dict(n="2048,4096", d=64, dtype="float32", check_rows=256, check_chunk=1024,
                    repeats=2)
RTOL = {"float32": 1e-4, "bfloat16": 1e-3, "float16": 1e-3}
Z_LIMIT = 5.0


class Interrupted(BaseException):
    """SIGTERM (``timeout``'s first signal): not an ``Exception``, so no per-step handler eats it."""


def _on_signal(signum, frame):
    raise Interrupted(f"received {signal.Signals(signum).name}")


def _is_oom(exc) -> bool:
    import torch

    return (isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError))
            or any(t in str(exc) for t in ("out of memory", "can't allocate memory")))


def make_inputs(n: int, d: int, dtype, device, seed: int):
    """Anchors h ~ N(0, 1) and positives h⁺ = h + 3·noise in ``dtype`` on ``device`` (drawn in
    float32 there, in slices of rows so the float32 copies stay small), requiring grad."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    anchors = torch.empty(n, d, device=device, dtype=dtype)
    positives = torch.empty(n, d, device=device, dtype=dtype)
    step = max(1, 2**26 // d)
    for r in range(0, n, step):
        h = torch.randn(min(step, n - r), d, generator=gen, device=device)
        anchors[r:r + step] = h
        positives[r:r + step] = h + 3.0 * torch.randn(h.shape, generator=gen, device=device)
        del h
    return anchors.requires_grad_(True), positives.requires_grad_(True)


def exact_block_losses(anchors, positives, offset: int, rows: int, temperature: float, chunk: int):
    """float64 per-row InfoNCE losses of anchor rows [offset, offset + rows) against every row
    of ``positives`` (the positive of row i at column offset + i), candidates in chunks."""
    import torch
    from torch.nn.functional import normalize

    with torch.no_grad():
        a = normalize(anchors[offset:offset + rows].double(), dim=1)
        lse = torch.full((rows,), -math.inf, device=a.device, dtype=torch.float64)
        for j in range(0, positives.shape[0], chunk):
            c = normalize(positives[j:j + chunk].double(), dim=1)
            lse = torch.logaddexp(lse, torch.logsumexp(a @ c.T / temperature, dim=1))
            del c
        own = normalize(positives[offset:offset + rows].double(), dim=1)
        return lse - (a * own).sum(dim=1) / temperature


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, small: --device cpu --n 2048,4096 --d 64 --dtype float32 "
                        "--check-rows 256 --check-chunk 1024 --repeats 2 (flags given override)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="default: cuda when there is one (cpu with --dry-run)")
    p.add_argument("--n", default=None, help="comma list of N = M (GPU default 262144,1048576)")
    p.add_argument("--d", type=int, default=None, help="embedding width (default 768)")
    p.add_argument("--dtype", choices=tuple(RTOL), default=None, help="default bfloat16")
    p.add_argument("--backend", default="auto", help="fastcl backend (default auto: triton on CUDA)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per size at most (default 3)")
    p.add_argument("--max-timed-s", type=float, default=12.0,
                   help="no further timed call at a size once its timed calls add up to this "
                        "with one more (at least one; default 12)")
    p.add_argument("--check-rows", type=int, default=None, help="anchor rows of the check (default 4096)")
    p.add_argument("--check-chunk", type=int, default=None,
                   help="candidates per float64 chunk of the check (default 65536)")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of the block check (default 1e-4 fp32, 1e-3 16-bit)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the start: no size or call starts that would not fit")
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads on CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    defaults = DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cpu" if args.dry_run else "auto"
    try:
        sizes = [int(x) for x in str(args.n).split(",") if x.strip()]
    except ValueError:
        raise SystemExit("--n: a comma list of integers") from None
    if not sizes or min(sizes) < 1 or args.d < 1 or args.repeats < 1 or args.check_rows < 1:
        raise SystemExit("--n, --d, --repeats and --check-rows must be positive")

    import torch

    device, on_gpu = select_device(args.device, args.threads)
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    import fastcl
    from fastcl.common import TEMPERATURE

    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else RTOL[args.dtype]
    deadline = None if args.time_budget is None else T0 + args.time_budget
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "the largest infonce forward+backward one device holds, with a float64 check",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": device,
        "environment": environment(device, args.threads),
        "settings": {**vars(args), "device": device, "sizes": sizes, "temperature": TEMPERATURE,
                     "rtol": rtol, "z_limit": Z_LIMIT,
                     "inputs": "h ~ N(0,1), h+ = h + 3·noise, drawn on the device",
                     "timing_method": "CUDA events per call" if on_gpu else "time.perf_counter per call",
                     "memory_method": ("torch.cuda.max_memory_allocated during a timed call minus the "
                                       "allocation before it (inputs; gradients dropped, so they count)"
                                       if on_gpu else "not measured on CPU"),
                     "fastcl_switches": {k: v for k, v in os.environ.items()
                                         if k.startswith(("FASTCL_", "TRITON_INTERPRET"))}},
        "rows": [], "interrupted": False,
    }
    rows = report["rows"]

    def save():
        report["elapsed_s"] = time.perf_counter() - T0
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(out_path)

    def left():
        return math.inf if deadline is None else deadline - time.perf_counter()

    signal.signal(signal.SIGTERM, _on_signal)
    code = 0
    prev = None                                # (n, seconds of one call) of the last size that ran
    stop = None                                # why the remaining sizes are skipped
    oom_at = None                              # the smallest size that ran out of memory
    try:
        for n in sizes:
            row = {"n": n, "m": n, "d": args.d, "dtype": args.dtype, "ok": False,
                   "inputs_mib": 2 * n * args.d * dtype.itemsize / MIB,
                   "flops": useful_flops("infonce", n, args.d)}
            rows.append(row)
            estimate = None if prev is None else 2 * prev[1] * (n / prev[0]) ** 2
            row["estimated_s"] = estimate
            if stop is None and estimate is not None and estimate > left():
                stop = f"time budget of {args.time_budget:g} s: {left():.0f} s left, size estimated {estimate:.0f} s"
            if stop is None and oom_at is not None and n >= oom_at:
                row.update(skipped=True, error=f"not tried: N={oom_at} ran out of memory")
                save()
                continue
            if stop is not None:
                row.update(skipped=True, error=stop)
                save()
                continue
            anchors = positives = None
            stage = "generating the inputs"
            try:
                t = time.perf_counter()
                anchors, positives = make_inputs(n, args.d, dtype, device, args.seed)
                sync(device)
                row["inputs_s"] = time.perf_counter() - t
                row["backend"] = fastcl.resolve_backend(args.backend, anchors)

                def call():
                    anchors.grad = positives.grad = None
                    loss = fastcl.infonce(anchors, positives, temperature=TEMPERATURE,
                                          backend=args.backend)
                    loss.backward()
                    return float(loss.detach())

                stage = "the first call"
                row["first_call_s"], row["loss_first_call"] = timed_call(call, device)
                prev = (n, row["first_call_s"])
                stage = "a timed call"
                times, peaks = [], []
                while len(times) < args.repeats:
                    last = times[-1] if times else row["first_call_s"]
                    if times and (sum(times) + last > args.max_timed_s or last > left()):
                        break
                    if not times and last > left():   # not even one: the first call stands in
                        row["note"] = "no timed call fits in the time budget: first_call_s only"
                        break
                    if on_gpu:
                        peak, (secs, loss) = cuda_peak(lambda: timed_call(call, device),
                                                       [anchors, positives])
                        peaks.append(peak / MIB)
                    else:
                        secs, loss = timed_call(call, device)
                    times.append(secs)
                    row["loss"] = loss
                anchors.grad = positives.grad = None
                if times:
                    prev = (n, min(times))
                row["loss"] = row.get("loss", row["loss_first_call"])
                row.update(times_s=times, repeats=len(times),
                           median_s=statistics.median(times) if times else None,
                           peak_beyond_inputs_mib=max(peaks, default=None))
                if times:
                    row["tflops"] = row["flops"] / row["median_s"] / 1e12

                stage = "the check"
                t = time.perf_counter()
                rows_b = min(args.check_rows, n)
                gen = torch.Generator().manual_seed(args.seed + n)
                offset = int(torch.randint(0, n - rows_b + 1, (1,), generator=gen))
                with torch.no_grad():
                    block = float(fastcl.infonce(anchors[offset:offset + rows_b].detach(),
                                                 positives.detach(), temperature=TEMPERATURE,
                                                 anchor_offset=offset, backend=args.backend))
                exact = exact_block_losses(anchors.detach(), positives.detach(), offset, rows_b,
                                           TEMPERATURE, args.check_chunk)
                mean64 = float(exact.mean())
                stderr = float(exact.std()) / math.sqrt(rows_b) if rows_b > 1 else 0.0
                sync(device)
                block_rel = abs(block - mean64) / abs(mean64)
                full_diff = row["loss"] - mean64
                z = full_diff / stderr if stderr > 0 else None
                row["check"] = {
                    "rows": rows_b, "offset": offset, "candidates": n, "chunk": args.check_chunk,
                    "fastcl_block_loss": block, "float64_block_loss": mean64,
                    "block_rel_error": block_rel, "rtol": rtol, "block_ok": block_rel <= rtol,
                    "float64_row_loss_std": float(exact.std()) if rows_b > 1 else None,
                    "full_minus_block_mean": full_diff, "full_z": z,
                    "full_ok": abs(full_diff) <= Z_LIMIT * stderr + rtol * abs(mean64),
                    "seconds": time.perf_counter() - t}
                row["check_ok"] = row["check"]["block_ok"] and row["check"]["full_ok"]
                row["ok"] = True
                if not row["check_ok"]:
                    code = 1
                del exact
            except (Interrupted, KeyboardInterrupt):
                row["error"] = f"interrupted during {stage}"
                raise
            except Exception as exc:  # an out-of-memory is a result; anything else an error
                oom = _is_oom(exc)
                row["error"] = (f"out of memory during {stage}: " if oom else f"{stage}: ") + \
                    f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                row["oom"] = oom
                if oom:
                    oom_at = n if oom_at is None else min(oom_at, n)
                else:
                    code = 1
            finally:
                anchors = positives = None
                gc.collect()
                if on_gpu:
                    torch.cuda.empty_cache()
                    row["device_max_allocated_mib"] = torch.cuda.max_memory_allocated() / MIB
            save()
    except (Interrupted, KeyboardInterrupt) as exc:
        report["interrupted"] = str(exc) or "KeyboardInterrupt"
        print(f"interrupted ({report['interrupted']}): writing what was measured", flush=True)
        code = 130
    save()

    env = report["environment"]
    print(f"largest | {device}: {env.get('gpu_model') or env['cpu_model']} | d {args.d}, {args.dtype}, "
          f"backend {args.backend} | check {args.check_rows} rows, rtol {rtol:g}")
    print(f"{'N=M':>9} {'ran':>7} {'first s':>8} {'median s':>9} {'TFLOP/s':>8} {'peak MiB':>9} "
          f"{'inputs MiB':>10} {'loss':>10} {'block err':>9} {'full z':>7} check")
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for r in rows:
        c = r.get("check") or {}
        if not r["ok"]:
            print(f"{r['n']:>9} {r.get('backend', '-'):>7} {fmt(r.get('first_call_s'), '8.3f')} "
                  f"{fmt(r.get('median_s'), '9.3f')}  {'SKIPPED' if r.get('skipped') else 'ERROR'}: {r.get('error')}")
            continue
        print(f"{r['n']:>9} {r['backend']:>7} {r['first_call_s']:8.3f} {fmt(r['median_s'], '9.3f')} "
              f"{fmt(r.get('tflops'), '8.1f')} {fmt(r['peak_beyond_inputs_mib'], '9.0f')} "
              f"{r['inputs_mib']:10.0f} {r['loss']:10.6f} {c['block_rel_error']:9.2e} "
              f"{fmt(c['full_z'], '7.2f')} {'PASS' if r['check_ok'] else 'FAIL'}"
              + (f"  ({r['note']})" if r.get("note") else ""))
    print(f"{report['elapsed_s']:.1f} s; wrote {out_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
