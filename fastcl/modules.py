"""``nn.Module`` wrappers: each holds its objective's hyper-parameters and calls the
functional form in :mod:`fastcl.functional`."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as fn


class _Loss(nn.Module):
    _fields: tuple[str, ...] = ()

    def extra_repr(self) -> str:
        return ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)


class InfoNCE(_Loss):
    """Unsupervised / supervised SimCSE loss; see :func:`fastcl.infonce`.

    ``loss = InfoNCE()(anchors, positives[, negatives])``.
    """

    _fields = ("temperature", "hard_negative_weight", "symmetric", "backend", "chunk_size")

    def __init__(self, temperature=0.05, hard_negative_weight=0.0, symmetric=False,
                 backend="auto", chunk_size=None):
        super().__init__()
        self.temperature, self.hard_negative_weight, self.symmetric = temperature, hard_negative_weight, symmetric
        self.backend, self.chunk_size = backend, chunk_size

    def forward(self, anchors, positives, negatives=None):
        return fn.infonce(anchors, positives, negatives, temperature=self.temperature,
                          hard_negative_weight=self.hard_negative_weight, symmetric=self.symmetric,
                          backend=self.backend, chunk_size=self.chunk_size)


class FocalInfoNCE(_Loss):
    """Focal-InfoNCE; see :func:`fastcl.focal_infonce`."""

    _fields = ("temperature", "m", "backend", "chunk_size")

    def __init__(self, temperature=0.05, m=0.3, backend="auto", chunk_size=None):
        super().__init__()
        self.temperature, self.m, self.backend, self.chunk_size = temperature, m, backend, chunk_size

    def forward(self, anchors, positives, negatives=None):
        return fn.focal_infonce(anchors, positives, negatives, temperature=self.temperature,
                                m=self.m, backend=self.backend, chunk_size=self.chunk_size)


class DCLRLoss(_Loss):
    """DCLR (noise negatives + instance weighting); see :func:`fastcl.dclr_loss`.

    ``loss = DCLRLoss(phi=0.9)(anchors, positives, complementary=(c, c_pos))``. Pass a
    ``torch.Generator`` to make the noise draws reproducible.
    """

    _fields = ("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std", "noise_temperature",
               "temperature", "formulation", "backend", "chunk_size")

    def __init__(self, phi=0.9, noise_ratio=1.0, noise_steps=4, noise_lr=1e-3, noise_std=1.0,
                 noise_temperature=None, temperature=0.05, formulation="paper",
                 generator: torch.Generator | None = None, backend="auto", chunk_size=None):
        super().__init__()
        self.phi, self.noise_ratio, self.noise_steps = phi, noise_ratio, noise_steps
        self.noise_lr, self.noise_std, self.noise_temperature = noise_lr, noise_std, noise_temperature
        self.temperature, self.formulation, self.generator = temperature, formulation, generator
        self.backend, self.chunk_size = backend, chunk_size

    def forward(self, anchors, positives, complementary=None, noise=None):
        return fn.dclr_loss(anchors, positives, complementary=complementary, phi=self.phi,
                            noise=noise, noise_ratio=self.noise_ratio, noise_steps=self.noise_steps,
                            noise_lr=self.noise_lr, noise_std=self.noise_std,
                            noise_temperature=self.noise_temperature, temperature=self.temperature,
                            generator=self.generator, formulation=self.formulation,
                            backend=self.backend, chunk_size=self.chunk_size)


class ESCLLoss(_Loss):
    """ESCL (InfoNCE + relative difference to a high-dropout view); see :func:`fastcl.escl_loss`."""

    _fields = ("temperature", "weight", "rd", "margins", "backend", "chunk_size")

    def __init__(self, temperature=0.05, weight=2.5e-3, rd="softplus", margins=(0.1, 0.3),
                 backend="auto", chunk_size=None):
        super().__init__()
        self.temperature, self.weight, self.rd, self.margins = temperature, weight, rd, margins
        self.backend, self.chunk_size = backend, chunk_size

    def forward(self, anchors, positives, sensitive):
        return fn.escl_loss(anchors, positives, sensitive, temperature=self.temperature,
                            weight=self.weight, rd=self.rd, margins=self.margins,
                            backend=self.backend, chunk_size=self.chunk_size)
