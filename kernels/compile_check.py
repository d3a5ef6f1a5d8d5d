"""Compile every kernel specialization fastcl can launch, for a CUDA target, without a GPU.

Triton's interpreter never runs the code generator, so a kernel can pass every interpreter
test and still fail to compile for a GPU. Triton's compiler itself needs no GPU: this
module builds each kernel × flag set × dtype × autotune config for ``sm_80`` / ``sm_90``
from its source (``triton.compile`` of an ``ASTSource`` with a ``GPUTarget``), runs ptxas
(shipped in the triton wheel) and reads its report: registers, spill bytes, stack frame.

Each specialization is compiled as a launch would build it. Triton specializes a kernel on its
arguments when it is launched: a pointer whose address is a multiple of 16 and an integer
that is a multiple of 16 are marked divisible by 16 (which lets the loads vectorize and the
K loop pipeline through asynchronous copies), an integer equal to 1 becomes a constant. A
compile without those facts is another kernel (on sm_90 the 128×128×64 similarity tile
loses its pipeline and spills 224 bytes without them, and has neither problem with them).
So every specialization names a launch (``LAUNCHES``): ``aligned``, the arguments of a
large-batch step (N = M = 32768, d = 768, chunks of 3072 rows; every buffer 16-byte
aligned), for which fastcl's kept configs must compile without spills; ``unaligned``, odd
sizes and views at an odd offset (no argument divisible by 16), which must compile, their
spills reported (the autotuner times every config at the shape it is given); ``odd``, for
the descriptor designs (which take only aligned buffers), odd sizes alone. The marks are
made by Triton's own launch-time function where the installed Triton exposes it.

    python -m fastcl.kernels.compile_check                # the representative subset
    python -m fastcl.kernels.compile_check --full --json report.json
    python -m fastcl.kernels.compile_check --sim-candidates   # what the lists are chosen from

A specialization fails on a compile error, or on register spills in a config that fastcl
keeps, for the aligned launch (``--allow-spills`` reports them only). What only an earlier
design launches (``FASTCL_LEGACY``: the first design's config list, the lists before the
current ones, the first design's epilogue mode) is kept for timing comparisons: it must
compile, its spills are reported but do not fail. The report's ``async`` column counts the
asynchronous copies (cp.async, TMA) in the PTX: a pipelined K loop has them. Each run
compiles into a fresh, private ``TRITON_CACHE_DIR``: Triton's cache key does not see every
module global a kernel reads, so a cached build of a fixed kernel could make a broken one
look fine. It must run without ``TRITON_INTERPRET=1``
(the interpreter replaces the jitted functions this needs).
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
FLOAT_ARGS = {"inv_t", "focal_m", "hard_w", "phi", "scale", "inv_eps"}

#: The integer arguments of the launches compiled, by name (the kernels share their names),
#: and whether their buffers start on a 16-byte boundary. ``aligned``: the second chunk of
#: 3072 rows of an N = M = 32768, d = 768 step (256 column tiles of partials). ``unaligned``:
#: 1000 anchors of width 130 from a view one element in, with an anchor offset (the default
#: design: the descriptor designs refuse such inputs). ``odd``: 1000 anchors of width 768,
#: aligned buffers (what the descriptor designs take with sizes not divisible by 16).
LAUNCHES = {
    "aligned": dict(aligned=True, R=3072, M=32768, D=768, DC=768, first_pos=3072, n_pos=32768,
                    T=256),
    "unaligned": dict(aligned=False, R=1000, M=1000, D=130, DC=130, first_pos=1000,
                      n_pos=1000, T=8),
    "odd": dict(aligned=True, R=1000, M=1000, D=768, DC=768, first_pos=1000, n_pos=1000, T=8),
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
    legacy: bool = False          # launched only by an earlier design (FASTCL_LEGACY): timed, spills reported
    candidate: bool = False       # a config tried for a list (--sim-candidates): spills reported
    launch: str = "aligned"       # the arguments it is specialized for (LAUNCHES)
    args: dict = field(default_factory=dict)  # integer arguments that differ from the launch's

    @property
    def name(self) -> str:
        desc = self.constexprs.get("DESC")
        flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                         for k, v in self.constexprs.items()
                         if k not in ("FOCAL", "HARD", "MASK", "RELEASED", "POSITIVES", "PREC", "DESC",
                                      "PERSISTENT")
                         and (k != "GROUP_R" or desc))
        return (f"{self.kernel}[{self.variant}] {self.dtype} sm_{self.arch} "
                f"w{self.num_warps} s{self.num_stages} {flags}"
                + (" persistent" if self.constexprs.get("PERSISTENT") else " descriptor" if desc else "")
                + (" (legacy)" if self.legacy else "") + (" (candidate)" if self.candidate else "")
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

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def spills_allowed(self) -> bool:
        """Spills reported, not failed: what only earlier designs launch, list candidates, and
        the launches other than the aligned one."""
        return self.spec.legacy or self.spec.candidate or self.spec.launch != "aligned"

    @property
    def failed(self) -> bool:
        return not self.ok or (self.spills > 0 and not self.spills_allowed)


#: The representative subset: every kernel and flag set, on these (arch, dtype) pairs.
SUBSET = ((90, "bfloat16"), (80, "float32"))


def _sim_spec(kc, variant, f, dtype, arch, prec, store_exp, config, persistent=False,
              **kw) -> Spec:
    """One similarity-kernel specialization: a 4-tuple config is the default design, a
    5-tuple (GROUP_R last) the descriptor design (FASTCL_SIM=descriptor), or with
    ``persistent`` its persistent form (FASTCL_SIM=persistent)."""
    br, bd, warps, stages = config[:4]
    desc = len(config) > 4
    return Spec("_similarity_kernel", variant, dtype, arch,
                dict(f, STORE_EXP=store_exp, PREC=prec, BLOCK_R=br, BLOCK_M=kc.SIM_BLOCK_M,
                     BLOCK_D=bd, DESC=desc, GROUP_R=config[4] if desc else 1,
                     PERSISTENT=bool(persistent)),
                warps, stages, ("q_ptr", "k_ptr", "cq_ptr", "ck_ptr")
                + (("t_ptr",) if store_exp else ()), **kw)


def candidates(archs=ARCHS, dtypes=None, design=None) -> list[Spec]:
    """Every config a list is chosen from, for every flag set, for the aligned launch (spills
    reported): the default design's (``SIM_CANDIDATES``) in both modes it is launched in (the
    mode the objective stores, and fp32 cosines for the first design's epilogue), the
    descriptor design's and its persistent form's (``DESC_CANDIDATES``) in the mode the
    objective stores. ``design``: "default", "descriptor" or "persistent" alone."""
    from . import contrastive as kc

    specs = []
    for arch in archs:
        for dtype in dtypes or list(DTYPES):
            prec = "ieee" if dtype == "float32" else "tf32"
            kind = "fp32" if dtype == "float32" else "16bit"
            for variant, f in kc.VARIANTS.items():
                exp = kc.stores_exp(f)
                if design in (None, "default"):
                    for store_exp in sorted({exp, False}, reverse=True):
                        for config in kc.SIM_CANDIDATES[kind]:
                            specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, store_exp,
                                                   config, candidate=True))
                for name in ("descriptor", "persistent"):
                    if design in (None, name):
                        for config in kc.DESC_CANDIDATES[kind]:
                            specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, exp, config,
                                                   persistent=name == "persistent",
                                                   candidate=True))
    return specs


def specializations(full: bool = False, archs=ARCHS, dtypes=None, rest: bool = False) -> list[Spec]:
    """What fastcl can launch. The default subset: every flag set and kernel, bf16 on sm_90
    and fp32 on sm_80, the configs in use (the descriptor design's too, in the mode each
    objective stores); ``full``: every dtype on every arch, plus the first design's config
    list and the descriptor design in the first design's epilogue mode; ``rest``: the full
    matrix less the subset."""
    from . import contrastive as kc

    full = full or rest
    if dtypes is None:
        pairs = ([(a, d) for a in archs for d in DTYPES] if full else
                 [(a, d) for a, d in SUBSET if a in archs])
    else:
        pairs = [(a, d) for a in archs for d in dtypes]
    specs = []
    for arch, dtype in pairs:
        prec = "ieee" if dtype == "float32" else "tf32"
        again = rest and (arch, dtype) in SUBSET     # already in the subset
        for variant, f in kc.VARIANTS.items():
            exp = kc.stores_exp(f)
            # the similarity kernel: the mode the new design uses, and fp32 cosines for the
            # first design's epilogue (FASTCL_LEGACY=epilogue)
            modes = sorted({exp, False}, reverse=True)
            # the earlier lists are timed on Hopper in bf16 only (bench/ab.py): the first
            # design's (FASTCL_LEGACY=configs) and the one before this (FASTCL_LEGACY=tiles)
            timed = full and (arch, dtype) == (90, "bfloat16")
            lists = (([] if again else [(kc.sim_configs(f, dtype, arch), False)])
                     + ([(kc.LEGACY_SIM_CONFIGS, True),
                         (kc.sim_configs(f, dtype, arch, unaligned_lists=True), True)]
                        if timed else []))
            for store_exp in modes:
                # a mode other than the one the objective stores is launched only by the first
                # design's epilogue (FASTCL_LEGACY=epilogue): kept for timing, spills reported
                other = store_exp != exp
                seen = set()                 # a config in several lists compiles once, as
                for configs, old in lists:   # the first (the kept list, when it is there)
                    for config in configs:
                        if tuple(config) not in seen:
                            seen.add(tuple(config))
                            specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, store_exp,
                                                   config, legacy=old or other))
                # the descriptor design (FASTCL_SIM=descriptor) and its persistent form: the
                # subset in the mode the objective stores, the rest in the first design's
                # epilogue mode
                if (store_exp != exp) if again else (full or store_exp == exp):
                    # (the persistent form in the first design's epilogue mode: not launched
                    # by the A/B, which runs each candidate with FASTCL_LEGACY unset)
                    for name in ("descriptor",) + (() if other else ("persistent",)):
                        for config in kc.sim_configs(f, dtype, arch, design=name):
                            specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, store_exp,
                                                   config, persistent=name == "persistent",
                                                   legacy=other))
            if again:
                continue
            row = {k: v for k, v in kc.ROW_BLOCK.items() if k != "num_warps"}
            for want_grad in (True, False):
                specs.append(Spec(
                    "_row_kernel", variant, dtype, arch,
                    dict(f, STORE_EXP=exp, WANT_GRAD=want_grad, TILE_M=kc.SIM_BLOCK_M, **row),
                    kc.ROW_BLOCK.get("num_warps", 4), 3,
                    ("g_ptr",) + (("t_ptr",) if exp else ())))
            for stage in ((0, 1) if f["RELEASED"] else (1,)):
                specs.append(Spec("_gradient_kernel", variant, dtype, arch,
                                  dict(f, STAGE=stage, **kc.GRAD_BLOCK), 4, 3, ("g_ptr",),
                                  legacy=True))
        if not again:
            # the chain rule through the normalization, at the widths of common encoders
            # (dq writes x̂ for the second GEMM when dk is wanted; a weight a row for dq, one
            # scalar for dk, a weight a row for dk in fp16)
            for width in (384, 768, 1536, 4096):
                block = 1 << (width - 1).bit_length()
                for x_hat, scale_stride in ((True, 1), (False, 1), (False, 0)):
                    specs.append(Spec("_tangent_kernel", f"d={width}", dtype, arch,
                                      dict(WRITE_X_HAT=x_hat, BLOCK_D=block),
                                      4 if width <= 1024 else 8, 3, ("x_ptr", "x_hat_ptr"),
                                      out_ptrs=("out_ptr",),
                                      args={"D": width, "scale_stride": scale_stride}))
    if not full:
        # the subset again for odd sizes and unaligned views: they must compile too (the
        # descriptor designs take only aligned buffers: odd sizes; what only an earlier
        # design launches is left to the aligned check)
        # (the chain rule at one width: the unaligned launch's own)
        specs += [replace(s, launch="odd" if s.constexprs.get("DESC") else "unaligned",
                          args={k: v for k, v in s.args.items() if k != "D"})
                  for s in specs if not s.legacy and s.args.get("D", 768) == 768]
    return specs


#: Integer arguments that take the value of another one in every launch.
SAME_AS = {"stride_q": "D", "stride_k": "D", "stride_u": "D", "stride_x": "D", "stride_out": "D",
           "stride_x_hat": "D", "stride_cq": "DC", "stride_ck": "DC", "stride_t": "M",
           "stride_g": "M", "stride_s": "M", "stride_part": "T"}


def _launch_specialization(value):
    """What a launch makes of one argument: ``(type, "D" | "")`` or ``("constexpr", 1)``;
    Triton's own function where it is exposed, else its rule written out."""
    try:
        from triton.runtime.jit import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    if native_specialize_impl is not None:
        kind, mark = native_specialize_impl(BaseBackend, value, False, True, True)[:2]
        return kind, mark or ""
    if isinstance(value, int):
        return ("constexpr", 1) if value == 1 else ("i32", "D" if value % 16 == 0 else "")
    return "*", "D" if value.data_ptr() % 16 == 0 else ""


