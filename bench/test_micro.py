"""Micro-benchmarks (pytest-benchmark): one forward+backward of each objective per
implementation at one fixed size, plus the matmul of the same FLOP count.

    python -m pytest bench/ --benchmark-only                         # run them
    python -m pytest bench/ --benchmark-only --benchmark-group-by=group --benchmark-columns=min,median,max,rounds
    python -m pytest bench/ --benchmark-only --benchmark-save=NAME    # keep for --benchmark-compare

The unit tests (plain ``python -m pytest``: pyproject.toml's testpaths, which name bench/'s
test_alternatives.py and test_stages.py only) never collect this file. Sizes: N=1024, d=384, float32 on CPU; N=8192, d=768,
bfloat16 on CUDA (set ``FASTCL_MICRO_N`` / ``FASTCL_MICRO_D`` to change them). On CUDA each
call ends with ``torch.cuda.synchronize()`` so that the wall time covers the kernels.
Each benchmark records its useful FLOPs and achieved TFLOP/s in ``extra_info``.
For the sweeps, plots and the fresh-process memory figures, use ``bench/run.py``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("pytest_benchmark")
torch = pytest.importorskip("torch")

import _checkout  # noqa: E402,F401  (fastcl.kernels importable from a bare checkout)
from _cases import MNRL_OBJECTIVES, OBJECTIVES, build, num_candidates  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
N = int(os.environ.get("FASTCL_MICRO_N", 8192 if CUDA else 1024))
D = int(os.environ.get("FASTCL_MICRO_D", 768 if CUDA else 384))
DTYPE = "bfloat16" if CUDA else "float32"
IMPLS = ["fastcl", "reference"] + (["tiled"] if CUDA else [])


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _cases():
    for objective in OBJECTIVES:
        for impl in IMPLS + (["mnrl"] if objective in MNRL_OBJECTIVES else []):
            yield pytest.param(objective, impl, id=f"{objective}-{impl}")


@pytest.mark.parametrize("objective,impl", list(_cases()))
def test_loss(benchmark, objective, impl):
    case = build(objective, impl, N, D, DTYPE, DEVICE)

    def call():
        out = case.step()
        _sync()
        return out

    benchmark.group = f"{objective} N={N} M={case.m} d={D} {DTYPE} {DEVICE}"
    benchmark.extra_info.update(backend=case.backend, useful_flops=case.flops)
    benchmark.pedantic(call, rounds=5 if not CUDA else 20, warmup_rounds=1, iterations=1)
    benchmark.extra_info["tflops_at_median"] = case.flops / benchmark.stats.stats.median / 1e12


@pytest.mark.parametrize("objective", ["infonce", "infonce-hard"])
def test_matmul_of_same_flops(benchmark, objective):
    """The physical limit: three (N×d)@(d×M) products, the 6·N·M·d FLOPs of one call."""
    m = num_candidates(objective, N)
    dt = getattr(torch, DTYPE)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    a = torch.randn(N, D, generator=g, device=DEVICE).to(dt)
    b = torch.randn(D, m, generator=g, device=DEVICE).to(dt)
    out = torch.empty(N, m, device=DEVICE, dtype=dt)

    def call():
        for _ in range(3):
            torch.mm(a, b, out=out)
        _sync()

    benchmark.group = f"{objective} N={N} M={m} d={D} {DTYPE} {DEVICE}"
    benchmark.extra_info["useful_flops"] = 6.0 * N * m * D
    benchmark.pedantic(call, rounds=5 if not CUDA else 20, warmup_rounds=1, iterations=1)
    benchmark.extra_info["tflops_at_median"] = 6.0 * N * m * D / benchmark.stats.stats.median / 1e12
