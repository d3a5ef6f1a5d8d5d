"""Switches that bring back an earlier design of the fast path, for side-by-side measurement.

Every performance change to the chunk driver and the Triton engine sits behind one name
here, so that one process can time the old and the new design on the same inputs
(``bench/ab.py`` does, through ``bench/gpu_check.sh``). They are read at every call, not at
import, and change speed and memory only: every design computes the same loss.

``FASTCL_LEGACY`` is a comma list of:

``dk``        ∂L/∂candidates accumulated through a fresh M×d product per chunk, then added
              (new: one GEMM accumulating in place into the fp32 buffer);
``chunks``    the first chunk sizing: one budget for all engines, counting the fp32 slice
              plus the gradient in the GEMM dtype, rows a multiple of 16 (new: each engine
              counts its own buffers, rows a multiple of the kernels' 128-row tile);
``epilogue``  Triton only: fp32 cosines, the row log-sum-exp in PyTorch ops and a separate
              gradient kernel (new: exp(l − tile max) stored in the GEMM dtype where the
              objective allows, one row kernel for log-sum-exp, loss and gradient in place);
``configs``   Triton only: the first autotune list (new: tiles that compile without spills);
``tiles``     Triton only: the autotune lists chosen from compiles that lacked a launch's
              alignment facts, which left out the 128×128×64 tile (new: lists chosen for the
              kernel a launch builds, with its pipelined 16-bit K loop: 128×128×64 first);
``tangent``   the chain rule through the L2 normalization in PyTorch ops (~10 launches a
              chunk; new, where the engine has one: one Triton launch that also writes the
              normalized anchors for the second GEMM);
``all``       every one of them.

``FASTCL_AUTOTUNE=0`` pins autotuning to the first config of each list (bounded compile
time in tests); it changes speed only.

``FASTCL_SIM`` picks a candidate design of the similarity kernel ahead of its measurement
(off by default; unset, the kernel is the one above, unchanged):

``descriptor`` Triton only: the tile loads of both operands (and of the DCLR mask's) and the
              store of the R×128 result through tensor descriptors (``tl.make_tensor_descriptor``:
              TMA on sm_90, the edges read as zeros and clipped on store by the descriptor's
              bounds) instead of per-element pointer tensors; a 1-D grid whose program ids go
              in groups of ``GROUP_R`` row blocks (each group sweeps every column tile, for
              L2 reuse); its own autotune list with the larger Hopper tiles (128 rows × 128
              columns × 64 of d, 8 warps, 3–4 stages). Inputs a descriptor cannot address
              (a row stride or base not 16-byte aligned, a strided column) take the default
              path for that call; the stored chunk's rows are padded to 16 bytes.
``persistent`` Triton only: the descriptor design with one program per SM walking the
              tiles in the same grouped order (``tl.range(..., flatten=True)``: the pipeliner
              may load the next tile's operands during this tile's epilogue, which the
              one-tile programs leave to other resident programs); its own autotune list.
"""

from __future__ import annotations

import os

LEGACY = ("dk", "chunks", "epilogue", "configs", "tangent", "tiles")
#: The values ``FASTCL_SIM`` takes ("" is the default design).
SIM = ("descriptor", "persistent")


def legacy(name: str) -> bool:
    """Whether ``FASTCL_LEGACY`` asks for the earlier design of ``name`` (one of ``LEGACY``)."""
    if name not in LEGACY:
        raise ValueError(f"unknown legacy switch {name!r}; known: {', '.join(LEGACY)}")
    raw = os.environ.get("FASTCL_LEGACY", "")
    if not raw:
        return False
    chosen = {part.strip() for part in raw.split(",") if part.strip()}
    unknown = chosen - set(LEGACY) - {"all"}
    if unknown:
        raise ValueError(f"FASTCL_LEGACY names unknown switches {sorted(unknown)}; "
                         f"known: {', '.join(LEGACY)}, all")
    return "all" in chosen or name in chosen


def autotune_pinned() -> bool:
    """``FASTCL_AUTOTUNE=0``: use each kernel's first config instead of autotuning."""
    return os.environ.get("FASTCL_AUTOTUNE", "1") == "0"


def sim_design() -> str:
    """``FASTCL_SIM``: the similarity kernel's candidate design ("" for the default one)."""
    raw = os.environ.get("FASTCL_SIM", "").strip()
    if raw and raw not in SIM:
        raise ValueError(f"FASTCL_SIM={raw!r} is unknown; known: {', '.join(SIM)} (or unset)")
    return raw