def _int_args(spec: Spec) -> dict:
    values = {k: v for k, v in LAUNCHES[spec.launch].items() if k != "aligned"}
    if spec.kernel == "_similarity_kernel" and not spec.constexprs.get("MASK"):
        values["DC"] = 0                   # the launcher passes no complementary width
    values.update(spec.args)
    values.setdefault("scale_stride", 1)   # one weight a row (0: one scalar for all)
    for name, source in SAME_AS.items():
        values.setdefault(name, values[source])
    if spec.kernel == "_similarity_kernel" and not spec.constexprs.get("MASK"):
        values["stride_cq"] = values["stride_ck"] = values["D"]   # q and keys stand in
    return values


def _specialize(fn, spec: Spec):
    """``(signature, constexprs, attrs)`` of ``fn`` as a launch with ``spec.launch``'s
    arguments builds them: pointer dtypes from the spec, the divisibility marks and the
    integers equal to 1 from what the launch would pass."""
    import torch
    from triton.backends.compiler import BaseBackend

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    aligned = LAUNCHES[spec.launch]["aligned"]
    ints = _int_args(spec)
    sig, constexprs, attrs = {}, dict(spec.constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
            continue
        if name.endswith("_ptr"):
            out_dtype = "fp32" if spec.dtype == "float16" else DTYPES[spec.dtype]
            kind = (DTYPES[spec.dtype] if name in spec.gemm_ptrs else
                    out_dtype if name in spec.out_ptrs else "fp32")
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
            attrs[(i,)] = BaseBackend.parse_attr(mark)
    return sig, constexprs, attrs


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


_WIDE_ADDPTR = re.compile(r"tt\.addptr %(\w+_ptr), %[\w.#]+ : !tt\.ptr<\w+>, i64")
#: a tensor descriptor's shape and strides are int64 by the op's definition (FASTCL_SIM=descriptor);
#: where the target has no TMA (sm_80) Triton rewrites it into int64 offset tensors on a pointer
_SPLAT = re.compile(r"%([\w.#]+) = tt\.splat %(\w+_ptr) :")
_WIDE_TENSOR = re.compile(r"tt\.addptr %([\w.#]+), %[\w.#]+ : tensor<[\dx]+x!tt\.ptr<\w+>>, "
                          r"tensor<[\dx]+xi64>")
_WIDE_DESCRIPTOR = re.compile(r"tt\.make_tensor_descriptor %(\w+_ptr), \[[^\]]*\], \[%[\w.#]+, %c1_i64\]")


def compile_one(spec: Spec) -> Result:
    """Compile one specialization and read ptxas's resource report."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import contrastive as kc

    fn = getattr(kc, spec.kernel)
    start = time.perf_counter()
    out = io.StringIO()
    try:
        src = ASTSource(fn, *_specialize(fn, spec))
        with contextlib.redirect_stdout(out):
            kernel = triton.compile(src, target=GPUTarget("cuda", spec.arch, 32),
                                    options={"num_warps": spec.num_warps,
                                             "num_stages": spec.num_stages})
    except Exception as exc:       # a compile error is the result, not a crash of the check
        lines = [line for line in str(exc).splitlines() if line.strip()]
        cause = exc.__cause__
        while cause is not None:   # Triton wraps the real message (e.g. a NameError)
            lines.append(f"{type(cause).__name__}: {cause}".splitlines()[0])
            cause = cause.__cause__
        return Result(spec, False, error="\n".join(lines[-6:])[:1500],
                      seconds=time.perf_counter() - start)
    log = out.getvalue()
    values = {k: int(m.group(1)) if (m := rx.search(log)) else None for k, rx in _PTXAS.items()}
    shared = getattr(kernel.metadata, "shared", None)
    ptx = kernel.asm.get("ptx", "")
    copies = ptx.count("cp.async.cg") + ptx.count("cp.async.ca") + ptx.count("cp.async.bulk")
    # which buffers are addressed with an int64 offset (R·M or M·d can pass 2³¹)
    ttir = kernel.asm.get("ttir", "")
    wide = set(_WIDE_ADDPTR.findall(ttir)) | set(_WIDE_DESCRIPTOR.findall(ttir))
    splats = {}                    # SSA names repeat across regions: the latest one, in order
    for line in ttir.splitlines():
        splats.update(_SPLAT.findall(line))
        wide.update(splats[v] for v in _WIDE_TENSOR.findall(line) if v in splats)
    wide = sorted(wide)
    return Result(spec, True, shared_bytes=shared, wide_pointers=wide, async_copies=copies,
                  seconds=time.perf_counter() - start,
                  log=[line.strip() for line in log.splitlines() if "bytes" in line or "Used" in line],
                  **values)


def _compile_many(specs: list[Spec]) -> list[Result]:
    return [compile_one(s) for s in specs]


def _prepare_environment(cache_dir: str) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"           # ptxas's -v report on stdout
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the runtime default, said aloud
    os.environ.pop("TRITON_INTERPRET", None)


def run(specs: list[Spec], jobs: int = 1) -> list[Result]:
    """Compile ``specs`` in ``jobs`` processes, in a fresh private Triton cache."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and "fastcl.kernels.contrastive" in sys.modules:
        raise RuntimeError("compile_check needs the jitted kernels: run it in a process "
                           "without TRITON_INTERPRET=1")
    with tempfile.TemporaryDirectory(prefix="fastcl-triton-cache-") as cache:
        _prepare_environment(cache)
        if jobs <= 1:
            return _compile_many(specs)
        parts = [specs[i::jobs] for i in range(jobs)]
        with ProcessPoolExecutor(jobs) as pool:
            done = list(pool.map(_compile_many, parts))
    results = [None] * len(specs)
    for i, part in enumerate(done):        # back in the order of ``specs``
        results[i::jobs] = part
    return results


def report(results: list[Result]) -> str:
    lines = [f"{'specialization':<100} {'regs':>5} {'spill':>6} {'stack':>6} {'smem':>7} "
             f"{'async':>5}  result"]
    for r in results:
        status = ("ERROR" if not r.ok else "SPILLS" if r.failed else
                  "ok (legacy spills)" if r.spills and r.spec.legacy else
                  "ok (spills reported)" if r.spills else "ok")
        lines.append(f"{r.spec.name:<100} {r.registers if r.registers is not None else '-':>5} "
                     f"{r.spills:>6} {r.stack_frame if r.stack_frame is not None else '-':>6} "
                     f"{r.shared_bytes if r.shared_bytes is not None else '-':>7} "
                     f"{r.async_copies:>5}  {status}")
        if r.error:
            lines += ["    " + line for line in r.error.splitlines()]
    failed = sum(r.failed for r in results)
    lines.append(f"{len(results)} specializations, {failed} failed, "
                 f"{sum(r.seconds for r in results):.0f} s of compiling")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--full", action="store_true", help="every dtype on every arch, legacy configs too")
    p.add_argument("--rest", action="store_true", help="the full matrix less the default subset")
    p.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), help="compute capabilities")
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None)
    p.add_argument("--kernel", default=None, help="only this kernel (e.g. _row_kernel)")
    p.add_argument("--sim-candidates", nargs="?", const="all",
                   choices=["all", "default", "descriptor", "persistent"],
                   help="only every config the similarity kernel's lists are chosen from "
                        "(SIM_CANDIDATES, DESC_CANDIDATES), spills reported, not failed")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--allow-spills", action="store_true", help="report spills, do not fail on them")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    specs = (candidates(tuple(args.arch), args.dtype,
                        None if args.sim_candidates == "all" else args.sim_candidates)
             if args.sim_candidates else
             specializations(args.full, tuple(args.arch), args.dtype, args.rest))
    if args.kernel:
        specs = [s for s in specs if s.kernel == args.kernel]
    results = run(specs, args.jobs)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**{k: v for k, v in asdict(r).items() if k != "spec"},
                        "spec": asdict(r.spec), "name": r.spec.name, "failed": r.failed}
                       for r in results], f, indent=1)
    failed = [r for r in results if not r.ok or (r.failed and not args.allow_spills)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
