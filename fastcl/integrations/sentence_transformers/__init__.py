"""fastcl losses for ``SentenceTransformerTrainer``.

Each class follows sentence-transformers' loss conventions: the constructor takes the
``SentenceTransformer`` model first, ``forward(sentence_features, labels)`` embeds the
input columns and returns the loss, and ``compute_loss_from_embeddings(embeddings,
labels)`` scores embeddings computed elsewhere. Columns are ``(anchor, positive[,
negative...])``. For the unsupervised recipes put the same sentence in both columns:
dropout gives the two views.

=============================  ======================================================
``FastInfoNCELoss``            drop-in for ``MultipleNegativesRankingLoss`` (cosine
                               similarity, ``scale = 1/τ``, extra columns as negatives)
``FastFocalInfoNCELoss``       Focal-InfoNCE
``FastDCLRLoss``               DCLR; a frozen ``guide`` model gives the complementary
                               embeddings (like ``GISTEmbedLoss``'s guide)
``FastESCLLoss``               ESCL; the high-dropout view is a third forward of the
                               anchors with every dropout at ``sensitive_dropout``
``FastGISTEmbedLoss``          drop-in for ``GISTEmbedLoss`` (a guide's per-row
                               false-negative filter, applied inside the tiles)
``CachedFastInfoNCELoss``      each of the above, cached (GradCache): a drop-in for
``CachedFastFocalInfoNCELoss`` ``CachedMultipleNegativesRankingLoss`` (and
``CachedFastDCLRLoss``         ``CachedGISTEmbedLoss``), with activation memory set by
``CachedFastESCLLoss``         ``mini_batch_size`` instead of the batch
``CachedFastGISTEmbedLoss``
``AugmentedPositives``         wraps any of the above: the positive column also
                               augmented (ConSERT's cutoffs, token shuffling, word
                               deletion; :mod:`fastcl.augment`), dropout still on
=============================  ======================================================

**Cached losses.** Pass 1 embeds each column in mini-batches of ``mini_batch_size``
inputs without a graph and keeps the random state taken before each mini-batch's forward
(ESCL's high-dropout view is one more column, embedded at ``sensitive_dropout``; DCLR's
guide embeds the batch once, here, without gradients). fastcl then computes the loss of
the whole batch and its gradient w.r.t. every embedding, without the N×M similarity
matrix. Pass 2 runs in the backward: each mini-batch is embedded again under its saved
random state, so dropout draws the masks of pass 1, and its cached gradient is
back-propagated. The gradients are those of one backward through the same forwards; a
``mini_batch_size`` that covers a whole column gives exactly the forwards, and so the
gradients, of the plain loss. ``mini_batch_size`` counts encoder inputs per forward; the
losses' own ``chunk_size`` (anchor rows per chunk inside the loss) is a separate knob.

The two passes come from sentence-transformers' ``CachedLossMixin``
(``sentence_transformers.base.losses``, sentence-transformers ≥ 5.7.0), the machinery of
its own cached losses. With older releases fastcl uses its own implementation of the same
contract (:mod:`._gradcache`), with the same numbers; :data:`GRADCACHE_BASE` says which.

**Several devices.** ``gather_across_devices=True`` (every loss, cached or not) gathers the
candidates of every process with their gradients (:func:`fastcl.distributed.gather`), so
each anchor is contrasted with the whole global batch; each process computes the mean
loss over its own anchors, rows ``[rank·n, rank·n + n)`` of the gathered batch
(``anchor_offset``). Once the gradients are averaged over processes (as
DistributedDataParallel does) they equal those of one process on the whole batch. DCLR's
noise is drawn from the gathered batch and broadcast from rank 0, so every process uses
the same noise, the one a single process on the whole batch would draw with the same
generator. Every process must hold the same number of examples per step
(``dataloader_drop_last=True``). Without an initialized process group of two or more
processes the option does nothing.

**Duplicate texts.** ``mask_duplicates=True`` (InfoNCE, focal, DCLR, GIST; plain and
cached) hashes each row's token ids (:func:`._base.text_ids`) before any forward and drops
every candidate whose text equals that of the anchor's positive: a sentence that occurs
twice in a batch is not a negative of itself, and dropout hides such pairs from any check
on embeddings.

**Layout**, one loss per module, as sentence-transformers' ``losses/``: ``infonce``,
``focal_infonce``, ``dclr``, ``escl``, ``gist`` and their ``cached_*`` forms, ``augment``
(the wrapper); ``_base`` holds what they share (the sentence-transformers imports, the
column checks, the gather, the guide's embeddings, the text ids, the two-pass forward) and
``_gradcache`` the fallback GradCache. Each
loss's docstring gives its formula, Args, Inputs, Relations and an Example; its ``citation``
property, the BibTeX of its paper (from :mod:`fastcl.citations`; the cached losses add
GradCache's). Import the classes from here:
``from fastcl.integrations.sentence_transformers import FastInfoNCELoss``.
"""

# GRADCACHE_BASE: the GradCache implementation the cached losses run on, sentence-transformers'
# own ``CachedLossMixin`` (≥ 5.7.0) or fastcl's fallback (:class:`._gradcache.GradCache`).
from ._base import GRADCACHE_BASE
from .augment import AugmentedPositives
from .cached_dclr import CachedFastDCLRLoss
from .cached_escl import CachedFastESCLLoss
from .cached_focal_infonce import CachedFastFocalInfoNCELoss
from .cached_gist import CachedFastGISTEmbedLoss
from .cached_infonce import CachedFastInfoNCELoss
from .dclr import FastDCLRLoss
from .escl import FastESCLLoss
from .focal_infonce import FastFocalInfoNCELoss
from .gist import FastGISTEmbedLoss
from .infonce import FastInfoNCELoss
from .evaluation import SentEvalSTSEvaluator

__all__ = ["FastInfoNCELoss", "FastFocalInfoNCELoss", "FastDCLRLoss", "FastESCLLoss",
           "FastGISTEmbedLoss", "CachedFastInfoNCELoss", "CachedFastFocalInfoNCELoss",
           "CachedFastDCLRLoss", "CachedFastESCLLoss", "CachedFastGISTEmbedLoss",
           "AugmentedPositives", "SentEvalSTSEvaluator"]
