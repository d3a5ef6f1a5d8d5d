"""Public functional API: argument checks, then dispatch to a backend.

Backends: ``"reference"`` (:mod:`fastcl.reference`, full matrices), ``"tiled"``
(:mod:`fastcl.tiled`, chunked, any device), ``"triton"`` (fused kernels, CUDA) and
``"auto"`` (Triton for CUDA tensors once the kernels are built in, tiled otherwise).
"""

from __future__ import annotations

import functools
import importlib.util
import os

from typing import Literal

import torch
from torch import Tensor

from . import _validation as check
from . import common, reference, tiled
from .tiled import Epilogue

__all__ = ["contrastive", "infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss",
           "resolve_backend"]

Backend = Literal["auto", "reference", "tiled", "triton"]
Formulation = Literal["paper", "released"]


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_problem(x: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take ``x`` (None if it can)."""
    if not _triton_installed():
        return "the triton package is not installed (pip install 'fastcl[triton]')"
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the kernels take float32, float16 or bfloat16 embeddings, not {x.dtype}"
    if x.is_meta:
        return "the embeddings are meta tensors, which hold no data for a kernel to read"
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return ("the embeddings are on the CPU: the kernels need CUDA tensors, or "
                "TRITON_INTERPRET=1 (set before fastcl.kernels is imported) to run them in "
                "Triton's interpreter")
    return None


def resolve_backend(backend: Backend, x: Tensor) -> str:
    """The backend a loss call with ``backend`` runs on for embeddings like ``x``: the
    rule of ``"auto"`` (Triton for CUDA tensors it can take, tiled otherwise), and a clear
    error when ``"triton"`` cannot run."""
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
    anchors = check.embeddings("anchors", anchors, scale_free=True)
    if anchor_offset is None:
        positives = check.embeddings("positives", positives, rows=anchors.shape[0],
                                     width=anchors.shape[1], like=anchors, scale_free=True)
        anchor_offset = 0
    else:
        anchor_offset = check.non_negative_int("anchor_offset", anchor_offset)
        positives = check.embeddings("positives", positives, width=anchors.shape[1], like=anchors,
                                     scale_free=True)
        if positives.shape[0] < anchor_offset + anchors.shape[0]:
            raise ValueError(
                f"positives has {positives.shape[0]} rows but anchor_offset={anchor_offset} with "
                f"{anchors.shape[0]} anchors needs at least {anchor_offset + anchors.shape[0]}")
    return anchors, positives, anchor_offset


def _negatives(negatives, anchors):
    if negatives is None:
        return None
    return check.embeddings("negatives", negatives, width=anchors.shape[1], like=anchors,
                             allow_empty=True, scale_free=True)


def contrastive(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
                temperature: float = common.TEMPERATURE, focal_m: float | None = None,
                hard_negative_weight: float = 0.0,
                complementary: tuple[Tensor, Tensor] | None = None, phi: float = common.PHI,
                noise: Tensor | None = None, noise_ratio: float = 0.0,
                noise_steps: int = common.NOISE_STEPS, noise_lr: float = common.NOISE_LR,
                noise_std: float = common.NOISE_STD, noise_temperature: float | None = None,
                generator: torch.Generator | None = None, formulation: Formulation = "paper",
                symmetric: bool = False, anchor_offset: int | None = None,
                backend: Backend = "auto", chunk_size: int | None = None) -> Tensor:
    r"""The composable objective: InfoNCE with any set of the features below, on every backend.

    :func:`infonce`, :func:`focal_infonce` and :func:`dclr_loss` are special cases of it.
    Notation: anchors ``h_i`` (N rows), candidates ``k = [h⁺; h⁻; Z]`` — the positives (N_b
    rows: the batch, N_b = N unless ``anchor_offset``), then ``negatives`` (K rows, optional),
    then the noise negatives ``Z`` (K_z rows, optional) — and ``s_ij = cos(h_i, k_j)``.
    Anchor i's positive is column ``p(i) = anchor_offset + i``.

    **Logits.** ``l_ij = s_ij/τ``. With ``focal_m = m`` (Focal-InfoNCE) the positive gets
    ``l_{i,p(i)} = s²/τ`` and every other column — in-batch, hard and noise negatives alike —
    ``l_ij = s_ij(s_ij + m)/τ``. With ``hard_negative_weight = w`` the log-weight ``w`` is added
    at column ``N_b + p(i)`` (anchor i's own hard negative: ``negatives`` then has N_b rows).

    **Mask** (DCLR's instance weighting, ``complementary = (c, c⁺)``, a frozen model's
    embeddings of the anchors and of the N_b positives): ``α_ij = 1[cos(c_i, c⁺_j) < φ]`` on
    the in-batch columns ``j < N_b``, ``j ≠ p(i)``; ``α = 1`` on the positive, on ``negatives``
    and on ``Z``. Without ``complementary`` every ``α_ij = 1``.

    **Noise negatives.** ``Z = dclr_noise(h, h⁺, K_z, steps=noise_steps, lr=noise_lr,
    std=noise_std, temperature=noise_temperature or τ, noise=noise, generator=generator,
    formulation=formulation)``: ``K_z = round(noise_ratio·N_b)`` rows drawn from
    ``N(0, noise_std²)``, or the rows of ``noise`` as the starting point; then the normalized
    gradient-ascent steps of :func:`dclr_noise`, which always use the plain logits (focal,
    ``w`` and α do not enter the noise update). ``Z`` carries no gradient. No noise columns
    when ``noise is None`` and ``noise_ratio = 0`` (the default).

    **Loss** (``formulation="paper"``, the default):

    .. math:: L^{\rightarrow} = \frac1N\sum_i\Big[-l_{i,p(i)}
              + \log\sum_j \alpha_{ij}\,e^{l_{ij}}\Big]

    A dropped negative leaves the denominator; with every feature off this is SimCSE's InfoNCE.

    **symmetric=True** averages with the reverse direction, ``L = ½(L^→ + L^←)``, where the
    positives are the anchors and the anchors the candidates (``s'_ij = cos(h⁺_i, h_j)``,
    positive in column i). The per-pair features apply to both directions — the focal
    modulation, and the mask transposed, ``α'_ij = 1[cos(c⁺_i, c_j) < φ]`` — while the extra
    columns belong to the forward direction only: ``L^←`` has no ``negatives``, no ``w``
    and no ``Z``. It needs every anchor of the batch (no ``anchor_offset``).

    **formulation="released"** is DCLR as the authors' released code computes it (the table
    in :func:`dclr_loss`'s docstring: logits multiplied by α, binary cross-entropy on the row
    softmax averaged over all N·M entries, the mask test ``cos/τ > 20φ``, noise columns dropped
    when φ < 0, ``K_z = int(N_b·noise_ratio)``, the released noise update). It combines with
    ``complementary``/``phi`` and the noise options only: ``focal_m``, ``negatives``,
    ``hard_negative_weight`` or ``symmetric`` with it raise a ``ValueError`` naming them.

    Args:
        anchors: (N, d) first view.
        positives: (N, d) second view (N_b rows with ``anchor_offset``); row i is anchor
            i's positive.
        negatives: optional (K, d) extra negatives: hard negatives (row i belongs to anchor
            i, K = N_b) or any K rows such as a queue.
        temperature: τ ≥ (2 + |m|)/√max of the accumulate dtype (1.08e-19 for float32 and
            16-bit inputs; below it the logits or their gradient overflow).
        focal_m: Focal-InfoNCE's m (None: no focal modulation; m = 0 still squares every
            cosine, s²/τ).
        hard_negative_weight: the log-weight ``w``; needs K = N_b ``negatives``.
        complementary: ``(c, c⁺)`` — (N, d_c) and (N_b, d_c) — turns the DCLR mask on.
        phi: the mask's cosine threshold φ ∈ [-1, 1] (read only with ``complementary``).
        noise: optional (K_z, d) starting noise (fixes K_z; ``noise_steps=0`` uses it as is).
        noise_ratio: ``K_z = round(noise_ratio·N_b)`` when ``noise`` is None; ≥ 0.
        noise_steps, noise_lr, noise_std, noise_temperature, generator: the noise update
            (:func:`dclr_noise`'s ``steps``, ``lr``, ``std``, ``temperature`` — default τ — and
            ``generator``).
        formulation: "paper" or "released" (above).
        symmetric: also score positives against anchors and average the two directions.
        anchor_offset: the anchors are rows ``[anchor_offset, anchor_offset + N)`` of the
            batch that ``positives``, ``negatives`` and ``complementary[1]`` hold (global
            negatives across processes; as in :func:`infonce`). The noise update then sees
            only these anchors (:func:`dclr_loss` says how to share one ``Z``).
        backend: "auto", "reference", "tiled" or "triton".
        chunk_size: anchor rows per chunk in the tiled path (default: from a memory budget).

    Returns the scalar loss (float32 for 16-bit inputs); gradients flow to ``anchors``,
    ``positives`` and ``negatives`` (never to ``complementary`` or ``Z``).

    References: Gao, Yao & Chen, "SimCSE", EMNLP 2021; Hou & Li, "Improving Contrastive
    Learning of Sentence Embeddings with Focal-InfoNCE", Findings of EMNLP 2023; Zhou et al.,
    "Debiased Contrastive Learning of Unsupervised Sentence Representations", ACL 2022.
    """
    anchors, positives, anchor_offset = _anchors_and_positives(anchors, positives, anchor_offset)
    negatives = _negatives(negatives, anchors)
    n, n_pos = anchors.shape[0], positives.shape[0]
    focal_m = None if focal_m is None else check.finite("focal_m", focal_m)
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    temperature = check.temperature(temperature, anchors.dtype, focal_m=focal_m,
                                    hard_negative_weight=hard_negative_weight)
    _check_hard_negatives(hard_negative_weight, negatives, n_pos)
    complementary = check.complementary(complementary, n, n_pos, anchors.device)
    phi = check.phi(phi)
    noise_ratio = _noise_ratio(noise_ratio)
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    symmetric = _check_symmetric(symmetric, n, n_pos)
    if formulation == "released":
        others = [name for name, on in (("focal_m", focal_m is not None),
                                         ("negatives", negatives is not None),
                                         ("hard_negative_weight", bool(hard_negative_weight)),
                                         ("symmetric", symmetric)) if on]
        if others:
            raise ValueError(
                f"formulation='released' is DCLR as the authors' code computes it and combines "
                f"with complementary, phi and the noise options only; got {', '.join(others)} "
                f"as well: use formulation='paper' to combine them")
    noise_temperature = temperature if noise_temperature is None else noise_temperature
    num = None if noise is not None else common.noise_count(noise_ratio, n_pos, formulation)
    steps, lr, std, noise_temperature, noise = _noise_args(
        anchors, num, noise_steps, noise_lr, noise_std, noise_temperature, noise)
    generator = check.generator(generator, anchors.device)
    chunk_size = check.chunk_size(chunk_size)
    return _contrastive(anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
                        hard_negative_weight=hard_negative_weight, complementary=complementary,
                        phi=phi, noise=noise, noise_ratio=noise_ratio, noise_steps=steps,
                        noise_lr=lr, noise_std=std, noise_temperature=noise_temperature,
                        generator=generator, formulation=formulation, symmetric=symmetric,
                        anchor_offset=anchor_offset, backend=resolve_backend(backend, anchors),
                        chunk_size=chunk_size)


def _contrastive(anchors, positives, negatives=None, *, temperature, focal_m=None,
                 hard_negative_weight=0.0, complementary=None, phi=common.PHI, noise=None,
                 noise_ratio=0.0, noise_steps=common.NOISE_STEPS, noise_lr=common.NOISE_LR,
                 noise_std=common.NOISE_STD, noise_temperature=None, generator=None,
                 formulation="paper", symmetric=False, anchor_offset=0, backend, chunk_size=None):
    """:func:`contrastive` on checked arguments and a resolved backend: what every public
    loss but ESCL runs. Autocast is off inside, on every backend: the loss depends on the
    inputs' dtype only (autocast would round the cosine GEMMs, hence the logits, to 16 bits)."""
    with common.autocast_off(anchors.device):
        return _contrastive_on(
            anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
            hard_negative_weight=hard_negative_weight, complementary=complementary, phi=phi,
            noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps, noise_lr=noise_lr,
            noise_std=noise_std, noise_temperature=noise_temperature, generator=generator,
            formulation=formulation, symmetric=symmetric, anchor_offset=anchor_offset,
            backend=backend, chunk_size=chunk_size)


