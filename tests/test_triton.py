"""The Triton backend against the reference.

On a CPU-only machine the kernels run in Triton's interpreter (conftest switches it on);
those tests use small shapes that hit every tile edge. A CPU widens 16-bit GEMM operands to
float32; the ``16bit_buffers`` tests keep them 16-bit as a GPU does (conftest's
``gpu_buffers``), so the interpreter also runs the kernels' bf16 and fp16 paths. The GPU tests
(skipped without CUDA) add larger shapes, each kept autotune config, a batch far beyond N×M
memory, and determinism.
"""

import itertools

import pytest
import torch

import fastcl

from conftest import correlated, inputs, loss_and_grads, make, objectives

triton = pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# fp32, Triton vs reference, values and gradients
FP32 = dict(atol=1e-4, rtol=1e-4)

#: The 16-bit GEMM dtypes a GPU keeps (bf16: the bounded design; fp16: the two-pass one)
DTYPES_16 = [torch.bfloat16, torch.float16]

# (N, K, d): N=1, N=17, M = N+K = 33, d=24, d=130, M ≠ N, d below one tile
SHAPES = [(1, 0, 24), (1, 3, 130), (17, 0, 130), (17, 16, 24), (5, 28, 7)]
NAMES = list(objectives(1, 0))
# N = 40, M = 80: three row tiles, candidates in three row blocks of 32, for the objectives
# that tests/test_contrastive.py's larger shapes (N = 33, M = 85, every feature of
# fastcl.contrastive) and tests/test_dclr_released.py's N = 33 leave out: a queue of
# negatives, the symmetric loss with one, ESCL
LARGE = (40, 40, 24)
LARGE_NAMES = ["infonce-negatives", "infonce-symmetric", "focal-negatives", "escl", "escl-margin"]
CASES = [(name, shape) for shape in SHAPES for name in NAMES] + [(name, LARGE) for name in LARGE_NAMES]


def _to(device, *ts):
    return [t.detach().to(device).requires_grad_(t.requires_grad) for t in ts]


def _compare(name, n, k, d, dtype=torch.float32, tol=FP32, chunk=None, device=DEVICE, noise=0.7):
    fn = objectives(n, k)[name]
    a, p, x = _to(device, *inputs(n, k, d, dtype, noise))
    leaves = [a, p, x]
    if dtype == torch.float32:
        ref_loss, ref_grads = loss_and_grads(lambda: fn(a, p, x, backend="reference"), leaves)
    else:  # 16-bit inputs: the float32 reference on the same rounded inputs
        a32, p32, x32 = _to(device, *(t.float() for t in leaves))
        ref_loss, ref_grads = loss_and_grads(lambda: fn(a32, p32, x32, backend="reference"),
                                             [a32, p32, x32])
    loss, grads = loss_and_grads(lambda: fn(a, p, x, backend="triton", chunk_size=chunk), leaves)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, atol=tol["atol"], rtol=tol["rtol"])
    for which, g, rg in zip(("anchors", "positives", "extra"), grads, ref_grads):
        if rg is None or rg.numel() == 0:
            assert g is None or not g.abs().any(), which
            continue
        g = g.float()
        if dtype != torch.float32:
            tol_g = dict(atol=tol["grad_frac"] * rg.abs().max().item(), rtol=0)
        else:
            tol_g = tol
        torch.testing.assert_close(g, rg, **tol_g, msg=lambda s: f"grad {which}: {s}")


@pytest.mark.parametrize("name,shape", CASES, ids=[f"{name}-N{n}K{k}d{d}" for name, (n, k, d) in CASES])
def test_triton_matches_reference(name, shape):
    _compare(name, *shape)


