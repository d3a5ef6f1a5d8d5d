"""The Triton kernels compile for real GPUs — on a CPU-only machine.

Triton's interpreter (which the other Triton tests use here) never runs the code generator,
so a kernel can pass there and fail on the first GPU. ``fastcl.kernels.compile_check``
compiles every specialization fastcl can launch for sm_80 and sm_90 (``triton.compile`` of an
``ASTSource`` with ``GPUTarget("cuda", 80 | 90, 32)``: Triton's code generator and ptxas, no
GPU needed), each as a launch specializes it (aligned large-batch arguments; the default run
also odd, unaligned ones), and reads ptxas's report; these tests run it in a separate process
(the kernels must be the jitted ones, and this process may have ``TRITON_INTERPRET=1``) and
fail on any compile error, or on a register spill in the aligned launch. The default run
is the bf16 check (``--arch 80 90 --dtype bfloat16``, which .ci/triton_range.sh runs on
the other Tritons): every kernel, flag set and mode in use in the first config of its
list, and each config of each list at least once, on sm_80 and sm_90, and the unaligned
launches on a covering set of strength 2 by flag (``compile_check.pairwise``: every kernel
and mode, each flag on and off with each other flag and each target). The other dtypes on
both targets compile on such a set too, each config of each list at least once
(``--rest --pairwise``). The ``slow`` test (``pytest -m slow``) compiles what those leave
out: every config and mode of every dtype on both targets with every flag set, and of the
unaligned launches.
"""

import itertools
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _cuda_backend_missing() -> str | None:
    try:
        from triton.backends import backends
    except ImportError as exc:             # a Triton without the backends registry
        return f"this Triton has no backends registry ({exc})"
    if "nvidia" not in backends:
        return "the installed Triton has no CUDA backend (no ptxas to compile for a GPU)"
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not (os.path.isfile(ptxas) or os.path.isfile(os.environ.get("TRITON_PTXAS_PATH", ""))):
        return f"Triton {triton.__version__} ships no ptxas ({ptxas}; TRITON_PTXAS_PATH unset)"
    return None


pytestmark = pytest.mark.skipif(_cuda_backend_missing() is not None,
                                reason=str(_cuda_backend_missing()))