def _contrastive_on(anchors, positives, negatives, *, temperature, focal_m, hard_negative_weight,
                    complementary, phi, noise, noise_ratio, noise_steps, noise_lr, noise_std,
                    noise_temperature, generator, formulation, symmetric, anchor_offset, backend,
                    chunk_size):
    noise_temperature = temperature if noise_temperature is None else noise_temperature
    if backend == "reference":
        return reference.contrastive(
            anchors, positives, negatives, temperature=temperature, focal_m=focal_m,
            hard_negative_weight=hard_negative_weight, complementary=complementary, phi=phi,
            noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps, noise_lr=noise_lr,
            noise_std=noise_std, noise_temperature=noise_temperature, generator=generator,
            formulation=formulation, symmetric=symmetric, anchor_offset=anchor_offset)
    engine = _engine(backend)
    blocks = [positives] + ([] if negatives is None else [negatives])
    num = (noise.shape[0] if noise is not None
           else common.noise_count(noise_ratio, positives.shape[0], formulation))
    if noise is not None or num:
        z = _dclr_noise(anchors, positives, num, noise_steps, noise_lr, noise_std,
                        noise_temperature, noise, generator, backend, chunk_size, formulation,
                        anchor_offset)
        # Z is not rescaled before its update (a step of lr is not scale-free); as loss
        # candidates its rows only enter through cosines
        blocks.append(common.shrink_huge_rows(z).to(anchors.dtype))
    masked = complementary is not None
    ep = Epilogue(temperature, focal_m=focal_m, hard_negative_weight=hard_negative_weight,
                  phi=phi if masked else None, complementary=complementary,
                  formulation=formulation, chunk_size=chunk_size, anchor_offset=anchor_offset)
    loss = tiled.contrastive_loss(ep, anchors, *blocks, engine=engine)
    if symmetric:
        # the reverse direction: positives against the anchors, focal and the transposed mask
        reverse = Epilogue(temperature, focal_m=focal_m, phi=phi if masked else None,
                           complementary=(complementary[1], complementary[0]) if masked else None,
                           chunk_size=chunk_size)
        loss = 0.5 * (loss + tiled.contrastive_loss(reverse, positives, anchors, engine=engine))
    return loss


