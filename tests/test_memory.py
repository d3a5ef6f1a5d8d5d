"""The tiled path never materializes N×M: a bound on every tensor it allocates.

A dispatch mode sees each op's outputs; the largest one must stay within what the
algorithm guarantees (one R×M chunk, or an N×d / M×d buffer), while the reference
necessarily produces N×M tensors (which also shows the probe works).
"""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastcl
from fastcl import tiled

from conftest import correlated, make, needs_st6


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


class PeakLive(TorchDispatchMode):
    """The most bytes that storages allocated inside the mode held at once. A storage counts
    from the op that created it until the last tensor made inside the mode that uses it (the
    op's output, its views, in-place results) is freed; views of tensors made outside the
    mode (the inputs) count nothing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._owned = {}                   # storage address -> [bytes, tensors alive]

    def _release(self, ptr):
        entry = self._owned[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._owned[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        outside = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._owned:
                if ptr in outside:         # a view of, or a write into, a tensor made outside
                    continue
                self._owned[ptr] = [t.untyped_storage().nbytes(), 0]
                self.live += self._owned[ptr][0]
                self.peak = max(self.peak, self.live)
            self._owned[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


@pytest.mark.parametrize("objective", ["infonce", "focal"])
def test_one_chunk_buffer_at_a_time(objective):
    """A call of several chunks holds one chunk's R×M buffers at a time: the previous chunk's
    are freed before the next chunk allocates its own (both at once doubled the peak)."""
    n, d, rows = 512, 8, 128
    a, p = make(n, d), correlated(make(n, d))
    ep = tiled.Epilogue(0.05, focal_m=0.3 if objective == "focal" else None, chunk_size=rows)
    chunk = tiled.TORCH.row_bytes(ep, torch.float32, n, n) * rows
    with PeakLive() as probe:
        tiled.contrastive_forward(ep, a.detach(), (p.detach(),), need=(True, True))
    # one chunk's buffers, and the N×d / M×d gradient buffers and small vectors beside them
    assert probe.peak <= chunk + 8 * n * d * 4 + 64 * 2**10, (probe.peak, chunk)


@needs_st6   # the bench's GISTEmbedLoss case embeds through version 6's embed_columns
def test_tensor_memory_counts_fake_tensors_as_real_ones():
    """bench/tensor_memory.py's figure at sizes nothing can run: the peak of live tensor bytes
    under FakeTensorMode equals the count on real tensors, byte for byte, for fastcl and for
    sentence-transformers' GISTEmbedLoss (whose N×N×d broadcast shows in it)."""
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "bench")
    sys.path.insert(0, bench)
    try:
        import tensor_memory
    finally:
        sys.path.remove(bench)
    pytest.importorskip("sentence_transformers")
    n, d = 96, 24     # large enough that the losses' shapes, not fixed overheads, set the peaks
    peaks = {}
    for impl in ("fastcl", "gistembed"):
        fake = tensor_memory.tensor_peak("gist", impl, n, d, "float32", fake=True)
        real = tensor_memory.tensor_peak("gist", impl, n, d, "float32", fake=False)
        assert fake["peak_mib"] == real["peak_mib"] > 0
        peaks[impl] = fake["peak_mib"]
    with pytest.raises(ValueError, match="NaN"):      # the input checks are on again
        fastcl.infonce(torch.full((2, 3), float("nan")), torch.ones(2, 3))
    # GISTEmbedLoss's blocks each broadcast an N×N×d product: fastcl holds far less
    assert peaks["gistembed"] > 4 * n * n * d * 4 / 2**20
    assert peaks["gistembed"] > 10 * peaks["fastcl"]
