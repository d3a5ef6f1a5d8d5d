#!/usr/bin/env python
"""Where the time of one fastcl infonce forward+backward goes: a ``torch.profiler`` breakdown.

    python bench/profile_step.py                          # GPU: N=M=16384 and 32768, bf16, d=768
    python bench/profile_step.py --device cpu --n 256 --d 64   # a tiny CPU run

For each size, side by side, one warm-up call (autotuning and compilation stay out of the
profile), then one profiled call:

* time per kernel family: ``similarity`` (``_similarity_kernel``), ``row``
  (``_row_kernel``), ``tangent`` (``_tangent_kernel``), ``gemm`` (cuBLAS), ``torch ops``
  (PyTorch's own elementwise, reduction, copy and fill kernels) and ``other``; on CPU the
  self time of each operator call (GEMMs: ``aten::mm`` and its kin; a launch is a call);
* GPU busy time (the union of the kernels' intervals) as a share of the call's span (its
  wall time, profiled, and once more without the profiler) and of the kernels' own span;
* launches (on GPU: kernels, copies and fills), in total and per chunk: chunks are what the driver chose, recorded from
  ``fastcl.tiled.chunk_rows`` during the call (or, failing that, the number of
  ``_similarity_kernel`` launches);
* the kernels that took the most time, and what autotuning chose (``chosen_configs()``).

Outputs: a table, ``<stem>.json`` (default stem ``bench/results/<device>-<date>-profile``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import re
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
import _report
from _cases import build
from _env import device_slug, environment
from _measure import default_threads, select_device, sync
from ab import chosen_configs, record_autotuning

HERE = Path(__file__).resolve().parent
FAMILIES = [  # first match wins
    ("similarity", r"_similarity_kernel"),
    ("row", r"_row_kernel|_row_finish_kernel"),
    ("tangent", r"_tangent_kernel"),
    ("gemm", r"gemm|xmma|cutlass|nvjet|sm90_|sm80_|Kernel2|cublas|splitK"
             r"|^aten::(mm|addmm_?|bmm|baddbmm|matmul|linear)$"),
    ("torch ops", r"at::|aten::|elementwise|reduce|Memset|Memcpy|memset|memcpy"),
]


def family(name: str) -> str:
    return next((f for f, pattern in FAMILIES if re.search(pattern, name)), "other")


@contextlib.contextmanager
def recorded_chunks():
    """Record the rows per chunk the driver chooses while the block runs (from
    ``fastcl.tiled.chunk_rows``, or ``rows_per_chunk`` where there is no ``chunk_rows``)."""
    import inspect

    import fastcl.tiled.driver as tiled

    seen = []
    name = next((f for f in ("chunk_rows", "rows_per_chunk") if hasattr(tiled, f)), None)
    if name is None:
        yield seen
        return
    original = getattr(tiled, name)
    signature = inspect.signature(original)

    def recording(*args, **kwargs):
        rows = original(*args, **kwargs)
        seen.append({"n": signature.bind(*args, **kwargs).arguments.get("n"), "rows": rows,
                     "from": f"fastcl.tiled.driver.{name}"})
        return rows

    setattr(tiled, name, recording)
    try:
        yield seen
    finally:
        setattr(tiled, name, original)


def _union_us(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def breakdown(prof, gpu: bool) -> dict:
    """Time per family, launches, busy time and the top kernels of one profile."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    if gpu:   # the kernels (and copies, fills) as the GPU ran them; not annotations or overhead
        kernels = [e for e in events if e.device_type == DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False)
                   and not re.match(r"Activity Buffer Request|Overhead", e.name)]
        spans = [(e.time_range.start, e.time_range.end) for e in kernels]
        times = [(e.name, e.time_range.end - e.time_range.start) for e in kernels]
        busy = _union_us(spans)
        span = (max(b for _, b in spans) - min(a for a, _ in spans)) if spans else 0.0
    else:     # operators and their self time (nothing counted twice); a launch is an op call
        times = [(e.name, e.self_cpu_time_total) for e in events if e.device_type == DeviceType.CPU]
        busy, span = sum(t for _, t in times), None
    families = {f: {"ms": 0.0, "launches": 0} for f, _ in FAMILIES + [("other", "")]}
    per_name = {}
    for name, us in times:
        f = families[family(name)]
        f["ms"] += us / 1e3
        f["launches"] += 1
        k = per_name.setdefault(name, [0.0, 0])
        k[0] += us / 1e3
        k[1] += 1
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:12]
    return {"busy_ms": busy / 1e3, "gpu_span_ms": None if span is None else span / 1e3,
            "launches": len(times), "families": families,
            "similarity_launches": families["similarity"]["launches"],
            "top": [{"name": name[:160], "ms": ms, "count": c, "family": family(name)}
                    for name, (ms, c) in top]}


