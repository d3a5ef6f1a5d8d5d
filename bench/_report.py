"""The outputs of a benchmark run: tables, the headline, the legend, JSON, CSV and plots
(see ``run.py`` for what a row holds)."""

from __future__ import annotations

import csv
import json
import math
import sys
import textwrap
from pathlib import Path

from _cases import OBJECTIVES
from _plan import DTYPES

IMPL_STYLE = {  # colour and marker per implementation, the same in every figure
    "fastcl": ("tab:blue", "o"),
    "tiled": ("tab:cyan", "s"),
    "reference": ("tab:red", "^"),
    "compiled": ("tab:orange", "v"),
    "mnrl": ("tab:purple", "D"),
}
DTYPE_LINE = {"bfloat16": "-", "float32": "--", "float16": "-.", "float64": ":"}


def _key(r):
    return (r["objective"], r["d"], r["dtype"], r["n"])


def add_ratios(rows: list[dict]) -> None:
    """Speed-up and memory ratio of each row against the eager reference of the same case."""
    ref = {_key(r): r for r in rows if r.get("kind") == "case" and r["impl"] == "reference"
           and r.get("ok")}
    for r in rows:
        if r.get("kind") != "case" or not r.get("ok"):
            continue
        base = ref.get(_key(r))
        if base is None or base is r:
            continue
        r["speedup_vs_reference"] = base["median_s"] / r["median_s"]
        if r.get("peak_beyond_inputs_mib") and base.get("peak_beyond_inputs_mib") is not None:
            r["memory_ratio_vs_reference"] = (base["peak_beyond_inputs_mib"]
                                              / max(r["peak_beyond_inputs_mib"], 1e-9))
        if r.get("loss") is not None and base.get("loss") is not None:
            r["loss_rel_diff_vs_reference"] = (abs(r["loss"] - base["loss"])
                                               / max(abs(base["loss"]), 1e-12))


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def _render(head, body, right):
    widths = [max([len(h)] + [len(c[i]) for c, _ in body if i < len(c)]) for i, h in enumerate(head)]

    def fmt(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(head), fmt(["-" * w for w in widths])]
    lines += [fmt(cells) + ("  " + err if err else "") for cells, err in body]
    return "\n".join(lines)


def case_cells(r) -> tuple[list[str], str | None]:
    cells = [r["objective"], r["impl"], r.get("backend") or "", str(r["n"]), str(r["m"]),
             str(r["d"]), r["dtype"]]
    if not r.get("ok"):
        return cells, ("SKIPPED: " if r.get("skipped") else "ERROR: ") + str(r.get("error", "?"))
    peak, nm = r.get("peak_beyond_inputs_mib"), r.get("nm_matrix_mib")
    cells += [f"{r['median_s'] * 1e3:.2f}", _fmt(r.get("first_call_s"), ".2f"), _fmt(peak, ".1f"),
              _fmt(peak / nm if peak is not None and nm else None, ".2f"),
              _fmt(r.get("retained_after_warmup_mib"), ".1f"), _fmt(r.get("tflops"), ".3g"),
              _fmt(r.get("pct_of_matmul"), ".1f"), _fmt(r.get("speedup_vs_reference"), ".2f"),
              _fmt(r.get("memory_ratio_vs_reference"), ".1f"), _fmt(r.get("loss"), ".5g")]
    return cells, None


CASE_HEAD = ("objective", "impl", "ran", "N", "M", "d", "dtype", "median ms", "1st call s",
             "peak MiB", "x N·M", "warm-up MiB", "TFLOP/s", "% mm", "x faster", "x less mem", "loss")
CASE_TEXT = {0, 1, 2, 6}  # left-aligned columns; the rest are numbers


def case_table(rows: list[dict]) -> str:
    """One line per case row; a figure column that no row fills (for example the warm-up
    memory, measured only in fresh CPU processes) is left out."""
    body = [case_cells(r) for r in rows if r.get("kind") == "case"]
    keep = [i for i in range(len(CASE_HEAD))
            if i < 7 or any(i < len(c) and c[i] for c, err in body if err is None)]
    body = [([c[i] for i in keep if i < len(c)], err) for c, err in body]
    return _render([CASE_HEAD[i] for i in keep], body,
                   right={k for k, i in enumerate(keep) if i not in CASE_TEXT})


E2E_HEAD = ("encoder", "loss impl", "ran", "batch N", "seq", "enc fwd ms", "loss ms", "enc bwd ms",
            "step ms", "loss share %", "peak MiB")


