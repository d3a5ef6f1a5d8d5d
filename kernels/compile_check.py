"""Compile every kernel specialization fastcl can launch, for a CUDA target, without a GPU.

Triton's interpreter never runs the code generator, so a kernel can pass every interpreter
test and still fail to compile for a GPU. Triton's compiler needs no GPU: each kernel × flag
set × dtype × autotune config is built for ``sm_80`` / ``sm_90`` (``triton.compile`` of an
``ASTSource`` with a ``GPUTarget``) as a launch specializes it (``LAUNCHES``, ``_specialize``),
and ptxas (in the triton wheel) reports registers, spills and stack frame. What the default
run and each option compile, and why: docs/testing.md.

    python -m fastcl.kernels.compile_check --arch 80 90 --dtype bfloat16   # bf16, both targets
    python -m fastcl.kernels.compile_check --exhaustive --json report.json
    python -m fastcl.kernels.compile_check --sim-candidates   # what the lists are chosen from
    python -m fastcl.kernels.compile_check --arch 80 90 --dtype bfloat16 --variant margin-soft

Each run compiles into a fresh, private ``TRITON_CACHE_DIR`` (Triton's cache key does not
see every module global a kernel reads), without ``TRITON_INTERPRET=1``. What follows the TTIR
is a function of the TTIR, the target and the options alone: specializations whose TTIR is
the same (a flag a kernel does not read) are compiled once a run and share that result
(``Result.same_code_as``; ``_claim_ttir``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace

#: Triton's names for the dtypes fastcl's kernels take.
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ARCHS = (80, 90)
FLOAT_ARGS = {"inv_t", "focal_m", "hard_w", "phi", "scale", "inv_eps", "bound", "hard_beta",
              "lr", "eps", "smoothing", "teacher_inv_t", "distill_weight"}

#: The integer arguments of the launches compiled, by name (the kernels share their names),
#: and whether their buffers start on a 16-byte boundary. ``aligned``: the second chunk of
#: 4096 rows of an N = M = 32768, d = 768 step (256 column tiles of partials). ``unaligned``:
#: 1000 anchors of width 130 from a view one element in, with an anchor offset.
#: Without the layout's rules the launcher passes R_half = R and zeros for the other rule
#: integers; with them (RULES), those of a paired chunk of MNRL's four directions with
#: in-batch hardness: half the rows a side, the anchors block after the positives.
_NO_RULES = dict(anchor_base=0, n_neg=0, n_noise=0, rules=0)
#: ``rules`` of that chunk: each side sees the positives and the anchors (blocks 0 and 3),
#: MNRL's exclusions, in-batch hardness, paired rows in one softmax
RULES_ARGS = dict(vis0=9, vis1=9, exclude_own=True, hard_mode=1, paired=True, joint=True)
LAUNCHES = {
    "aligned": dict(aligned=True, R=4096, M=32768, D=768, DC=768, first_pos=4096, n_pos=32768,
                    T=256, n_ck=32768, R_half=4096, n_labels=32768, n_teacher=32768, **_NO_RULES),
    "unaligned": dict(aligned=False, R=1000, M=1000, D=130, DC=130, first_pos=1000,
                      n_pos=1000, T=8, n_ck=1000, R_half=1000, n_labels=1000, n_teacher=1000,
                      **_NO_RULES),
}


@dataclass
class Spec:
    """One specialization: a kernel, its constexprs, launch options and pointer dtypes."""

    kernel: str
    variant: str
    dtype: str
    arch: int
    constexprs: dict
    num_warps: int = 4
    num_stages: int = 3
    gemm_ptrs: tuple = ()         # pointer arguments in the GEMM dtype; the others are fp32
    out_ptrs: tuple = ()          # pointer arguments in the gradient's dtype (fp32 for fp16)
    candidate: bool = False       # a config tried for a list (--sim-candidates): spills reported
    launch: str = "aligned"       # the arguments it is specialized for (LAUNCHES)
    args: dict = field(default_factory=dict)  # integer arguments that differ from the launch's

    @property
    def name(self) -> str:
        """The kernel, its flag set's name and what else it is specialized for (the flags
        that name says left out)."""
        from .configs import FLAGS

        flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                         for k, v in self.constexprs.items() if k not in FLAGS)
        return (f"{self.kernel}[{self.variant}] {self.dtype} sm_{self.arch} "
                f"w{self.num_warps} s{self.num_stages} {flags}"
                + (" (candidate)" if self.candidate else "")
                + (f" ({self.launch})" if self.launch != "aligned" else "")
                + "".join(f" {k}={v}" for k, v in self.args.items()))


@dataclass
class Result:
    spec: Spec
    ok: bool
    error: str | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    shared_bytes: int | None = None
    async_copies: int = 0         # cp.async / TMA copies in the PTX: a pipelined K loop
    wide_pointers: list = field(default_factory=list)  # pointer args offset in int64
    seconds: float = 0.0
    log: list = field(default_factory=list)
    same_code_as: str | None = None   # a specialization of the run with the same TTIR: its result
    code: str | None = None           # the hash of the TTIR, the target and the options

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def failed(self) -> bool:
        """A compile error, or spills where they are not only reported (list candidates, and
        the launches other than the aligned one)."""
        return not self.ok or (self.spills > 0 and not self.spec.candidate
                               and self.spec.launch == "aligned")


#: The default run's dtype: every kernel and flag set on both targets (bf16, the dtype of
#: large-batch training: the bf16 check); the other dtypes on a covering set
#: (``--rest --pairwise``).
CHECK_DTYPE = "bfloat16"


def _sim_spec(variant, f, dtype, arch, store_exp, config, bounded=False, **kw) -> Spec:
    """One similarity-kernel specialization with ``config`` (BLOCK_R, BLOCK_D, num_warps,
    num_stages); ``bounded``: the bounded design (``logit_bound``), which stores E in the
    GEMM dtype."""
    from . import configs as cfg

    br, bd, warps, stages = config
    store_exp = store_exp or bounded
    return Spec("_similarity_kernel", variant, dtype, arch,
                dict(f, STORE_EXP=store_exp, BOUNDED=bounded, BLOCK_R=br,
                     BLOCK_M=cfg.SIM_BLOCK_M, BLOCK_D=bd),
                warps, stages, ("q_ptr", "k_ptr", "cq_ptr", "ck_ptr")
                + (("t_ptr",) if store_exp else ()), **kw)


def _sized(kernel, variant, dtype, arch, constexprs, block, **kw) -> Spec:
    """A specialization launched with ``block`` (``configs``' sizes, ``num_warps`` among them)."""
    sizes = {k: v for k, v in block.items() if k != "num_warps"}
    return Spec(kernel, variant, dtype, arch, dict(constexprs, **sizes),
                block.get("num_warps", 4), 3, **kw)


def modes(f: dict, dtype: str) -> list[tuple[bool, bool]]:
    """The (store_exp, bounded) modes the similarity kernel is launched in for a flag set
    and dtype: the bounded design where it can apply (``contrastive.bounded_design``), and
    the two-pass design's mode (where the bound is too wide, or it cannot apply)."""
    from . import contrastive as kc

    return ([(True, True)] if kc.bounded_design(f, dtype) else []) + [(kc.stores_exp(f), False)]


def candidates(archs=ARCHS, dtypes=None) -> list[Spec]:
    """Every config a list is chosen from (``SIM_CANDIDATES``), for every flag set, for the
    aligned launch, in each mode the objective is launched in (spills reported)."""
    from . import configs as cfg

    return [_sim_spec(variant, f, dtype, arch, exp, config, bounded, candidate=True)
            for arch in archs for dtype in dtypes or list(DTYPES)
            for variant, f in cfg.VARIANTS.items()
            for config in cfg.SIM_CANDIDATES["fp32" if dtype == "float32" else "16bit"]
            for exp, bounded in modes(f, dtype)]


def _launchable(arch: int, dtype: str) -> list[Spec]:
    """Every kernel and flag set on one target and dtype, aligned, with every config of the
    installed Triton's lists, each in every mode its objective is launched in."""
    from . import configs as cfg
    from . import contrastive as kc

    specs = []
    for variant, f in cfg.VARIANTS.items():
        exp = kc.stores_exp(f)
        specs += [_sim_spec(variant, f, dtype, arch, store, config, bounded)
                  for config in cfg.sim_configs(f, dtype, arch)
                  for store, bounded in modes(f, dtype)]
        specs += [_sized("_row_kernel", variant, dtype, arch,
                         dict(kc.row_flags(f), STORE_EXP=exp, WANT_GRAD=want_grad,
                              TILE_M=cfg.SIM_BLOCK_M), cfg.row_block(f),
                         gemm_ptrs=("g_ptr",) + (("t_ptr",) if exp else ()))
                  for want_grad in (True, False)]
    # the bounded design's rows: loss, 1/Z and the positive's coefficient from the partials
    bounds = dtype != "float16"
    specs += [_sized("_row_finish_kernel", f"positives={int(positives)}", dtype, arch,
                     dict(POSITIVES=positives), cfg.FINISH_BLOCK)
              for positives in (True, False) if bounds]
    # the chain rule through the normalization, at the widths of common encoders (dq
    # writes x̂ for the second GEMM when dk is wanted; a weight a row for dq, one scalar
    # for dk, a weight a row for dk in fp16; the bounded design's dq, with and without dk)
    for width in (384, 768, 1536, 4096):
        block = cfg.vector_block(width)
        for x_hat, scale_stride, bound in ((True, 1, False), (False, 1, False), (False, 0, False)) + (
                ((True, 1, True), (False, 1, True)) if bounds else ()):
            specs.append(_sized("_tangent_kernel", f"d={width}", dtype, arch,
                                dict(WRITE_X_HAT=x_hat, BOUNDED=bound), block,
                                gemm_ptrs=("x_ptr", "x_hat_ptr", "k_ptr"),
                                out_ptrs=("out_ptr",) + (() if bound else ("dk_ptr",)),
                                args={"D": width, "scale_stride": scale_stride}))
        # DCLR's noise step: the keys in the GEMM dtype, the accumulator and Z in fp32+
        specs += [_sized("_noise_step_kernel", f"d={width}", dtype, arch,
                         dict(RELEASED=released), block, gemm_ptrs=("x_ptr",),
                         args={"D": width}) for released in (False, True)]
    return specs


def specializations(archs=ARCHS, dtypes=None, rest: bool = False,
                    exhaustive: bool = False) -> list[Spec]:
    """What fastcl can launch (``_launchable``) on ``archs`` in ``CHECK_DTYPE``, the bf16
    check (``rest``: the other dtypes, unaligned in the first config of each list;
    ``dtypes``: these), aligned and unaligned. Unless ``exhaustive`` (or
    ``rest``), the aligned launches are ``first_configs`` plus each config of each list once
    on each target, and the unaligned ones a covering set of strength 2 by flag
    (``pairwise``; docs/testing.md)."""
    if dtypes is None and not rest:
        dtypes = [CHECK_DTYPE]
    specs = [s for arch in archs for dtype in dtypes or DTYPES
             if not (rest and dtype == CHECK_DTYPE) for s in _launchable(arch, dtype)]
    # the launches again for odd sizes and unaligned views: they must compile too (the
    # chain rule at the unaligned launch's own width)
    mirror = [replace(s, launch="unaligned", args={k: v for k, v in s.args.items() if k != "D"})
              for s in specs if s.args.get("D", 768) == 768]
    if rest:
        return specs + first_configs(mirror)
    aligned = specs
    if not exhaustive:
        # every flag set and mode in the first config of its list (the largest tile, the
        # likeliest to spill), and each config of each list at least once on each target
        # (the full product: the slow test, --exhaustive)
        aligned = first_configs(specs)
        aligned += [s for s in pairwise(specs, configs=True) if s not in aligned]
    return aligned + (mirror if exhaustive else pairwise(first_configs(mirror), by_flag=True))


#: Integer arguments that take the value of another one in every launch.
SAME_AS = {"stride_q": "D", "stride_k": "D", "stride_u": "D", "stride_x": "D", "stride_out": "D",
           "stride_x_hat": "D", "stride_dk": "D", "stride_z": "D", "stride_cq": "DC", "stride_ck": "DC", "stride_t": "M",
           "stride_g": "M", "stride_s": "M", "stride_part": "T"}


# --- What differs between the Tritons fastcl supports (3.1 … the newest) --------------------
# Every version difference the check meets is handled here, next to the functions that need it:
# how a launch marks an argument (``_launch_specialization``), how ``ASTSource`` takes the
# signature, the constants and the marks (``_ast_source``), and how ptxas's report is read
# (``_ptxas_log``).


def _specialize_impl():
    """Triton's own launch-time function for one argument, as ``value -> (type, key)``, where
    the installed Triton exposes one: ``native_specialize_impl`` (3.6+), the Python
    ``specialize_impl`` (3.3–3.5), ``mangle_type`` with ``compute_spec_key`` (3.1, 3.2: key
    ``"D"``, ``"1"`` or ``"N"``)."""
    import triton.runtime.jit as jit
    from triton.backends.compiler import BaseBackend

    if hasattr(jit, "native_specialize_impl"):                       # 3.6+
        return lambda v: jit.native_specialize_impl(BaseBackend, v, False, True, True)[:2]
    make = getattr(jit, "create_specialize_impl", None)
    if make is not None:
        extra = BaseBackend.get_arg_specialization
        import inspect
        if inspect.signature(make).parameters:                        # 3.4, 3.5
            impl = make(extra)
            return lambda v: impl(v, False, True, True)[:2]
        impl = make()                                                 # 3.3
        return lambda v: impl(v, extra, False, True, True)[:2]
    if hasattr(jit, "mangle_type"):
        if hasattr(BaseBackend, "compute_spec_key"):                  # 3.2: the backend's
            from triton.backends.compiler import AttrsDescriptor
            key = lambda v: AttrsDescriptor.get_property_key(v, True)  # noqa: E731
        else:                                                         # 3.1
            key = getattr(jit, "compute_spec_key", None)
        if key is not None:
            return lambda v: (jit.mangle_type(v), key(v))
    raise RuntimeError("compile_check: no launch-time specialization found in this Triton")


def _launch_specialization(value):
    """What a launch makes of one argument, by Triton's own function: ``(type, "D" | "")``
    or ``("constexpr", 1)`` (Triton 3.1 and 3.2 key an integer equal to 1 ``"1"`` and make it
    a constant in the launch: the same thing)."""
    kind, mark = _specialize_impl()(value)
    if mark == "1" and kind in ("i32", "i64"):          # 3.1, 3.2: equal to 1
        return "constexpr", 1
    if kind == "constexpr":
        return kind, mark
    return kind, "D" if mark == "D" else ""


def _parse_attr(mark: str) -> list:
    """The attribute a mark gives (``[["tt.divisibility", 16]]`` for ``"D"``): the backend's
    ``parse_attr`` (3.3+), the same rule before it."""
    from triton.backends.compiler import BaseBackend

    if hasattr(BaseBackend, "parse_attr"):
        return BaseBackend.parse_attr(mark)
    return [["tt.divisibility", 16]] if "D" in mark else []


def _ast_source(fn, sig: dict, constexprs: dict, attrs: dict):
    """``ASTSource`` of what ``_specialize`` gives (the 3.3+ form: every argument in ``sig``,
    ``"constexpr"`` for the constexprs and the integers equal to 1; the marks keyed by
    ``(index,)``), in the form the installed Triton takes, as its launcher builds it. Before
    3.3 (``AttrsDescriptor``): the signature holds the runtime arguments alone, by name, an
    integer equal to 1 among them as ``i32`` and in the constants too; the marks are sets of
    indices, ``equal_to_1`` among them."""
    from triton.compiler import ASTSource

    try:
        from triton.backends.compiler import AttrsDescriptor          # 3.2
    except ImportError:
        try:
            from triton.compiler.compiler import AttrsDescriptor      # 3.1
        except ImportError:
            AttrsDescriptor = None                                    # 3.3+
    if AttrsDescriptor is None:
        return ASTSource(fn, sig, constexprs, attrs)
    ones = [i for i, name in enumerate(fn.arg_names)
            if sig[name] == "constexpr" and i not in fn.constexprs]
    signature = {name: "i32" if i in ones else kind for i, (name, kind) in enumerate(sig.items())
                 if kind != "constexpr" or i in ones}
    divisible = sorted(i for (i,), value in attrs.items() if ["tt.divisibility", 16] in value)
    if hasattr(AttrsDescriptor, "from_hints"):                        # 3.2
        hints = {i: 16 for i in divisible} | {i: 1 for i in ones}
        descriptor = AttrsDescriptor.from_hints(hints)
    else:                                                             # 3.1
        descriptor = AttrsDescriptor(divisible_by_16=set(divisible), equal_to_1=set(ones))
    return ASTSource(fn, signature, dict(constexprs), descriptor)


def first_configs(specs: list[Spec]) -> list[Spec]:
    """``specs`` with one config of each similarity list: the first (the largest tile, the
    likeliest to spill), for every kernel, flag set, mode and launch; the other
    kernels whole (the other dtypes in ``tests/test_compile.py``)."""
    seen, kept = set(), []
    for s in specs:
        tile = {k: v for k, v in s.constexprs.items() if k not in ("BLOCK_R", "BLOCK_D")}
        key = (s.kernel, s.variant, s.dtype, s.arch, s.launch, tuple(sorted(tile.items())),
               tuple(sorted(s.args.items())))
        if s.kernel != "_similarity_kernel" or key not in seen:
            seen.add(key)
            kept.append(s)
    return kept


def _int_args(spec: Spec) -> dict:
    from . import configs as cfg
    from . import contrastive as kc

    values = {k: v for k, v in LAUNCHES[spec.launch].items() if k != "aligned"}
    if spec.constexprs.get("RULES"):
        values.update(rules=kc.pack_rules(**RULES_ARGS), R_half=values["R"] // 2,
                      anchor_base=values["first_pos"])
    alone = spec.kernel == "_similarity_kernel" and not cfg.second_product(spec.constexprs)
    if alone:
        values["DC"] = values["n_ck"] = 0  # the launcher passes no complementary width
    values.update(spec.args)
    values.setdefault("scale_stride", 1)   # one weight a row (0: one scalar for all)
    for name, source in SAME_AS.items():
        values.setdefault(name, values[source])
    if alone:
        values["stride_cq"] = values["stride_ck"] = values["D"]   # q and keys stand in
    return values


def _specialize(fn, spec: Spec):
    """``(signature, constexprs, attrs)`` of ``fn`` as a launch with ``spec.launch``'s
    arguments builds them: pointer dtypes from the spec, the flags packed as the launcher
    packs them, the divisibility marks and the integers equal to 1 from what the launch
    would pass."""
    import torch

    from . import contrastive as kc

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "i64": torch.int64}
    aligned = LAUNCHES[spec.launch]["aligned"]
    ints = _int_args(spec)
    sig, constexprs, attrs = {}, kc.kernel_constexprs(fn, spec.constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            out_dtype = "fp32" if spec.dtype == "float16" else DTYPES[spec.dtype]
            kind = (DTYPES[spec.dtype] if name in spec.gemm_ptrs else
                    out_dtype if name in spec.out_ptrs else
                    "i64" if name.endswith("_ids_ptr") else "fp32")   # duplicate ids
            sig[name] = "*" + kind
            # a buffer at a 16-byte boundary, or one element past it
            mark = _launch_specialization(torch.empty(16, dtype=torch_dtype[kind])[0 if aligned else 1:])[1]
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
            continue
        else:
            kind, mark = _launch_specialization(ints[name])
            if kind == "constexpr":
                sig[name], constexprs[name] = "constexpr", mark
                continue
            sig[name] = "i32"
        if mark:
            attrs[(i,)] = _parse_attr(mark)
    return sig, constexprs, attrs


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _run_ptxas(ptx_text: str, arch: int, fmad: bool = True) -> tuple[bytes, str]:
    """The wheel's own ptxas with ``-v`` on ``ptx_text``, with the flags Triton gives it (line
    info unless ``TRITON_DISABLE_LINE_INFO``, the target's ``sm_90a`` name, fused
    multiply-adds as ``fmad``): ``(cubin, its report)``."""
    import subprocess

    from triton.backends.nvidia import compiler as nv

    if hasattr(nv, "get_ptxas"):
        import inspect
        tool = nv.get_ptxas(arch) if inspect.signature(nv.get_ptxas).parameters else nv.get_ptxas()
        ptxas = tool.path if hasattr(tool, "path") else tool[0]          # 3.4+ | 3.3
    else:                                                                 # 3.1, 3.2
        ptxas = nv._path_to_binary("ptxas")[0]
    name = (nv.sm_arch_from_capability(arch) if hasattr(nv, "sm_arch_from_capability")
            else f"sm_{arch}{'a' if arch == 90 else ''}")
    flags = ([] if os.environ.get("TRITON_DISABLE_LINE_INFO") else ["-lineinfo"]) + (
        [] if fmad else ["--fmad=false"])
    with tempfile.TemporaryDirectory(prefix="fastcl-ptxas-") as tmp:
        ptx, cubin = os.path.join(tmp, "kernel.ptx"), os.path.join(tmp, "kernel.cubin")
        with open(ptx, "w") as f:
            f.write(ptx_text)
        proc = subprocess.run([ptxas, *flags, "-v", f"--gpu-name={name}", ptx, "-o", cubin],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"`ptxas` failed with error code {proc.returncode}: \n{proc.stderr}")
        with open(cubin, "rb") as f:
            return f.read(), proc.stdout + proc.stderr


def _ptxas_log(kernel, arch: int, printed: str) -> str:
    """ptxas's ``-v`` report of ``kernel``: what the compile printed where the installed Triton
    prints it (``TRITON_DUMP_PTXAS_LOG``, 3.5+; on 3.1, ``_hook_stages``'s cubin stage), else
    the wheel's own ptxas run again with ``-v`` on the kernel's PTX (``_run_ptxas``)."""
    if _PTXAS["registers"].search(printed):
        return printed
    return printed + _run_ptxas(kernel.asm["ptx"], arch)[1]


_WIDE_ADDPTR = re.compile(r"tt\.addptr %(\w+_ptr), %[\w.#]+ : !tt\.ptr<\w+>, i64")
_SPLAT = re.compile(r"%([\w.#]+) = tt\.splat %(\w+_ptr) :")
_WIDE_TENSOR = re.compile(r"tt\.addptr %([\w.#]+), %[\w.#]+ : tensor<[\dx]+x!tt\.ptr<\w+>>, "
                          r"tensor<[\dx]+xi64>")


def _named_ttir(ttir: str, names: list) -> str:
    """The TTIR with the kernel's arguments under their own names: Triton before 3.5 prints
    them ``%arg0``, ``%arg1`` … (in the order of the runtime arguments; the block arguments
    of the loops inside take the numbers after them)."""
    if re.search(r"tt\.func public @\w+\(%arg0\b", ttir) is None:
        return ttir
    return re.sub(r"%arg(\d+)\b",
                  lambda m: f"%{names[int(m.group(1))]}" if int(m.group(1)) < len(names)
                  else m.group(0), ttir)


class SameCode(Exception):
    """Raised at the TTIR stage of a specialization whose TTIR (with the target and the
    options) another compile of the run has claimed: what follows would be the same."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


#: The folder in which a run's compiles claim their TTIR's hash (``_compile_part``), the hash
#: the compile in progress claimed, and its ptxas report where ``_hook_stages`` ran ptxas.
_CLAIMS: dict = {"folder": None, "code": None, "ptxas": None}


def _claim_ttir(module, target, options) -> None:
    """Claim this TTIR for the compile in progress, or raise ``SameCode``: one file a hash,
    created exclusively, so that the processes of a run compile each TTIR once."""
    import hashlib

    folder = _CLAIMS["folder"]
    if folder is None:
        return
    code = hashlib.sha256(f"{target!r}\n{options!r}\n{module}".encode()).hexdigest()[:32]
    try:
        os.close(os.open(os.path.join(folder, code), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        raise SameCode(code) from None
    _CLAIMS["code"] = code


def _hook_stages() -> None:
    """Put ``_claim_ttir`` after the CUDA backend's TTIR stage; on Triton 3.1, which keeps
    ptxas's ``-v`` report to itself, make its cubin stage the same ptxas command with the
    report kept (``_run_ptxas``: 3.1's own flags), so that ptxas runs once (once a process)."""
    from triton.backends import backends

    from . import configs as cfg

    # the class triton.compile builds (Triton 3.1 loads it under another module's name)
    CUDABackend = backends["nvidia"].compiler
    add_stages = CUDABackend.add_stages
    if getattr(add_stages, "fastcl_hooks", False):
        return
    keeps_report = cfg.triton_version() < (3, 2)

    def with_hooks(self, stages, options, *rest):
        add_stages(self, stages, options, *rest)
        make_ttir = stages.get("ttir")
        if make_ttir is not None:
            def ttir(src, metadata):
                module = make_ttir(src, metadata)
                _claim_ttir(module, self.target, options)
                return module
            stages["ttir"] = ttir
        if keeps_report and "cubin" in stages:
            def cubin(ptx, metadata):
                data, _CLAIMS["ptxas"] = _run_ptxas(ptx, self.target.arch,
                                                    options.enable_fp_fusion)
                return data
            stages["cubin"] = cubin

    with_hooks.fastcl_hooks = True
    CUDABackend.add_stages = with_hooks


def compile_one(spec: Spec) -> Result:
    """Compile one specialization and read ptxas's resource report (in a run of
    several: ``same_code_as`` set later where its TTIR was another's)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from . import contrastive as kc

    fn = getattr(kc, spec.kernel)
    start = time.perf_counter()
    out = io.StringIO()
    _CLAIMS["code"] = _CLAIMS["ptxas"] = None
    try:
        sig, constexprs, attrs = _specialize(fn, spec)
        src = _ast_source(fn, sig, constexprs, attrs)
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(src, target=GPUTarget("cuda", spec.arch, 32),
                                    options={"num_warps": spec.num_warps,
                                             "num_stages": spec.num_stages})
        log = _ptxas_log(kernel, spec.arch, out.getvalue() + (_CLAIMS["ptxas"] or ""))
    except SameCode as same:       # resolved by ``run`` from the result of the claim
        return Result(spec, True, code=same.code, same_code_as="?",
                      seconds=time.perf_counter() - start)
    except Exception as exc:       # a compile error is the result, not a crash of the check
        lines = [line for line in str(exc).splitlines() if line.strip()]
        cause = exc.__cause__
        while cause is not None:   # Triton wraps the real message (e.g. a NameError)
            lines.append(f"{type(cause).__name__}: {cause}".splitlines()[0])
            cause = cause.__cause__
        return Result(spec, False, error="\n".join(lines[-6:])[:1500], code=_CLAIMS["code"],
                      seconds=time.perf_counter() - start)
    values = {k: int(m.group(1)) if (m := rx.search(log)) else None for k, rx in _PTXAS.items()}
    shared = getattr(kernel.metadata, "shared", None)
    ptx = kernel.asm.get("ptx", "")
    copies = ptx.count("cp.async.cg") + ptx.count("cp.async.ca") + ptx.count("cp.async.bulk")
    # which buffers are addressed with an int64 offset (R·M or M·d can pass 2³¹)
    ttir = _named_ttir(kernel.asm.get("ttir", ""), [n for n, t in sig.items() if t != "constexpr"])
    wide = set(_WIDE_ADDPTR.findall(ttir))
    splats = {}                    # SSA names repeat across regions: the latest one, in order
    for line in ttir.splitlines():
        splats.update(_SPLAT.findall(line))
        wide.update(splats[v] for v in _WIDE_TENSOR.findall(line) if v in splats)
    wide = sorted(wide)
    return Result(spec, True, shared_bytes=shared, wide_pointers=wide, async_copies=copies,
                  seconds=time.perf_counter() - start, code=_CLAIMS["code"],
                  log=[line.strip() for line in log.splitlines() if "bytes" in line or "Used" in line],
                  **values)


#: What a specialization varies in besides its kernel, for ``pairwise``: the flag set (the
#: width for the chain rule; ``by_flag``: each flag of it, a factor of its own), the dtype and
#: the arch, and for the similarity kernel the config list they choose (16-bit or fp32, on
#: sm_80 or sm_90: the tiles, hence the registers and shared memory, differ), the launch, the
#: mode (the similarity kernel's (STORE_EXP, BOUNDED), the row kernel's WANT_GRAD, the chain
#: rule's (WRITE_X_HAT, BOUNDED, scale_stride)).
def _factors(spec: Spec, by_flag: bool = False) -> dict:
    from .configs import FLAGS

    c = spec.constexprs
    mode = (c.get("STORE_EXP"), c.get("BOUNDED"), c.get("WANT_GRAD"), c.get("WRITE_X_HAT"),
            spec.args.get("scale_stride"))
    flags = {k: c[k] for k in FLAGS if k in c} if by_flag else {}
    out = dict(flags or {"flags": spec.variant}, dtype=spec.dtype, arch=spec.arch,
               launch=spec.launch, mode=mode)
    if spec.kernel == "_similarity_kernel":
        out["list"] = ("fp32" if spec.dtype == "float32" else "16bit", spec.arch)
    return out


def _pairs(spec: Spec, configs: bool = False, by_flag: bool = False) -> set:
    """The pairs of factor values ``spec`` compiles (see ``pairwise``), and its flag set on
    its target (unless ``by_flag``)."""
    import itertools

    f = _factors(spec, by_flag)
    items = sorted((k, repr(v)) for k, v in f.items())
    out = {(spec.kernel,) + a + b for a, b in itertools.combinations(items, 2)}
    if not by_flag:
        out.add((spec.kernel, "target", f["flags"], f["dtype"], f["arch"]))
    if configs:
        c = spec.constexprs
        out.add((spec.kernel, "config", f["dtype"], f["arch"], c.get("BLOCK_R"),
                 c.get("BLOCK_D"), spec.num_warps, spec.num_stages))
    return out


def pairwise(specs: list[Spec], configs: bool = False, by_flag: bool = False) -> list[Spec]:
    """A subset of ``specs`` in which, for each kernel, every pair of factor values
    (``_factors``: flag set, dtype, arch, launch, mode, the similarity kernel's config list)
    that some specialization of ``specs`` has is compiled at least once, and each flag set on
    each target; with ``configs``, each config on each target too. ``by_flag``: each flag a
    factor of its own, not the flag set (each flag, on and off, with each value of the other
    factors and with each other flag: a covering set of strength 2 over the flags, where a
    flag set's code is compiled whole anyway; no flag set asked for on each target).
    Greedy and deterministic: the earliest specialization that covers the most pairs not
    yet covered, in the order of ``specs``."""
    covers = [_pairs(s, configs, by_flag) for s in specs]
    need = set().union(*covers) if covers else set()
    chosen = set()
    while need:
        best = max(range(len(specs)), key=lambda i: (len(covers[i] & need), -i))
        chosen.add(best)
        need -= covers[best]
    return [s for i, s in enumerate(specs) if i in chosen]


def _prepare_environment(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    # every compile runs its stages (a cached kernel skips the TTIR stage, where the claims are)
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    # ptxas's -v report on stdout (Triton 3.5+; before it, _ptxas_log runs ptxas again)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    # the runtime default, said aloud (_ptxas_log's own ptxas run keeps it: no --fmad=false)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_part(cache_dir: str, specs: list[Spec]) -> list[Result]:
    """Compile ``specs`` in this process, claiming each TTIR in ``cache_dir``'s claims."""
    _prepare_environment(cache_dir)
    _CLAIMS["folder"] = os.path.join(cache_dir, "fastcl-ttir-claims")
    os.makedirs(_CLAIMS["folder"], exist_ok=True)
    _hook_stages()
    try:
        return [compile_one(s) for s in specs]
    finally:
        _CLAIMS["folder"] = None


def run(specs: list[Spec], jobs: int = 1) -> list[Result]:
    """Compile ``specs`` in ``jobs`` processes, in a fresh private Triton cache, each TTIR
    once: a result whose TTIR another compile claimed is that compile's (ok, error,
    registers, spills …) under its own spec, ``same_code_as`` naming the other."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and "fastcl.kernels.contrastive" in sys.modules:
        raise RuntimeError("compile_check needs the jitted kernels: run it in a process "
                           "without TRITON_INTERPRET=1")
    # flag sets that launch the same specialization (a flag the kernel is not passed: the
    # row kernel's GUIDE, MASK, MARGIN) compile it once, without even a TTIR of their own
    owners = {}
    for s in specs:
        owners.setdefault(_same_launch(s), s)
    unique, jobs = list(owners.values()), max(jobs, 1)
    parts = [unique[i::jobs] for i in range(jobs)]
    with tempfile.TemporaryDirectory(prefix="fastcl-triton-cache-") as cache:
        if jobs == 1:
            done = [_compile_part(cache, unique)]
        else:
            with ProcessPoolExecutor(jobs) as pool:
                done = list(pool.map(_compile_part, [cache] * jobs, parts))
    results = [None] * len(unique)
    for i, part in enumerate(done):        # back in the order of ``unique``
        results[i::jobs] = part
    claimed = {r.code: r for r in results if r.code is not None and r.same_code_as is None}
    for i, r in enumerate(results):
        if r.same_code_as is not None:
            owner = claimed[r.code]
            results[i] = replace(owner, spec=r.spec, seconds=r.seconds, same_code_as=owner.spec.name)
    by_launch = dict(zip(owners, results))
    return [r if owners[key] is s else replace(r, spec=s, seconds=0.0,
                                               same_code_as=r.same_code_as or r.spec.name)
            for s in specs for key in [_same_launch(s)] for r in [by_launch[key]]]


def _same_launch(spec: Spec) -> str:
    """What a specialization compiles from: all of it but the flag set's name."""
    return repr(replace(spec, variant=""))


def report(results: list[Result]) -> str:
    """The table of ``results`` and a summary line."""
    lines = [f"{'specialization':<100} {'regs':>5} {'spill':>6} {'stack':>6} {'smem':>7} "
             f"{'async':>5}  result"]
    for r in results:
        status = ("ERROR" if not r.ok else "SPILLS" if r.failed else
                  "ok (spills reported)" if r.spills else "ok")
        lines.append(f"{r.spec.name:<100} {r.registers if r.registers is not None else '-':>5} "
                     f"{r.spills:>6} {r.stack_frame if r.stack_frame is not None else '-':>6} "
                     f"{r.shared_bytes if r.shared_bytes is not None else '-':>7} "
                     f"{r.async_copies:>5}  {status}")
        if r.same_code_as:
            lines.append(f"    (the TTIR of {r.same_code_as}: its result)")
        if r.error:
            lines += ["    " + line for line in r.error.splitlines()]
    shared = sum(r.same_code_as is not None for r in results)
    lines.append(f"{len(results)} specializations ({len(results) - shared} compiled, {shared} "
                 f"the same TTIR as one of them), {sum(r.failed for r in results)} failed, "
                 f"{sum(r.seconds for r in results):.0f} s of compiling")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .configs import VARIANTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rest", action="store_true", help="the full matrix less the default subset")
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None)
    p.add_argument("--variant", nargs="+", default=None,
                   help="only these flag sets (names in configs.VARIANTS), each config and mode "
                        "of their lists (the covering subsets are chosen over every flag set)")
    p.add_argument("--first-config", action="store_true",
                   help="only the first config of each similarity list")
    p.add_argument("--pairwise", action="store_true",
                   help="only a subset that compiles every pair of flag, dtype, target, launch "
                        "and mode values at least once, and each config on each target (after "
                        "--first-config: the first)")
    p.add_argument("--exhaustive", action="store_true",
                   help="the default subset in full: every config with every flag set, every "
                        "config and mode of the unaligned launches (by default covering "
                        "subsets, compile_check.pairwise)")
    p.add_argument("--sim-candidates", action="store_true",
                   help="only every config the similarity kernel's lists are chosen from "
                        "(SIM_CANDIDATES), spills reported, not failed")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    unknown = [v for v in args.variant or () if v not in VARIANTS]
    if unknown:
        p.error(f"--variant: {', '.join(unknown)} not in configs.VARIANTS")
    # (--first-config, --pairwise, --variant: their own subsets of all of it)
    specs = (candidates(tuple(args.arch), args.dtype) if args.sim_candidates else
             specializations(tuple(args.arch), args.dtype, args.rest, args.exhaustive
                             or args.first_config or args.pairwise or bool(args.variant)))
    if args.variant:
        specs = [s for s in specs if s.variant in args.variant]
    if args.first_config:
        specs = first_configs(specs)
    if args.pairwise:
        specs = pairwise(specs, configs=not args.first_config, by_flag=True)
    results = run(specs, args.jobs)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: v for k, v in asdict(r).items() if k != "spec"},
                        "spec": asdict(r.spec), "name": r.spec.name, "failed": r.failed}
                       for r in results], f, indent=1)
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
