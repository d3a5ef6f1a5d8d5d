"""fastcl's objectives on sentence-transformers' trainer: ``fastcl-train`` or :func:`build_trainer`.
:mod:`.cli` options and config files, :mod:`.build` model, loss and trainer, :mod:`.run` the run
folder, resume and records; docs/training.md."""

from .build import build_trainer, load_model
from .cli import SAMPLES, FastclArguments, ObjectiveArguments, build_parser, resolve_args
from .run import LOG, MODEL_DIR, RESULTS, main, read_log

__all__ = ["build_trainer", "load_model", "main", "FastclArguments", "ObjectiveArguments", "SAMPLES",
           "build_parser", "resolve_args", "read_log", "LOG", "MODEL_DIR", "RESULTS"]
