"""The trainer's records: ``train_log.jsonl``, one JSON object per logged step and evaluation
(``{"type": "step" | "eval" | "summary", "step", "epoch", ...}`` with what transformers logged;
an evaluation's scores under their task names: ``stsb-dev``, ``sickr-dev``, ``avg``,
``stsb-dev_alignment`` ...). Curves: ``--report_to tensorboard`` (transformers' own)."""

from __future__ import annotations

import json
import math
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
