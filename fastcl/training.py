"""One training step over an encoder: the views of a batch, the loss, backward and update.

One step is: a batch of examples → embeddings of every view (:func:`embed_views`) → the
method's fastcl loss (:func:`fastcl.objectives.objective_loss`) → backward and an optimizer
step (:func:`train_step`). The same views and the same loss serve the cached two-pass
encoding (:func:`cached_backward`) and data parallelism (the views of all processes
gathered first, :func:`fastcl.distributed.global_views`).

Views per method (the SimCSE conventions the papers share; what a method needs is in its
:data:`fastcl.objectives.METHODS` entry):

- unsupervised (simcse, dclr, focal, escl): one forward of the duplicated batch
  ``[x1, x1, x2, x2, …]`` in train mode; the two dropout masks give anchors ``h`` and
  positives ``h⁺``.
- a sensitive view (escl): a third view ``h⁻`` of the same sentences from a separate forward
  with every dropout rate set to ``sensitive_dropout`` (0.45); the two main views keep the
  model's own rate.
- a complementary view (dclr): a frozen complementary encoder embeds the batch in eval mode
  under no_grad. Without dropout its two views coincide, so ``c = c⁺`` and the instance
  weights are ``α_ij = 1[cos(c_i, c_j) < φ]``.
- supervised (simcse-sup): one forward of ``[p1, e1, c1, p2, e2, c2, …]`` (premise,
  entailment, contradiction) gives ``h``, ``h⁺`` and hard negatives ``h⁻``.
- an augmentation (``obj.augment``, unsupervised methods, :mod:`fastcl.augment`): the second
  copy of each sentence in the duplicated batch is also augmented, dropout still on. Token-level
  ones change its input ids once per step in :func:`view_inputs` (drawn from the CPU's global
  random state); embedding-level ones act inside the forward (:func:`forward`) with masks drawn
  from the device's global random state, which the cached encoding replays per mini-batch.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from . import augment
from .encoders import SentenceEncoder, dropout_rate, tokenize
from .objectives import Objective, objective_loss


def view_inputs(obj: Objective, tokenizer, batch: list, max_length: int, device) -> list:
    """The encoder forwards :func:`embed_views` makes for ``batch``, in order, as
    ``(name, features)`` pairs: ``grouped`` (simcse-sup: ``[p1, e1, c1, p2, …]``), ``doubled``
    (unsupervised: ``[x1, x1, x2, x2, …]``) and, for a sensitive view (ESCL), ``sensitive`` (``[x1, x2, …]`` at
    ``obj.sensitive_dropout``). The batch is tokenized once, padded to its longest input.
    With ``obj.augment`` the second copies of ``doubled`` are augmented: a token-level
    augmentation is drawn here, an embedding-level one adds the tokens it may change
    (:data:`fastcl.augment.KEY`), which :func:`forward` hands to its hook."""
    if obj.spec.supervised:
        if not batch or isinstance(batch[0], str):
            raise ValueError(f"{obj.method} takes (sent0, sent1[, hard_neg]) examples")
        feats = tokenize(tokenizer, [s for example in batch for s in example], max_length, device)
        return [("grouped", feats)]
    if not batch or not isinstance(batch[0], str):
        raise ValueError(f"{obj.method} takes a batch of sentences")
    feats = tokenize(tokenizer, batch, max_length, device)
    doubled = {k: v.repeat_interleave(2, dim=0) for k, v in feats.items()}
    aug = augment.parse(obj.augment)
    if aug is not None:
        second = torch.arange(2 * len(batch)) % 2 == 1  # the positive copy of each pair
        doubled = augment.augment_features(aug, doubled, second, tokenizer)
    calls = [("doubled", doubled)]
    if obj.spec.sensitive_view:
        calls.append(("sensitive", feats))
    return calls


def forward_mode(obj: Objective, encoder: SentenceEncoder, name: str):
    """The context a forward of :func:`view_inputs` runs in (the sensitive view's dropout)."""
    if name == "sensitive":
        return dropout_rate(encoder, obj.sensitive_dropout)
    return contextlib.nullcontext()


def forward(obj: Objective, encoder: SentenceEncoder, name: str, features: dict) -> torch.Tensor:
    """The encoder's forward ``name`` of :func:`view_inputs` on ``features`` (all its rows
    or a slice of them): in its :func:`forward_mode`, with the objective's embedding-level
    augmentation on the tokens the features mark."""
    features = dict(features)
    where = features.pop(augment.KEY, None)
    with forward_mode(obj, encoder, name), \
            augment.on_embeddings(augment.parse(obj.augment), encoder.backbone, where):
        return encoder(**features)


def assemble_views(obj: Objective, outputs: dict, n: int) -> dict:
    """The views of ``n`` examples from the embeddings of each forward of :func:`view_inputs`."""
    if "grouped" in outputs:
        z = outputs["grouped"]
        z = z.view(n, z.shape[0] // n, -1)
        out = {"anchors": z[:, 0], "positives": z[:, 1]}
        if z.shape[1] == 3:
            out["negatives"] = z[:, 2]
        return out
    z = outputs["doubled"].view(n, 2, -1)
    out = {"anchors": z[:, 0], "positives": z[:, 1]}
    if "sensitive" in outputs:
        out["sensitive"] = outputs["sensitive"]
    return out


def embed_views(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list,
                max_length: int) -> dict:
    """Embeddings of every view ``obj.method`` needs for one batch (see the module docstring).

    ``batch`` holds sentences (unsupervised) or (sent0, sent1[, hard_neg]) tuples
    (supervised). Returns a dict with ``anchors``, ``positives`` and, by method,
    ``negatives`` (hard negatives), ``sensitive`` (ESCL) or ``complementary`` (DCLR, a pair).
    """
    device = next(encoder.parameters()).device
    outputs = {}
    for name, feats in view_inputs(obj, tokenizer, batch, max_length, device):
        outputs[name] = forward(obj, encoder, name, feats)
    out = assemble_views(obj, outputs, len(batch))
    complementary = complementary_views(obj, batch, max_length)
    if complementary is not None:
        out["complementary"] = complementary
    return out


def complementary_views(obj: Objective, sentences: list, max_length: int,
                        mini_batch_size: int | None = None):
    """``(c, c⁺)`` of the frozen complementary encoder, no_grad, float32; with
    ``mini_batch_size``, in forwards of at most that many sentences. ``frozen``: eval mode,
    one view (c⁺ = c). ``released`` (the authors' code): dropout on, the duplicated batch,
    c and c⁺ its halves. None when the method takes no complementary model or none is set."""
    if not obj.spec.complementary or obj.complementary is None:
        return None
    comp = obj.complementary
    released = obj.complementary_mode == "released"
    comp.train(released)
    device = next(comp.parameters()).device
    texts = list(sentences) * 2 if released else list(sentences)
    with torch.no_grad():
        feats = tokenize(obj.complementary_tokenizer, texts, max_length, device)
        step = mini_batch_size or len(texts)
        c = torch.cat([comp(**{k: v[i:i + step] for k, v in feats.items()}).float()
                       for i in range(0, len(texts), step)])
    comp.eval()
    n = len(sentences)
    return (c[:n], c[n:]) if released else (c, c)


def step_loss(obj: Objective, views: dict, distributed: bool = False) -> torch.Tensor:
    """The loss a step differentiates: the method's loss on ``views`` or, ``distributed``,
    this process's share of it against the views of every process (the global mean loss
    once gradients are averaged over the processes)."""
    if not distributed:
        return objective_loss(obj, views)
    from .distributed import global_views
    views, anchor_offset = global_views(obj, views)
    return objective_loss(obj, views, anchor_offset)


def train_step(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list, optimizer,
               scheduler, *, max_length: int, max_grad_norm: float = 1.0,
               autocast=None, mini_batch_size: int | None = None, distributed: bool = False) -> dict:
    """One optimizer step on one batch: views → loss → backward → clip → step.

    ``mini_batch_size``: cached two-pass encoding (:func:`cached_backward`), same gradients
    with the activations of at most ``mini_batch_size`` encoder inputs at a time.
    ``distributed``: this process holds its share of the global batch; the loss is computed
    against the candidates of all processes and gradients are averaged over them
    (:mod:`fastcl.distributed`).

    Returns ``{"loss": float, "grad_norm": float, "lr": float}`` (lr of this step; with
    ``distributed`` the loss is the global mean).
    """
    encoder.train()
    lr = optimizer.param_groups[0]["lr"]
    if mini_batch_size is None:
        with autocast if autocast is not None else contextlib.nullcontext():
            views = embed_views(obj, encoder, tokenizer, batch, max_length)
            loss = step_loss(obj, views, distributed)
        loss.backward()
    else:
        loss = cached_backward(obj, encoder, tokenizer, batch, max_length=max_length,
                               mini_batch_size=mini_batch_size, autocast=autocast,
                               distributed=distributed)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss = float(loss.detach())
    if distributed:
        from . import distributed as dist_cl
        dist_cl.average_gradients(params)
        loss = dist_cl.mean(loss, device=params[0].device)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": float(grad_norm), "lr": lr}


def _rng_snapshot(device: torch.device) -> tuple:
    """The random state an encoder forward on ``device`` draws its dropout from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_restore(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def cached_backward(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list, *,
                    max_length: int, mini_batch_size: int, autocast=None,
                    distributed: bool = False) -> torch.Tensor:
    """Cached (two-pass, GradCache-style) encoding: accumulates into ``.grad`` the gradient
    of :func:`step_loss` and returns the loss, detached.

    Pass 1 makes every forward of :func:`view_inputs` in mini-batches of ``mini_batch_size``
    rows without a graph, saving the random state before each mini-batch. The embeddings
    become leaf tensors; the loss and its gradient with respect to them come from fastcl.
    Pass 2 restores each mini-batch's random state, so its dropout masks (and an
    embedding-level augmentation's masks) are those of pass 1, re-encodes the mini-batch with a graph and back-propagates its cached embedding gradient.
    Afterwards the random state is the one pass 1 left, so the following steps draw as after
    an ordinary step. DCLR's complementary encoder runs once, in pass 1.

    The gradient equals that of one backward through the same mini-batched forwards; with
    ``mini_batch_size`` at least the rows of each forward (2N unsupervised, 3N or 2N
    simcse-sup) the forwards are the whole-batch ones and so is the gradient.
    """
    if isinstance(mini_batch_size, bool) or not isinstance(mini_batch_size, int) or mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be a positive integer, got {mini_batch_size!r}")
    amp = (lambda: autocast) if autocast is not None else contextlib.nullcontext
    device = next(encoder.parameters()).device
    minis = []  # (name, first row, features, random state)
    cached = {}
    with torch.no_grad():
        for name, feats in view_inputs(obj, tokenizer, batch, max_length, device):
            rows = next(iter(feats.values())).shape[0]
            parts = []
            for start in range(0, rows, mini_batch_size):
                part = {k: v[start:start + mini_batch_size] for k, v in feats.items()}
                minis.append((name, start, part, _rng_snapshot(device)))
                with amp():
                    parts.append(forward(obj, encoder, name, part))
            cached[name] = torch.cat(parts).requires_grad_(True)
        # as in the ordinary step: after the views, under autocast, and before the state the
        # next step starts from (the released mode's dropout draws from it)
        with amp():
            complementary = complementary_views(obj, batch, max_length, mini_batch_size)
    after = _rng_snapshot(device)
    views = assemble_views(obj, cached, len(batch))
    if complementary is not None:
        views["complementary"] = complementary
    with amp():
        loss = step_loss(obj, views, distributed)
    loss.backward()
    grads = {name: leaf.grad for name, leaf in cached.items()}
    del views, cached
    for name, start, part, state in minis:
        _rng_restore(state, device)
        with amp():
            z = forward(obj, encoder, name, part)
        if grads[name] is None:  # the loss does not depend on this view
            continue
        torch.autograd.backward(z, grads[name][start:start + z.shape[0]].to(z.dtype))
    _rng_restore(after, device)
    return loss.detach()


# ---------------------------------------------------------------------------------------
# Optimizer and schedule

def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float):
    """AdamW; biases and normalization weights are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def linear_schedule(optimizer, total_steps: int, warmup_steps: int = 0):
    """Linear warmup over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------
# Reproducibility and checkpoints

def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random state a step consumes (dropout, DCLR noise), in a form torch.load
    reads with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def _tuples(x):
    """random.setstate needs tuples where a round trip may have produced lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x

