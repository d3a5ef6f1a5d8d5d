"""Argument checks shared by every public entry point.

Bad input must fail here, with the argument named, and never deep inside a kernel
or as a silently wrong number.
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Literal, get_args

import torch

from .common import accumulate_dtype, huge_row_limit, shrink_huge_rows

Backend = Literal["auto", "reference", "tiled", "triton"]
BACKENDS = get_args(Backend)
Formulation = Literal["paper", "released"]      # DCLR's paper, or the authors' released code
FORMULATIONS = get_args(Formulation)

_CHECK_FINITE = True        # the scan of the inputs (set_input_checks says what it costs)


def set_input_checks(enabled: bool) -> bool:
    """Turn the scan of input embeddings on or off (on by default): the NaN/Inf test, and the
    rescaling of rows too large to square (max-abs above
    :func:`fastcl.common.huge_row_limit`, ≈ 3e17 in float32 at d = 768; without the scan such
    rows give NaN). The scan reads its results back once a call, for all inputs together (a
    device sync on GPU; :func:`one_host_read`); off, a call reads nothing back. Returns the
    previous setting, to put it back::

        previous = fastcl.set_input_checks(False)
        try:
            ...
        finally:
            fastcl.set_input_checks(previous)
    """
    global _CHECK_FINITE
    previous, _CHECK_FINITE = _CHECK_FINITE, bool(enabled)
    return previous


def embeddings(name: str, x, *, rows: int | None = None, width: int | None = None,
               like: torch.Tensor | None = None, like_name: str = "anchors",
               allow_empty: bool = False, scale_free: bool = False, device=None) -> torch.Tensor:
    """Check a 2-D floating embedding matrix and return it (``like``: the tensor, named
    ``like_name``, whose dtype and device it must share; ``device``: the anchors' device, for
    a matrix of its own dtype).

    ``scale_free=True`` (the caller uses x only through cosines of its rows): rows whose
    max-abs is too large to square in the accumulate dtype are returned multiplied by a power
    of two (:func:`fastcl.common.shrink_huge_rows`: exact, the cosines unchanged, the
    gradient flowing back through the factor). One reduction (each row's max-abs) serves that
    test and the NaN/Inf test, with one host sync."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}; "
                        f"pass {name}.to_dense()")
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
        plural = like_name.endswith("s")            # "anchors have", "x has"
        if x.dtype != like.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but {like_name} "
                            f"{'have' if plural else 'has'} {like.dtype}")
        if x.device != like.device:
            raise ValueError(f"{name} is on {x.device} but {like_name} "
                             f"{'are' if plural else 'is'} on {like.device}")
    if device is not None and x.device != device:
        raise ValueError(f"{name} is on {x.device} but anchors are on {device}")
    # (under torch.compile the values cannot be read while tracing: the fused op tests them;
    # tested first, as torch.compile before torch 2.6 specializes on the size x.numel() reads)
    if _CHECK_FINITE and not torch.compiler.is_compiling() and x.numel() and not x.is_meta:
        queue = _SCAN.get()
        scan = queue if queue is not None and queue is not _EAGER else _Scan()
        scan.queued.append((name, *_largest(x)))
        if scan is not queue:       # not queued with the call's other inputs (one_host_read): now
            scan.read()
            if scan.huge and scale_free:
                x = shrink_huge_rows(x)
    return x


def _largest(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """``x``'s largest |entry| as a float32 scalar on its device (one reduction; NaN if an
    entry is NaN, which the max propagates), and the value above which some row is too
    large to square (:func:`fastcl.common.huge_row_limit`). float64's range exceeds
    float32's: there both are log₂."""
    top = torch.linalg.vector_norm(x.detach(), ord=float("inf"))
    limit = huge_row_limit(x.dtype, x.shape[1])
    if x.dtype == torch.float64:
        return torch.log2(top).float(), math.log2(limit)
    return top.float(), limit


class _Scan:
    """The NaN/Inf and huge-row tests of one call's inputs, queued by :func:`embeddings` as
    ``(name, largest |entry| on its device, limit)`` (:func:`_largest`) and read back
    together by :meth:`read`."""

    def __init__(self):
        self.queued: list[tuple[str, torch.Tensor, float]] = []
        self.huge = False                   # a read found rows too large to square

    def read(self) -> None:
        """One host read of every queued test (the checks have put the inputs on one
        device): raises the NaN/Inf error of the first input, in the order checked, that has
        one."""
        queued, self.queued = self.queued, []
        tops = torch.stack([top for _, top, _ in queued]).tolist()
        for (name, _, limit), top in zip(queued, tops):
            if not top < math.inf:
                raise ValueError(f"{name} contains NaN or Inf values")
            self.huge |= top > limit


#: The scan of the call in progress (:func:`one_host_read`); ``_EAGER`` while a call reads
#: each input as it is checked.
_SCAN: contextvars.ContextVar[_Scan | None] = contextvars.ContextVar("fastcl_scan", default=None)
_EAGER = _Scan()


class _HugeRows(Exception):
    """Raised by :func:`read_inputs` for :func:`one_host_read`: an input has rows too large
    to square, and the call is to run again reading each input as it is checked."""


def one_host_read(fn):
    """Decorator of a public entry point: the NaN/Inf tests of every input that
    :func:`embeddings` checks within the call (nested entry points included) are queued and
    read back with **one** host read (a device sync on GPU), at :func:`read_inputs`, which the
    entry point calls once its arguments are checked and before any work. A NaN/Inf input
    raises there, naming the argument. An input with rows too large to square (max-abs
    ≳ 3e17 in float32, see :func:`fastcl.common.huge_row_limit`; never in training) makes
    the call start again with one read per input, which rescales those rows: nothing has
    been computed or drawn at random before the read, so the result is the same."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _CHECK_FINITE or torch.compiler.is_compiling() or _SCAN.get() is not None:
            return fn(*args, **kwargs)
        token = _SCAN.set(_Scan())
        try:
            out = fn(*args, **kwargs)
            read_inputs()                   # a no-op where the entry point has read them
            return out
        except _HugeRows:
            pass
        finally:
            _SCAN.reset(token)
        token = _SCAN.set(_EAGER)
        try:
            return fn(*args, **kwargs)
        finally:
            _SCAN.reset(token)
    return call


def read_inputs() -> None:
    """Read the tests queued so far in this call (:func:`one_host_read`): raises the first
    NaN/Inf input's error; outside a scan, or with nothing queued, it reads nothing."""
    if torch.compiler.is_compiling():       # (no scan while tracing; nor can it read a ContextVar)
        return
    scan = _SCAN.get()
    if scan is None or scan is _EAGER or not scan.queued:
        return
    scan.read()
    if scan.huge:
        raise _HugeRows()


def inputs_read() -> bool:
    """Whether this call's inputs passed :func:`one_host_read`'s scan (no NaN/Inf, no rows
    too large to square): True only inside such a call, after :func:`read_inputs`."""
    if torch.compiler.is_compiling():
        return False
    scan = _SCAN.get()
    return scan is not None and scan is not _EAGER and not scan.queued


def generator(value, device) -> torch.Generator | None:
    """``generator=``: None or a torch.Generator on the embeddings' device type."""
    if value is None:
        return None
    if not isinstance(value, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(value).__name__} "
                        f"(for a seed, pass torch.Generator().manual_seed(seed))")
    if value.device.type != torch.device(device).type:
        raise ValueError(f"generator is a {value.device.type} generator but the embeddings are on "
                         f"{device}: draw the noise with torch.Generator(device={str(device)!r})")
    return value