def e2e_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        if r.get("kind") != "e2e":
            continue
        cells = [r.get("encoder", ""), r["impl"], r.get("backend") or "", str(r["n"]),
                 str(r.get("seq", ""))]
        if not r.get("ok"):
            body.append((cells, ("SKIPPED: " if r.get("skipped") else "ERROR: ")
                         + str(r.get("error", "?"))))
            continue
        cells += [f"{r['encoder_forward_s'] * 1e3:.1f}", f"{r['loss_s'] * 1e3:.2f}",
                  f"{r['encoder_backward_s'] * 1e3:.1f}", f"{r['step_s'] * 1e3:.1f}",
                  f"{100 * r['loss_share']:.2f}", _fmt(r.get("peak_beyond_inputs_mib"), ".0f")]
        body.append((cells, None))
    return _render(E2E_HEAD, body, right=set(range(3, len(E2E_HEAD)))) if body else ""


def write_csv(rows: list[dict], path: Path) -> None:
    cols = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: (";".join(f"{x:.6g}" for x in v) if isinstance(v, list) else v)
                        for k, v in r.items()})


# --------------------------------------------------------------------------- run outputs

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


def write_outputs(report: dict, rows: list[dict], stem: Path, plots: bool) -> list[Path]:
    add_ratios(rows)
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
        write_csv(rows, csv_path)
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
                if plot(rows, path, metric, label, mem_label):
                    written.append(path)
            except Exception as exc:  # a plot must never lose the measurements
                print(f"plot {metric} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    return written


def print_tables(rows):
    add_ratios(rows)
    print()
    print(case_table(rows))
    e2e = e2e_table(rows)
    if e2e:
        print("\nEnd to end: one training step (encoder forward, loss forward+backward, encoder backward)")
        print(e2e)


def legend(device: str, in_process: bool, rows: list[dict], malloc_env: dict | None) -> str:
    fresh = device != "cuda" and not in_process
    in_units = "x N·M = that in units of one N×M float32 matrix"
    if device == "cuda":
        mem = ("peak MiB = torch.cuda.max_memory_allocated during one call minus the allocation "
               f"before it (inputs); {in_units}")
    elif in_process:
        mem = "peak MiB = not measured (in-process)"
    else:
        mem = (f"peak MiB = peak RSS of a fresh process beyond its RSS once the inputs exist; {in_units};"
               "\nwarm-up MiB = part of it already resident before the measured call (left by the "
               "warm-up: libraries, thread pools)")
    text = ("median ms = median forward+backward time; 1st call s = the first call of the case "
            "(compilation, autotuning, lazy init);\n" + mem + ";\nTFLOP/s = useful FLOPs "
            "(6·N·M·d per loss; DCLR adds the mask and the noise update) / median time; % mm = that / "
            "torch.mm throughput on (N×d)@(d×M) in the same dtype, measured in this run;\n"
            "x faster, x less mem = the eager reference's time and memory over this row's; "
            "loss = the value of the last call")
    if fresh:
        methods = sorted({r["memory_method"] for r in rows
                          if r.get("kind") == "case" and r.get("memory_method")})
        text += ("\nmemory method: " + "; ".join(methods or ["none (no case succeeded)"])
                 + " | malloc: " + (" ".join(f"{k}={v}" for k, v in (malloc_env or {}).items())
                                    or "glibc defaults"))
    return text


# --------------------------------------------------------------------------- plots

def _panels(rows, d):
    """Objectives present among the successful case rows of width ``d``."""
    present = {r["objective"] for r in rows if r.get("kind") == "case" and r["d"] == d}
    return [o for o in OBJECTIVES if o in present]


def main_width(rows) -> int | None:
    """The embedding width with the most case rows (the sweep's main width)."""
    counts = {}
    for r in rows:
        if r.get("kind") == "case":
            counts[r["d"]] = counts.get(r["d"], 0) + 1
    return max(counts, key=lambda d: (counts[d], d)) if counts else None


def _n_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _value_label(y: float, _pos=None) -> str:
    return f"{y:g}" if y >= 1e-3 else f"{y:.0e}"


def plot(rows: list[dict], path: Path, metric: str, device_label: str, memory_label: str) -> bool:
    """One figure, a panel per objective, a line per implementation (and dtype)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    d = main_width(rows)
    objectives = _panels(rows, d)
    if not objectives:
        return False
    ylabels = {"time": "median forward+backward time (ms)",
               "memory": f"peak memory beyond inputs (MiB)\n{memory_label}",
               "pct": "useful FLOP/s / matmul FLOP/s (%)"}
    titles = {"time": "Time vs batch size", "memory": "Peak memory vs batch size",
              "pct": "Useful FLOP/s as % of the measured torch.mm throughput"}
    all_dtypes = sorted({r["dtype"] for r in rows if r.get("kind") == "case" and r.get("ok")
                         and r["d"] == d})
    one_dtype = len(all_dtypes) == 1
    cols = min(3, len(objectives))
    nrows = math.ceil(len(objectives) / cols)
    height = 3.9 * nrows + 1.0
    fig, axes = plt.subplots(nrows, cols, figsize=(5.4 * cols, height), squeeze=False)
    impls_seen = []
    for ax, objective in zip(axes.flat, objectives):
        sel = [r for r in rows if r.get("kind") == "case" and r.get("ok")
               and r["objective"] == objective and r["d"] == d]
        groups = {}
        for r in sel:
            groups.setdefault((r["impl"], r["dtype"]), []).append(r)
        ys_all = []
        order = list(IMPL_STYLE)
        for (impl, dtype), rs in sorted(groups.items(),
                                        key=lambda kv: order.index(kv[0][0]) if kv[0][0] in order else 99):
            rs.sort(key=lambda r: r["n"])
            if metric == "time":
                pts = [(r["n"], r["median_s"] * 1e3) for r in rs]
            elif metric == "memory":
                pts = [(r["n"], r["peak_beyond_inputs_mib"]) for r in rs
                       if r.get("peak_beyond_inputs_mib") is not None]
                pts = [(x, max(y, 1e-2)) for x, y in pts]
            else:
                pts = [(r["n"], r["pct_of_matmul"]) for r in rs if r.get("pct_of_matmul") is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ys_all += ys
            color, marker = IMPL_STYLE.get(impl, ("black", "."))
            ax.plot(xs, ys, "-" if one_dtype else DTYPE_LINE.get(dtype, "-"), color=color,
                    marker=marker, ms=5, lw=1.6)
            if impl not in impls_seen:
                impls_seen.append(impl)
        ns = sorted({r["n"] for r in sel})
        if metric == "memory" and ns:
            m_of = {r["n"]: r["m"] for r in sel}
            ref_line = [n * m_of[n] * 4 / 2**20 for n in ns]
            ys_all += ref_line
            ax.plot(ns, ref_line, ":", color="gray", lw=1.3, marker=".", ms=4)
        ax.set_xscale("log", base=2)
        if ns:
            ax.xaxis.set_major_locator(FixedLocator(ns))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _p: _n_label(int(round(x)))))
            ax.xaxis.set_minor_formatter(NullFormatter())
            if len(ns) == 1:
                ax.set_xlim(ns[0] / 2, ns[0] * 2)
        if metric in ("time", "memory"):
            ax.set_yscale("log")
            if ys_all:
                lo = 10 ** math.floor(math.log10(min(ys_all)))
                hi = 10 ** math.ceil(math.log10(max(ys_all)))
                ax.set_ylim(lo, hi if hi > lo else lo * 10)
            ax.yaxis.set_major_locator(LogLocator(base=10))
            ax.yaxis.set_major_formatter(FuncFormatter(_value_label))
            ax.yaxis.set_minor_formatter(NullFormatter())
        else:
            ax.set_ylim(0, max(100, *(y * 1.05 for y in ys_all)) if ys_all else 100)
        m_note = {"infonce-hard": "M = 2N", "dclr": "M = 2N, K = N", "noise": "K = N, 4 steps"}
        ax.set_title(f"{objective}" + (f"  ({m_note[objective]})" if objective in m_note else ""),
                     fontsize=11)
        ax.set_xlabel("batch size N (= M unless noted)")
        ax.set_ylabel(ylabels[metric], fontsize=9)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
    for ax in axes.flat[len(objectives):]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=IMPL_STYLE[i][0], marker=IMPL_STYLE[i][1], lw=1.6, label=i)
               for i in IMPL_STYLE if i in impls_seen]
    if not one_dtype:
        handles += [Line2D([], [], color="black", ls=DTYPE_LINE.get(t, "-"), label=t) for t in all_dtypes]
    if metric == "memory":
        handles.append(Line2D([], [], color="gray", ls=":", marker=".", label="one N×M float32 matrix"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), frameon=False,
               fontsize=10)
    # wrapped to the figure's width (a one-objective figure is narrower than the device name)
    title = textwrap.wrap(f"{titles[metric]} — {device_label}, d={d}, {', '.join(all_dtypes)}",
                          int(fig.get_figwidth() * 9))
    fig.suptitle("\n".join(title), fontsize=12)
    fig.tight_layout(rect=(0, 0.55 / height, 1, 1 - (0.15 + 0.2 * len(title)) / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
