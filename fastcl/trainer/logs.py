"""The trainer's records: ``train_log.jsonl`` (one JSON object per step and evaluation) and
the plots drawn from it. Every write that replaces a file goes through a temporary file and
``os.replace``, so a crash leaves the previous version whole.

A record is ``{"type": "step" | "eval" | "summary", "step", "epoch", ...}`` with what
transformers logged (``loss``, ``learning_rate``, ``grad_norm``; an evaluation's scores under
their task names: ``stsb-dev``, ``sickr-dev``, ``avg``, ``stsb-dev_alignment`` ...)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..files import replace_text

LOG = "train_log.jsonl"
TEMPORARY = (f".{LOG}.tmp", ".dev_curve.tmp.png", ".align_uniform.tmp.png", ".loss_curve.tmp.png")


def json_safe(value):
    """``value`` with every NaN or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
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
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records


def truncate_log(out: Path, step: int) -> list:
    """Drop records of steps after ``step`` (they are redone after a resume), atomically.
    Returns the records kept."""
    kept = [r for r in read_log(out) if r.get("step", 0) <= step]
    replace_text(out / LOG, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


def moving_average(values: list, window: int) -> list:
    """The mean of each value and the ``window - 1`` before it (fewer at the start); NaNs
    (None in the log) are left out of the means."""
    finite = [v if v is not None and math.isfinite(v) else None for v in values]
    means, total, count = [], 0.0, 0
    for i, v in enumerate(finite):
        if v is not None:
            total, count = total + v, count + 1
        if i >= window and finite[i - window] is not None:
            total, count = total - finite[i - window], count - 1
        means.append(total / count if count else math.nan)
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

    if trained:
        losses = [r.get("loss") for r in trained]
        window = max(1, min(100, len(trained) // 10))
        fig, ax = plt.subplots(figsize=(6, 4))
        x = [r["step"] for r in trained]
        ax.plot(x, [_nan(v) for v in losses], alpha=0.35 if window > 1 else 1.0, label="loss")
        if window > 1:
            ax.plot(x, moving_average(losses, window), label=f"moving average ({window} steps)")
        ax.set(xlabel="step", ylabel="loss", title="training loss")
        ax.legend()
        _save_figure(fig, out / "loss_curve.png")
    if not evals:
        return
    steps = [r["step"] for r in evals]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("stsb-dev", "sickr-dev"):
        if key in evals[0]:
            ax.plot(steps, [_nan(r.get(key)) for r in evals], marker="o", label=key)
    if "sickr-dev" in evals[0]:
        ax.plot(steps, [_nan(r.get("avg")) for r in evals], linestyle="--", label="mean")
    scored = [r for r in evals if r.get(select) is not None]
    if scored:
        best = max(scored, key=lambda r: r[select])
        ax.axvline(best["step"], color="grey", linestyle=":", label=f"best (step {best['step']})")
    ax.set(xlabel="step", ylabel="Spearman x100", title="dev STS")
    ax.legend()
    _save_figure(fig, out / "dev_curve.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key in zip(axes, ("alignment", "uniformity")):
        ax.plot(steps, [_nan(r.get(f"stsb-dev_{key}")) for r in evals], marker="o")
        ax.set(xlabel="step", ylabel=key, title=f"{key} on STS-B dev (lower is better)")
    _save_figure(fig, out / "align_uniform.png")


def _nan(value) -> float:
    return math.nan if value is None else value


def _save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)