def _check_hard_negatives(hard_negative_weight, negatives, n_pos):
    if hard_negative_weight and (negatives is None or negatives.shape[0] != n_pos):
        got = "no negatives" if negatives is None else f"{negatives.shape[0]} negatives"
        raise ValueError(f"hard_negative_weight needs one hard negative per anchor "
                         f"({n_pos} negatives), got {got}")


def _check_symmetric(symmetric, n, n_pos) -> bool:
    symmetric = check.flag("symmetric", symmetric)
    if symmetric and n_pos != n:
        raise ValueError("symmetric=True needs every anchor of the batch in this call "
                         "(no anchor_offset slice)")
    return symmetric


def _noise_ratio(value):
    value = check.finite("noise_ratio", value)
    if value < 0:
        raise ValueError(f"noise_ratio must be >= 0, got {value}")
    return value


def infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
            temperature: float = common.TEMPERATURE, hard_negative_weight: float = 0.0,
            symmetric: bool = False, anchor_offset: int | None = None, backend: Backend = "auto",
            chunk_size: int | None = None) -> Tensor:
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
    hard_negative_weight = check.finite("hard_negative_weight", hard_negative_weight)
    temperature = check.temperature(temperature, anchors.dtype,
                                    hard_negative_weight=hard_negative_weight)
    _check_hard_negatives(hard_negative_weight, negatives, positives.shape[0])
    symmetric = _check_symmetric(symmetric, anchors.shape[0], positives.shape[0])
    chunk_size = check.chunk_size(chunk_size)
    return _contrastive(anchors, positives, negatives, temperature=temperature,
                        hard_negative_weight=hard_negative_weight, symmetric=symmetric,
                        anchor_offset=anchor_offset, backend=resolve_backend(backend, anchors),
                        chunk_size=chunk_size)


