"""Compile every kernel specialization fastcl can launch, for a CUDA target, without a GPU.

Triton's interpreter never runs the code generator, so a kernel can pass every interpreter
test and still fail to compile for a GPU. Triton's compiler itself needs no GPU: this
module builds each kernel × flag set × dtype × autotune config for ``sm_80`` / ``sm_90``
from its source (``triton.compile`` of an ``ASTSource`` with a ``GPUTarget``), runs ptxas
(shipped in the triton wheel) and reads its report: registers, spill bytes, stack frame.

    python -m fastcl.kernels.compile_check                # the representative subset
    python -m fastcl.kernels.compile_check --full --json report.json

A specialization fails on a compile error, or on register spills in a config that fastcl
keeps (``--allow-spills`` reports them only). The first design's config list
(``FASTCL_LEGACY=configs``) is kept for timing comparisons only: it must compile, its spills
are reported but do not fail. Each run compiles into a fresh, private ``TRITON_CACHE_DIR``:
Triton's cache key does not see every module global a kernel reads, so a cached build of a
fixed kernel could make a broken one look fine. It must run without ``TRITON_INTERPRET=1``
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
from dataclasses import asdict, dataclass, field

#: Triton's names for the dtypes fastcl's kernels take.
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ARCHS = (80, 90)
FLOAT_ARGS = {"inv_t", "focal_m", "hard_w", "phi", "scale", "inv_eps"}


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
    legacy: bool = False          # a config kept only for timing the first design
    candidate: bool = False       # a config tried for a list (--sim-candidates): spills reported

    @property
    def name(self) -> str:
        desc = self.constexprs.get("DESC")
        flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                         for k, v in self.constexprs.items()
                         if k not in ("FOCAL", "HARD", "MASK", "RELEASED", "POSITIVES", "PREC", "DESC")
                         and (k != "GROUP_R" or desc))
        return (f"{self.kernel}[{self.variant}] {self.dtype} sm_{self.arch} "
                f"w{self.num_warps} s{self.num_stages} {flags}" + (" descriptor" if desc else "")
                + (" (legacy)" if self.legacy else "") + (" (candidate)" if self.candidate else ""))


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
    wide_pointers: list = field(default_factory=list)  # pointer args offset in int64
    seconds: float = 0.0
    log: list = field(default_factory=list)

    @property
    def spills(self) -> int:
        return (self.spill_stores or 0) + (self.spill_loads or 0)

    @property
    def failed(self) -> bool:
        return not self.ok or (self.spills > 0 and not self.spec.legacy and not self.spec.candidate)


#: The representative subset: every kernel and flag set, on these (arch, dtype) pairs.
SUBSET = ((90, "bfloat16"), (80, "float32"))


def _sim_spec(kc, variant, f, dtype, arch, prec, store_exp, config, **kw) -> Spec:
    """One similarity-kernel specialization: a 4-tuple config is the default design, a
    5-tuple (GROUP_R last) the descriptor design (FASTCL_SIM=descriptor)."""
    br, bd, warps, stages = config[:4]
    desc = len(config) > 4
    return Spec("_similarity_kernel", variant, dtype, arch,
                dict(f, STORE_EXP=store_exp, PREC=prec, BLOCK_R=br, BLOCK_M=kc.SIM_BLOCK_M,
                     BLOCK_D=bd, DESC=desc, GROUP_R=config[4] if desc else 1),
                warps, stages, ("q_ptr", "k_ptr", "cq_ptr", "ck_ptr")
                + (("t_ptr",) if store_exp else ()), **kw)


def candidates(archs=ARCHS, dtypes=None) -> list[Spec]:
    """Every config the descriptor design tries (``DESC_CANDIDATES``), for every flag set in
    the mode its objective stores: what its kept lists were chosen from (spills reported)."""
    from . import contrastive as kc

    specs = []
    for arch in archs:
        for dtype in dtypes or list(DTYPES):
            prec = "ieee" if dtype == "float32" else "tf32"
            for variant, f in kc.VARIANTS.items():
                for config in kc.DESC_CANDIDATES["fp32" if dtype == "float32" else "16bit"]:
                    specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, kc.stores_exp(f),
                                           config, candidate=True))
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
            lists = (([] if again else [(kc.sim_configs(f, dtype, arch), False)])
                     # the first design's list is timed on Hopper in bf16 only (bench/ab.py)
                     + ([(kc.LEGACY_SIM_CONFIGS, True)] if full and (arch, dtype) == (90, "bfloat16")
                        else []))
            for store_exp in modes:
                for configs, old in lists:
                    for config in configs:
                        specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, store_exp,
                                               config, legacy=old))
                # the descriptor design (FASTCL_SIM=descriptor): the subset in the mode the
                # objective stores, the rest in the first design's epilogue mode
                if (store_exp != exp) if again else (full or store_exp == exp):
                    for config in kc.sim_configs(f, dtype, arch, design="descriptor"):
                        specs.append(_sim_spec(kc, variant, f, dtype, arch, prec, store_exp, config))
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
            for width in (384, 768, 1536, 4096):
                block = 1 << (width - 1).bit_length()
                for x_hat in (True, False):
                    specs.append(Spec("_tangent_kernel", f"d={width}", dtype, arch,
                                      dict(WRITE_X_HAT=x_hat, BLOCK_D=block),
                                      4 if width <= 1024 else 8, 3, ("x_ptr", "x_hat_ptr"),
                                      out_ptrs=("out_ptr",)))
    return specs


def _signature(fn, spec: Spec) -> dict:
    sig = {}
    for i, name in enumerate(fn.arg_names):
        if i in fn.constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            out_dtype = "fp32" if spec.dtype == "float16" else DTYPES[spec.dtype]
            sig[name] = "*" + (DTYPES[spec.dtype] if name in spec.gemm_ptrs else
                               out_dtype if name in spec.out_ptrs else "fp32")
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


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
        src = ASTSource(fn, _signature(fn, spec), dict(spec.constexprs))
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
    # which buffers are addressed with an int64 offset (R·M or M·d can pass 2³¹)
    ttir = kernel.asm.get("ttir", "")
    wide = set(_WIDE_ADDPTR.findall(ttir)) | set(_WIDE_DESCRIPTOR.findall(ttir))
    splats = {}                    # SSA names repeat across regions: the latest one, in order
    for line in ttir.splitlines():
        splats.update(_SPLAT.findall(line))
        wide.update(splats[v] for v in _WIDE_TENSOR.findall(line) if v in splats)
    wide = sorted(wide)
    return Result(spec, True, shared_bytes=shared, wide_pointers=wide,
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
    lines = [f"{'specialization':<100} {'regs':>5} {'spill':>6} {'stack':>6} {'smem':>7}  result"]
    for r in results:
        status = ("ERROR" if not r.ok else "SPILLS" if r.failed else
                  "ok (legacy spills)" if r.spills else "ok")
        lines.append(f"{r.spec.name:<100} {r.registers if r.registers is not None else '-':>5} "
                     f"{r.spills:>6} {r.stack_frame if r.stack_frame is not None else '-':>6} "
                     f"{r.shared_bytes if r.shared_bytes is not None else '-':>7}  {status}")
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
    p.add_argument("--sim-candidates", action="store_true",
                   help="only every config the descriptor design tries (DESC_CANDIDATES), "
                        "spills reported, not failed")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--allow-spills", action="store_true", help="report spills, do not fail on them")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    specs = (candidates(tuple(args.arch), args.dtype) if args.sim_candidates else
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
    failed = [r for r in results if not r.ok or (r.spills and not r.spec.legacy
                                                 and not r.spec.candidate and not args.allow_spills)]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
