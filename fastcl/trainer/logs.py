"""The trainer's records: ``train_log.jsonl``, one JSON object per logged step and evaluation
(``{"type": "step" | "eval" | "summary", "step", "epoch", ...}`` with what transformers logged;
an evaluation's scores under their task names: ``stsb-dev``, ``sickr-dev``, ``avg``,
``stsb-dev_alignment`` ...), and the plots drawn from it. Files are replaced through a
temporary file and ``os.replace``: a crash leaves the previous version whole."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..files import replace_text

LOG = "train_log.jsonl"


def json_safe(value):
    """``value`` with every NaN or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        safe = {k: json_safe(v) for k, v in items}
        return safe if isinstance(value, dict) else list(safe.values())
    return value


def append_log(out: Path, record: dict) -> dict:
    """Append ``record`` to the log; returns it as written (``json_safe``)."""
    safe = json_safe(record)
    with open(out / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(safe, allow_nan=False) + "\n")
    return safe


def read_log(out: Path) -> list:
    """The records of the log; a last line cut short by a crash is ignored."""
    path = out / LOG
    lines = [x for x in path.read_text(encoding="utf-8").split("\n") if x.strip()] if path.is_file() else []
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records


def truncate_log(out: Path, step: int) -> list:
    """Drop the records of steps after ``step`` (redone after a resume), atomically; returns
    the records kept."""
    kept = [r for r in read_log(out) if r.get("step", 0) <= step]
    replace_text(out / LOG, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def moving_average(values: list, window: int) -> list:
    """The mean of each value and the ``window - 1`` before it (fewer at the start); NaNs
    (None in the log) are left out of the means."""
    means = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1):i + 1] if v is not None and math.isfinite(v)]
        means.append(sum(part) / len(part) if part else math.nan)
    return means


def write_plots(out: Path, records: list, select: str = "stsb-dev") -> None:
    """loss_curve.png (the step losses and their moving average), and with evaluations
    dev_curve.png (dev Spearman over steps, the best by ``select`` marked) and
    align_uniform.png (Wang & Isola's metrics on STS-B dev)."""
    trained = [r for r in records if r.get("type") == "step"]
    evals = [r for r in records if r.get("type") == "eval"]
    if not trained and not evals:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def curve(ax, rows, key, **kw):
        ax.plot([r["step"] for r in rows], [math.nan if r.get(key) is None else r[key] for r in rows], **kw)

    def save(fig, name):
        for ax in fig.axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.tight_layout()
        tmp = out / f".{Path(name).stem}.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, out / name)

    if trained:
        window = max(1, min(100, len(trained) // 10))
        fig, ax = plt.subplots(figsize=(6, 4))
        curve(ax, trained, "loss", alpha=0.35 if window > 1 else 1.0, label="loss")
        if window > 1:
            ax.plot([r["step"] for r in trained], moving_average([r.get("loss") for r in trained], window),
                    label=f"moving average ({window} steps)")
        ax.set(xlabel="step", ylabel="loss", title="training loss")
        save(fig, "loss_curve.png")
    if not evals:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("stsb-dev", "sickr-dev"):
        if key in evals[0]:
            curve(ax, evals, key, marker="o", label=key)
    if "sickr-dev" in evals[0]:
        curve(ax, evals, "avg", linestyle="--", label="mean")
    scored = [r for r in evals if r.get(select) is not None]
    if scored:
        best = max(scored, key=lambda r: r[select])
        ax.axvline(best["step"], color="grey", linestyle=":", label=f"best (step {best['step']})")
    ax.set(xlabel="step", ylabel="Spearman x100", title="dev STS")
    save(fig, "dev_curve.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key in zip(axes, ("alignment", "uniformity")):
        curve(ax, evals, f"stsb-dev_{key}", marker="o")
        ax.set(xlabel="step", ylabel=key, title=f"{key} on STS-B dev (lower is better)")
    save(fig, "align_uniform.png")