def _run_check(tmp_path, *args):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # two processes, or FASTCL_COMPILE_JOBS (.ci/tests: 1, a process a core)
    jobs = os.environ.get("FASTCL_COMPILE_JOBS", "2")
    proc = subprocess.run([sys.executable, "-m", "fastcl.kernels.compile_check", "--jobs", jobs,
                           "--json", str(out), *args],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _problems(results):
    return [f"{r['name']}: " + (r["error"] or f"{r['spill_stores']} B spill stores, "
                                f"{r['spill_loads']} B spill loads")
            for r in results if r["failed"]]


@pytest.fixture(scope="module")
def subset(tmp_path_factory):
    return _run_check(tmp_path_factory.mktemp("compile"))


def test_every_kernel_compiles_without_spills(subset):
    proc, results = subset
    assert not _problems(results), "\n".join(_problems(results))
    assert proc.returncode == 0, proc.stdout[-2000:]


def test_every_variant_and_kernel_is_covered(subset):
    from fastcl.kernels.configs import FLAGS, VARIANTS
    _, results = subset
    seen = {(r["spec"]["kernel"], r["spec"]["variant"], r["spec"]["dtype"], r["spec"]["arch"])
            for r in results}
    for kernel in ("_similarity_kernel", "_row_kernel"):
        for variant in VARIANTS:
            assert (kernel, variant, "bfloat16", 90) in seen
            assert (kernel, variant, "bfloat16", 80) in seen
    for width in (384, 768, 1536, 4096):
        assert ("_tangent_kernel", f"d={width}", "bfloat16", 90) in seen
    for positives in (0, 1):
        assert ("_row_finish_kernel", f"positives={positives}", "bfloat16", 90) in seen
    # the bounded design beside the two-pass one, for every flag set but the released DCLR
    # and the layout's rules
    bounded = {r["spec"]["variant"] for r in results
               if r["spec"]["kernel"] == "_similarity_kernel" and r["spec"]["constexprs"]["BOUNDED"]}
    assert bounded == {v for v, f in VARIANTS.items() if not (f["RELEASED"] or f["RULES"] or f["SOFT"] or f["PRIOR"])}
    # every kernel again as an unaligned launch builds it, with each pair of flag values the
    # flag sets have (each flag on and off, each two flags on together), each flag value on
    # each target (a covering set of strength 2, compile_check.pairwise by flag)
    def pairs(kernel, launch):
        return {p for r in results if (r["spec"]["kernel"], r["spec"]["launch"]) == (kernel, launch)
                for p in itertools.combinations(sorted(
                    [(k, v) for k, v in r["spec"]["constexprs"].items() if k in FLAGS]
                    + [("arch", r["spec"]["arch"])]), 2)}
    for kernel in ("_similarity_kernel", "_row_kernel"):
        assert pairs(kernel, "unaligned") == pairs(kernel, "aligned"), kernel
    assert ("_tangent_kernel", "d=768") in {(r["spec"]["kernel"], r["spec"]["variant"])
                                            for r in results if r["spec"]["launch"] == "unaligned"}


def test_the_default_run_is_the_bf16_check(subset):
    """The default run is the full bf16 check (``--arch 80 90 --dtype bfloat16``, which
    .ci/triton_range.sh runs on the floor Triton and on 3.6) spec for spec: on the newest
    Triton, CI's run of that check is this one."""
    _, results = subset
    # (listed as the check lists them: without TRITON_INTERPRET=1, the GPU's tile sizes)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    listing = ("import json; from fastcl.kernels.compile_check import specializations; "
               "print(json.dumps([s.name for s in specializations(archs=(80, 90), "
               "dtypes=['bfloat16'])]))")
    proc = subprocess.run([sys.executable, "-c", listing], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16 = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(bf16) > 400
    assert [r["name"] for r in results] == bf16
    assert not [r for r in results if r["failed"]]


def test_the_same_ttir_is_compiled_once(subset):
    """Specializations with the same TTIR (a flag the kernel does not read: the row kernel's
    GUIDE) share one compile's result, which names a compile of the run."""
    _, results = subset
    compiled = {r["name"]: r for r in results if r["same_code_as"] is None}
    shared = [r for r in results if r["same_code_as"] is not None]
    assert shared
    for r in shared:
        owner = compiled[r["same_code_as"]]
        assert owner["code"] == r["code"] and owner["spec"]["kernel"] == r["spec"]["kernel"]
        assert (owner["registers"], owner["spill_stores"]) == (r["registers"], r["spill_stores"])
    # the row kernel reads no GUIDE: a flag set with the guide shares its row kernels
    rows = {(r["spec"]["variant"], r["spec"]["dtype"], r["spec"]["arch"],
             r["spec"]["constexprs"]["WANT_GRAD"]): r for r in results
            if r["spec"]["kernel"] == "_row_kernel" and r["spec"]["launch"] == "aligned"}
    assert rows[("rules-guide", "bfloat16", 90, True)]["code"] == rows[("rules", "bfloat16", 90, True)]["code"]


def test_the_aligned_launch_pipelines_the_k_loop(subset):
    """What the compile check measures is the kernel a large-batch launch builds: its K loop
    loads through asynchronous copies (cp.async), several stages deep in shared memory."""
    _, results = subset
    _assert_pipelined([r for r in results if r["spec"]["kernel"] == "_similarity_kernel"])


def _assert_pipelined(sims):
    sims = [r for r in sims if r["spec"]["launch"] == "aligned"]
    assert sims
    for r in sims:
        c = r["spec"]["constexprs"]
        assert r["async_copies"] > 0, r["name"]
        stage = (c["BLOCK_R"] + c["BLOCK_M"]) * c["BLOCK_D"] * (4 if r["spec"]["dtype"] == "float32" else 2)
        assert r["shared_bytes"] >= 2 * stage, (r["name"], r["shared_bytes"], stage)


_SPECIALIZE = """
import json
from dataclasses import replace
from fastcl.kernels import compile_check as cc
from fastcl.kernels import configs as cfg
from fastcl.kernels import contrastive as kc

out = {}
spec = cc._sim_spec("dclr-mask", cfg.VARIANTS["dclr-mask"], "bfloat16", 90, True, (64, 64, 8, 3))
fn = kc._similarity_kernel
for launch in ("aligned", "unaligned"):
    sig, constexprs, attrs = cc._specialize(fn, replace(spec, launch=launch))
    out[launch] = {"sig": sig, "marked": {fn.arg_names[k[0]]: v for k, v in attrs.items()}}
tangent = cc.Spec("_tangent_kernel", "d=768", "bfloat16", 90, dict(WRITE_X_HAT=False, BOUNDED=False, BLOCK_D=1024),
                  4, 3, ("x_ptr", "x_hat_ptr"), out_ptrs=("out_ptr",),
                  args={"D": 768, "scale_stride": 1})
for stride in (1, 0):
    sig, constexprs, _ = cc._specialize(kc._tangent_kernel,
                                        replace(tangent, args={"D": 768, "scale_stride": stride}))
    out[f"tangent{stride}"] = [sig["scale_stride"], constexprs.get("scale_stride")]
print(json.dumps(out))
"""


def test_launch_specialization_is_tritons():
    """The divisibility marks and constants are those Triton's launcher gives the same values:
    an aligned large-batch launch marks every pointer and integer, an odd one none; an integer
    equal to 1 is a constant (the chain rule's one weight a row)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SPECIALIZE], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    from fastcl.kernels.compile_check import LAUNCHES
    # the layout's integers are zeros without its rules (multiples of 16 at any launch)
    zeros = {n for n, v in LAUNCHES["unaligned"].items() if v == 0 and n not in ("aligned",)}
    for launch, marked in (("aligned", True), ("unaligned", False)):
        sig = out[launch]["sig"]
        args = {n for n, t in sig.items() if t == "i32" or t.startswith("*")}
        assert {"q_ptr", "k_ptr", "t_ptr", "stride_q", "M"} <= args
        assert zeros & args and zeros & args <= set(out[launch]["marked"]), launch
        assert set(out[launch]["marked"]) - zeros == ((args - zeros) if marked else set()), launch
        assert all(v == [["tt.divisibility", 16]] for v in out[launch]["marked"].values())
    assert out["tangent1"] == ["constexpr", 1]
    assert out["tangent0"] == ["i32", None]


_COMPILED_MARKS = """
import json, re, tempfile
from dataclasses import replace
import triton
from fastcl.kernels import compile_check as cc
from fastcl.kernels import contrastive as kc

cc._prepare_environment(tempfile.mkdtemp(prefix="fastcl-marks-"))
spec = cc.Spec("_tangent_kernel", "d=768", "bfloat16", 90, dict(WRITE_X_HAT=True, BOUNDED=False, BLOCK_D=1024),
               4, 3, ("x_ptr", "x_hat_ptr"), out_ptrs=("out_ptr",), args={"D": 768, "scale_stride": 1})
out = {"version": triton.__version__}
for launch in ("aligned", "unaligned"):
    for stride in (1, 0):
        # (the unaligned launch at its own width, 130: no integer a multiple of 16)
        s = replace(spec, launch=launch, args={"scale_stride": stride}
                    | ({"D": 768} if launch == "aligned" else {}))
        fn = kc._tangent_kernel
        sig, constexprs, attrs = cc._specialize(fn, s)
        src = cc._ast_source(fn, sig, constexprs, attrs)
        kernel = triton.compile(src, target=triton.backends.compiler.GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "num_stages": 3})
        head = next(line for line in kernel.asm["ttir"].splitlines() if "tt.func public" in line)
        head = cc._named_ttir(head, [n for n, t in sig.items() if t != "constexpr"])
        r = cc.compile_one(s)
        out[f"{launch}{stride}"] = {
            "args": re.findall(r"%(\\w+): [^ ,)]+", head),
            "marked": re.findall(r"%(\\w+): [^ ,)]+ {tt.divisibility = 16 : i32}", head),
            "ok": r.ok, "error": r.error, "registers": r.registers,
            "spills": [r.spill_stores, r.spill_loads], "wide": r.wide_pointers}
