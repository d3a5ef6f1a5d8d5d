"""With ``fastcl.set_input_checks(False)`` nothing in a call reads a tensor's value on the
host (forward and backward, DCLR's noise update included), so a GPU never idles for the host
inside a call. With the checks on (the default), a call reads once: the NaN/Inf tests of all
its inputs together.

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


def _more_calls(n=24, d=16):
    """Calls with more inputs: each of them one more read before the scan was fused."""
    (a, p, x), calls = _calls(n, d)
    c = (make(n, 6, seed=6, grad=False), make(n, 6, seed=7, grad=False))
    g = tuple(make(n, 5, seed=s, grad=False) for s in (8, 9, 10))
    ids = torch.arange(n) % (n - 2)
    return {
        **calls,
        "dclr drawn noise": lambda **kw: fastcl.dclr_loss(
            a, p, complementary=c, phi=0.5, noise_steps=2,
            generator=torch.Generator().manual_seed(0), **kw),
        "dclr released": lambda **kw: fastcl.dclr_loss(a, p, complementary=c, noise=x,
                                                       noise_steps=2, formulation="released", **kw),
        "dclr_noise": lambda **kw: fastcl.dclr_noise(a, p, None, noise=x, steps=2, **kw).sum(),
        "escl": lambda **kw: fastcl.escl_loss(a, p, x, **kw),
        "escl ids": lambda **kw: fastcl.escl_loss(a, p, x, duplicate_ids=ids, **kw),
        "gist": lambda **kw: fastcl.contrastive(
            a, p, x, guide=g, directions=("query_to_doc", "query_to_query"), **kw),
        "symmetric": lambda **kw: fastcl.infonce(a, p, symmetric=True, **kw),
    }


@pytest.mark.parametrize("backend", ["tiled", "triton"])
@pytest.mark.parametrize("name", list(_more_calls()))
def test_one_host_read_with_input_checks(name, backend, host_reads):
    """One read for the call, forward and backward: the NaN/Inf tests of every input (the
    embeddings, the negatives, the complementary pair, the noise, the guide) together."""
    if backend == "triton":
        pytest.importorskip("triton")
    call = _more_calls()[name]
    with host_reads:
        loss = call(backend=backend, chunk_size=8)
        if loss.requires_grad:              # (dclr_noise's noise has no graph)
            loss.backward()
    assert host_reads.count == 1


def test_metrics_read_once(host_reads):
    x, y = make(12, 8), make(12, 8, seed=1)
    with host_reads:
        fastcl.alignment(x, y)
    assert host_reads.count == 1


@pytest.mark.parametrize("bad", ["positives", "negatives", "complementary[1]", "noise",
                                 "guide[1] (positives)"])
def test_the_one_read_names_the_input(bad):
    """The fused scan raises the error the input's own check raised: the first bad input,
    named, before any work."""
    n, d = 10, 8
    inputs = {"positives": make(n, d, seed=1), "negatives": make(n, d, seed=2),
              "complementary[1]": make(n, 4, seed=3), "noise": make(5, d, seed=4),
              "guide[1] (positives)": make(n, 3, seed=5)}
    inputs[bad] = inputs[bad].detach().clone()
    inputs[bad][3, 1] = float("nan")
    a = make(n, d)
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(bad)} contains NaN or Inf"):
        fastcl.contrastive(a, inputs["positives"], inputs["negatives"],
                           complementary=(make(n, 4, seed=6), inputs["complementary[1]"]),
                           noise=inputs["noise"], noise_steps=1,
                           guide=(make(n, 3, seed=7), inputs["guide[1] (positives)"],
                                  make(n, 3, seed=8)), backend="tiled")


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


@pytest.mark.parametrize("backend", ["tiled", "triton"])
def test_huge_rows_rerun_draws_the_same_noise(backend, host_reads):
    """Rows too large to square make the call start again, reading each input as it is
    checked (which rescales them): nothing was drawn before the fused read, so the noise
    that the generator gives is the one the rows at scale 1 get."""
    if backend == "triton":
        pytest.importorskip("triton")
    a, p = make(12, 8, grad=False), correlated(make(12, 8, grad=False))
    seeded = lambda x, y: fastcl.dclr_loss(x, y, noise_steps=2, backend=backend,   # noqa: E731
                                           generator=torch.Generator().manual_seed(3))
    want = seeded(a, p)
    host_reads.count = 0                       # (its tolist counts from the fixture on)
    with host_reads:
        got = seeded(a * 1e20, p * 1e20)
    assert host_reads.count == 1 + 2           # the fused read, then one per input on the rerun
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
