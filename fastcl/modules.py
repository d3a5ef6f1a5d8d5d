"""``nn.Module`` wrappers: each holds its objective's hyper-parameters and calls the
functional form in :mod:`fastcl.functional`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import common as c
from . import functional as fn
from .functional import Backend, Formulation


class _Loss(nn.Module):
    """Holds the ``__init__`` arguments named in ``_fields`` (shown by ``repr``) and passes
    them, with those in ``_quiet`` (not shown), to the functional form."""

    _fields: tuple[str, ...] = ()
    _quiet: tuple[str, ...] = ()

    def _keep(self, values: dict) -> None:
        super().__init__()
        for name in self._fields + self._quiet:
            setattr(self, name, values[name])

    def _options(self) -> dict:
        return {name: getattr(self, name) for name in self._fields + self._quiet}

    def extra_repr(self) -> str:
        return ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)


class InfoNCE(_Loss):
    """Unsupervised / supervised SimCSE loss; see :func:`fastcl.infonce`.

    ``loss = InfoNCE()(anchors, positives[, negatives])``.
    """

    _fields = ("temperature", "hard_negative_weight", "symmetric", "backend", "chunk_size")

    def __init__(self, temperature: float = c.TEMPERATURE, hard_negative_weight: float = 0.0,
                 symmetric: bool = False, backend: Backend = "auto", chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor, negatives: Tensor | None = None) -> Tensor:
        return fn.infonce(anchors, positives, negatives, **self._options())


class FocalInfoNCE(_Loss):
    """Focal-InfoNCE; see :func:`fastcl.focal_infonce`."""

    _fields = ("temperature", "m", "backend", "chunk_size")

    def __init__(self, temperature: float = c.TEMPERATURE, m: float = c.FOCAL_M,
                 backend: Backend = "auto", chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor, negatives: Tensor | None = None) -> Tensor:
        return fn.focal_infonce(anchors, positives, negatives, **self._options())


class DCLRLoss(_Loss):
    """DCLR (noise negatives + instance weighting); see :func:`fastcl.dclr_loss`.

    ``loss = DCLRLoss(phi=0.9)(anchors, positives, complementary=(c, c_pos))``. Pass a
    ``torch.Generator`` to make the noise draws reproducible.
    """

    _fields = ("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std", "noise_temperature",
               "temperature", "formulation", "backend", "chunk_size")
    _quiet = ("generator",)

    def __init__(self, phi: float = c.PHI, noise_ratio: float = c.NOISE_RATIO,
                 noise_steps: int = c.NOISE_STEPS, noise_lr: float = c.NOISE_LR,
                 noise_std: float = c.NOISE_STD, noise_temperature: float | None = None,
                 temperature: float = c.TEMPERATURE, formulation: Formulation = "paper",
                 generator: torch.Generator | None = None, backend: Backend = "auto",
                 chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor,
                complementary: tuple[Tensor, Tensor] | None = None, noise: Tensor | None = None) -> Tensor:
        return fn.dclr_loss(anchors, positives, complementary=complementary, noise=noise,
                            **self._options())


class ESCLLoss(_Loss):
    """ESCL (InfoNCE + relative difference to a high-dropout view); see :func:`fastcl.escl_loss`."""

    _fields = ("temperature", "weight", "rd", "margins", "backend", "chunk_size")

    def __init__(self, temperature: float = c.TEMPERATURE, weight: float = c.ESCL_WEIGHT,
                 rd: str = c.ESCL_RD, margins: tuple[float, float] = c.ESCL_MARGINS,
                 backend: Backend = "auto", chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor, sensitive: Tensor) -> Tensor:
        return fn.escl_loss(anchors, positives, sensitive, **self._options())
