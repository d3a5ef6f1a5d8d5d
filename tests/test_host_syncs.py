"""With ``fastcl.set_input_checks(False)`` nothing in a call reads a tensor's value on the
host (forward and backward, DCLR's noise update included), so a GPU never idles for the host
inside a call.

On a CPU the reads are counted where they would be syncs on a GPU: ops that turn a tensor
into a Python number (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``) and
``Tensor.tolist``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fastcl

from conftest import correlated, make


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    probe = HostReads()
    tolist = torch.Tensor.tolist

    def counted(self):
        probe.count += 1
        return tolist(self)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return probe


def _calls(n=24, d=16):
    a, p = make(n, d), correlated(make(n, d))
    x = make(n, d, seed=4)
    c = (make(n, 6, seed=6, grad=False), make(n, 6, seed=7, grad=False))
    return (a, p, x), {
        "infonce": lambda **kw: fastcl.infonce(a, p, **kw),
        "hard": lambda **kw: fastcl.infonce(a, p, x, hard_negative_weight=0.5, **kw),
        "focal": lambda **kw: fastcl.focal_infonce(a, p, x, **kw),
        "dclr": lambda **kw: fastcl.dclr_loss(a, p, complementary=c, phi=0.5, noise=x,
                                              noise_steps=2, **kw),
    }


@pytest.mark.parametrize("backend", ["tiled", "triton"])
@pytest.mark.parametrize("name", ["infonce", "hard", "focal", "dclr"])
def test_no_host_read_without_input_checks(name, backend, host_reads):
    if backend == "triton":
        pytest.importorskip("triton")
    leaves, calls = _calls()
    previous = fastcl.set_input_checks(False)
    try:
        with host_reads:
            loss = calls[name](backend=backend, chunk_size=8)
            loss.backward()
    finally:
        fastcl.set_input_checks(previous)
    assert host_reads.count == 0
