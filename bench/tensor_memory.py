#!/usr/bin/env python
"""Peak tensor memory of one loss call, at sizes no machine can hold, side by side.

    python bench/tensor_memory.py --objective gist --impl fastcl,gistembed --n 1024,16384
    python bench/tensor_memory.py --objective infonce --impl fastcl,reference,mnrl --n 65536

``run.py`` measures memory as a process's peak RSS, which needs the call to run. Some
implementations cannot run at the sizes that matter: sentence-transformers' GISTEmbedLoss
forms its cosines through an N×N×d broadcast (``nn.CosineSimilarity`` on ``h[:, None]`` and
``h[None]``), about 9 TiB at N = 16384, d = 768. Here each case of ``_cases.py`` (the same
inputs and call as ``run.py``) is built and called under ``FakeTensorMode``: every op
allocates a tensor with its shape and dtype and no data, so any size can be counted. torch's
``MemTracker`` follows every storage from the op that creates it until it is freed, and its
peak (minus the inputs, registered before the call) is the figure: the tensor bytes a real
call would hold at once. Allocator overhead, library code and thread pools are not in it;
``run.py``'s RSS figures are.

The count does not depend on the values, so it is the same on real tensors: ``--real-up-to
N`` runs the cases with N at most that on real tensors too (the ``real_peak_mib`` column;
``matches`` says whether the two counts agree to the byte). Input checks are off (a NaN/Inf
scan needs the values); they allocate a few scalars.

Output: a table with each implementation's ratio to ``fastcl`` and
``<out>/<device>-<date>-tensor-memory[-TAG].json`` and ``.csv`` (``--out``, default ``runs/bench/``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
from _cases import IMPLS, OBJECTIVES, build
from _measure import MIB
from _report import write_csv

HERE = Path(__file__).resolve().parent


def tensor_peak(objective: str, impl: str, n: int, d: int, dtype: str, fake: bool) -> dict:
    """Peak live tensor bytes beyond the inputs over one call (forward + backward) of a case,
    on fake (``fake=True``) or real CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from fastcl import set_input_checks

    t0 = time.perf_counter()
    checks = set_input_checks(False)    # build() sets the process-wide switch: put it back
    try:
        with FakeTensorMode() if fake else contextlib.nullcontext():
            case = build(objective, impl, n, d, dtype, "cpu", input_checks=False)
            tracker = MemTracker()
            tracker.track_external(*case.leaves)
            with tracker:
                inputs = tracker.get_tracker_snapshot("current")
                result = case.step()
                del result
            peak = tracker.get_tracker_snapshot("peak")
    finally:
        set_input_checks(checks)
    total = sum(s["Total"] for s in peak.values())
    base = sum(s["Total"] for s in inputs.values())
    out = {"peak_mib": (total - base) / MIB, "inputs_mib": base / MIB,
           "backend": case.backend, "seconds": time.perf_counter() - t0}
    case.leaves.clear()
    del case
    gc.collect()
    return out


def measure(objective, impl, n, d, dtype, real_up_to) -> dict:
    row = {"objective": objective, "impl": impl, "n": n, "d": d, "dtype": dtype}
    try:
        fake = tensor_peak(objective, impl, n, d, dtype, fake=True)
        row.update(ok=True, backend=fake["backend"], peak_mib=fake["peak_mib"],
                   inputs_mib=fake["inputs_mib"], fake_seconds=fake["seconds"])
        if n <= real_up_to:
            real = tensor_peak(objective, impl, n, d, dtype, fake=False)
            row.update(real_peak_mib=real["peak_mib"], real_seconds=real["seconds"],
                       matches=abs(real["peak_mib"] - fake["peak_mib"]) * MIB < 1)
    except Exception as exc:  # a failing case is a row
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's peak over fastcl's for the same case: how many times fastcl's memory it holds."""
    ours = {(r["objective"], r["n"], r["d"], r["dtype"]): r["peak_mib"] for r in rows
            if r.get("ok") and r["impl"] == "fastcl"}
    for r in rows:
        base = ours.get((r["objective"], r["n"], r["d"], r["dtype"]))
        if r.get("ok") and base:
            r["x_fastcl"] = r["peak_mib"] / base


