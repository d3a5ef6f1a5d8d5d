"""fastcl's own GradCache for sentence-transformers releases without ``CachedLossMixin``.

sentence-transformers 5.7.0 and later ship the two-pass machinery of their cached losses
as ``sentence_transformers.base.losses.CachedLossMixin``; fastcl's cached losses build on
it there. For older releases, :class:`GradCache` implements the same contract, so one loss
class works with both:

- the loss is an ``nn.Module`` with ``model``, ``mini_batch_size``, ``show_progress_bar``,
  and ``calculate_loss(reps, labels, *, with_backward=False)``, where ``reps[c][b]`` is the
  embedding of mini-batch ``b`` of column ``c``; with ``with_backward`` it leaves the gradient
  of the loss in each ``reps[c][b].grad`` and returns the loss detached;
- ``embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state,
  random_state=None)`` embeds rows ``[begin, end)`` of one column and returns
  ``(embeddings, random_state)``; a loss may wrap it (ESCL sets its dropout rate there);
- ``forward_cached(sentence_features, labels)`` runs the two passes.

Pass 1 embeds every mini-batch without a graph and keeps the random state taken just before
its forward. The loss and its gradient w.r.t. every embedding are then computed on the whole
batch. The returned loss is a leaf whose backward hook runs pass 2: each mini-batch is
embedded again under its saved random state (so dropout draws the masks of pass 1), with a
graph, and its cached gradient is back-propagated into the model.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, Iterable, Iterator

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import get_device_states, set_device_states

__all__ = ["GradCache", "RandomState", "batch_rows", "minibatch", "minibatch_ranges"]


class RandomState:
    """The CPU random state and that of every accelerator the given tensors live on, taken at
    construction; ``with state:`` restores it for the block and puts the outer state back after."""

    def __init__(self, *tensors: Any) -> None:
        self.cpu = torch.get_rng_state()
        self.devices, self.device_states = get_device_states(
            *(t for t in tensors if isinstance(t, Tensor)))

    def __enter__(self) -> None:
        self._fork = torch.random.fork_rng(devices=self.devices)
        self._fork.__enter__()
        torch.set_rng_state(self.cpu)
        set_device_states(self.devices, self.device_states)

    def __exit__(self, *exc) -> None:
        fork, self._fork = self._fork, None
        fork.__exit__(*exc)


def batch_rows(features: dict[str, Any]) -> int:
    """The number of inputs in a column's features."""
    for key in ("input_ids", "attention_mask"):
        value = features.get(key)
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    for value in features.values():
        if isinstance(value, Tensor) and value.ndim > 0:
            return value.shape[0]
    raise ValueError("the features hold no batched tensor")


def minibatch(features: dict[str, Any], begin: int, end: int) -> dict[str, Any]:
    """Rows ``[begin, end)`` of a column's features (a new dict). Padding columns that every
    row of the slice pads are dropped, so a mini-batch of short inputs runs at its own width."""
    n = batch_rows(features)
    mask = features.get("attention_mask")
    width = seq = None
    if isinstance(mask, Tensor) and mask.ndim == 2:
        seq = mask.shape[1]
        active = mask[begin:end].bool().any(dim=0).nonzero()
        if active.numel():
            width = int(active.max()) + 1
    out = {}
    for key, value in features.items():
        if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == n:
            value = value[begin:end]
            if width is not None and value.ndim >= 2 and value.shape[1] == seq:
                value = value[:, :width]
        out[key] = value
    return out


def minibatch_ranges(features: dict[str, Any], size: int) -> list[tuple[int, int]]:
    n = batch_rows(features)
    return [(begin, min(begin + size, n)) for begin in range(0, n, size)]


