"""Environment switches of the fast path. They are read at every call, not at import, and
change speed only: every setting computes the same loss.

``FASTCL_AUTOTUNE=0`` pins autotuning to the first config of each list (bounded compile
time in tests).

``FASTCL_SIM=descriptor`` runs the one candidate design of the similarity kernel that a GPU
has not timed yet (off by default; unset, the kernel is the pointer-load design): the tile
loads of both operands (and of the DCLR mask's) and the store of the R×128 result through
tensor descriptors (``tl.make_tensor_descriptor``: TMA on sm_90, the edges read as zeros and
clipped on store by the descriptor's bounds) instead of per-element pointer tensors; a 1-D
grid whose program ids go in groups of ``GROUP_R`` row blocks (each group sweeps every column
tile, for L2 reuse); its own autotune list with the larger Hopper tiles. Inputs a descriptor
cannot address (a row stride or base not 16-byte aligned, a strided column) take the default
path for that call; the stored chunk's rows are padded to 16 bytes. ``bash
bench/gpu_check.sh`` times it against the default; the measurement then promotes it (the
switch goes, the design stays) or deletes it. Every other performance change is compared
between commits (``bench/ab.py --base``), not kept behind a switch.
"""

from __future__ import annotations

import os

#: The values ``FASTCL_SIM`` takes ("" is the default design).
SIM = ("descriptor",)


def autotune_pinned() -> bool:
    """``FASTCL_AUTOTUNE=0``: use each kernel's first config instead of autotuning."""
    return os.environ.get("FASTCL_AUTOTUNE", "1") == "0"


def sim_design() -> str:
    """``FASTCL_SIM``: the similarity kernel's candidate design ("" for the default one)."""
    raw = os.environ.get("FASTCL_SIM", "").strip()
    if raw and raw not in SIM:
        raise ValueError(f"FASTCL_SIM={raw!r} is unknown; known: {', '.join(SIM)} (or unset)")
    return raw