def table(rows: list[dict]) -> str:
    head = ["objective", "impl", "N", "d", "dtype", "peak MiB", "x fastcl", "real MiB", "same"]
    lines = []
    for r in rows:
        if not r.get("ok"):
            lines.append([r["objective"], r["impl"], str(r["n"]), str(r["d"]), r["dtype"],
                          "—", "", "", r["error"]])
            continue
        lines.append([r["objective"], r["impl"], str(r["n"]), str(r["d"]), r["dtype"],
                      f"{r['peak_mib']:,.1f}", f"{r['x_fastcl']:,.1f}" if "x_fastcl" in r else "",
                      f"{r['real_peak_mib']:,.1f}" if "real_peak_mib" in r else "",
                      {True: "yes", False: "NO"}.get(r.get("matches"), "")])
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])


def _list(values, cast=str):
    return [cast(v) for item in values for v in item.split(",") if v]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objective", action="append", required=True,
                   help=f"comma list of {', '.join(OBJECTIVES)}")
    p.add_argument("--impl", action="append", required=True, help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--n", action="append", required=True, help="comma list of batch sizes N")
    p.add_argument("--d", action="append", help="comma list of embedding widths (default 768)")
    p.add_argument("--dtype", action="append", help="comma list of dtypes (default float32)")
    p.add_argument("--real-up-to", type=int, default=0,
                   help="also count on real tensors for N up to this (default 0: never)")
    p.add_argument("--out", "--out-dir", dest="out_dir", default=str(HERE.parent / "runs" / "bench"),
                   help="folder of the outputs (default runs/bench, untracked; committed results: "
                        "--out bench/results)")
    p.add_argument("--tag", default=None, help="appended to the output file names")
    p.add_argument("--no-save", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    import torch

    objectives, impls = _list(args.objective), _list(args.impl)
    for name, given, known in (("objective", objectives, OBJECTIVES), ("impl", impls, IMPLS)):
        unknown = sorted(set(given) - set(known))
        if unknown:
            p.error(f"--{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    if "compiled" in impls:
        p.error("--impl compiled: a compiled graph cannot be counted on fake tensors")
    rows = []
    for objective in objectives:
        for d in _list(args.d or ["768"], int):
            for dtype in _list(args.dtype or ["float32"]):
                for n in _list(args.n, int):
                    for impl in impls:
                        try:
                            build(objective, impl, 2, d, dtype, "cpu", input_checks=False)
                        except ValueError:
                            continue            # this implementation does not compute it
                        row = measure(objective, impl, n, d, dtype, args.real_up_to)
                        rows.append(row)
                        print(f"  {objective} {impl} N={n}: "
                              + (f"{row['peak_mib']:,.1f} MiB" if row["ok"] else row["error"]),
                              file=sys.stderr, flush=True)
    add_ratios(rows)
    print(table(rows))
    print("peak MiB = the most tensor bytes alive at once during one forward+backward, beyond the "
          "inputs, counted on fake tensors (FakeTensorMode, MemTracker); x fastcl = that over "
          "fastcl's; real MiB = the same count on real tensors; same = whether they agree")
    if args.no_save:
        return 0
    report = {"benchmark": "fastcl: peak tensor memory of one loss call (FakeTensorMode + MemTracker)",
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": "python bench/tensor_memory.py " + shlex.join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "rows": rows}
    stem = Path(args.out_dir) / (f"cpu-{datetime.date.today().isoformat()}-tensor-memory"
                                 + (f"-{args.tag}" if args.tag else ""))
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_csv(rows, Path(f"{stem}.csv"))
    print(f"wrote {stem}.json and .csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
