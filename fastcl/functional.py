"""Public functional API: argument checks, then dispatch to a backend.

Backends: ``"reference"`` (:mod:`fastcl.reference`, full matrices), ``"tiled"``
(:mod:`fastcl.tiled`, chunked, any device), ``"triton"`` (fused kernels, CUDA) and
``"auto"`` (Triton for CUDA tensors once the kernels are built in, tiled otherwise).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import _validation as check
from . import reference, tiled
from .tiled import Epilogue

__all__ = ["infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss"]


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_problem(x: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take ``x`` (None if it can)."""
    if not _triton_installed():
        return "the triton package is not installed (pip install 'fastcl[triton]')"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels take float32, float16 or bfloat16 embeddings, not {x.dtype}"
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("the embeddings are on the CPU: the kernels need CUDA tensors, or "
                "TRITON_INTERPRET=1 (set before fastcl.kernels is imported) to run them in "
                "Triton's interpreter")
    return None


def _backend(backend: str, x: torch.Tensor) -> str:
    check.choice("backend", backend, check.BACKENDS)
    if backend == "triton":
        problem = _triton_problem(x)
        if problem:
            raise ValueError(f"backend='triton' cannot run here: {problem}; use backend='tiled'")
    elif backend == "auto":
        backend = "triton" if x.is_cuda and _triton_problem(x) is None else "tiled"
    return backend


def _engine(backend: str):
    """The chunk engine of the shared tiled driver for a resolved backend."""
    if backend == "triton":
        from .kernels.contrastive import triton_chunk
        return triton_chunk
    return tiled.torch_chunk


def _anchors_and_positives(anchors, positives, anchor_offset=None):
    """Anchors (N×d) and positives: N rows, or — with ``anchor_offset`` — the whole batch the
    anchors are rows ``[anchor_offset, anchor_offset + N)`` of. Returns the offset as an int."""
    anchors = check.embeddings("anchors", anchors)
    if anchor_offset is None:
        positives = check.embeddings("positives", positives, rows=anchors.shape[0],
                                     width=anchors.shape[1], like=anchors)
        anchor_offset = 0
    else:
        anchor_offset = check.non_negative_int("anchor_offset", anchor_offset)
        positives = check.embeddings("positives", positives, width=anchors.shape[1], like=anchors)
        if positives.shape[0] < anchor_offset + anchors.shape[0]:
            raise ValueError(
                f"positives has {positives.shape[0]} rows but anchor_offset={anchor_offset} with "
                f"{anchors.shape[0]} anchors needs at least {anchor_offset + anchors.shape[0]}")
    return anchors, positives, anchor_offset




def _negatives(negatives, anchors):
    if negatives is None:
        return None
    return check.embeddings("negatives", negatives, width=anchors.shape[1], like=anchors,
                             allow_empty=True)


