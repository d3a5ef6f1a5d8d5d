"""The public surface: module wrappers, the kernels subpackage, backend dispatch."""

import pytest
import torch

import fastcl

from conftest import correlated, make


def test_public_names():
    for name in ["infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss", "alignment",
                 "uniformity", "InfoNCE", "FocalInfoNCE", "DCLRLoss", "ESCLLoss"]:
        assert callable(getattr(fastcl, name)), name
    for name in ["infonce", "focal_infonce", "dclr_loss", "dclr_noise", "escl_loss"]:
        assert callable(getattr(fastcl.reference, name)), name


def test_kernels_subpackage_is_installed():
    import fastcl.kernels
    assert fastcl.kernels.__name__ == "fastcl.kernels"
    assert isinstance(fastcl.kernels.triton_available(), bool)


def test_modules_match_functional():
    a = make(6, 12, dtype=torch.float64)
    p = correlated(a)
    s = correlated(a, 1.0, seed=3)
    comp = (make(6, 4, dtype=torch.float64, seed=4, grad=False),
            make(6, 4, dtype=torch.float64, seed=5, grad=False))
    z = make(6, 12, dtype=torch.float64, seed=6, grad=False)
    pairs = [
        (fastcl.InfoNCE(temperature=0.1, symmetric=True)(a, p),
         fastcl.infonce(a, p, temperature=0.1, symmetric=True)),
        (fastcl.InfoNCE(hard_negative_weight=0.5)(a, p, s),
         fastcl.infonce(a, p, s, hard_negative_weight=0.5)),
        (fastcl.FocalInfoNCE(m=0.2)(a, p), fastcl.focal_infonce(a, p, m=0.2)),
        (fastcl.DCLRLoss(phi=0.3, noise_steps=2)(a, p, comp, noise=z),
         fastcl.dclr_loss(a, p, complementary=comp, phi=0.3, noise=z, noise_steps=2)),
        (fastcl.ESCLLoss(weight=0.1, rd="margin")(a, p, s),
         fastcl.escl_loss(a, p, s, weight=0.1, rd="margin")),
        # the module's generator draws the noise (test_dclr: a seed's draw is reproducible)
        (fastcl.DCLRLoss(generator=torch.Generator().manual_seed(1))(a, p),
         fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(1))),
    ]
    for got, want in pairs:
        torch.testing.assert_close(got, want)


def test_module_repr_shows_hyper_parameters():
    assert "phi=0.85" in repr(fastcl.DCLRLoss(phi=0.85))
    assert "temperature=0.05" in repr(fastcl.InfoNCE())


def test_auto_backend_is_tiled_on_cpu():
    assert fastcl.resolve_backend("auto", make(4, 8)) == "tiled"
    assert fastcl.resolve_backend("auto", make(4, 8, dtype=torch.float64)) == "tiled"


def test_losses_train_a_linear_encoder():
    """A few optimizer steps on the tiled loss lower it (the gradients point the right way)."""
    torch.manual_seed(0)
    enc = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(enc.parameters(), lr=0.5)
    x = torch.randn(32, 16)
    views = lambda: (torch.nn.functional.dropout(x, 0.1), torch.nn.functional.dropout(x, 0.1))
    g = torch.Generator().manual_seed(0)
    x1, x2 = views()
    first = fastcl.infonce(enc(x1), enc(x2)).item()
    for _ in range(30):
        x1, x2 = views()
        loss = fastcl.dclr_loss(enc(x1), enc(x2), generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x1, x2 = views()
    assert fastcl.infonce(enc(x1), enc(x2)).item() < first


def test_the_public_api_is_fully_annotated():
    """Every public function and module method states its argument and return types, and
    the annotations resolve (py.typed promises that to type checkers)."""
    import inspect
    import typing

    callables = [getattr(fastcl, name) for name in fastcl.__all__ if inspect.isfunction(getattr(fastcl, name))]
    for cls in (fastcl.InfoNCE, fastcl.FocalInfoNCE, fastcl.DCLRLoss, fastcl.ESCLLoss):
        callables += [cls.__init__, cls.forward]
    assert len(callables) >= 16
    for fn in callables:
        hints = typing.get_type_hints(fn)
        params = [p for p in inspect.signature(fn).parameters if p != "self"]
        missing = [p for p in params if p not in hints]
        assert not missing, f"{fn.__qualname__}: no annotation for {missing}"
        assert fn.__name__ == "__init__" or "return" in hints, f"{fn.__qualname__}: no return annotation"


def test_the_integrations_name_a_torch_too_old_for_transformers_5():
    """transformers 5 under torch 2.5 imports with PyTorch switched off, and
    sentence-transformers then fails deep in its import: fastcl's adapters stop first and
    say what to install."""
    from fastcl.integrations import stack_problem
    problem = stack_problem("2.5.1+cu124", "5.24.0")
    assert "torch >= 2.6" in problem and "'transformers<5' 'sentence-transformers<6'" in problem
    assert stack_problem("2.6.0", "5.0.0") is None
    assert stack_problem("2.5.1", "4.57.6") is None
    assert stack_problem("2.13.0+cpu", "5.24.0") is None
    assert stack_problem("2.5.1", None) is None          # no transformers: nothing to say


def test_the_check_at_import_raises_under_that_pair(monkeypatch):
    import importlib.metadata

    import fastcl.integrations as integrations
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "5.24.0" if name == "transformers" else real(name))
    with pytest.raises(ImportError, match=r"transformers 5\.24\.0 needs torch >= 2\.6"):
        integrations.check_stack()
