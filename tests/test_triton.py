"""The Triton kernels' own behaviour, beside the grid of tests/test_matches_reference.py:
the noise update's fused step, the bounded and two-pass designs, chunk sizing on CUDA, the
GPU's tiles launched in the interpreter, and (skipped without CUDA; the grid's larger shapes
are its ``gpu`` cases) each kept autotune config, a batch far beyond N×M memory, determinism.
Tolerances as the grid's: 1e-4 in float32; 16-bit: the loss 2e-2 relative, gradients 3e-2 of
their largest entry."""

import pytest
import torch

import fastcl

from conftest import DEVICE, correlated, inputs, loss_and_grads, make, needs_gpu, objectives
from conftest import TRITON_TOL as FP32
from test_matches_reference import (ALL_DIRECTIONS, DTYPES_16, NAMES, POSITIVE_NOISE_16,
                                    RULES_COVERING, Objective, check)

triton = pytest.importorskip("triton")


def _compare(name, n, k, d, dtype=torch.float32, chunk=None, noise=0.7):
    """The objective ``name`` on Triton against the reference (the grid's ``check``)."""
    leaves, call = Objective(name, n, k, d, noise).build(dtype, DEVICE)
    check(call, leaves, "triton", chunk)


def _compare_rules(case, chunk=5, dtype=torch.float32):
    leaves, call = case.build(dtype, DEVICE)
    check(call, leaves, "triton", chunk)


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


# --------------------------------------------------------------------------- GPU only
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
        _compare(name, 517, 300, 1024, dtype=dtype)


@needs_gpu
@pytest.mark.parametrize("name", ["infonce", "dclr-weighted"])
def test_gpu_16384_matches_reference(name):
    """The loss and gradients at the benchmark's size, bf16, against the float32 reference."""
    _compare(name, 16384, 0, 768, dtype=torch.bfloat16)


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
        a, p, x = (t.detach().cuda().requires_grad_() for t in inputs(n, k, d, torch.bfloat16))
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
@pytest.fixture
def launches(monkeypatch):
    """Launches of each Triton kernel, by name."""
    from fastcl.kernels import contrastive as kc
    seen = {}
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


@pytest.mark.parametrize("design", ["bounded", "two-pass"])
@pytest.mark.parametrize("name", ["infonce", "infonce-hard", "focal-negatives", "dclr-weighted"])
def test_chunk_designs(name, design, launches, monkeypatch):
    """Where every logit is bounded (unit rows: l ≤ 1/τ, focal (1+m)/τ, plus a hard
    negative's log-weight) the chunk needs no pass over its R×M rows: the similarity kernel
    sums exp(l − B) per tile and one launch a chunk finishes the rows from those partials.
    Past the spread exp(l − B) may underflow (τ below 0.025 for InfoNCE; forced here): the
    two-pass design runs its row kernel a chunk instead. Both match the reference."""
    from fastcl.kernels import contrastive as kc
    if design == "two-pass":
        monkeypatch.setattr(kc, "BOUND_SPREAD", 0.0)
    _compare(name, 17, 16, 24, chunk=7)
    used, unused = (("_row_finish_kernel", "_row_kernel") if design == "bounded"
                    else ("_row_kernel", "_row_finish_kernel"))
    assert launches.get(used, 0) == 3 and unused not in launches      # N = 17 in chunks of 7


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
    a = a.detach().to(DEVICE).requires_grad_()
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


def test_rules_refused_beside_what_the_kernels_lack():
    """The rules beside a hard-negative weight or DCLR's mask: refused on backend='triton'
    with the reason, run tiled by 'auto'. Matryoshka runs a kernel call per width."""
    a, p, x = (t.detach().to(DEVICE) for t in inputs(5, 5, 12, torch.float32))
    kw = dict(directions=("query_to_doc", "query_to_query"))
    for extra, name in ((dict(hard_negative_weight=0.5), "hard_negative_weight"),
                        (dict(complementary=(a, p), phi=0.5), "complementary")):
        with pytest.raises(ValueError, match=f"backend='triton' does not compute {name}"):
            fastcl.contrastive(a, p, x, backend="triton", **kw, **extra)
        torch.testing.assert_close(fastcl.contrastive(a, p, x, backend="auto", **kw, **extra),
                                   fastcl.contrastive(a, p, x, backend="reference", **kw, **extra))


#: Every covering case in bf16; in fp32 and fp16 the paired ones, with and without focal
#: and the guide (each flag set, its own autotune list).
GPU_RULES = ([(i, torch.bfloat16) for i in range(len(RULES_COVERING))]
             + [(i, torch.float32) for i in (1, 4, 8, 9)] + [(i, torch.float16) for i in (4, 8)])


@needs_gpu
@pytest.mark.parametrize("index,dtype", GPU_RULES, ids=[f"{i}-{str(d)[6:]}" for i, d in GPU_RULES])
def test_gpu_layout_rules(index, dtype):
    """The covering cases at N = 1000 (chunks of 384 rows: a short last one), d = 384."""
    _compare_rules(RULES_COVERING[index].resized(1000, 384), chunk=384, dtype=dtype)