def test_autotune_timings_keep_every_tuned_key(monkeypatch):
    """Triton's autotuner keeps only its last tuning's times; the benchmark's record
    (bench/_autotune.py) keeps each key's, for bench/ab.py to report every tile it tried."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import _autotune
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(_autotune, "_TIMINGS", {})
    monkeypatch.setattr(_autotune, "_TUNERS", {})
    name = "_similarity_kernel[(128, 64, 8, 3), (64, 64, 8, 3)]"
    tuner = SimpleNamespace(cache={}, configs_timings=None, keys=["M"])
    _autotune._TUNERS[name] = tuner
    tuner.cache[(1,)] = "big"
    tuner.configs_timings = {"big": [1.0, 0.9, 1.1], "small": [2.0, 1.9, 2.1]}
    _autotune.note_timings(tuner, name, 0)
    tuner.cache[(2,)] = "small"
    tuner.configs_timings = {"big": [3.0, 2.9, 3.1], "small": [2.5, 2.4, 2.6]}
    _autotune.note_timings(tuner, name, 1)
    _autotune.note_timings(tuner, name, 2)              # no new key: nothing changes
    assert _autotune.autotune_timings() == {name: {"M=1": {"big": 1.0, "small": 2.0},
                                                   "M=2": {"big": 3.0, "small": 2.5}}}
    tuner.cache[(3,)] = "big"                          # one config: nothing was timed for it
    tuner.configs_timings = {"other": [1.0]}
    _autotune.note_timings(tuner, name, 2)
    assert set(_autotune.autotune_timings()[name]) == {"M=1", "M=2"}
    assert _autotune.chosen_configs() == {name: {"(1,)": "big", "(2,)": "small", "(3,)": "big"}}
    # the attribute read is the one Triton's autotuner writes
    import inspect

    from triton.runtime.autotuner import Autotuner
    assert "self.configs_timings = " in inspect.getsource(Autotuner)

    # record(): each autotuner fastcl hands out is kept, and a launch that tunes a new key
    # leaves its times (a stand-in autotuner: no GPU here)
    from fastcl.kernels import contrastive as kc
    monkeypatch.setattr(_autotune, "_TIMINGS", {})
    monkeypatch.setattr(_autotune, "_TUNERS", {})
    config = SimpleNamespace(kwargs={"BLOCK_R": 64, "BLOCK_D": 32}, num_warps=8, num_stages=3)

    class Tuner:
        cache, configs, keys, configs_timings = {}, [config], ["M"], {"c": [0.5]}

        def __getitem__(self, grid):
            def launch(*args):
                self.cache[args] = "c"
            return launch
    monkeypatch.setattr(kc, "_similarity", lambda f, dtype, device: Tuner())
    assert _autotune.record() and _autotune.record()       # once: a second call changes nothing
    kc._similarity(None, None, None)[(1,)](7)
    kc._similarity(None, None, None)[(1,)](7)              # a key tuned before: no new times
    listed = "_similarity_kernel[(64, 32, 8, 3)]"
    assert _autotune.chosen_configs() == {listed: {"(7,)": "c"}}
    assert _autotune.autotune_timings() == {listed: {"M=7": {"c": 0.5}}}


# (chunks of one row: tests/test_contrastive.py's test_triton_chunks_every_feature)
@pytest.mark.parametrize("chunk", [7, 16])
def test_triton_chunks(chunk):
    _compare("dclr-weighted", 17, 16, 24, chunk=chunk)
    _compare("focal-negatives", 17, 16, 24, chunk=chunk)


@pytest.mark.parametrize("n,k,d", [(1, 1, 24), (17, 33, 130), (9, 4, 7)])
def test_noise_update_matches_reference(n, k, d):
    a = make(n, d).to(DEVICE)
    p = correlated(a).to(DEVICE)
    z0 = make(k, d, seed=9, grad=False).to(DEVICE)
    kw = dict(steps=4, lr=0.05, temperature=0.1, noise=z0)
    ref = fastcl.dclr_noise(a, p, k, backend="reference", **kw)
    got = fastcl.dclr_noise(a, p, k, backend="triton", **kw)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5)
    step = torch.linalg.vector_norm(fastcl.dclr_noise(a, p, k, steps=1, lr=0.05, noise=z0,
                                                      backend="triton") - z0, dim=1)
    torch.testing.assert_close(step, torch.full_like(step, 0.05))


@pytest.mark.parametrize("formulation", ["paper", "released"])
def test_noise_step_is_one_launch(formulation, monkeypatch):
    """Each step of the Triton noise update moves the noise in one launch of the fused step
    (the chain rule, the radial projection, the normalized ascent), as the torch ops of the
    tiled backend do it, on the same noise rows."""
    from fastcl.kernels import contrastive as kc
    launches, torch_steps = [], []
    step = kc._noise_step_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid[0])
            return step[grid]
    monkeypatch.setattr(kc, "_noise_step_kernel", Spy())
    original = fastcl.tiled.noise._noise_step
    monkeypatch.setattr(fastcl.tiled.noise, "_noise_step",
                        lambda *a: torch_steps.append(a[4].shape[0]) or original(*a))
    a = make(13, 40).to(DEVICE)
    p = correlated(a).to(DEVICE)
    z0 = make(9, 40, seed=9, grad=False).to(DEVICE)
    kw = dict(steps=3, lr=0.05, temperature=0.1, noise=z0, formulation=formulation)
    got = fastcl.dclr_noise(a, p, 9, backend="triton", **kw)
    assert launches == [9] * 3 and not torch_steps
    want = fastcl.dclr_noise(a, p, 9, backend="tiled", **kw)
    assert torch_steps == [9] * 3
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES_16, ids=lambda d: str(d)[6:])
def test_16bit_buffers_noise_update(dtype, gpu_buffers):
    """The noise update with the keys in a GPU's 16-bit GEMM dtype (the fused step reads
    them widened): within the rounding of the float32 reference on the same inputs (each
    step's keys are the noise rounded to 16 bits; three steps move z by up to 0.07)."""
    a = make(13, 40, dtype=dtype, grad=False)
    p = correlated(a)
    z0 = make(9, 40, seed=9, grad=False)
    kw = dict(steps=3, lr=0.05, temperature=0.1, noise=z0)
    got = fastcl.dclr_noise(a, p, 9, backend="triton", **kw)
    want = fastcl.dclr_noise(a.float(), p.float(), 9, backend="reference", **kw)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)    # (seen: 1.3e-4 bf16, 2e-5 fp16)
    assert gpu_buffers and set(gpu_buffers) == {dtype}


def test_dclr_with_noise_steps_end_to_end():
    a = make(12, 24).to(DEVICE)
    p = correlated(a).to(DEVICE)
    c = make(12, 8, seed=3, grad=False).to(DEVICE)
    comp = (c, correlated(c, 0.3).detach())
    kw = dict(complementary=comp, phi=0.3, noise_ratio=1.5, noise_steps=4)
    ref = fastcl.dclr_loss(a, p, generator=torch.Generator(DEVICE).manual_seed(0),
                           backend="reference", **kw)
    got = fastcl.dclr_loss(a, p, generator=torch.Generator(DEVICE).manual_seed(0),
                           backend="triton", **kw)
    torch.testing.assert_close(got, ref, **FP32)


def test_non_contiguous_inputs():
    base = make(17, 60).to(DEVICE)
    a, p = base[:, ::2], base.flip(0)[:, 1::2]
    torch.testing.assert_close(fastcl.infonce(a, p, backend="triton"),
                               fastcl.infonce(a, p, backend="reference"), **FP32)



def test_tiny_and_zero_norm_rows_match_the_reference():
    """x̂ = x / max(‖x‖, EPS): the chain rule projects every row whose norm is above EPS, however
    small (1e-10, 1e-6 here), and none of the zero rows. Gradients scale as 1/‖x‖. τ = 1 keeps
    the softmax far from saturation, whose p − 1 would cost fp32 digits on every backend."""
    a, p = make(9, 24), correlated(make(9, 24))
    with torch.no_grad():
        for x in (a, p):
            x[1] *= 1e-10 / x[1].norm()
            x[4] *= 1e-6 / x[4].norm()
        a[6] = 0.0
        p[2] = 0.0
    a, p = _to(DEVICE, a, p)
    ref, rg = loss_and_grads(lambda: fastcl.infonce(a, p, temperature=1.0, backend="reference"), [a, p])
    got, g = loss_and_grads(lambda: fastcl.infonce(a, p, temperature=1.0, backend="triton"), [a, p])
    torch.testing.assert_close(got, ref, **FP32)
    for x, y in zip(g, rg):
        torch.testing.assert_close(x, y, **FP32)