def temperature(value, dtype: torch.dtype, *, name: str = "temperature", focal_m: float | None = None,
                hard_negative_weight: float = 0.0) -> float:
    r"""A temperature τ > 0 whose logits and gradients the accumulate dtype of ``dtype`` holds.

    With \|s\| ≤ 1 the logits reach ``(1 + |m|)/τ + |w|`` and ``∂ℓ/∂s`` is at most
    ``(2 + |m|)/τ`` (m = 0 without focal modulation); the fused chain rule sums those against
    rows of norm up to ``√max/2`` (larger rows are rescaled:
    :func:`fastcl.common.huge_row_limit`), ``Σ_j |∂ℓ_i/∂s_ij|·‖k_j‖ ≤ 2(2 + |m|)/τ · √max/2``.
    So τ must be at least ``(2 + |m|)/√max``: 1.08e-19 in float32 (every 16-bit input
    too), 1.5e-154 in float64. Below it the loss or its gradient is inf/NaN on every backend
    (1/τ alone overflows float32 below 2.9e-39)."""
    value = positive(name, value)
    acc = accumulate_dtype(dtype)
    big = torch.finfo(acc).max
    m = abs(focal_m) if focal_m is not None else 0.0
    smallest = (2.0 + m) / math.sqrt(big)
    if value < smallest:
        with_m = f" with focal_m={focal_m}" if focal_m is not None else ""
        raise ValueError(f"{name}={value!r} is too small{with_m}: the logits s/{name} and their "
                         f"gradient (up to {2.0 + m:g}/{name}) must stay finite in {acc} "
                         f"(accumulate dtype of {dtype} inputs); {name} must be >= {smallest:.3g}")
    if abs(hard_negative_weight) > big / 4:
        raise ValueError(f"hard_negative_weight={hard_negative_weight!r} is beyond {acc}'s range "
                         f"for a logit: |hard_negative_weight| must be <= {big / 4:.3g}")
    return value


def learnable(name: str, value) -> tuple:
    """``(number, tensor or None)``: a tensor that requires grad (a learnable ``name``, one
    element) read once for its value, returned 0-dim beside it; anything else as given (the
    number checks follow). The value is read on the host: the fused kernels take it as a
    number, its gradient flows back through the tensor."""
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return value, None
    if value.numel() != 1:
        raise ValueError(f"{name} must be a number or a tensor of one element, got a tensor of "
                         f"shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
    value = value.reshape(())
    if torch.compiler.is_compiling():   # read (and checked) by the custom op at run time
        return None, value
    return float(value.detach()), value


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
                        f"learnable {name} is not supported; a learnable temperature is)")
    if isinstance(value, bool):         # a switch where a number belongs: True is not 1.0
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    # comparisons rather than math.isfinite: under torch.compile(dynamic=True) a number may be
    # symbolic, which comparisons take (as guards) and math.isfinite does not
    if not (value == value and abs(value) != math.inf):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def within(name: str, value, low: float, high: float = math.inf, closed: bool = False) -> float:
    """A finite number in ``[low, high)`` (``[low, high]`` if ``closed``; ``>= low`` without
    ``high``)."""
    value = finite(name, value)
    if not (low <= value and (value <= high if closed else value < high)):
        end = "]" if closed else ")"
        span = f"be >= {low:g}" if high == math.inf else f"lie in [{low:g}, {high:g}{end}"
        raise ValueError(f"{name} must {span}, got {value}")
    return value


def ids(name: str, x, rows: int, device) -> torch.Tensor:
    """One integer per row (text ids, class labels): a 1-D integer tensor of ``rows`` entries
    on the anchors' ``device``, returned as int64."""
    if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != rows:
        raise ValueError(f"{name} must have shape ({rows},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but anchors are on {device}")
    return x.to(torch.long)


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