def test_guide_cast_once_a_call(gpu_buffers, monkeypatch):
    """The guide's unit rows reach every chunk's kernels in the GEMM dtype, one tensor for
    the whole call (cast once, not per chunk); and the call matches the reference, its GEMM
    in bf16 (the grid's bf16 16-bit case of this rule, test_matches_reference.grid_16bit)."""
    from fastcl.kernels import contrastive as kc
    taken = []
    rules = kc._rules
    monkeypatch.setattr(kc, "_rules", lambda ep, c: taken.append(ep.guide[:2]) or rules(ep, c))
    _compare_rules(RULES_COVERING[8], chunk=5, dtype=torch.bfloat16)
    assert len(taken) >= 4                     # N = 19 in chunks of 5
    assert all(t.dtype == torch.bfloat16 for pair in taken for t in pair)
    assert len({(pair[0].data_ptr(), pair[1].data_ptr()) for pair in taken}) == 1
    assert set(gpu_buffers) == {torch.bfloat16}


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


def _tile_cases(tiles, names, every=1):
    """Every tile × dtype × objective; the default run takes every ``every``-th tile (and
    the last) once, with the objectives and dtypes in turn (``-m slow``: all)."""
    return [pytest.param(tile, name, dtype, id=f"{tile[0]}x{tile[1]}-{name}-{str(dtype)[6:]}",
                         marks=() if ((i % every == 0 or i == len(tiles) - 1)
                                      and name == names[i % len(names)]
                                      and dtype == GPU_TILE_DTYPES[i % len(GPU_TILE_DTYPES)])
                         else pytest.mark.slow)
            for i, tile in enumerate(tiles) for dtype in GPU_TILE_DTYPES for name in names]


@pytest.mark.parametrize("tile,name,dtype", _tile_cases(_kept_tiles(), NAMES))
def test_gpu_tiles_match_reference(tile, name, dtype, gpu_tiles, gpu_buffers):
    """Each kept config's tiles with the GPU's row and finishing blocks, on the GEMM dtype a
    GPU takes (bf16: the bounded design; fp16: the two-pass design's row kernel), in chunks
    of 128 rows (the last one 2 rows)."""
    gpu_tiles(tile)
    _compare(name, *GPU_TILE_SHAPE, dtype=dtype, chunk=128, noise=POSITIVE_NOISE_16)


@pytest.mark.parametrize("index", [pytest.param(i, id=case.resized(*GPU_TILE_SHAPE[::2]).id,
                                                marks=() if i == 8 else pytest.mark.slow)
                                   for i, case in enumerate(RULES_COVERING)])
def test_gpu_tiles_layout_rules(index, gpu_tiles, gpu_buffers):
    """Each covering case at N = 130 in chunks of 128 rows, with a kept config's tiles and a
    dtype in turn, the guide's rows clustered (as on a GPU: at this N a random guide has
    cosines within 16-bit rounding of θ). The default run: GIST's four blocks with the guide,
    focal and noise."""
    tiles = _kept_tiles()
    gpu_tiles(tiles[index % len(tiles)])
    _compare_rules(RULES_COVERING[index].resized(*GPU_TILE_SHAPE[::2]), chunk=128,
                   dtype=GPU_TILE_DTYPES[index % len(GPU_TILE_DTYPES)])


@pytest.mark.parametrize("guided", [False, True], ids=["mnrl", "gist"])
def test_layout_rules_on_a_slice_of_the_batch(guided):
    """One process's rows of a gathered batch (``anchor_offset``, the whole batch's anchors
    as the anchors block, ids of every column): MNRL's four directions, or GIST's blocks and
    guide."""
    from fastcl import layout
    g = torch.Generator().manual_seed(11)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)  # noqa: E731
    n_b, n, offset, d = 12, 5, 4, 20
    batch = randn(n_b, d)
    a_all, p_all = batch, batch + 0.7 * randn(n_b, d)
    a = a_all[offset:offset + n].clone().requires_grad_()
    p, cands = p_all.clone().requires_grad_(), a_all.clone().requires_grad_()
    ids = lambda: torch.randint(0, 4, (n_b,), generator=g).to(DEVICE)  # noqa: E731
    kw = dict(temperature=0.1, anchor_offset=offset, anchor_candidates=cands,
              duplicate_ids=(ids(), None, ids()))
    if guided:
        gb = randn(n_b, 8)
        kw.update(directions=layout.gist(), guide=(gb[offset:offset + n] + 0.3 * randn(n, 8),
                                                   gb + 0.3 * randn(n_b, 8), None, gb),
                  guide_margin=0.05, focal_m=0.3)
    else:
        kw.update(directions=ALL_DIRECTIONS, hardness_mode="in_batch_negatives", hardness_strength=0.5)
    leaves = [a, p, cands]
    ref = loss_and_grads(lambda: fastcl.contrastive(a, p, backend="reference", **kw), leaves)
    got = loss_and_grads(lambda: fastcl.contrastive(a, p, backend="triton", chunk_size=2, **kw), leaves)
    torch.testing.assert_close(got[0], ref[0], **FP32)
    for x, y in zip(got[1], ref[1]):
        torch.testing.assert_close(x, y, **FP32)
