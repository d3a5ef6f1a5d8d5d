"""fastcl's trainer: a sentence encoder trained with one of fastcl's objectives, on
sentence-transformers' ``SentenceTransformerTrainer``.

    fastcl-train --method simcse --model bert-base-uncased --data wiki1m_for_simcse.txt \
        --output-dir out/simcse --sts-dir data

(also ``python -m fastcl.trainer`` and the repository's ``train.py``). The papers' recipes
ship as config files: ``fastcl-train --config recipe:simcse-bert --data ... --output-dir ...``
(``--config FILE`` takes any YAML or JSON of options; flags on the command line win).

The pieces: :mod:`.cli` (options, recipes, config files, every check between options),
:mod:`.build` (model, dataset, loss and training arguments from the options), :mod:`.heads`
(SimCSE's training-only MLP, the poolers' modules), :mod:`.run` (the output folder, the
trainer with verified checkpoints, the saved model), :mod:`.logs` (``train_log.jsonl`` and
plots). Durable files are :mod:`fastcl.files`.

Large batches: ``--mini-batch-size B`` uses the cached (GradCache) form of the loss: the
encoder sees at most B inputs at a time, with the gradients of one pass. ``torchrun
--nproc_per_node W -m fastcl.trainer ...`` splits each batch over W processes whose losses
use the candidates of all of them (``gather_across_devices``).
"""

from .cli import build_parser, resolve_args
from .logs import LOG, read_log
from .run import MODEL_DIR, RESULTS, main

__all__ = ["main", "build_parser", "resolve_args", "read_log", "LOG", "MODEL_DIR", "RESULTS"]