def infonce(anchors, positives, negatives=None, *, temperature=0.05, hard_negative_weight=0.0,
            symmetric=False, anchor_offset=None, backend="auto", chunk_size=None):
    r"""InfoNCE over in-batch negatives: unsupervised and supervised SimCSE.

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau}
              + \log\sum_j \exp\big(\frac{s_{ij}}{\tau} + w\,[j = N+i]\big)\Big]

    with ``s_ij = cos(anchors_i, k_j)`` and candidates ``k = [positives; negatives]``.

    Args:
        anchors: (N, d) first view.
        positives: (N, d) second view; row i is anchor i's positive.
        negatives: optional (K, d) extra negatives: hard negatives (row i belongs to
            anchor i, K = N) or any K rows such as a queue.
        temperature: τ > 0.
        hard_negative_weight: log-weight ``w`` added to the logit of each anchor's own hard
            negative (column N + i); needs K = N.
        symmetric: also score positives against anchors and average the two directions.
        anchor_offset: for global negatives across processes (None: positives has exactly
            the anchors' rows): the anchors are rows ``[anchor_offset, anchor_offset + N)``
            of the batch that ``positives`` and ``negatives`` hold (anchor i's positive is
            ``positives[anchor_offset + i]``, its hard negative ``negatives[anchor_offset + i]``);
            the loss is their mean.
        backend: "auto", "reference", "tiled" or "triton".
        chunk_size: anchor rows per chunk in the tiled path (default: from a memory budget).

    Reference: Gao, Yao & Chen, "SimCSE", EMNLP 2021.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    temperature = check.positive("temperature", temperature)
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    if hard_negative_weight and (negatives is None or negatives.shape[0] != positives.shape[0]):
        got = "no negatives" if negatives is None else f"{negatives.shape[0]} negatives"
        raise ValueError(f"hard_negative_weight needs one hard negative per anchor "
                         f"({positives.shape[0]} negatives), got {got}")
    if symmetric and positives.shape[0] != anchors.shape[0]:
        raise ValueError("symmetric=True needs every anchor of the batch in this call "
                         "(no anchor_offset slice)")
    chunk_size = check.chunk_size(chunk_size)
    be = _backend(backend, anchors)
    if be == "reference":
        return reference.infonce(anchors, positives, negatives, temperature=temperature,
                                 hard_negative_weight=hard_negative_weight, symmetric=symmetric,
                                 anchor_offset=anchor_offset)
    ep = Epilogue(temperature, hard_negative_weight=hard_negative_weight, chunk_size=chunk_size,
                  anchor_offset=anchor_offset)
    cands = (positives,) if negatives is None else (positives, negatives)
    loss = tiled.contrastive_loss(ep, anchors, *cands, engine=_engine(be))
    if symmetric:
        reverse = tiled.contrastive_loss(Epilogue(temperature, chunk_size=chunk_size), positives,
                                         anchors, engine=_engine(be))
        loss = 0.5 * (loss + reverse)
    return loss


def focal_infonce(anchors, positives, negatives=None, *, temperature=0.05, m=0.3,
                  anchor_offset=None, backend="auto", chunk_size=None):
    r"""Focal-InfoNCE: InfoNCE whose logits are modulated by the similarity itself.

    Positive logit ``s²/τ``, negative logits ``s(s+m)/τ``:

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}^2}{\tau} + \log\Big(e^{s_{ii}^2/\tau}
              + \sum_{j\ne i} e^{s_{ij}(s_{ij}+m)/\tau}\Big)\Big]

    Hard negatives get up-weighted (large s), easy ones down-weighted. Nothing is detached.

    ``anchor_offset``: as in :func:`infonce`.

    Reference: Hou & Li, "Improving Contrastive Learning of Sentence Embeddings with
    Focal-InfoNCE", Findings of EMNLP 2023.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    temperature = check.positive("temperature", temperature)
    m = check.finite("m", m)
    chunk_size = check.chunk_size(chunk_size)
    be = _backend(backend, anchors)
    if be == "reference":
        return reference.focal_infonce(anchors, positives, negatives, temperature=temperature, m=m,
                                       anchor_offset=anchor_offset)
    cands = (positives,) if negatives is None else (positives, negatives)
    ep = Epilogue(temperature, focal_m=m, chunk_size=chunk_size, anchor_offset=anchor_offset)
    return tiled.contrastive_loss(ep,
                                  anchors, *cands, engine=_engine(be))


def _noise_args(anchors, num, steps, lr, std, temperature, noise):
    steps = check.non_negative_int("noise_steps", steps)
    lr = check.finite("noise_lr", lr)
    std = check.positive("noise_std", std)
    temperature = check.positive("noise_temperature", temperature)
    if noise is not None:
        noise = check.embeddings("noise", noise, width=anchors.shape[1], allow_empty=True)
        if noise.device != anchors.device:
            raise ValueError(f"noise is on {noise.device} but anchors are on {anchors.device}")
        if num is not None and noise.shape[0] != num:
            raise ValueError(f"noise has {noise.shape[0]} rows but num={num}")
    else:
        num = check.non_negative_int("num", num)
    return steps, lr, std, temperature, noise


def _dclr_noise(anchors, positives, num, steps, lr, std, temperature, noise, generator, be, chunk_size,
                formulation="paper", anchor_offset=0):
    if be == "reference":
        return reference.dclr_noise(anchors, positives, num, steps=steps, lr=lr, std=std,
                                    temperature=temperature, noise=noise, generator=generator,
                                    formulation=formulation, anchor_offset=anchor_offset)
    if noise is None:
        noise = reference.draw_noise(num, anchors.shape[1], std=std, generator=generator,
                                     device=anchors.device)
    return tiled.noise_update(anchors, noise, steps=steps, lr=lr, temperature=temperature,
                              chunk_size=chunk_size, engine=_engine(be),
                              positives=positives if formulation == "released" else None,
                              anchor_offset=anchor_offset)