print(json.dumps(out))
"""


def test_the_marks_reach_the_compiler():
    """On whichever Triton is installed (the CI runs this on the floor and on 3.6 too), what
    ``_specialize`` decides is what the compiled kernel carries: the aligned launch's pointers
    and integers marked divisible by 16 in the TTIR's signature, the unaligned launch's
    pointers unmarked, an integer equal to 1 folded away (no argument), one equal to 0 kept;
    ptxas's report read and the kernel's arguments found by name in the TTIR."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _COMPILED_MARKS], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    pointers = {"u_ptr", "x_ptr", "inv_x_ptr", "scale_ptr", "out_ptr", "x_hat_ptr",
                "inv_z_ptr", "pos_coef_ptr", "k_ptr", "dk_ptr"}
    ints = {"D", "stride_u", "stride_x", "stride_out", "stride_x_hat", "stride_k", "stride_dk",
            "first_pos"}
    for launch in ("aligned", "unaligned"):
        for stride in (1, 0):
            got = out[f"{launch}{stride}"]
            assert got["ok"], (out["version"], launch, got["error"])
            assert pointers | ints <= set(got["args"]), (out["version"], got["args"])
            assert ("scale_stride" in got["args"]) == (stride == 0), (out["version"], got["args"])
            # (0 is a multiple of 16 too: Triton marks it)
            expected = (pointers | ints if launch == "aligned" else set()) | (
                {"scale_stride"} if stride == 0 else set())
            assert set(got["marked"]) == expected, (out["version"], launch, stride, got["marked"])
            assert got["registers"] and got["spills"] == [0, 0], (out["version"], got)
            assert {"u_ptr", "x_ptr", "out_ptr", "x_hat_ptr"} <= set(got["wide"]), got["wide"]


