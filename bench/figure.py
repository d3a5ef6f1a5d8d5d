#!/usr/bin/env python
"""The README's figure: time and peak memory against N, one line per implementation, from
the JSON of one ``bench/run.py`` run (ratios side by side in one run; CPU now, GPU when
measured).

    python bench/figure.py bench/results/cpu-2026-12-03-custom-alternatives.json \\
        --out docs/benchmarks-cpu.png [--objective infonce]

Rows that did not run (skipped, failed, wrong) are left out of the lines and listed under
the figure with their reason.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STYLE = {"fastcl": ("C3", "o", 2.6), "torch-lce": ("C0", "s", 1.6), "cce": ("C1", "^", 1.6),
         "memeff": ("C4", "D", 1.6), "inf-cl": ("C5", "v", 1.6), "compiled": ("C2", "P", 1.6),
         "reference": ("C7", "X", 1.6), "mnrl": ("C8", "*", 1.6)}
LABEL = {"fastcl": "fastcl", "torch-lce": "PyTorch linear_cross_entropy (chunked)",
         "cce": "Cut Cross-Entropy", "memeff": "memeff", "inf-cl": "Inf-CL",
         "compiled": "torch.compile(reference)", "reference": "eager reference (N×N)",
         "mnrl": "sentence-transformers MNRL"}


def figure(report: dict, out: Path, objective: str = "infonce") -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get("objective") == objective and r.get("kind", "case") == "case"]
    if not rows:
        raise SystemExit(f"no {objective} rows in the report")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    missing = []
    for impl in impls:
        ok = sorted((r for r in rows if r["impl"] == impl and r.get("ok")), key=lambda r: r["n"])
        for r in rows:
            if r["impl"] == impl and not r.get("ok"):
                missing.append(f"{impl} N={r['n']}: {r.get('error')}")
        if not ok:
            continue
        color, marker, width = STYLE.get(impl, ("k", ".", 1.2))
        label = LABEL.get(impl, impl) + (f" [{ok[0]['backend']}]" if ok[0].get("backend") not in
                                         (impl, None, "reference", "compiled") else "")
        ns = [r["n"] for r in ok]
        ax_t.plot(ns, [r["median_s"] for r in ok], marker=marker, color=color, lw=width, label=label)
        mem = [(r["n"], r.get("peak_beyond_inputs_mib")) for r in ok
               if r.get("peak_beyond_inputs_mib") is not None]
        if mem:
            ax_m.plot(*zip(*mem), marker=marker, color=color, lw=width, label=label)
    env = report.get("environment", {})
    first = rows[0]
    for ax, what in ((ax_t, "median time of forward + backward (s)"),
                     (ax_m, "peak memory beyond the inputs (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N = M (batch size)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=7.5, loc="upper left")
    where = env.get("gpu_model") or env.get("cpu_model") or report.get("device")
    fig.suptitle(f"{objective}, d={first['d']}, {first['dtype']} — {where}, "
                 f"{env.get('cpu_threads', '')} threads; one run ({report.get('date', '')[:10]}), "
                 f"every row checked against the float64 reference"
                 + (f"; load average {env['load_average_at_start'][0]:.1f} at the start, "
                    f"{report['load_average_at_end'][0]:.1f} at the end (shared machine)"
                    if env.get("load_average_at_start") and report.get("load_average_at_end") else ""),
                 fontsize=9, wrap=True)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return missing


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", help="a bench/run.py JSON")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--objective", default="infonce")
    args = p.parse_args(argv)
    missing = figure(json.loads(Path(args.report).read_text()), Path(args.out), args.objective)
    print(f"wrote {args.out}")
    for line in missing:
        print(f"  not drawn: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
