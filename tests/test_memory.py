"""The tiled path never materializes N×M: a bound on every tensor it allocates.

A dispatch mode sees each op's outputs; the largest one must stay within what the
algorithm guarantees (one R×M chunk, or an N×d / M×d buffer), while the reference
necessarily produces N×M tensors (which also shows the probe works).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastcl

from conftest import correlated, make


class LargestOutput(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


N, D, CHUNK = 256, 8, 16


def _run(fn):
    a = make(N, D)
    p = correlated(a)
    x = make(N, D, seed=5)
    comp = (make(N, 4, seed=6, grad=False), make(N, 4, seed=7, grad=False))
    calls = {
        "infonce": lambda **kw: fastcl.infonce(a, p, **kw),
        "infonce-hard": lambda **kw: fastcl.infonce(a, p, x, hard_negative_weight=1.0, **kw),
        "focal": lambda **kw: fastcl.focal_infonce(a, p, x, **kw),
        "dclr": lambda **kw: fastcl.dclr_loss(a, p, complementary=comp, phi=0.5, noise_ratio=1.0,
                                              generator=torch.Generator().manual_seed(0), **kw),
        "escl": lambda **kw: fastcl.escl_loss(a, p, x, **kw),
    }
    return calls[fn]


@pytest.mark.parametrize("objective", ["infonce", "infonce-hard", "focal", "dclr", "escl"])
def test_tiled_never_holds_n_by_m(objective):
    call = _run(objective)
    m = 2 * N  # every objective here has at most 2N candidates
    with LargestOutput() as probe:
        call(backend="tiled", chunk_size=CHUNK).backward()
    # one chunk of R×M rows is the largest thing allowed (the N×d and M×d buffers are smaller)
    assert probe.largest <= max(CHUNK * m, m * D), probe.largest
    with LargestOutput() as probe_ref:
        call(backend="reference").backward()
    assert probe_ref.largest >= N * N


def test_noise_update_is_chunked():
    a = make(N, D)
    with LargestOutput() as probe:
        fastcl.dclr_noise(a, a, N, steps=4, chunk_size=CHUNK)
    assert probe.largest <= CHUNK * N
