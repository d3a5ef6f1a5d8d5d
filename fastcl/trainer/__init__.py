"""fastcl's trainer: a sentence encoder trained with one of fastcl's contrastive objectives, on
sentence-transformers' ``SentenceTransformerTrainer``.

    fastcl-train --method simcse --max_steps 20            # the shipped sample, offline
    fastcl-train --method simcse --model bert-base-uncased --data wiki1m_for_simcse.txt \\
        --sts_dir SentEval/data/downstream --output_dir out/simcse --learning_rate 3e-5

(also ``python -m fastcl.trainer`` and the repository's ``train.py``). Every training argument
is transformers' (``HfArgumentParser``: ``--per_device_train_batch_size``, ``--bf16``,
``--deepspeed`` ...); a YAML or JSON file of options runs as ``fastcl-train run.yaml``, the
papers' recipes as ``--config recipe:NAME``. From Python, :func:`build_trainer` takes a
``SentenceTransformer``, a ``datasets.Dataset`` and training arguments.

The pieces: :mod:`.cli` (options, config files, recipes, their checks), :mod:`.build` (model,
data columns, loss, :func:`build_trainer`), :mod:`.heads` (SimCSE's training-only MLP, the
poolers' modules), :mod:`.run` (the output folder, verified checkpoints, the saved model),
:mod:`.logs` (``train_log.jsonl`` and plots). Durable files are :mod:`fastcl.files`.
"""

from .build import build_trainer
from .cli import FastclArguments, build_parser, resolve_args
from .logs import LOG, read_log
from .run import MODEL_DIR, RESULTS, main

__all__ = ["build_trainer", "main", "FastclArguments", "build_parser", "resolve_args", "read_log",
           "LOG", "MODEL_DIR", "RESULTS"]