class GradCache:
    """The two-pass cached forward (see the module docstring), mixed into an ``nn.Module`` loss."""

    model: Any
    mini_batch_size: int
    show_progress_bar: bool = False
    uses_gradient_cache: bool = True  # the backward runs from a hook on the returned loss

    def embed_minibatch(self, sentence_feature: dict[str, Tensor], begin: int, end: int, with_grad: bool,
                        copy_random_state: bool, random_state: RandomState | None = None
                        ) -> tuple[Tensor, RandomState | None]:
        features = minibatch(sentence_feature, begin, end)
        with random_state if random_state is not None else nullcontext():
            with nullcontext() if with_grad else torch.no_grad():
                state = RandomState(*features.values()) if copy_random_state else None
                reps = self.model(features)["sentence_embedding"]
        return reps, state

    def embed_minibatch_iter(self, sentence_feature: dict[str, Tensor], with_grad: bool,
                             copy_random_state: bool, random_states: list | None = None,
                             ranges: list[tuple[int, int]] | None = None
                             ) -> Iterator[tuple[Tensor, RandomState | None]]:
        if ranges is None:
            ranges = minibatch_ranges(sentence_feature, self.mini_batch_size)
        steps: Iterable = ranges
        if self.show_progress_bar:
            from tqdm.auto import tqdm
            steps = tqdm(ranges, desc="Embed mini-batches")
        for i, (begin, end) in enumerate(steps):
            yield self.embed_minibatch(sentence_feature, begin, end, with_grad, copy_random_state,
                                       None if random_states is None else random_states[i])

    def forward_cached(self, sentence_features: Iterable[dict[str, Tensor]],
                       labels: Tensor | None = None) -> Tensor:
        sentence_features = list(sentence_features)
        grad_enabled = torch.is_grad_enabled()
        # boundaries fixed before any forward: a module may edit the features in place
        ranges = [minibatch_ranges(f, self.mini_batch_size) for f in sentence_features]
        reps, states = [], []
        for features, column_ranges in zip(sentence_features, ranges):  # pass 1
            column = [(r.detach().requires_grad_(), s) for r, s in self.embed_minibatch_iter(
                features, with_grad=False, copy_random_state=grad_enabled, ranges=column_ranges)]
            reps.append([r for r, _ in column])
            states.append([s for _, s in column])
        if not grad_enabled:
            return self.calculate_loss(reps, labels)
        loss = self.calculate_loss(reps, labels, with_backward=True).detach().requires_grad_()
        cache = [[r.grad for r in column] for column in reps]
        unused = [str(c) for c, column in enumerate(cache) if any(g is None for g in column)]
        if unused:
            raise ValueError(f"{type(self).__name__} did not use input column(s) {', '.join(unused)}: "
                             "their embeddings got no gradient; remove them from the dataset")
        loss.register_hook(functools.partial(self._replay, sentence_features=sentence_features,
                                             cache=cache, random_states=states, ranges=ranges))
        return loss

    def _replay(self, grad_output: Tensor, *, sentence_features, cache, random_states, ranges) -> None:
        """Pass 2: each mini-batch again, under its saved random state, with a graph; its
        cached gradient (times the gradient reaching the loss) is back-propagated. Under
        DistributedDataParallel only the last backward synchronizes the gradients."""
        model = getattr(self.model, "_orig_mod", self.model)
        jobs = [(features, begin, end, state, grad)
                for features, column_ranges, column_states, column_grads
                in zip(sentence_features, ranges, random_states, cache)
                for (begin, end), state, grad in zip(column_ranges, column_states, column_grads)]
        with torch.enable_grad():
            for i, (features, begin, end, state, grad) in enumerate(jobs):
                defer = isinstance(model, DistributedDataParallel) and i < len(jobs) - 1
                with model.no_sync() if defer else nullcontext():
                    reps, _ = self.embed_minibatch(features, begin, end, with_grad=True,
                                                   copy_random_state=False, random_state=state)
                    if reps.shape != grad.shape:
                        raise RuntimeError(
                            f"{type(self).__name__}: the embeddings replayed in the backward pass "
                            f"have shape {tuple(reps.shape)}, those of the forward pass had "
                            f"{tuple(grad.shape)}. A wrapper that changes the model's output "
                            "during the forward only (MatryoshkaLoss of sentence-transformers "
                            "releases without gradient-cache support) cannot wrap a cached loss; "
                            "give the loss matryoshka_dims= instead")
                    if reps.requires_grad:  # else the model is frozen
                        torch.autograd.backward(reps, (grad * grad_output).to(reps.dtype))