# bf16 inputs: loss within 2e-2 relative of the fp32 reference on the same rounded inputs;
# gradients within 3e-2 of the largest gradient entry (bf16 keeps 8 bits of mantissa).
BF16 = dict(atol=0, rtol=2e-2, grad_frac=3e-2)


@pytest.mark.parametrize("name", ["infonce", "focal-negatives", "dclr-weighted", "dclr-released"])
def test_triton_bf16_inputs(name):
    """bf16 embeddings (on a CPU the GEMM operands are widened; a GPU keeps them 16-bit, as
    test_16bit_buffers_match_reference does here)."""
    _compare(name, 17, 16, 24, dtype=torch.bfloat16, tol=BF16)


# 16-bit chunk buffers as on a GPU (conftest's gpu_buffers): bf16 takes the bounded design
# with its tile of exp in bf16, fp16 the two-pass design on fp16 buffers. N = 17 (row tiles
# cut) with and without extra columns (K = 0: an empty negatives or noise block, d = 130: more
# than one d-block), N = 1, d = 7; LARGE in chunks of 16 rows (three chunks, the last one
# short). Positives at cosine ≈ 0.2 to their anchors (``noise=5``): at τ = 0.05 the softmax is
# then not saturated (with the other tests' 0.7 some losses are near 1e-6 and 1 − p_pos is
# below float32's resolution, in the reference too: the comparison would measure float32
# rounding), while logits still span about ±10, so the bounded design's tile holds
# exp(l − 1/τ) down to about e⁻³⁰, the range its 16-bit dtype must keep.
POSITIVE_NOISE_16 = 5.0
SHAPES_16 = [(17, 16, 24), (17, 0, 130)]
EDGES_16 = [(1, 3, 130), (5, 28, 7)]
def _case_16(name, shape, chunk, dtype, default):
    n, k, d = shape
    return pytest.param(name, shape, chunk, dtype, marks=() if default else pytest.mark.slow,
                        id=f"{name}-N{n}K{k}d{d}" + (f"-chunk{chunk}" if chunk else "")
                           + f"-{str(dtype)[6:]}")


#: The default run: every objective at N = 17, K = 16 in both dtypes (both designs), and at
#: K = 0, at an edge shape and in chunks (LARGE) in one dtype each, in turn, so that each
#: shape meets both dtypes; ``-m slow``: every shape in both.
CASES_16 = ([_case_16(name, shape, None, dtype, shape == SHAPES_16[0] or (
                 shape == SHAPES_16[1] and dtype == DTYPES_16[i % 2]) or (
                 shape == EDGES_16[i % 2] and dtype == DTYPES_16[i // 2 % 2]))
             for i, name in enumerate(NAMES) for shape in SHAPES_16 + EDGES_16 for dtype in DTYPES_16]
            + [_case_16(name, LARGE, 16, dtype, dtype == DTYPES_16[i % 2])
               for i, name in enumerate(LARGE_NAMES) for dtype in DTYPES_16])


@pytest.mark.parametrize("name,shape,chunk,dtype", CASES_16)
def test_16bit_buffers_match_reference(name, shape, chunk, dtype, gpu_buffers):
    _compare(name, *shape, dtype=dtype, tol=BF16, chunk=chunk, noise=POSITIVE_NOISE_16)
    assert gpu_buffers and set(gpu_buffers) == {dtype}


# --------------------------------------------------------------------------- GPU only
GPU_SHAPES = [(256, 0, 768), (1000, 1000, 384), (517, 300, 1024), (4096, 0, 768)]


@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"N{n}K{k}d{d}" for n, k, d in GPU_SHAPES])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp32(name, shape):
    _compare(name, *shape)


@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=[f"N{n}K{k}d{d}" for n, k, d in GPU_SHAPES])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_bf16(name, shape):
    _compare(name, *shape, dtype=torch.bfloat16, tol=BF16)


@needs_gpu
@pytest.mark.parametrize("shape", GPU_SHAPES[:3], ids=[f"N{n}K{k}d{d}" for n, k, d in GPU_SHAPES[:3]])
@pytest.mark.parametrize("name", NAMES)
def test_gpu_fp16(name, shape):
    """fp16 chunk buffers for real (the CPU tests emulate them with ``gemm_dtype``)."""
    _compare(name, *shape, dtype=torch.float16, tol=BF16)


#: One objective per autotune list (16-bit and fp32, with and without the DCLR mask; focal
#: with the mask has its own list on sm_90).
LISTS = [("infonce", torch.bfloat16), ("dclr-weighted", torch.bfloat16),
         ("focal-negatives", torch.bfloat16), ("infonce", torch.float32),
         ("dclr-weighted", torch.float32)]


@needs_gpu
@pytest.mark.parametrize("name,dtype", LISTS, ids=[f"{n}-{str(d)[6:]}" for n, d in LISTS])
def test_gpu_every_kept_config(name, dtype, monkeypatch):
    """Each config of the kept autotune lists, launched alone, matches the reference (the
    autotuner would otherwise run only its fastest, or with FASTCL_AUTOTUNE=0 its first)."""
    from fastcl.kernels import configs as cfg
    from fastcl.kernels import contrastive as kc
    from fastcl.tiled import Epilogue
    comp = (torch.ones(2, 2), torch.ones(2, 2)) if name == "dclr-weighted" else None
    ep = Epilogue(0.05, focal_m=0.5 if name.startswith("focal") else None,
                  phi=0.2 if comp else None, complementary=comp)
    arch = kc._arch(torch.cuda.current_device())
    for config in cfg.sim_configs(kc.flags(ep), dtype, arch):
        monkeypatch.setattr(cfg, "sim_configs", lambda *a, config=config, **k: [config])
        _compare(name, 517, 300, 1024, dtype=dtype, tol=FP32 if dtype == torch.float32 else BF16)


