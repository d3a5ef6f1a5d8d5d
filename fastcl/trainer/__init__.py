"""fastcl's trainer: a sentence encoder trained with one of fastcl's objectives.

    fastcl-train --method simcse --model bert-base-uncased --data wiki1m_for_simcse.txt \
        --output-dir out/simcse --sts-dir data

(also ``python -m fastcl.trainer`` and the repository's ``train.py``). The papers' recipes
ship as config files: ``fastcl-train --config recipe:simcse-bert --data ... --output-dir ...``
(``--config FILE`` takes any YAML or JSON of options; flags on the command line win).

The pieces: :mod:`.cli` (options, recipes, config files, checks), :mod:`.loop` (set-up, loop,
checkpoint, resume, evaluation, export), :mod:`.logs` (``train_log.jsonl`` and plots),
:mod:`.report` (``--report-to`` TensorBoard / W&B). One step is
:func:`fastcl.training.train_step`; the objective is :mod:`fastcl.objectives`.

Large batches: ``--mini-batch-size B`` encodes at most B inputs at a time (cached two-pass
encoding with exact dropout replay: the gradients of one pass, the activation memory of B
inputs). ``torchrun --nproc_per_node W -m fastcl.trainer ...`` splits each batch over W
processes whose losses use the candidates of all of them (global in-batch negatives), with
the gradients of single-process training on the whole batch.
"""

from .cli import CHECKPOINT, build_parser, resolve_args
from .logs import LOG, append_log, read_log
from .loop import Run, dev_evaluation, main, make_objective, setup

__all__ = ["main", "build_parser", "resolve_args", "make_objective", "setup", "Run",
           "dev_evaluation", "read_log", "append_log", "LOG", "CHECKPOINT"]