def test_kept_lists_come_from_the_candidates():
    """Every config of the kept lists, an older Triton's too, is one the candidate run
    reports on; an older Triton takes its own list only where it has one."""
    from fastcl.kernels import configs as cfg

    for name, f in cfg.VARIANTS.items():
        for dtype in ("float32", "bfloat16", "float16"):
            kind = "fp32" if dtype == "float32" else "16bit"
            for arch in (80, 90):
                new = cfg.sim_configs(f, dtype, arch, version=cfg.OLDER_TRITON)
                old = cfg.sim_configs(f, dtype, arch, version=(3, 1))
                assert new and old and set(new + old) <= set(cfg.SIM_CANDIDATES[kind])
                assert old == cfg.SIM_CONFIGS_OLDER_TRITON.get((arch, kind, name), new)
    assert cfg.sim_configs(cfg.VARIANTS["infonce"], "bfloat16", 90)[0] == (128, 64, 8, 3)
    masked = cfg.VARIANTS["dclr-mask"]
    assert cfg.sim_configs(masked, "bfloat16", 90, version=(3, 6))[0] == (128, 64, 8, 3)
    assert cfg.sim_configs(masked, "bfloat16", 90, version=(3, 5))[0] == (64, 64, 8, 3)


def test_the_engine_autotunes_over_the_kept_list(monkeypatch):
    """What the GPU engine hands Triton's autotuner: the kept list of the installed Triton,
    or its first config under FASTCL_AUTOTUNE=0 (the autotuner itself replaced: no GPU
    here)."""
    import torch
    from fastcl.kernels import configs as cfg
    from fastcl.kernels import contrastive as kc

    def autotune(configs, key):          # the "autotuner": the list it was handed
        handed = [(c.kwargs["BLOCK_R"], c.kwargs["BLOCK_D"], c.num_warps, c.num_stages)
                  for c in configs]
        return lambda fn: (handed, key)
    monkeypatch.setattr(kc, "INTERPRET", False)
    monkeypatch.setattr(kc, "_arch", lambda index: 90)
    monkeypatch.setattr(kc.triton, "autotune", autotune)
    kc._autotuned.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        for name in ("infonce", "dclr-mask"):
            f = cfg.VARIANTS[name]
            kept = list(cfg.sim_configs(f, "bfloat16", 90))
            assert kc._similarity(f, torch.bfloat16, cuda) == (kept, ["M", "D", "DC", "FLAGS"])
            monkeypatch.setenv("FASTCL_AUTOTUNE", "0")
            assert kc._similarity(f, torch.bfloat16, cuda)[0] == kept[:1]
            monkeypatch.delenv("FASTCL_AUTOTUNE")
    finally:
        kc._autotuned.cache_clear()