@needs_gpu
@pytest.mark.parametrize("name", ["infonce", "dclr-weighted"])
def test_gpu_16384_matches_reference(name):
    """The loss and gradients at the benchmark's size, bf16, against the float32 reference."""
    _compare(name, 16384, 0, 768, dtype=torch.bfloat16, tol=BF16)


@needs_gpu
def test_gpu_huge_batch_never_holds_n_by_m():
    n, d = 65536, 768
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    p = (a.detach() + 0.5 * torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=g))
    p.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fastcl.infonce(a, p, backend="triton")
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert torch.isfinite(loss)
    # N×M in fp32 would be 16 GiB; the chunks and the N×d gradients stay far below
    assert extra < n * n * 4 / 16, extra


@needs_gpu
@pytest.mark.parametrize("name", ["infonce", "focal-negatives", "dclr-weighted", "dclr-released"])
def test_gpu_deterministic(name):
    n, k, d = 3000, 1000, 768
    fn = objectives(n, k)[name]
    runs = []
    for _ in range(2):
        a, p, x = _to("cuda", *inputs(n, k, d, torch.bfloat16))
        loss, grads = loss_and_grads(lambda: fn(a, p, x, backend="triton"), [a, p, x])
        runs.append((loss, grads))
    assert torch.equal(runs[0][0], runs[1][0])
    for g1, g2 in zip(runs[0][1], runs[1][1]):
        assert (g1 is None and g2 is None) or torch.equal(g1, g2)


GIB = 2**30


@pytest.mark.parametrize("m,free,rows", [(16384, 100 * GIB, 4096), (32768, 100 * GIB, 4096),
                                         (65536, 100 * GIB, 4096), (65536, 1 * GIB, 1024),
                                         (2048, 100 * GIB, 2048)])