def dclr_noise(anchors, positives, num, *, steps=4, lr=1e-3, std=1.0, temperature=0.05,
               noise=None, generator=None, formulation="paper", backend="auto", chunk_size=None):
    r"""DCLR's noise negatives after ``steps`` normalized gradient-ascent steps.

    Starting from ``Z ~ N(0, std²)`` (num×d, drawn with ``generator``) or from ``noise``,
    each step computes

    .. math:: L_U = \frac1N\sum_i\Big[-\frac{s(h_i,h^+_i)}{\tau_u}
              + \log\sum_j \exp\frac{\cos(h_i, z_j)}{\tau_u}\Big],\quad
              z_j \leftarrow z_j + \beta\,\frac{g_j}{\lVert g_j\rVert},\ g = \partial L_U/\partial Z

    with h, h⁺ detached (β = ``lr``, τ_u = ``temperature``). A row with g_j = 0 stays put.
    ``formulation="released"`` follows the authors' code: each step's loss is the
    cross-entropy over ``[h⁺; Z]`` (the N in-batch columns join the log-sum-exp), and a row
    with g_j = 0 becomes 0. Returns the (num×d) float32 noise (float64 for float64 anchors),
    with no autograd graph.

    Reference: Zhou et al., "Debiased Contrastive Learning of Unsupervised Sentence
    Representations", ACL 2022.
    """
    anchors, positives, _ = _anchors_and_positives(anchors, positives)
    steps, lr, std, temperature, noise = _noise_args(anchors, num, steps, lr, std, temperature, noise)
    num = noise.shape[0] if noise is not None else num
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    chunk_size = check.chunk_size(chunk_size)
    return _dclr_noise(anchors, positives, num, steps, lr, std, temperature, noise, generator,
                       _backend(backend, anchors), chunk_size, formulation)