def test_resources_are_read(subset):
    _, results = subset
    for r in results:
        assert r["registers"] and 0 < r["registers"] <= 255, r["name"]
        assert r["spill_stores"] is not None and r["stack_frame"] is not None, r["name"]


def test_large_buffers_are_addressed_in_int64(subset):
    """R·M (a chunk) and M·d (the candidates) can pass 2³¹ elements: every buffer that scales
    with them gets an int64 offset (the tile base; offsets inside a tile stay int32)."""
    _, results = subset
    for r in results:
        kernel, c = r["spec"]["kernel"], r["spec"]["constexprs"]
        if kernel == "_similarity_kernel":
            need = {"q_ptr", "k_ptr", "t_ptr"} | ({"ck_ptr"} if c["MASK"] else set())
        elif kernel == "_row_kernel":          # without a gradient only the BCE reads the row
            need = ({"t_ptr", "g_ptr"} if c["WANT_GRAD"] else
                    {"t_ptr"} if c["RELEASED"] else set())
        elif kernel == "_row_finish_kernel":   # R×T partials: far below 2³¹
            need = set()
        elif kernel == "_noise_step_kernel":   # K×d: the accumulator, the keys, the noise
            need = {"u_ptr", "x_ptr", "z_ptr"}
        else:
            need = {"u_ptr", "x_ptr", "out_ptr"} | ({"x_hat_ptr"} if c["WRITE_X_HAT"] else set())
            if c["BOUNDED"]:                   # the positive's key row and its dk row
                need |= {"k_ptr"} | ({"dk_ptr"} if c["WRITE_X_HAT"] else set())
        assert need <= set(r["wide_pointers"]), (r["name"], r["wide_pointers"])


def test_candidates_beyond_int32_tiles_are_refused():
    """Offsets inside one tile are int32: M ≥ 2³¹/256 candidates get a clear error."""
    import torch
    from fastcl.kernels.contrastive import MAX_CANDIDATES, triton_chunk
    from fastcl.tiled import Chunk, Epilogue
    keys = torch.zeros(MAX_CANDIDATES, 1)
    q = torch.ones(1, 1)
    one = torch.ones(1)
    chunk = Chunk(0, 1, 1, 1, 0, q, keys, one, one.expand(MAX_CANDIDATES),
                  one.expand(MAX_CANDIDATES))
    with pytest.raises(ValueError, match="candidates.*backend='tiled'"):
        triton_chunk(Epilogue(0.05), chunk, True)


REST = {("float32", 80), ("float32", 90), ("float16", 80), ("float16", 90)}