def focal_infonce(anchors: Tensor, positives: Tensor, negatives: Tensor | None = None, *,
                  temperature: float = common.TEMPERATURE, m: float = common.FOCAL_M,
                  anchor_offset: int | None = None, backend: Backend = "auto",
                  chunk_size: int | None = None) -> Tensor:
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
    m = check.finite("m", m)
    temperature = check.temperature(temperature, anchors.dtype, focal_m=m)
    chunk_size = check.chunk_size(chunk_size)
    return _contrastive(anchors, positives, negatives, temperature=temperature, focal_m=m,
                        anchor_offset=anchor_offset, backend=resolve_backend(backend, anchors),
                        chunk_size=chunk_size)


def _noise_args(anchors, num, steps, lr, std, temperature, noise,
                names=("noise_steps", "noise_lr", "noise_std", "noise_temperature")):
    steps = check.non_negative_int(names[0], steps)
    lr = check.finite(names[1], lr)
    std = check.positive(names[2], std)
    temperature = check.temperature(temperature, anchors.dtype, name=names[3])
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
    with common.autocast_off(anchors.device):
        return _dclr_noise_on(anchors, positives, num, steps, lr, std, temperature, noise,
                              generator, be, chunk_size, formulation, anchor_offset)


def _dclr_noise_on(anchors, positives, num, steps, lr, std, temperature, noise, generator, be,
                   chunk_size, formulation, anchor_offset):
    if be == "reference":
        return reference.dclr_noise(anchors, positives, num, steps=steps, lr=lr, std=std,
                                    temperature=temperature, noise=noise, generator=generator,
                                    formulation=formulation, anchor_offset=anchor_offset)
    if noise is None:
        noise = common.draw_noise(num, anchors.shape[1], std=std, generator=generator,
                                     device=anchors.device)
    return tiled.noise_update(anchors, noise, steps=steps, lr=lr, temperature=temperature,
                              chunk_size=chunk_size, engine=_engine(be),
                              positives=positives if formulation == "released" else None,
                              anchor_offset=anchor_offset)


