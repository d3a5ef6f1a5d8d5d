"""``nn.Module`` wrappers: each holds its objective's hyper-parameters and calls the
functional form in :mod:`fastcl.functional`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import common as c
from . import functional as fn
from .functional import Backend, Formulation


class _Loss(nn.Module):
    """Holds its ``__init__`` arguments (shown by ``repr``, but those in ``_quiet``) and
    passes them to the functional form."""

    _quiet: tuple[str, ...] = ()

    def _keep(self, values: dict) -> None:
        super().__init__()
        self._names = tuple(name for name in values if name != "self")
        for name in self._names:
            setattr(self, name, values[name])

    def _options(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def extra_repr(self) -> str:
        return ", ".join(f"{f}={getattr(self, f)!r}" for f in self._names if f not in self._quiet)


class InfoNCE(_Loss):
    """Unsupervised / supervised SimCSE loss; see :func:`fastcl.infonce`.

    ``loss = InfoNCE()(anchors, positives[, negatives])``.
    """

    def __init__(self, temperature: float = c.TEMPERATURE, hard_negative_weight: float = 0.0,
                 symmetric: bool = False, backend: Backend = "auto", chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor, negatives: Tensor | None = None) -> Tensor:
        return fn.infonce(anchors, positives, negatives, **self._options())


class FocalInfoNCE(_Loss):
    """Focal-InfoNCE; see :func:`fastcl.focal_infonce`."""

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

    def __init__(self, temperature: float = c.TEMPERATURE, weight: float = c.ESCL_WEIGHT,
                 rd: str = c.ESCL_RD, margins: tuple[float, float] = c.ESCL_MARGINS,
                 backend: Backend = "auto", chunk_size: int | None = None):
        self._keep(locals())

    def forward(self, anchors: Tensor, positives: Tensor, sensitive: Tensor) -> Tensor:
        return fn.escl_loss(anchors, positives, sensitive, **self._options())