def test_every_dtype_compiles_on_both_targets(tmp_path):
    """Every dtype on sm_80 and sm_90 beyond the bf16 check, without spills, on a covering
    set of strength 2 by flag (``--rest --pairwise``; the slow test has all): each kernel
    on each of these targets, each pair of flag values the flag sets have with each other
    and with each dtype and target, each config of each list on each target, the chain
    rule at each width in float16 and in float32, and each mode of each config list (fp32
    tiles, the 16-bit ones in float16)."""
    from fastcl.kernels import configs as cfg
    from fastcl.kernels.configs import FLAGS, VARIANTS
    proc, results = _run_check(tmp_path, "--rest", "--pairwise")
    assert not _problems(results), "\n".join(_problems(results))
    assert proc.returncode == 0
    specs = [r["spec"] for r in results]
    seen = {(s["kernel"], s["variant"], s["dtype"], s["arch"]) for s in specs}
    for kernel in ("_similarity_kernel", "_row_kernel", "_tangent_kernel", "_row_finish_kernel"):
        built = {t for t in REST if kernel != "_row_finish_kernel" or t[0] != "float16"}
        assert {(d, a) for k, _, d, a in seen if k == kernel} == built, kernel  # (no bounded fp16)
    every = {p for f in VARIANTS.values() for p in itertools.combinations(sorted(f.items()), 2)}
    every |= {(flag, t) for f in VARIANTS.values() for flag in f.items() for t in REST}
    sim = {p for s in specs if s["kernel"] == "_similarity_kernel"
           for flags in [sorted((k, v) for k, v in s["constexprs"].items() if k in FLAGS)]
           for p in list(itertools.combinations(flags, 2)) + [(f, (s["dtype"], s["arch"])) for f in flags]}
    assert sim == every
    for width in (384, 768, 1536, 4096):
        for dtype in ("float16", "float32"):
            assert any(k == "_tangent_kernel" and v == f"d={width}" and d == dtype
                       for k, v, d, _ in seen), (width, dtype)
    sims = [s for s in specs if s["kernel"] == "_similarity_kernel"]
    for dtype, arch in REST:
        got = {(s["constexprs"]["BLOCK_R"], s["constexprs"]["BLOCK_D"], s["num_warps"], s["num_stages"])
               for s in sims if (s["dtype"], s["arch"]) == (dtype, arch)}
        assert got == {c for f in VARIANTS.values() for c in cfg.sim_configs(f, dtype, arch)}, (dtype, arch)
    _assert_pipelined([r for r in results if r["spec"]["kernel"] == "_similarity_kernel"])
    modes = {}          # each config list: the bounded design, the two-pass one, without exp
    for s in sims:
        modes.setdefault(("fp32" if s["dtype"] == "float32" else "16bit", s["arch"]), set()).add(
            (s["constexprs"]["STORE_EXP"], s["constexprs"]["BOUNDED"]))
    assert modes[("fp32", 80)] == modes[("fp32", 90)] == {(True, True), (True, False), (False, False)}
    # float16: the two-pass design only, both of its modes
    assert modes[("16bit", 80)] | modes[("16bit", 90)] == {(True, False), (False, False)}


@pytest.mark.slow
def test_full_matrix_compiles_without_spills(tmp_path):
    """What the default run leaves out: every dtype on sm_80 and sm_90 beyond the subset, every
    config and mode; the subset in full (``--exhaustive``): every config with every flag set,
    every config and mode of the unaligned launches."""
    proc, results = _run_check(tmp_path, "--rest")
    assert not _problems(results), "\n".join(_problems(results))
    assert {(r["spec"]["dtype"], r["spec"]["arch"]) for r in results} >= REST
    assert proc.returncode == 0
    (tmp_path / "subset").mkdir()
    proc, results = _run_check(tmp_path / "subset", "--exhaustive")
    assert not _problems(results), "\n".join(_problems(results))
    assert proc.returncode == 0
    from fastcl.kernels.compile_check import specializations
    assert len(results) == len(specializations(exhaustive=True))