def test_cuda_chunk_sizing(m, free, rows):
    """On CUDA the Triton engine counts its one 16-bit buffer against 128 MiB, and takes at
    least 4096 rows (faster on an H200 than 2048 or 3072) where they need at most a quarter
    of the free memory: 4096 × 65536 × 2 B = 512 MiB fits in 100 GiB, not in 1 GiB."""
    from fastcl.tiled import Epilogue, engine_for, rows_per_chunk
    ep = Epilogue(0.05)
    row_bytes = engine_for("triton").row_bytes(ep, torch.bfloat16, m, m)
    assert row_bytes == 2 * m
    asked = []
    got = rows_per_chunk(m, m, ep, row_bytes, "cuda", 128,
                         lambda: asked.append(1) or free)
    assert got == rows
    # the free memory is asked only when the budget alone gives fewer rows than the floor
    assert bool(asked) == (128 * 2**20 // row_bytes < min(m, 4096))
    # an explicit budget is the user's: no floor
    assert rows_per_chunk(m, m, Epilogue(0.05, memory_budget=64 * 2**20), row_bytes, "cuda",
                          128, lambda: free) == min(m, 64 * 2**20 // row_bytes // 128 * 128)


# --------------------------------------------------------------------------- bounded design
class _Launches(dict):
    """Launches of each Triton kernel, by name."""


@pytest.fixture
def launches(monkeypatch):
    from fastcl.kernels import contrastive as kc
    seen = _Launches()
    for name in ("_row_kernel", "_row_finish_kernel"):
        kernel = getattr(kc, name)

        class Spy:
            def __init__(self, kernel, name):
                self.kernel, self.name = kernel, name

            def __getitem__(self, grid):
                seen[self.name] = seen.get(self.name, 0) + 1
                return self.kernel[grid]
        monkeypatch.setattr(kc, name, Spy(kernel, name))
    return seen


@pytest.mark.parametrize("name", ["infonce", "infonce-hard", "focal-negatives", "dclr-weighted"])
def test_bounded_design_has_no_row_pass(name, launches):
    """Where every logit is bounded (unit rows: l ≤ 1/τ, focal (1+m)/τ, plus a hard
    negative's log-weight) the chunk needs no pass over its R×M rows: the similarity kernel
    sums exp(l − B) per tile and one launch finishes the rows from those partials."""
    _compare(name, 17, 16, 24, chunk=7)
    assert launches.get("_row_finish_kernel", 0) == 3 and "_row_kernel" not in launches


@pytest.mark.parametrize("name", ["infonce", "focal-negatives", "dclr-weighted", "infonce-hard"])
def test_two_pass_design_where_the_bound_is_too_wide(name, launches, monkeypatch):
    """Past the spread exp(l − B) may underflow (τ below 0.025 for InfoNCE): the two-pass
    design runs, and matches the reference too."""
    from fastcl.kernels import contrastive as kc
    monkeypatch.setattr(kc, "BOUND_SPREAD", 0.0)
    _compare(name, 17, 16, 24, chunk=7)
    assert launches.get("_row_kernel", 0) == 3                  # one a chunk
    assert "_row_finish_kernel" not in launches


def test_logit_bound_says_where_it_holds():
    from fastcl.kernels.contrastive import BOUND_SPREAD, logit_bound
    from fastcl.tiled import Epilogue
    assert logit_bound(Epilogue(0.05), torch.bfloat16) == pytest.approx(20.0)
    assert logit_bound(Epilogue(0.05, hard_negative_weight=0.8), torch.float32) == pytest.approx(20.8)
    assert logit_bound(Epilogue(0.05, focal_m=0.3), torch.bfloat16) == pytest.approx(26.0)
    assert logit_bound(Epilogue(2 / BOUND_SPREAD * 0.99), torch.float32) is None   # τ < 0.025
    assert logit_bound(Epilogue(0.05), torch.float16) is None     # 5 exponent bits
    assert logit_bound(Epilogue(0.05, formulation="released"), torch.float32) is None


def test_bounded_design_keeps_a_tiny_loss_exact():
    """Positives far closer than any negative: the loss is ~1e-6, the difference of two
    logits near 1/τ. The row loss is formed as log1p(Σ_{j≠i} exp(l_ij − l_ii)), not as
    B + log Z − l_ii, which would cancel to ~1e-6 absolute."""
    a = make(16, 32, dtype=torch.float64)
    with torch.no_grad():
        a.copy_(torch.nn.functional.one_hot(torch.arange(16), 32).double() * 3.0
                + 0.001 * a)
    p = correlated(a, 1e-4).detach().requires_grad_()
    a32, p32 = [t.detach().float().requires_grad_() for t in (a, p)]
    ref, ref_g = loss_and_grads(lambda: fastcl.infonce(a, p, temperature=0.05,
                                                       backend="reference"), [a, p])
    got, got_g = loss_and_grads(lambda: fastcl.infonce(a32, p32, temperature=0.05,
                                                       backend="triton"), [a32, p32])
    assert 0 < ref < 1e-5, ref
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=0)
    for g, rg in zip(got_g, ref_g):
        torch.testing.assert_close(g.double(), rg, rtol=1e-3, atol=1e-3 * rg.abs().max().item())


# --------------------------------------------------------------------------- layout rules
# fastcl.layout's rules in the kernels (RULES, GUIDE): MNRL's directions, partition modes and
# hardness, GIST's blocks and guide filter, duplicate ids, with focal and DCLR's noise,
# against the reference (values and gradients, fp32). Rows i and N + i of a paired chunk are
# a row's two sides; N = 19 with chunks of 5 leaves a short last chunk, M = 38 or more
# crosses the interpreter's 16-wide column tiles.
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


def _rule_case(n, k, d, directions, partition="joint", hardness=None, focal=None, guide=None,
               ids=False, noise=False):
    return dict(shape=(n, k, d), directions=directions, partition=partition, hardness=hardness,
                focal=focal, guide=guide, ids=ids, noise=noise)


def _rule_cases():
    """Every directions set and partition with each hardness mode, and GIST's four block
    sets with both margin strategies, each with and without focal, ids and noise."""
    from fastcl import layout
    sets = [("query_to_doc",) + extra for r in range(4)
            for extra in itertools.combinations(ALL_DIRECTIONS[1:], r)]
    cases = []
    for dirs in sets:
        modes = ["joint"] + (["per_direction"] if set(dirs) <= {"query_to_doc", "doc_to_query"} else [])
        for mode, hardness, focal, ids in itertools.product(
                modes, [None, "in_batch_negatives", "hard_negatives", "all_negatives"],
                [None, 0.3], [False, True]):
            for shape in ((7, 1, 12), (19, 0, 24), (5, 2, 7)):
                cases.append(_rule_case(*shape, dirs, mode, hardness, focal, ids=ids))
    for anchors, positives in itertools.product([True, False], repeat=2):
        for guide, focal, ids, noise in itertools.product(
                [(0.0, "absolute"), (0.1, "absolute"), (0.1, "relative")], [None, 0.3],
                [False, True], [False, True]):
            for shape in ((7, 1, 12), (19, 0, 24), (5, 2, 7)):
                cases.append(_rule_case(*shape, layout.gist(anchors, positives), focal=focal,
                                        guide=guide, ids=ids, noise=noise))
    return cases


#: The default run's cases: each directions set, partition mode, hardness mode and GIST block
#: set at least once, with and without focal, ids, the guide's strategies and noise, at each
#: shape (``pytest -m slow`` runs every case of ``_rule_cases``).
def _covering():
    from fastcl import layout
    q2d, q2q, d2q, d2d = ALL_DIRECTIONS
    return [
        _rule_case(7, 1, 12, (q2d, q2q), hardness="in_batch_negatives", ids=True),
        _rule_case(19, 0, 24, (q2d, d2q), "per_direction", hardness="hard_negatives", focal=0.3),
        _rule_case(5, 2, 7, (q2d, d2q), "joint", hardness="all_negatives"),
        _rule_case(19, 0, 24, (q2d, d2d), focal=0.3, ids=True),
        _rule_case(7, 1, 12, ALL_DIRECTIONS, hardness="in_batch_negatives", focal=0.3),
        _rule_case(5, 2, 7, (q2d, q2q, d2q), "joint", hardness="hard_negatives", ids=True),
        _rule_case(19, 0, 24, (q2d,), hardness="all_negatives", noise=True),
        _rule_case(7, 1, 12, layout.gist(), guide=(0.1, "absolute"), ids=True),
        _rule_case(19, 0, 24, layout.gist(), guide=(0.1, "relative"), focal=0.3, noise=True),
        _rule_case(5, 2, 7, layout.gist(False, False), guide=(0.0, "absolute"), focal=0.3),
        _rule_case(7, 1, 12, layout.gist(True, False), guide=(0.1, "relative"), noise=True),
        _rule_case(19, 0, 24, layout.gist(False, True), guide=(0.0, "absolute"), ids=True),
    ]


def _rule_id(case):
    dirs = case["directions"]
    name = ("+".join(d.replace("_to_", "2")[0] + d.split("_to_")[1][0] for d in dirs)
            if isinstance(dirs, tuple) else f"gist{int(dirs.anchor_to_anchors)}{int(dirs.positive_to_positives)}")
    extras = [case["partition"] if case["partition"] != "joint" else "",
              (case["hardness"] or "").split("_")[0], "focal" if case["focal"] else "",
              "guide-%s-%s" % case["guide"] if case["guide"] else "", "ids" if case["ids"] else "",
              "noise" if case["noise"] else ""]
    return "-".join([name] + [e for e in extras if e]) + "-N%dK%dd%d" % case["shape"]


def _separated_guide(n, k):
    """Guide embeddings (anchors', positives', the K negatives' of each row) whose every
    cosine lies at least 0.04 from its row's threshold θ_i = γ_i − m (m = 0 or 0.1, absolute
    or relative), with drops in every block of GIST's (the positives' at m > 0), for any n.
    Built on orthogonal axes: a row's cluster (4) and text (rows 2t and 2t + 1 are
    duplicates) and axes of its own. Anchor i: (cluster + text)/√2; its positive leans off it
    by γ_i = 0.95 (even rows) or 0.8 (odd rows), along its own axis; a negative: (cluster +
    its own axis)/√2, or its row's anchor (the same text) for every third row. Row i then
    sees its duplicate's anchor and the same-text negatives at 1 (dropped), its duplicate's
    positive at 0.8 (kept: θ ≥ 0.85) or 0.95 (dropped: θ ≤ 0.8) and, from its positive,
    theirs at 0.76 (kept at θ = 0.95, 0.85 or 0.8, dropped at 0.7 or 0.72); everything else
    at 0.5 or below."""
    i = torch.arange(n)
    text, width = i // 2, 4 + (n + 1) // 2
    dim = width + n + n * k
    anchors = torch.zeros(n, dim)
    anchors[i, (text % 4)] = anchors[i, 4 + text] = 2 ** -0.5
    gamma = torch.where(i % 2 == 0, 0.95, 0.8)[:, None]
    own = torch.zeros(n, dim)
    own[i, width + i] = 1.0
    positives = gamma * anchors + (1 - gamma**2).sqrt() * own
    negatives = torch.zeros(n * k, dim)
    rows = torch.arange(n * k)                 # row r·n + i: the r-th negative of row i
    negatives[rows, text.repeat(k) % 4] = negatives[rows, width + n + rows] = 2 ** -0.5
    same_text = i.repeat(k) % 3 == 0
    negatives[same_text] = anchors.repeat(k, 1)[same_text]
    return [anchors, positives, negatives if k else None]


def _rule_inputs(case, device=DEVICE, clustered=False):
    """Embeddings (anchors, positives, K hard negatives a row), the guide's (8 wide), text
    ids in 3 classes (many duplicates) and the keyword arguments of ``fastcl.contrastive``.
    ``clustered``: the guide of :func:`_separated_guide`, whose cosines all lie at least 0.04
    from their row's threshold (at N = 1000 a random guide has entries within rounding of θ,
    which a 16-bit guide GEMM, or another summation order, may put on the other side)."""
    from fastcl import layout
    n, k, d = case["shape"]
    g = torch.Generator().manual_seed(n * 100 + d)
    base = torch.randn(n, d, generator=g)
    a, p = base, base + 0.7 * torch.randn(n, d, generator=g)
    neg = torch.cat([base + 1.2 * torch.randn(n, d, generator=g) for _ in range(k)]) if k else None
    lay = case["directions"]
    lay = lay if isinstance(lay, layout.Layout) else layout.from_directions(lay, case["partition"])
    kw = dict(temperature=0.1, directions=lay, focal_m=case["focal"])
    if case["hardness"]:
        kw.update(hardness_mode=case["hardness"], hardness_strength=0.8)
    if case["guide"]:
        if clustered:
            guide = _separated_guide(n, k)
        else:
            gb = torch.randn(n, 8, generator=g)
            guide = [gb + 0.3 * torch.randn(n, 8, generator=g) for _ in range(2)]
            guide.append(torch.cat([gb + 0.5 * torch.randn(n, 8, generator=g) for _ in range(k)])
                         if k else None)
        kw.update(guide=tuple(guide) + (None,), guide_margin=case["guide"][0],
                  margin_strategy=case["guide"][1])
    if case["ids"]:
        ids = [torch.randint(0, 3, (size,), generator=g) for size in (n, n * k, n)]
        kw.update(duplicate_ids=(ids[0], ids[1] if k else None, ids[2] if lay.scores_anchors else None))
    if case["noise"]:
        kw.update(noise=torch.randn(3, d, generator=g), noise_steps=0)
    kw = {key: (v.to(device) if isinstance(v, torch.Tensor) else
                tuple(x if x is None else x.to(device) for x in v) if isinstance(v, tuple) and key in ("guide", "duplicate_ids")
                else v) for key, v in kw.items()}
    leaves = [x.to(device).requires_grad_() for x in (a, p) + ((neg,) if k else ())]
    return leaves, kw


def _compare_rules(case, chunk=5, dtype=torch.float32, device=DEVICE, clustered=None):
    """Triton (inputs in ``dtype``) against the float32 reference on the same rounded
    inputs: fp32 to FP32; 16-bit loss to BF16's rtol, gradients to its share of their
    largest entry. ``clustered`` (see _rule_inputs): by default on a GPU's large shapes."""
    leaves, kw = _rule_inputs(case, device, clustered=device == "cuda" if clustered is None else clustered)
    _compare_contrastive(leaves, kw, dtype, chunk)


def _compare_contrastive(leaves, kw, dtype, chunk):
    """``fastcl.contrastive(*leaves, **kw)`` on Triton with the leaves rounded to ``dtype``
    against the float32 reference on the same rounded values (tolerances: _compare_rules)."""
    low = [x.detach().to(dtype).requires_grad_() for x in leaves]
    wide = [x.detach().float().requires_grad_() for x in low]
    ref = loss_and_grads(lambda: fastcl.contrastive(*wide, backend="reference", **kw), wide)
    got = loss_and_grads(lambda: fastcl.contrastive(*low, backend="triton", chunk_size=chunk, **kw), low)
    exact = dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], **(FP32 if exact else dict(atol=0, rtol=BF16["rtol"])))
    for g, rg in zip(got[1], ref[1]):
        tol = FP32 if exact else dict(atol=BF16["grad_frac"] * rg.abs().max().item(), rtol=0)
        torch.testing.assert_close(g.float(), rg, **tol)