def dclr_noise(anchors: Tensor, positives: Tensor, num: int | None, *,
               steps: int = common.NOISE_STEPS, lr: float = common.NOISE_LR,
               std: float = common.NOISE_STD, temperature: float = common.TEMPERATURE,
               noise: Tensor | None = None, generator: torch.Generator | None = None,
               formulation: Formulation = "paper", backend: Backend = "auto",
               chunk_size: int | None = None) -> Tensor:
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
    steps, lr, std, temperature, noise = _noise_args(anchors, num, steps, lr, std, temperature, noise,
                                                     names=("steps", "lr", "std", "temperature"))
    num = noise.shape[0] if noise is not None else num
    generator = check.generator(generator, anchors.device)
    formulation = check.choice("formulation", formulation, ("paper", "released"))
    chunk_size = check.chunk_size(chunk_size)
    return _dclr_noise(anchors, positives, num, steps, lr, std, temperature, noise, generator,
                       resolve_backend(backend, anchors), chunk_size, formulation)


def dclr_loss(anchors: Tensor, positives: Tensor, *,
              complementary: tuple[Tensor, Tensor] | None = None, phi: float = common.PHI,
              noise: Tensor | None = None, noise_ratio: float = common.NOISE_RATIO,
              noise_steps: int = common.NOISE_STEPS, noise_lr: float = common.NOISE_LR,
              noise_std: float = common.NOISE_STD, noise_temperature: float | None = None,
              temperature: float = common.TEMPERATURE, generator: torch.Generator | None = None,
              formulation: Formulation = "paper", anchor_offset: int | None = None,
              backend: Backend = "auto", chunk_size: int | None = None) -> Tensor:
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
    return contrastive(anchors, positives, temperature=temperature, complementary=complementary,
                       phi=phi, noise=noise, noise_ratio=noise_ratio, noise_steps=noise_steps,
                       noise_lr=noise_lr, noise_std=noise_std, noise_temperature=noise_temperature,
                       generator=generator, formulation=formulation, anchor_offset=anchor_offset,
                       backend=backend, chunk_size=chunk_size)


def escl_loss(anchors: Tensor, positives: Tensor, sensitive: Tensor, *,
              temperature: float = common.TEMPERATURE, weight: float = common.ESCL_WEIGHT,
              rd: Literal["softplus", "margin"] = common.ESCL_RD,
              margins: tuple[float, float] = common.ESCL_MARGINS, anchor_offset: int | None = None,
              backend: Backend = "auto", chunk_size: int | None = None) -> Tensor:
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
                                 width=anchors.shape[1], like=anchors, scale_free=True)
    temperature = check.temperature(temperature, anchors.dtype)
    weight = check.finite("weight", weight)
    rd = check.choice("rd", rd, ("softplus", "margin"))
    if not isinstance(margins, (tuple, list)) or len(margins) != 2:
        raise ValueError(f"margins must be a pair (a, b), got {margins!r}")
    margins = (check.finite("margins[0]", margins[0]), check.finite("margins[1]", margins[1]))
    chunk_size = check.chunk_size(chunk_size)
    be = resolve_backend(backend, anchors)
    with common.autocast_off(anchors.device):
        return _escl(anchors, positives, sensitive, temperature, weight, rd, margins,
                     anchor_offset, be, chunk_size)


def _escl(anchors, positives, sensitive, temperature, weight, rd, margins, anchor_offset, be,
          chunk_size):
    if be == "reference":
        return reference.escl_loss(anchors, positives, sensitive, temperature=temperature,
                                   weight=weight, rd=rd, margins=margins,
                                   anchor_offset=anchor_offset)
    # The RD term only pairs row i with row i: O(N·d), identical for every backend.
    own_positives = positives[anchor_offset:anchor_offset + anchors.shape[0]]
    rd_term = common.relative_difference(anchors, own_positives, sensitive,
                                            temperature=temperature, rd=rd, margins=margins)
    ep = Epilogue(temperature, chunk_size=chunk_size, anchor_offset=anchor_offset)
    return tiled.contrastive_loss(ep, anchors, positives, engine=_engine(be)) + weight * rd_term
