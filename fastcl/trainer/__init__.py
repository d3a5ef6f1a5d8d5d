"""fastcl's trainer: a sentence encoder trained with one of fastcl's objectives on
sentence-transformers' ``SentenceTransformerTrainer``: ``fastcl-train --method simcse``
(``python -m fastcl.trainer``, ``train.py``), every training argument under its Hugging Face
name; from Python, :func:`build_trainer` takes a ``SentenceTransformer``, a
``datasets.Dataset`` and training arguments. :mod:`.cli` (options, config files, recipes),
:mod:`.build` (model, data columns, loss, the trainer), :mod:`.heads` (the poolers' modules),
:mod:`.run` (the run folder, resume, the saved model), :mod:`.logs` (``train_log.jsonl``,
plots); guide: docs/training.md.
"""

from .build import build_trainer, load_model
from .cli import SAMPLES, FastclArguments, build_parser, resolve_args
from .logs import LOG, read_log
from .run import MODEL_DIR, RESULTS, main

__all__ = ["build_trainer", "load_model", "main", "FastclArguments", "SAMPLES", "build_parser",
           "resolve_args", "read_log", "LOG", "MODEL_DIR", "RESULTS"]