@pytest.mark.parametrize("case", _covering(), ids=_rule_id)
def test_layout_rules_match_the_reference(case):
    _compare_rules(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", _rule_cases(), ids=_rule_id)
def test_every_layout_rule_matches_the_reference(case):
    _compare_rules(case)


def test_rules_refused_beside_what_the_kernels_lack():
    """The rules beside a hard-negative weight or DCLR's mask: refused on backend='triton'
    with the reason, run tiled by 'auto'. Matryoshka runs a kernel call per width."""
    a, p, x = (t.detach() for t in inputs(5, 5, 12, torch.float32))
    kw = dict(directions=("query_to_doc", "query_to_query"))
    for extra, name in ((dict(hard_negative_weight=0.5), "hard_negative_weight"),
                        (dict(complementary=(a, p), phi=0.5), "complementary")):
        with pytest.raises(ValueError, match=f"backend='triton' does not compute {name}"):
            fastcl.contrastive(a, p, x, backend="triton", **kw, **extra)
        torch.testing.assert_close(fastcl.contrastive(a, p, x, backend="auto", **kw, **extra),
                                   fastcl.contrastive(a, p, x, backend="reference", **kw, **extra))
    for extra in (dict(), kw, dict(focal_m=0.3, hard_negative_weight=0.5)):
        leaves = [t.clone().requires_grad_() for t in (a, p, x)]
        got = fastcl.contrastive(*leaves, backend="triton", matryoshka_dims=(12, 7, 2),
                                 matryoshka_weights=(1.0, 0.5, 2.0), **extra)
        want = fastcl.contrastive(*leaves, backend="reference", matryoshka_dims=(12, 7, 2),
                                  matryoshka_weights=(1.0, 0.5, 2.0), **extra)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for g, w in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


#: Every covering case in bf16; in fp32 and fp16 the paired ones, with and without focal
#: and the guide (each flag set, its own autotune list).
GPU_RULES = ([(i, torch.bfloat16) for i in range(len(_covering()))]
             + [(i, torch.float32) for i in (1, 4, 8, 9)] + [(i, torch.float16) for i in (4, 8)])


@needs_gpu
@pytest.mark.parametrize("index,dtype", GPU_RULES, ids=[f"{i}-{str(d)[6:]}" for i, d in GPU_RULES])
def test_gpu_layout_rules(index, dtype):
    """The covering cases at N = 1000 (chunks of 384 rows: a short last one), d = 384."""
    case = dict(_covering()[index], shape=(1000, _covering()[index]["shape"][1], 384))
    _compare_rules(case, chunk=384, dtype=dtype, device="cuda")


#: Every covering case in bf16 and fp16, at its own small shape (chunks of 5 rows); the
#: default run takes MNRL's four directions with hardness and focal and GIST's guide with
#: focal and noise in bf16, per-direction softmaxes and the guide in fp16 (``-m slow``: the
#: rest; every case passes)
RULES_16 = [pytest.param(i, dtype, id=f"{_rule_id(_covering()[i])}-{str(dtype)[6:]}",
                         marks=() if (i, dtype) in ((4, DTYPES_16[0]), (8, DTYPES_16[0]),
                                                    (1, DTYPES_16[1]), (8, DTYPES_16[1]))
                         else pytest.mark.slow)
            for dtype in DTYPES_16 for i in range(len(_covering()))]


@pytest.mark.parametrize("index,dtype", RULES_16)
def test_16bit_buffers_layout_rules(index, dtype, gpu_buffers):
    """test_gpu_layout_rules's cases on 16-bit chunk buffers, as a GPU runs them."""
    _compare_rules(_covering()[index], dtype=dtype)
    assert gpu_buffers and set(gpu_buffers) == {dtype}


def test_guide_cast_once_a_call(gpu_buffers, monkeypatch):
    """The guide's unit rows reach every chunk's kernels in the GEMM dtype, one tensor for
    the whole call (cast once, not per chunk)."""
    from fastcl.kernels import contrastive as kc
    taken = []
    rules = kc._rules
    monkeypatch.setattr(kc, "_rules", lambda ep, c: taken.append(ep.guide[:2]) or rules(ep, c))
    _compare_rules(_covering()[8], chunk=5, dtype=torch.bfloat16)
    assert len(taken) >= 4                     # N = 19 in chunks of 5
    assert all(t.dtype == torch.bfloat16 for pair in taken for t in pair)
    assert len({(pair[0].data_ptr(), pair[1].data_ptr()) for pair in taken}) == 1


MATRYOSHKA_16 = [pytest.param(extra, dtype, id=f"{name}-{str(dtype)[6:]}",
                               marks=() if dtype == DTYPES_16[i % 2] else pytest.mark.slow)
                  for i, (name, extra) in enumerate([
                      ("plain", dict()), ("directions", dict(directions=("query_to_doc", "query_to_query"))),
                      ("focal-hard", dict(focal_m=0.3, hard_negative_weight=0.5))])
                  for dtype in DTYPES_16]


@pytest.mark.parametrize("extra,dtype", MATRYOSHKA_16)
def test_16bit_buffers_matryoshka(extra, dtype, gpu_buffers):
    """Matryoshka on Triton (a kernel call per width: 24, 10, 3, with weights) on 16-bit
    chunk buffers, against the float32 reference on the same rounded inputs."""
    kw = dict(matryoshka_dims=(24, 10, 3), matryoshka_weights=(1.0, 0.5, 2.0), **extra)
    _compare_contrastive(inputs(17, 17, 24, dtype, POSITIVE_NOISE_16), kw, dtype, chunk=7)
    assert len(gpu_buffers) >= 3 and set(gpu_buffers) == {dtype}


# --------------------------------------------------------------------------- the GPU's tiles
# The interpreter launches small tiles (16 × 16 similarity tiles of 16-wide d blocks, short
# row and finishing blocks) so that small shapes cross several of them. These tests launch
# the GPU's instead, in the interpreter: the 128-wide tile, each kept config's row and d
# blocks, the row and finishing kernels' GPU blocks (kernels/configs.py's GPU_* constants).
# N = 130: two to five row blocks, the last one short; M = 270 with the extra columns: three
# column tiles, the last 14 wide; d = 104: cut by every d block.
GPU_TILE_SHAPE = (130, 140, 104)
GPU_TILE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _kept_tiles():
    """Every (BLOCK_R, BLOCK_D) of the kept lists, largest first."""
    from fastcl.kernels import configs as cfg
    lists = [*cfg.SIM_CONFIGS.values(), *cfg.SIM_CONFIGS_BY_VARIANT.values(),
             *(kept for by in cfg.SIM_CONFIGS_BY_ARCH.values() for kept in by.values())]
    return sorted({c[:2] for kept in lists for c in kept}, reverse=True)


@pytest.fixture
def gpu_tiles(monkeypatch):
    """``gpu_tiles(tile)``: the GPU's launch sizes with ``tile`` = (BLOCK_R, BLOCK_D) for
    the similarity kernel, in the interpreter (on a GPU the autotuner launches them:
    test_gpu_every_kept_config)."""
    from fastcl.kernels import configs as cfg
    if not cfg.INTERPRET:
        pytest.skip("a GPU launches its own tiles (test_gpu_every_kept_config)")

    def use(tile):
        monkeypatch.setattr(cfg, "SIM_BLOCK_M", cfg.GPU_SIM_BLOCK_M)
        monkeypatch.setattr(cfg, "SIM_FIXED", {"BLOCK_R": tile[0], "BLOCK_D": tile[1]})
        monkeypatch.setattr(cfg, "ROW_BLOCK", cfg.GPU_ROW_BLOCK)
        monkeypatch.setattr(cfg, "FINISH_BLOCK", cfg.GPU_FINISH_BLOCK)
    return use


def _tile_id(tile):
    return "x".join(map(str, tile))


def _tile_cases(tiles, names, every=1):
    """Every tile × dtype × objective; the default run takes every ``every``-th tile (and
    the last) once, with the objectives and dtypes in turn (``-m slow``: all)."""
    return [pytest.param(tile, name, dtype, id=f"{_tile_id(tile)}-{name}-{str(dtype)[6:]}",
                         marks=() if ((i % every == 0 or i == len(tiles) - 1)
                                      and name == names[i % len(names)]
                                      and dtype == GPU_TILE_DTYPES[i % len(GPU_TILE_DTYPES)])
                         else pytest.mark.slow)
            for i, tile in enumerate(tiles) for dtype in GPU_TILE_DTYPES for name in names]


def _compare_tiles(name, dtype, chunk):
    _compare(name, *GPU_TILE_SHAPE, dtype=dtype, tol=FP32 if dtype == torch.float32 else BF16,
             chunk=chunk, noise=POSITIVE_NOISE_16)


@pytest.mark.parametrize("tile,name,dtype", _tile_cases(_kept_tiles(), NAMES))
def test_gpu_tiles_match_reference(tile, name, dtype, gpu_tiles, gpu_buffers):
    """Each kept config's tiles with the GPU's row and finishing blocks, on the GEMM dtype a
    GPU takes (bf16: the bounded design; fp16: the two-pass design's row kernel), in chunks
    of 128 rows (the last one 2 rows)."""
    gpu_tiles(tile)
    _compare_tiles(name, dtype, chunk=128)


def _gpu_tile_rule(case):
    return dict(case, shape=(GPU_TILE_SHAPE[0], case["shape"][1], GPU_TILE_SHAPE[2]))


@pytest.mark.parametrize("index", [pytest.param(i, id=_rule_id(_gpu_tile_rule(case)),
                                                marks=() if i == 8 else pytest.mark.slow)
                                   for i, case in enumerate(_covering())])
def test_gpu_tiles_layout_rules(index, gpu_tiles, gpu_buffers):
    """Each covering case at N = 130 in chunks of 128 rows, with a kept config's tiles and a
    dtype in turn, the guide's rows clustered (as on a GPU: at this N a random guide has
    cosines within 16-bit rounding of θ). The default run: GIST's four blocks with the guide,
    focal and noise."""
    tiles = _kept_tiles()
    gpu_tiles(tiles[index % len(tiles)])
    _compare_rules(_gpu_tile_rule(_covering()[index]), chunk=128,
                   dtype=GPU_TILE_DTYPES[index % len(GPU_TILE_DTYPES)], clustered=True)


@pytest.mark.parametrize("guided", [False, True], ids=["mnrl", "gist"])
def test_layout_rules_on_a_slice_of_the_batch(guided):
    """One process's rows of a gathered batch (``anchor_offset``, the whole batch's anchors
    as the anchors block, ids of every column): MNRL's four directions, or GIST's blocks and
    guide."""
    from fastcl import layout
    g = torch.Generator().manual_seed(11)
    n_b, n, offset, d = 12, 5, 4, 20
    batch = torch.randn(n_b, d, generator=g)
    a_all, p_all = batch, batch + 0.7 * torch.randn(n_b, d, generator=g)
    a = a_all[offset:offset + n].clone().requires_grad_()
    p, cands = p_all.clone().requires_grad_(), a_all.clone().requires_grad_()
    ids = torch.randint(0, 4, (n_b,), generator=g)
    kw = dict(temperature=0.1, anchor_offset=offset, anchor_candidates=cands,
              duplicate_ids=(ids, None, torch.randint(0, 4, (n_b,), generator=g)))
    if guided:
        gb = torch.randn(n_b, 8, generator=g)
        kw.update(directions=layout.gist(), guide=(gb[offset:offset + n] + 0.3 * torch.randn(n, 8, generator=g),
                                                   gb + 0.3 * torch.randn(n_b, 8, generator=g), None, gb),
                  guide_margin=0.05, focal_m=0.3)
    else:
        kw.update(directions=ALL_DIRECTIONS, hardness_mode="in_batch_negatives", hardness_strength=0.5)
    leaves = [a, p, cands]
    ref = loss_and_grads(lambda: fastcl.contrastive(a, p, backend="reference", **kw), leaves)
    got = loss_and_grads(lambda: fastcl.contrastive(a, p, backend="triton", chunk_size=2, **kw), leaves)
    torch.testing.assert_close(got[0], ref[0], **FP32)
    for x, y in zip(got[1], ref[1]):
        torch.testing.assert_close(x, y, **FP32)
