"""Launch sizes of the kernels in :mod:`fastcl.kernels.contrastive`: the flag sets they are
built for, the similarity kernel's autotune lists and the other kernels' blocks.

The lists are chosen by ``python -m fastcl.kernels.compile_check --sim-candidates`` from
``SIM_CANDIDATES``: a kept config compiles without register spills, for every flag set on
sm_80 and sm_90, as a large-batch launch specializes it (16-byte aligned buffers, sizes that
are multiples of 16: the 16-bit K loop is pipelined through asynchronous copies), in each
mode its objective is launched in. The tests hold every list to that on the floor Triton of
pyproject.toml, on 3.6 and on the newest.
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Every flag set an objective launches, by name (the compile check builds each one).
_OFF = dict(FOCAL=False, HARD=False, MASK=False, RELEASED=False, POSITIVES=True, RULES=False,
            GUIDE=False, MARGIN=False, PRIOR=False, SOFT=False, TEACHER=False)
VARIANTS = {
    "infonce": dict(_OFF),
    "infonce-hard": dict(_OFF, HARD=True),
    "focal": dict(_OFF, FOCAL=True),
    "dclr-mask": dict(_OFF, MASK=True),
    # fastcl.contrastive's combinations (noise columns and the symmetric reverse add no flag)
    "focal-hard": dict(_OFF, FOCAL=True, HARD=True),
    "focal-mask": dict(_OFF, FOCAL=True, MASK=True),
    "hard-mask": dict(_OFF, HARD=True, MASK=True),
    "focal-hard-mask": dict(_OFF, FOCAL=True, HARD=True, MASK=True),
    "dclr-released": dict(_OFF, RELEASED=True),
    "dclr-released-mask": dict(_OFF, RELEASED=True, MASK=True),
    "noise": dict(_OFF, POSITIVES=False),
    # fastcl.layout's rules (MNRL's directions and hardness, duplicate ids), and GIST's
    # guide, on InfoNCE and focal
    "rules": dict(_OFF, RULES=True),
    "rules-guide": dict(_OFF, RULES=True, GUIDE=True),
    "focal-rules": dict(_OFF, FOCAL=True, RULES=True),
    "focal-rules-guide": dict(_OFF, FOCAL=True, RULES=True, GUIDE=True),
}


def _plus(name: str, flag: str) -> str:
    """The name of flag set ``name`` with one more flag, as the margin's and the prior's
    are named (``infonce`` and ``dclr-`` left out: ``hard-margin``, ``mask-margin-prior``)."""
    return "-".join(filter(None, (name.removeprefix("infonce").removeprefix("dclr-").strip("-"), flag)))


# the false-negative margin (a threshold per row, a test in the tile) on each of those
VARIANTS.update({_plus(name, "margin"): dict(VARIANTS[name], MARGIN=True) for name in (
    "infonce", "infonce-hard", "focal", "focal-hard", "dclr-mask", "focal-mask", "hard-mask",
    "focal-hard-mask", "rules", "rules-guide", "focal-rules", "focal-rules-guide")})
# the debiased row loss (the row kernel counts each row's kept others) on the one-softmax
# objectives, with and without the margin
VARIANTS.update({_plus(name, "prior"): dict(VARIANTS[name], PRIOR=True) for name in (
    "infonce", "infonce-hard", "focal", "dclr-mask", "rules", "rules-guide", "margin",
    "focal-margin", "hard-margin", "mask-margin", "rules-margin", "rules-guide-margin")})
# soft targets (label smoothing, labels) on each flag set above but the released DCLR's, the
# noise loss's and the debiased one's (the similarity kernel stores the cosines, as focal's
# does); beside the margin too (its drops leave the target's kept set)
_SOFT = [name for name, f in VARIANTS.items()
         if f["POSITIVES"] and not (f["RELEASED"] or f["PRIOR"])]
VARIANTS.update({f"{name}-soft": dict(VARIANTS[name], SOFT=True) for name in _SOFT})
# a teacher in the soft target (its cosines a second product in the guide's slots: not
# beside DCLR's mask or the guide) on those, with and without the margin
VARIANTS.update({f"{name}-teacher": dict(VARIANTS[name], SOFT=True, TEACHER=True)
                 for name in _SOFT if not (VARIANTS[name]["MASK"] or VARIANTS[name]["GUIDE"])})
#: The flags that make a variant.
FLAGS = tuple(_OFF)


def variant_name(f: dict) -> str | None:
    """The name in ``VARIANTS`` of these flags (None for a flag set no objective launches)."""
    f = {k: bool(f[k]) for k in FLAGS}
    return next((name for name, v in VARIANTS.items() if v == f), None)


#: The similarity tile's width is fixed (the partials are laid out by column tile). The
#: interpreter's launches are smaller (the tests' small shapes then cross several tiles);
#: tests/test_triton.py's ``gpu_tiles`` runs the GPU's ``GPU_*`` sizes in the interpreter too.
GPU_SIM_BLOCK_M = 128
SIM_BLOCK_M = 16 if INTERPRET else GPU_SIM_BLOCK_M

#: Autotune lists (BLOCK_R, BLOCK_D, num_warps, num_stages) with BLOCK_M = 128, by input kind
#: and whether the tile holds a second product (DCLR's mask, GIST's guide). The second
#: accumulator takes registers; exact fp32 products (no tensor cores) need thinner K steps.
SIM_CONFIGS = {
    ("16bit", False): [(128, 64, 8, 3), (128, 32, 8, 4), (64, 64, 8, 3)],
    ("16bit", True): [(64, 64, 8, 3), (64, 32, 8, 3)],
    ("fp32", False): [(64, 32, 8, 3), (32, 32, 8, 3)],
    ("fp32", True): [(64, 16, 8, 3), (32, 16, 8, 3)],
}
#: Where a target takes another list: sm_90 has the registers for the 128-row masked tile.
SIM_CONFIGS_BY_ARCH = {90: {("16bit", True): [(128, 64, 8, 3), (64, 64, 8, 3), (64, 32, 8, 3)]}}
#: The two middle 16-bit tiles, the list of most flag sets below.
_MID = [(64, 64, 8, 3), (64, 32, 8, 3)]
#: Where one flag set (a name in VARIANTS) needs its own list on one target, by (arch, input
#: kind, variant): the flag sets that hold the most beside the tile (focal's s beside E, the
#: layout's masks, the guide's second product) take smaller tiles there, the largest that
#: do not spill (``--sim-candidates`` reports what the others spill).
SIM_CONFIGS_BY_VARIANT = {
    **{(90, "16bit", v): _MID for v in ("focal-mask", "focal-hard-mask", "focal-rules",
                                         "rules-guide", "focal-rules-guide")},
    (80, "16bit", "focal-rules"): _MID,
    (90, "16bit", "focal-hard"): [(128, 32, 8, 4), (64, 64, 8, 3)],
    **{(arch, "16bit", "rules"): _MID[:1] for arch in (80, 90)},
    (90, "fp32", "focal"): [(64, 32, 8, 3)],
    (90, "fp32", "focal-hard"): [(32, 32, 8, 3)],
    (90, "fp32", "focal-hard-mask"): [(32, 16, 8, 3)],
    (80, "fp32", "focal-rules-guide"): [(64, 16, 8, 3)],
    # the margin's threshold and test beside the tile: its base's list, or a thinner K step
    **{(90, "16bit", v): _MID for v in ("focal-hard-mask-margin", "focal-margin", "focal-mask-margin",
                                         "focal-rules-margin", "rules-guide-margin",
                                         "focal-rules-guide-margin", "rules-guide-prior",
                                         "rules-guide-margin-prior")},
    (80, "16bit", "focal-rules-margin"): _MID,
    **{(arch, "16bit", "rules-margin"): _MID[:1] for arch in (80, 90)},
    (90, "16bit", "rules-margin-prior"): _MID[:1],
    # soft targets store the cosines (as focal does): the 128-row masked tile spills there
    (90, "16bit", "hard-mask-soft"): _MID,
    (80, "fp32", "rules-guide-soft"): [(32, 16, 8, 3)],
    # the guide's product beside the margin's or the prior's test, and the teacher's beside
    # the layout's masks: thinner tiles
    **{(arch, "fp32", v): [(32, 16, 8, 3)] for arch in (80, 90)
       for v in ("rules-guide-margin", "rules-guide-prior", "rules-guide-margin-prior")},
    **{(90, "16bit", v): _MID for v in ("rules-teacher", "focal-rules-teacher",
                                         "rules-margin-teacher", "focal-rules-margin-teacher")},
    (80, "fp32", "focal-rules-teacher"): [(32, 16, 8, 3)],
    # DCLR's mask and the margin's test, or the prior's row count, beside the stored cosines
    # (focal's, soft targets'): the 64-row fp32 tiles (the 32-row ones spill on sm_90)
    (90, "fp32", "mask-margin-soft"): [(64, 16, 8, 3)],
    (90, "fp32", "focal-prior"): [(64, 32, 8, 3)],
    (90, "fp32", "mask-margin-prior"): [(64, 16, 8, 3)],
}
#: Tritons before this version allocate registers less tightly: their code for these flag
#: sets spills in the tiles above (on the floor, 3.1: 16–240 bytes of spill stores and loads
#: in a 16-bit launch, where 3.6 and the newest need none), so such a Triton autotunes over
#: these lists instead (each spill-free there). A per-version list rather than smaller tiles
#: for every Triton: 3.6 and the newest keep their larger tiles.
OLDER_TRITON = (3, 6)
SIM_CONFIGS_OLDER_TRITON = {
    **{(90, "16bit", v): _MID for v in ("dclr-mask", "hard-mask", "dclr-released-mask")},
    **{(arch, "16bit", "rules-guide"): _MID[1:] for arch in (80, 90)},
    **{(arch, "16bit", "focal-rules-guide"): [(32, 64, 8, 3)] for arch in (80, 90)},
    # the false-negative margin and the debiased loss's flag sets
    **{(arch, "16bit", v): _MID for arch in (80, 90) for v in ("margin", "hard-margin")},
    **{(90, "16bit", v): _MID for v in ("mask-margin", "focal-mask-margin", "hard-mask-margin",
                                         "mask-margin-prior")},
    **{(arch, "16bit", "rules-prior"): _MID[:1] for arch in (80, 90)},
    **{(80, "16bit", v): _MID[:1] for v in ("rules-margin", "rules-margin-prior")},
    **{(arch, "16bit", v): [(32, 64, 8, 3)] for arch in (80, 90)
       for v in ("rules-guide-margin", "rules-guide-prior", "rules-guide-margin-prior",
                 "focal-rules-guide-margin")},
    # soft targets store the cosines beside the guide's product (as focal does); the
    # teacher's product beside the hard negative's weight and the margin
    **{(arch, "16bit", "rules-guide-soft"): [(32, 64, 8, 3)] for arch in (80, 90)},
    **{(90, "16bit", v): _MID for v in ("hard-margin-teacher", "focal-hard-margin-teacher")},
}

# A soft variant's similarity tile is its base's (SOFT is read by the row kernel only): its
# base's own lists, where the base has one and the soft variant none.
for _lists in (SIM_CONFIGS_BY_VARIANT, SIM_CONFIGS_OLDER_TRITON):
    _lists.update({(arch, kind, f"{name}-soft"): kept for (arch, kind, name), kept in list(_lists.items())
                   if f"{name}-soft" in VARIANTS and (arch, kind, f"{name}-soft") not in _lists})

#: What the compile check tries for the lists, (BLOCK_R, BLOCK_D, num_warps, num_stages) with
#: BLOCK_M = 128 (``--sim-candidates`` reports each one for the aligned launch).
SIM_CANDIDATES = {
    "16bit": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 4), (256, 64, 8, 3), (64, 64, 8, 3),
              (64, 32, 8, 3), (64, 16, 8, 4), (32, 64, 8, 3)],
    "fp32": [(64, 32, 8, 3), (64, 16, 8, 3), (32, 32, 8, 3), (32, 16, 8, 3)],
}

SIM_FIXED = {"BLOCK_R": 16, "BLOCK_D": 16}                # interpreter tiles (tl.dot needs ≥ 16)
GPU_ROW_BLOCK = {"BLOCK_N": 2048, "BLOCK_T": 256, "num_warps": 8}
GPU_FINISH_BLOCK = {"BLOCK_R": 32, "BLOCK_T": 128, "num_warps": 4}
ROW_BLOCK = {"BLOCK_N": 32, "BLOCK_T": 4} if INTERPRET else GPU_ROW_BLOCK


def row_block(f: dict) -> dict:
    """The row kernel's launch sizes for a flag set: soft targets beside the layout's rules
    or a teacher hold the most per column (the label ids, the rules' masks, the teacher's
    logits): a quarter of the columns a step beside the rules, an eighth with a teacher, whose
    cosines the gradient pass reads again (the widest steps that spill on no Triton from the
    floor to the newest)."""
    if INTERPRET or not (f.get("SOFT") and (f.get("RULES") or f.get("TEACHER"))):
        return ROW_BLOCK
    return dict(ROW_BLOCK, BLOCK_N=ROW_BLOCK["BLOCK_N"] // (8 if f.get("TEACHER") else 4))
FINISH_BLOCK = {"BLOCK_R": 4, "BLOCK_T": 4} if INTERPRET else GPU_FINISH_BLOCK


def vector_block(d: int) -> dict:
    """The launch sizes of the kernels that take one row of width ``d`` a program (the chain
    rule, the noise step): the whole row in one block, more warps past 1024."""
    import triton

    return {"BLOCK_D": triton.next_power_of_2(d),
            **({} if INTERPRET else {"num_warps": 4 if d <= 1024 else 8})}


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton."""
    import triton
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def second_product(f: dict) -> bool:
    """Whether the similarity tile holds a second product, and takes the lists for it: the
    complementary model's cosines (DCLR's mask), or the guide's or the teacher's, in the
    same slots."""
    return bool(f["MASK"] or f.get("GUIDE") or f.get("TEACHER"))


def sim_configs(f: dict, dtype, arch: int = 90, version: tuple | None = None) -> list[tuple]:
    """The similarity kernel's autotune list for these flags, input dtype (a torch dtype or
    its name), compute capability (90 for sm_90; an sm_80-class GPU uses 80) and Triton
    version (``(major, minor)``; the installed one by default)."""
    kind = "fp32" if str(dtype).replace("torch.", "") == "float32" else "16bit"
    arch = 80 if arch < 90 else 90
    name = variant_name(f)
    second = second_product(f)
    older = (version or triton_version()) < OLDER_TRITON
    return ((older and SIM_CONFIGS_OLDER_TRITON.get((arch, kind, name)))
            or SIM_CONFIGS_BY_VARIANT.get((arch, kind, name))
            or SIM_CONFIGS_BY_ARCH.get(arch, {}).get((kind, second))
            or SIM_CONFIGS[(kind, second)])


def autotune_pinned() -> bool:
    """``FASTCL_AUTOTUNE=0``: the first config of each list instead of autotuning (bounded
    compile time in tests on a GPU). Read at every call."""
    return os.environ.get("FASTCL_AUTOTUNE", "1") == "0"
