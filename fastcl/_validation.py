"""Argument checks shared by every public entry point.

Bad input must fail here, with the argument named, and never deep inside a kernel
or as a silently wrong number.
"""

from __future__ import annotations

import math

import torch

BACKENDS = ("auto", "reference", "tiled", "triton")

# Finite checks cost one reduction per input (and a device sync on GPU); they can be
# switched off for production runs with ``fastcl.set_input_checks(False)``.
_CHECK_FINITE = True


def set_input_checks(enabled: bool) -> None:
    """Turn the NaN/Inf scan of input embeddings on or off (on by default)."""
    global _CHECK_FINITE
    _CHECK_FINITE = bool(enabled)


def embeddings(name: str, x, *, rows: int | None = None, width: int | None = None,
               like: torch.Tensor | None = None, allow_empty: bool = False) -> torch.Tensor:
    """Check a 2-D floating embedding matrix and return it."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, dim), got shape {tuple(x.shape)}")
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{name} is an empty batch (shape {tuple(x.shape)})")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has zero width (shape {tuple(x.shape)})")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} has {x.shape[0]} rows but {rows} are needed (shape {tuple(x.shape)})")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} has width {x.shape[1]} but the embeddings have width {width}")
    if like is not None:
        if x.dtype != like.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but anchors have {like.dtype}")
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but anchors are on {like.device}")
    if _CHECK_FINITE and x.numel() and not x.is_meta and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def positive(name: str, value) -> float:
    value = finite(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def finite(name: str, value) -> float:
    if isinstance(value, torch.Tensor) and value.requires_grad:
        # float() would silently cut the graph: a learnable value would get no gradient
        raise TypeError(f"{name} is a tensor that requires grad, but fastcl's losses take it as "
                        f"a number and return no gradient for it; pass float({name}) (a "
                        f"learnable {name} is not supported)")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def phi(value) -> float:
    value = finite("phi", value)
    if not -1.0 <= value <= 1.0:
        raise ValueError(f"phi is a cosine threshold and must lie in [-1, 1], got {value}")
    return value


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """A switch: True or False (a tensor or a string here is a mistake, not a truth value)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def choice(name: str, value, options) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def chunk_size(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"chunk_size must be a positive integer or None, got {value!r}")
    return value


def complementary(value, n: int, n_positives: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``complementary=(c_anchors, c_positives)``: the frozen model's view of the batch."""
    if value is None:
        return None
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError("complementary must be a pair (c_anchors, c_positives) or None")
    c_anchors = embeddings("complementary[0]", value[0], rows=n)
    c_positives = embeddings("complementary[1]", value[1], rows=n_positives, width=c_anchors.shape[1])
    for i, c in enumerate((c_anchors, c_positives)):
        if c.device != device:
            raise ValueError(f"complementary[{i}] is on {c.device} but anchors are on {device}")
    if c_positives.dtype != c_anchors.dtype:
        raise TypeError(f"complementary[1] is {c_positives.dtype} but complementary[0] is "
                        f"{c_anchors.dtype}: the complementary model's two views share one dtype")
    return c_anchors.detach(), c_positives.detach()
