"""``--report-to``: the records of ``train_log.jsonl`` mirrored to experiment trackers.

Every record the trainer logs is handed to the open reporters after it is written to the log;
its numeric fields become scalars at its step: ``train/loss``, ``train/grad_norm``,
``train/lr``, ``train/examples_per_s``, ``train/epoch`` for a step record, ``eval/stsb-dev``,
``eval/sickr-dev``, ``eval/alignment``, ``eval/uniformity``, ``eval/metric`` for an
evaluation. Only rank 0 reports.

- ``tensorboard``: event files in ``OUTPUT_DIR/runs`` (``torch.utils.tensorboard``; needs the
  ``tensorboard`` package), the run's options as text.
- ``wandb``: a Weights & Biases run (``wandb.init(project=$WANDB_PROJECT or "fastcl",
  dir=OUTPUT_DIR, config=<the options>)``; needs the ``wandb`` package and its login).

Resume: the log then holds the records up to the checkpoint, and the steps after it are
redone. Each reporter opens by replaying the log, so the tracker shows exactly the log's
records: TensorBoard's new event file starts with a purge marker at step 0 that hides the
interrupted run's events (TensorBoard keeps the later file's values for repeated steps);
W&B starts a new run that holds the whole history.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .logs import json_safe

CHOICES = ("none", "tensorboard", "wandb")
TENSORBOARD_DIR = "runs"
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
_PREFIX = {"step": "train", "eval": "eval"}
_SKIPPED = ("type", "step", "best")  # not curves: the record's kind, its x axis, a flag


def requested(report_to) -> list:
    """The reporters of ``--report-to`` (``none`` and repeats dropped)."""
    return list(dict.fromkeys(name for name in report_to or () if name != "none"))


def check_available(names) -> None:
    """Import each reporter's package now, before step 1: a missing one is an ImportError
    naming the option and the package to install."""
    for name in names:
        try:
            if name == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            else:
                import wandb  # noqa: F401
        except ImportError as err:
            raise ImportError(f"--report-to {name} needs the {_PACKAGES[name]} package, which "
                              f"cannot be imported ({err}): pip install {_PACKAGES[name]}") from err


def scalars(record: dict) -> dict:
    """The tracker scalars of a log record: ``{"train/loss": ..., ...}`` (numbers only)."""
    prefix = _PREFIX.get(record.get("type"))
    if prefix is None:
        return {}
    return {f"{prefix}/{key}": float(value) for key, value in record.items()
            if key not in _SKIPPED and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoard:
    def __init__(self, out: Path, args):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step=0: whatever an earlier run of this folder wrote is hidden (see above)
        self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=0)

    def write(self, record: dict) -> None:
        step = record.get("step", 0)
        if record.get("type") == "start":
            options = json.dumps(json_safe(record.get("args", {})), indent=2, default=str)
            self.writer.add_text("run/options", f"```\n{options}\n```", step)
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandB:
    def __init__(self, out: Path, args):
        import os

        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "fastcl",
                              name=out.resolve().name, dir=str(out), job_type="train",
                              config=json.loads(json.dumps(json_safe(vars(args)), default=str)))

    def write(self, record: dict) -> None:
        values = {k: v for k, v in scalars(record).items() if math.isfinite(v)}
        if values:
            self.run.log(values, step=record["step"])

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class Reporters:
    """The open reporters of a run; ``write`` each logged record, ``close`` at the end."""

    def __init__(self, out: Path, names, args):
        self.reporters = []
        try:
            for name in names:
                self.reporters.append((TensorBoard if name == "tensorboard" else WandB)(out, args))
        except BaseException:
            self.close(failed=True)
            raise

    def write(self, record: dict) -> None:
        for reporter in self.reporters:
            reporter.write(record)

    def replay(self, records) -> None:
        for record in records:
            self.write(record)

    def close(self, failed: bool = False) -> None:
        reporters, self.reporters = self.reporters, []
        errors = []
        for reporter in reporters:
            try:
                reporter.close(failed)
            except Exception as err:  # close the others all the same
                errors.append(err)
        if errors and not failed:
            raise errors[0]