def dclr_loss(anchors, positives, *, complementary=None, phi=0.9, noise=None, noise_ratio=1.0,
              noise_steps=4, noise_lr=1e-3, noise_std=1.0, noise_temperature=None,
              temperature=0.05, generator=None, formulation="paper", anchor_offset=None,
              backend="auto", chunk_size=None):
    r"""DCLR: InfoNCE with optimized noise negatives and instance weighting.

    Candidates ``k = [positives; Z]`` with ``Z`` from :func:`dclr_noise`
    (``K = round(noise_ratio·N)`` rows unless ``noise`` is given, which fixes K). A frozen
    complementary model's embeddings ``complementary=(c, c⁺)`` drop every in-batch negative
    it finds too similar, ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` (positives and noise keep α = 1):

    .. math:: L = \frac1N\sum_i\Big[-\frac{s_{ii}}{\tau} + \log\sum_j \alpha_{ij}\,e^{s_{ij}/\tau}\Big]

    ``formulation="released"`` reproduces the authors' released code instead. Every
    difference from the paper's formulation (the default), in one place:

    ====================  ===============================  ==================================
    what                  ``"paper"``                      ``"released"``
    ====================  ===============================  ==================================
    loss                  cross-entropy; a dropped         logits multiplied by α (a dropped
                          negative leaves the denominator  negative gets logit 0), binary
                                                           cross-entropy on the row softmax,
                                                           mean over all N·(N+K) entries
    mask test             ``cos(c_i, c⁺_j) ≥ φ`` drops     ``cos(c_i, c⁺_j)/τ > 20φ`` drops
    noise columns         never dropped                    complementary cosine 0: every one
                                                           dropped when φ < 0
    noise step's loss     ``−s⁺/τ_u + log Σ_j e^{cos(h,    cross-entropy over ``[h⁺; Z]``: the
                          z_j)/τ_u}`` (noise columns)      N in-batch columns join the LSE
    K noise rows          ``round(noise_ratio·N)``         ``int(N·noise_ratio)``
    zero noise gradient   the row stays where it was       the row becomes 0 (0/0 → NaN → 0)
    ====================  ===============================  ==================================

    Outside the loss, ``train.py --complementary-mode released`` runs the complementary model
    as that code does (dropout on, the duplicated batch, its own pooler output); the
    default ``frozen`` embeds the batch once in eval mode.

    ``anchor_offset`` (global negatives across processes): as in :func:`infonce`, with
    ``complementary = (c of these anchors, c⁺ of the whole batch)`` and K counted from the
    whole batch. The noise update then sees only these anchors: to match one process on
    the whole batch, compute ``Z = dclr_noise(all anchors, all positives, K, generator=g,
    formulation=...)`` identically on every process and pass ``noise=Z, noise_steps=0``.

    Reference: Zhou et al., "Debiased Contrastive Learning of Unsupervised Sentence
    Representations", ACL 2022.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    n = anchors.shape[0]
    complementary = check.complementary(complementary, n, positives.shape[0], anchors.device)
    phi = check.phi(phi)
    temperature = check.positive("temperature", temperature)
    noise_ratio = check.finite("noise_ratio", noise_ratio)
    if noise_ratio < 0:
        raise ValueError(f"noise_ratio must be >= 0, got {noise_ratio}")
    noise_temperature = temperature if noise_temperature is None else noise_temperature
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    num = (None if noise is not None
           else reference.noise_count(noise_ratio, positives.shape[0], formulation))
    steps, lr, std, noise_temperature, noise = _noise_args(
        anchors, num, noise_steps, noise_lr, noise_std, noise_temperature, noise)
    chunk_size = check.chunk_size(chunk_size)
    be = _backend(backend, anchors)
    if be == "reference":
        return reference.dclr_loss(anchors, positives, complementary=complementary, phi=phi,
                                   noise=noise, noise_ratio=noise_ratio, noise_steps=steps,
                                   noise_lr=lr, noise_std=std, noise_temperature=noise_temperature,
                                   temperature=temperature, generator=generator,
                                   formulation=formulation, anchor_offset=anchor_offset)
    num = noise.shape[0] if noise is not None else num
    z = _dclr_noise(anchors, positives, num, steps, lr, std, noise_temperature, noise, generator,
                    be, chunk_size, formulation, anchor_offset)
    ep = Epilogue(temperature, phi=phi if complementary is not None else None,
                  complementary=complementary, formulation=formulation, chunk_size=chunk_size,
                  anchor_offset=anchor_offset)
    return tiled.contrastive_loss(ep, anchors, positives, z.to(anchors.dtype), engine=_engine(be))


def escl_loss(anchors, positives, sensitive, *, temperature=0.05, weight=2.5e-3, rd="softplus",
              margins=(0.1, 0.3), anchor_offset=None, backend="auto", chunk_size=None):
    r"""ESCL: InfoNCE plus a relative-difference term on a high-dropout "sensitive" view.

    .. math:: L = \mathrm{InfoNCE}(h, h^+) + \lambda\,\frac{1}{2N}\sum_i\sum_{h'\in\{h,h^+\}}
              \mathrm{softplus}\Big(\frac{D^{pos}_i - D^{neg}_i(h')}{\tau}\Big)

    with ``D^pos = 1 − cos(h, h⁺)``, ``D^neg(h') = 1 − cos(h', h⁻)`` and λ = ``weight``.
    The paper's exact RD equation is not public; this relative-difference ranking form is a
    reconstruction. ``rd="margin"`` selects SNCSE's bidirectional margin form instead,
    ``relu(Δ + a) + relu(−Δ − b)`` with ``Δ = cos(h', h⁻) − cos(h, h⁺)`` and
    ``(a, b) = margins``. The sensitive view is a training-time device only.
    ``anchor_offset``: as in :func:`infonce` (``sensitive`` holds the anchors' own rows).

    Reference: Liu et al., "Equivariant Contrastive Learning for Sentence Embeddings"
    (ESCL), ICASSP 2023.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    sensitive = check.embeddings("sensitive", sensitive, rows=anchors.shape[0],
                                 width=anchors.shape[1], like=anchors)
    temperature = check.positive("temperature", temperature)
    weight = check.finite("weight", weight)
    rd = check.choice("rd", rd, ("softplus", "margin"))
    if not isinstance(margins, (tuple, list)) or len(margins) != 2:
        raise ValueError(f"margins must be a pair (a, b), got {margins!r}")
    margins = (check.finite("margins[0]", margins[0]), check.finite("margins[1]", margins[1]))
    chunk_size = check.chunk_size(chunk_size)
    be = _backend(backend, anchors)
    if be == "reference":
        return reference.escl_loss(anchors, positives, sensitive, temperature=temperature,
                                   weight=weight, rd=rd, margins=margins,
                                   anchor_offset=anchor_offset)
    # The RD term only pairs row i with row i: O(N·d), identical for every backend.
    own_positives = positives[anchor_offset:anchor_offset + anchors.shape[0]]
    rd_term = reference.relative_difference(anchors, own_positives, sensitive,
                                            temperature=temperature, rd=rd, margins=margins)
    ep = Epilogue(temperature, chunk_size=chunk_size, anchor_offset=anchor_offset)
    return tiled.contrastive_loss(ep, anchors, positives, engine=_engine(be)) + weight * rd_term