def profile_call(n: int, d: int, dtype: str, device: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gpu = device == "cuda"
    case = build("infonce", "fastcl", n, d, dtype, device)
    out = {"n": n, "backend": case.backend}
    t0 = time.perf_counter()
    case.step()                                          # warm-up: autotuning, compilation
    sync(device)
    out["first_call_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    case.step()
    sync(device)
    out["wall_unprofiled_ms"] = (time.perf_counter() - t0) * 1e3
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with recorded_chunks() as seen, profile(activities=activities) as prof:
        t0 = time.perf_counter()
        loss = case.step()
        sync(device)
        out["wall_ms"] = (time.perf_counter() - t0) * 1e3
    out["loss"] = float(loss.detach())
    out.update(breakdown(prof, gpu))
    out["busy_pct_of_wall"] = 100.0 * out["busy_ms"] / out["wall_ms"]
    if out["gpu_span_ms"]:
        out["busy_pct_of_gpu_span"] = 100.0 * out["busy_ms"] / out["gpu_span_ms"]
    out["rows_per_chunk"] = seen
    chunks = sum(math.ceil(s["n"] / s["rows"]) for s in seen
                 if isinstance(s["rows"], int) and isinstance(s["n"], int) and s["rows"] > 0)
    if chunks:
        out["chunks"], out["chunks_from"] = chunks, seen[0]["from"]
    elif out["similarity_launches"]:
        out["chunks"], out["chunks_from"] = out["similarity_launches"], "_similarity_kernel launches"
    else:
        out["chunks"], out["chunks_from"] = None, "unknown"
    out["launches_per_chunk"] = out["launches"] / out["chunks"] if out["chunks"] else None
    out["chosen_configs"] = chosen_configs()
    return out


def table(sizes: dict, gpu: bool) -> str:
    names = list(sizes)
    fmt = lambda v, f: "" if v is None else format(v, f)
    lines = [("wall ms (profiled)", "wall_ms", ".2f"), ("wall ms (no profiler)", "wall_unprofiled_ms", ".2f"),
             ("GPU busy ms" if gpu else "self time ms", "busy_ms", ".2f"),
             ("busy % of wall", "busy_pct_of_wall", ".1f"), ("GPU span ms", "gpu_span_ms", ".2f"),
             ("busy % of GPU span", "busy_pct_of_gpu_span", ".1f"),
             ("launches" if gpu else "op calls", "launches", "d"), ("chunks", "chunks", "d"),
             ("launches per chunk", "launches_per_chunk", ".1f"), ("loss", "loss", ".6g")]
    body = []
    for fam, _ in FAMILIES + [("other", "")]:
        cells = [f"{fam} ms (launches)"]
        for n in names:
            f = sizes[n].get("families", {}).get(fam)
            cells.append("" if f is None else f"{f['ms']:.2f} ({f['launches']})")
        body.append((cells, None))
    for label, key, spec in lines:
        body.append(([label] + [fmt(sizes[n].get(key), spec) for n in names], None))
    for n in names:
        if sizes[n].get("error"):
            body.append(([f"{n}: ERROR"], sizes[n]["error"]))
    return _report._render(["", *names], body, right=set(range(1, len(names) + 1)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--n", default=None, help="comma list of N=M (GPU default 16384,32768; CPU 256)")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads on CPU")
    p.add_argument("--out-stem", default=None, help="output path without extension")
    args = p.parse_args(argv)

    import torch

    device, gpu = select_device(args.device, args.threads)
    record_autotuning()
    ns = [int(x) for x in (args.n or ("16384,32768" if gpu else "256")).split(",") if x.strip()]
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    stem = Path(args.out_stem) if args.out_stem else (
        HERE / "results" / f"{device_slug(device)}-{datetime.date.today().isoformat()}-profile")
    stem.parent.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "fastcl profile: one infonce forward+backward",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "device": device,
              "n": ns, "d": args.d, "dtype": dtype,
              "environment": environment(device, args.threads), "sizes": {}}
    print(f"fastcl profile | {device} | infonce N=M={','.join(map(str, ns))} d={args.d} {dtype}",
          flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])):
        torch.ones(1, device=device).add_(1)    # the profiler's own start-up, out of the calls
    code = 0
    for n in ns:
        name = f"N={n}"
        t0 = time.perf_counter()
        try:
            result = profile_call(n, args.d, dtype, device)
        except Exception as exc:  # a size that fails is reported, the others still run
            result = {"n": n, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            code = 1
        finally:
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        result["seconds"] = time.perf_counter() - t0
        report["sizes"][name] = result
        Path(f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"  {name}: " + (f"ERROR: {result['error']}" if "error" in result else
                               f"{result['wall_ms']:.2f} ms wall, {result['busy_ms']:.2f} ms busy, "
                               f"{result['launches']} launches, {result['chunks']} chunks"), flush=True)
    print("\n" + table(report["sizes"], gpu))
    for name, result in report["sizes"].items():
        if result.get("top"):
            print(f"\ntop {'kernels' if gpu else 'operators'}, {name}:")
            for k in result["top"][:8]:
                print(f"  {k['ms']:9.3f} ms  {k['count']:4d}x  {k['family']:<10}  {k['name'][:90]}")
        print(f"chosen configs, {name}: {json.dumps(result.get('chosen_configs'))[:600]}")
    print(f"\nwrote {stem}.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
