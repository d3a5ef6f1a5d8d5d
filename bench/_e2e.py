"""The end-to-end case: one training step of a BERT-shaped encoder with random weights, and
the share of the step spent in the loss.

The step is an unsupervised SimCSE step: one forward of the duplicated batch
``[x1, x1, x2, x2, ...]`` in train mode (two dropout views, ``[CLS]`` embeddings) → the
loss → backward. Only the tokenizer is a stand-in (:class:`RandomTokens`: random token ids, no
vocabulary, nothing downloaded) and there is no optimizer update: the case measures the
forward, the loss and the backward.

Each iteration is timed in three parts — encoder forward, the loss (forward and backward on
detached copies of the views, once per implementation on the same views), encoder backward
(from the first implementation's gradients) — which together are exactly one step. The share
of the loss is its median over the median step. Implementations: ``fastcl``
(:func:`fastcl.infonce` with the default backend, what training runs), ``tiled`` and ``reference``
(the same InfoNCE with that backend). On CUDA each implementation also runs whole steps for
the peak memory (allocator delta beyond the weights and the token ids).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
from _measure import MIB, cuda_peak, sync

ENCODERS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "small": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}
IMPLS = ("fastcl", "tiled", "reference")


def bert_config(size: str):
    """A BERT-shaped encoder config with random weights (nothing is downloaded)."""
    from transformers import BertConfig

    return BertConfig(vocab_size=30522, max_position_embeddings=512, **ENCODERS[size])


class RandomTokens:
    """A stand-in tokenizer: sentence ``str(i)`` is row ``i`` of a fixed table of random token
    ids, ``seq`` tokens each (no padding), as :func:`fastcl.encoders.tokenize` calls it."""

    def __init__(self, n: int, seq: int, vocab_size: int, seed: int):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1000, vocab_size, (n, seq), generator=gen)

    def __call__(self, sentences, **_options) -> dict:
        import torch

        ids = self.ids[[int(s) for s in sentences]]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def e2e_measure(spec: dict, device: str, repeats: int) -> list[dict]:
    """One row per implementation of ``spec["impls"]`` (see the module docstring)."""
    import torch
    from transformers import BertModel

    import fastcl
    from fastcl.encoders import SentenceEncoder
    from fastcl import common

    n, seq, seed = spec["n"], spec["seq"], spec.get("seed", 0)
    fastcl.set_input_checks(spec.get("input_checks", True))
    torch.manual_seed(seed)
    config = bert_config(spec["encoder"])
    encoder = SentenceEncoder(BertModel(config, add_pooling_layer=False), "cls_before_pooler")
    encoder.to(device).train()                              # dropout on: the two views differ
    tokenizer = RandomTokens(n, seq, config.vocab_size, seed)
    batch = [str(i) for i in range(n)]
    doubled = tokenizer([s for s in batch for _ in (0, 1)])  # [x1, x1, x2, x2, ...]: SimCSE's duplicated batch
    use_autocast = device == "cuda" and spec["dtype"] in ("bfloat16", "float16")
    autocast = (lambda: torch.autocast("cuda", dtype=getattr(torch, spec["dtype"]))) if use_autocast \
        else contextlib.nullcontext
    impls = spec["impls"]

    def views_of():
        with autocast():
            h = encoder(**{k: v.to(device) for k, v in doubled.items()})
        return {"anchors": h[0::2], "positives": h[1::2]}

    def loss_of(impl, views):
        return fastcl.infonce(views["anchors"], views["positives"], temperature=common.TEMPERATURE,
                              backend="auto" if impl == "fastcl" else impl)

    def clock():
        if device == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def span(a, b):
        return a.elapsed_time(b) / 1e3 if device == "cuda" else b - a

    parts = {"fwd": [], "bwd": [], **{i: [] for i in impls}}
    emb_dtype = None
    warm = 2 if device == "cuda" else 1                     # warm-up steps (not timed)
    for it in range(warm + repeats):
        encoder.zero_grad(set_to_none=True)
        t_fwd = clock()
        views = views_of()
        t_loss = [clock()]
        grads = {}
        order = impls[it % len(impls):] + impls[:it % len(impls)]   # no implementation always first
        for impl in order:
            leaves = {k: v.detach().requires_grad_(True) for k, v in views.items()}
            loss_of(impl, leaves).backward()
            grads[impl] = [leaves[k].grad for k in views]
            t_loss.append(clock())
        torch.autograd.backward(list(views.values()), grads[order[0]])
        t_end = clock()
        sync(device)
        emb_dtype = str(views["anchors"].dtype).replace("torch.", "")
        if it >= warm:
            parts["fwd"].append(span(t_fwd, t_loss[0]))
            for k, impl in enumerate(order):
                parts[impl].append(span(t_loss[k], t_loss[k + 1]))
            parts["bwd"].append(span(t_loss[-1], t_end))
        del views, grads

    med = {k: statistics.median(v) for k, v in parts.items()}
    probe = torch.zeros(2, 2, device=device, dtype=getattr(torch, emb_dtype))
    rows = []
    for impl in impls:
        step = med["fwd"] + med[impl] + med["bwd"]
        row = {"ok": True, "impl": impl,
               "backend": fastcl.resolve_backend("auto" if impl == "fastcl" else impl, probe),
               "embedding_dtype": emb_dtype,
               "encoder_params": sum(p.numel() for p in encoder.parameters()),
               "hidden": config.hidden_size, "layers": config.num_hidden_layers,
               "encoder_forward_s": med["fwd"], "loss_s": med[impl], "encoder_backward_s": med["bwd"],
               "step_s": step, "loss_share": med[impl] / step, "loss_times_s": parts[impl],
               "autocast": spec["dtype"] if use_autocast else None, "repeats": repeats}
        if device == "cuda":
            encoder.zero_grad(set_to_none=True)
            gc.collect()

            def whole_step():
                loss = loss_of(impl, views_of())
                loss.backward()
                return loss

            peak, loss = cuda_peak(whole_step)
            row["peak_beyond_inputs_mib"] = peak / MIB
            row["memory_method"] = "torch.cuda.max_memory_allocated delta over one whole step"
            del loss
            encoder.zero_grad(set_to_none=True)
        else:
            row["peak_beyond_inputs_mib"] = None
            row["memory_method"] = "not measured on CPU (one process for both implementations)"
        rows.append(row)
    return rows


def bert_config_sized(hidden: int, layers: int, heads: int | None = None,
                      intermediate: int | None = None):
    """:func:`bert_config` at any width and depth (heads: one per 64 dimensions, the FFN 4×
    wider, unless given; the same vocabulary and positions)."""
    from transformers import BertConfig

    heads = heads or max(1, hidden // 64)
    return BertConfig(vocab_size=30522, max_position_embeddings=512, hidden_size=hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=intermediate or 4 * hidden)
