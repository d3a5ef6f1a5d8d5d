"""The training objectives: one table, :data:`METHODS`, and one dispatch, :func:`objective_loss`.

Every step driver uses this dispatch: the plain step, the cached two-pass encoding and the
data-parallel step (which only gathers the views of all processes first, see
:func:`fastcl.distributed.global_views`). A new objective is one :class:`Method` entry in
:data:`METHODS` (its views, its loss, its recipe) plus, if it has hyper-parameters of its
own, fields of :class:`Objective`; the trainer's command line, the distributed gather and
the cached encoding read everything else from the entry.

Views (the dict a loss receives): ``anchors`` h and ``positives`` h⁺ always; by method
``negatives`` (supervised hard negatives), ``sensitive`` (ESCL's high-dropout view),
``complementary`` (DCLR's frozen ``(c, c⁺)``); with global negatives also ``all_anchors``
(every process's anchors, detached) when the entry asks for them.

The InfoNCE family (simcse, simcse-sup, focal, dclr) computes :func:`fastcl.contrastive`
with the features its objective carries, so they compose: ``focal_m`` adds Focal-InfoNCE's
modulation to simcse, simcse-sup and dclr (focal itself reads ``m``), on top of the hard
negatives of simcse-sup and DCLR's mask and noise negatives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from . import augment, common
from .functional import contrastive, dclr_noise, escl_loss


@dataclass
class Objective:
    """A method and its hyper-parameters (defaults: the papers', from :mod:`fastcl.common`)."""

    method: str
    temperature: float = common.TEMPERATURE
    hard_negative_weight: float = 0.0           # simcse-sup
    phi: float = common.PHI                     # dclr
    noise_ratio: float = common.NOISE_RATIO
    noise_steps: int = common.NOISE_STEPS
    noise_lr: float = common.NOISE_LR
    noise_std: float = common.NOISE_STD
    formulation: str = "paper"
    m: float = common.FOCAL_M                   # focal
    focal_m: float | None = None                # simcse, simcse-sup, dclr: focal modulation (None: off)
    rd_weight: float = common.ESCL_WEIGHT       # escl
    rd: str = common.ESCL_RD
    sensitive_dropout: float = common.SENSITIVE_DROPOUT
    complementary: torch.nn.Module | None = None
    complementary_tokenizer: object = None
    complementary_mode: str = "frozen"          # or "released": dropout on, two views
    generator: torch.Generator | None = None
    augment: str | None = None                  # unsupervised: the positive view's "NAME[:rate]"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.focal_m is not None and "focal_m" not in self.spec.options:
            hint = " (its margin is m)" if self.method == "focal" else ""
            raise ValueError(f"focal_m applies to {', '.join(_takes('focal_m'))}, not to "
                             f"{self.method}{hint}")
        if self.focal_m is not None and self.formulation == "released":
            raise ValueError("focal_m combines with DCLR's paper formulation only, not with "
                             "formulation='released' (the authors' code)")
        if self.augment is not None:
            if self.spec.supervised:
                raise ValueError(f"augment applies to the unsupervised methods (the second copy of "
                                 f"each sentence); {self.method} has its positives in the data")
            augment.parse(self.augment)  # a clear error for a bad NAME[:rate] now

    @property
    def spec(self) -> "Method":
        return METHODS[self.method]


@dataclass(frozen=True)
class Method:
    """What a method needs from the step drivers, and its loss.

    ``loss(obj, views, anchor_offset)`` returns the mean loss over ``views["anchors"]``;
    with ``anchor_offset`` (global negatives) the anchors are rows ``[offset, offset + n)``
    of the gathered candidates. ``options`` names the :class:`Objective` fields it reads
    (the trainer accepts their flags with this method only); ``recipe`` holds the papers'
    training defaults (BERT-base).
    """

    loss: Callable
    supervised: bool = False         # (sent0, sent1[, hard_neg]) examples, one grouped forward
    sensitive_view: bool = False     # a third forward at ``sensitive_dropout``
    complementary: bool = False      # a frozen complementary encoder's (c, c⁺)
    global_anchors: bool = False     # global negatives need every process's anchors (detached)
    options: tuple = ()
    recipe: dict = field(default_factory=dict)


def _features(obj: Objective, views: dict, anchor_offset) -> dict:
    """The :func:`fastcl.contrastive` options every InfoNCE-family method shares: τ, the
    supervised hard negatives and their weight, and the focal modulation ``focal_m``."""
    negatives = views.get("negatives")
    return dict(negatives=negatives, temperature=obj.temperature, focal_m=obj.focal_m,
                hard_negative_weight=obj.hard_negative_weight if negatives is not None else 0.0,
                anchor_offset=anchor_offset)


def _infonce(obj: Objective, views: dict, anchor_offset):
    return contrastive(views["anchors"], views["positives"], **_features(obj, views, anchor_offset))


def _focal(obj: Objective, views: dict, anchor_offset):
    return contrastive(views["anchors"], views["positives"],
                       **dict(_features(obj, views, anchor_offset), focal_m=obj.m))


def _escl(obj: Objective, views: dict, anchor_offset):
    return escl_loss(views["anchors"], views["positives"], views["sensitive"],
                     temperature=obj.temperature, weight=obj.rd_weight, rd=obj.rd,
                     anchor_offset=anchor_offset)


def _dclr(obj: Objective, views: dict, anchor_offset):
    h, h_pos = views["anchors"], views["positives"]
    comp = views.get("complementary")
    if comp is not None:
        comp = tuple(c.to(h.dtype) for c in comp)
    noise = dict(noise_ratio=obj.noise_ratio, noise_steps=obj.noise_steps, noise_lr=obj.noise_lr,
                 noise_std=obj.noise_std, generator=obj.generator)
    if "all_anchors" in views:
        # Global negatives: every process draws and improves the noise of one process on the
        # whole batch (same generator state everywhere), then uses it as it is.
        everyone = views["all_anchors"]
        num = common.noise_count(obj.noise_ratio, everyone.shape[0], obj.formulation)
        z = dclr_noise(everyone, h_pos.detach(), num, steps=obj.noise_steps, lr=obj.noise_lr,
                       std=obj.noise_std, temperature=obj.temperature, generator=obj.generator,
                       formulation=obj.formulation)
        noise = dict(noise=z, noise_steps=0)
    return contrastive(h, h_pos, complementary=comp, phi=obj.phi, formulation=obj.formulation,
                       **_features(obj, views, anchor_offset), **noise)


_UNSUPERVISED = dict(batch_size=64, lr=3e-5, epochs=1, mlp_only_train=True, select="stsb")

METHODS: dict[str, Method] = {
    "simcse": Method(_infonce, options=("focal_m",), recipe=_UNSUPERVISED),
    "simcse-sup": Method(_infonce, supervised=True, options=("hard_negative_weight", "focal_m"),
                         recipe=dict(batch_size=512, lr=5e-5, epochs=3, mlp_only_train=False,
                                     select="stsb")),
    "dclr": Method(_dclr, complementary=True, global_anchors=True,
                   options=("phi", "noise_ratio", "noise_steps", "noise_lr", "noise_std",
                            "formulation", "complementary", "complementary_mode", "focal_m"),
                   recipe=dict(_UNSUPERVISED, batch_size=128, epochs=3, select="avg")),
    "focal": Method(_focal, options=("m",), recipe=_UNSUPERVISED),
    "escl": Method(_escl, sensitive_view=True, options=("rd_weight", "rd", "sensitive_dropout"),
                   recipe=_UNSUPERVISED),
}


def _takes(option: str) -> list:
    """The methods whose entry reads the :class:`Objective` field ``option``."""
    return [name for name, spec in METHODS.items() if option in spec.options]


def objective_loss(obj: Objective, views: dict, anchor_offset: int | None = None) -> torch.Tensor:
    """The method's fastcl loss on ``views`` (see the module docstring)."""
    return obj.spec.loss(obj, views, anchor_offset)
