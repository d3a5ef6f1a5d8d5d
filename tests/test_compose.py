"""Objectives that compose: ``focal_m`` on simcse, simcse-sup and dclr through the one dispatch
(fastcl.objectives), in the trainer (``--focal-m``) and in the sentence-transformers losses;
every loss equals :func:`fastcl.contrastive` with the same options (values and gradients)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

import fastcl
from fastcl import objectives
from fastcl.trainer import loop as train
from test_train import base_args, step_records, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

N, D = 6, 16


def fixed_views(supervised=False, complementary=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    views = {"anchors": torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_(),
             "positives": torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_()}
    if supervised:
        views["negatives"] = torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_()
    if complementary:
        c = torch.randn(N, 8, generator=g, dtype=torch.float64)
        c[1] = c[0] + 0.05 * c[1]  # a near-duplicate pair: the mask drops something at phi 0.5
        views["complementary"] = (c, c)
    return views


def loss_and_grads(fn, views):
    leaves = [v for k, v in views.items() if k != "complementary"]
    for leaf in leaves:
        leaf.grad = None
    loss = fn(views)
    loss.backward()
    return loss.detach(), [leaf.grad.clone() for leaf in leaves]


def assert_equal(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_objective_loss_is_contrastive_with_the_objective_features(backend, monkeypatch):
    # the dispatch passes no backend (auto → tiled on the CPU); the reference backend checks
    # that the options themselves are the right ones, not only the same code path
    real = fastcl.functional.contrastive
    monkeypatch.setattr(objectives, "contrastive", lambda *a, **kw: real(*a, backend=backend, **kw))
    cases = [
        (objectives.Objective("simcse", focal_m=0.3), fixed_views(),
         lambda v: real(v["anchors"], v["positives"], focal_m=0.3)),
        (objectives.Objective("simcse-sup", focal_m=0.3, hard_negative_weight=0.7),
         fixed_views(supervised=True),
         lambda v: real(v["anchors"], v["positives"], v["negatives"], focal_m=0.3,
                        hard_negative_weight=0.7)),
        (objectives.Objective("dclr", focal_m=0.3, phi=0.5, noise_ratio=0.5, noise_steps=2,
                              generator=torch.Generator().manual_seed(4)),
         fixed_views(complementary=True),
         lambda v: real(v["anchors"], v["positives"], focal_m=0.3, complementary=v["complementary"],
                        phi=0.5, noise_ratio=0.5, noise_steps=2,
                        generator=torch.Generator().manual_seed(4))),
        (objectives.Objective("focal", m=0.2), fixed_views(),
         lambda v: real(v["anchors"], v["positives"], focal_m=0.2)),
    ]
    for obj, views, want in cases:
        got = loss_and_grads(lambda v: objectives.objective_loss(obj, v), views)
        assert_equal(got, loss_and_grads(lambda v: want(v), views))
        if obj.method != "focal":  # the focal term is really on: it changes the loss
            plain = objectives.Objective(obj.method, **{k: getattr(obj, k) for k in (
                "phi", "noise_ratio", "noise_steps", "hard_negative_weight")})
            if plain.method == "dclr":
                plain.generator = torch.Generator().manual_seed(4)
            assert abs(float(objectives.objective_loss(plain, views).detach()) - float(got[0])) > 1e-3


def test_focal_m_is_checked_per_method():
    with pytest.raises(ValueError, match="focal_m applies to simcse, simcse-sup, dclr, not to focal"):
        objectives.Objective("focal", focal_m=0.3)
    with pytest.raises(ValueError, match="not to escl"):
        objectives.Objective("escl", focal_m=0.3)
    with pytest.raises(ValueError, match="formulation='released'"):
        objectives.Objective("dclr", focal_m=0.3, formulation="released")


@pytest.mark.parametrize("method", ["dclr", "simcse-sup", "simcse"])
def test_trainer_two_steps_with_focal_m(tiny, tmp_path, method):  # noqa: F811
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, method, steps=2, focal_m=0.3)) == 0
    records = step_records(out)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    config = (out / "fastcl_config.yaml").read_text()
    assert "focal_m: 0.3" in config
    assert "focal_m" in (out / "README.md").read_text()  # the model card lists it


def test_trainer_focal_m_changes_the_loss(tiny, tmp_path):  # noqa: F811
    assert train.main(base_args(tiny, tmp_path / "a", "simcse", steps=1)) == 0
    assert train.main(base_args(tiny, tmp_path / "b", "simcse", steps=1, focal_m=0.3)) == 0
    assert step_records(tmp_path / "a")[0]["loss"] != step_records(tmp_path / "b")[0]["loss"]


@pytest.mark.parametrize("method,extra,message", [
    ("focal", {"focal_m": 0.3}, "--focal-m applies to --method simcse, simcse-sup or dclr only; "
                                "--method focal takes its margin as --m"),
    ("escl", {"focal_m": 0.3}, "--focal-m applies to --method"),
    ("dclr", {"focal_m": 0.3, "dclr_formulation": "released"}, "--focal-m combines with"),
])
def test_trainer_refuses_focal_m_where_it_does_not_apply(tiny, tmp_path, capsys, method, extra,  # noqa: F811
                                                         message):
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", method, **extra))
    assert err.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# sentence-transformers losses: the same options, equal to fastcl.contrastive on their embeddings

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")


@pytest.fixture(scope="module")
def st_model():
    from test_st_cached import load_model
    return load_model()


def _st_case(name, model):
    from fastcl.integrations import sentence_transformers as fst
    from test_st_cached import ANCHORS, NEGATIVES, POSITIVES
    guide_rows = torch.randn(len(ANCHORS), 8, generator=torch.Generator().manual_seed(1))
    if name == "infonce":
        return (fst.FastInfoNCELoss(model, scale=20.0, focal_m=0.3, symmetric=True), [ANCHORS, POSITIVES],
                None, lambda e: fastcl.contrastive(e[0], e[1], temperature=0.05, focal_m=0.3, symmetric=True))
    if name == "infonce-hard":
        return (fst.CachedFastInfoNCELoss(model, focal_m=0.3, hard_negative_weight=0.5, mini_batch_size=4),
                [ANCHORS, POSITIVES, NEGATIVES], None,
                lambda e: fastcl.contrastive(e[0], e[1], e[2], focal_m=0.3, hard_negative_weight=0.5))
    if name == "focal-hard":
        return (fst.FastFocalInfoNCELoss(model, m=0.2, hard_negative_weight=0.5), [ANCHORS, POSITIVES, NEGATIVES],
                None, lambda e: fastcl.contrastive(e[0], e[1], e[2], focal_m=0.2, hard_negative_weight=0.5))
    loss = fst.FastDCLRLoss(model, model, phi=0.5, noise_ratio=0.5, noise_steps=2, focal_m=0.3,
                            generator=torch.Generator().manual_seed(2))
    comp = (guide_rows, guide_rows)
    return (loss, [ANCHORS, POSITIVES], comp,
            lambda e: fastcl.contrastive(e[0], e[1], focal_m=0.3, complementary=comp, phi=0.5,
                                         noise_ratio=0.5, noise_steps=2,
                                         generator=torch.Generator().manual_seed(2)))


@pytest.mark.parametrize("name", ["infonce", "infonce-hard", "focal-hard", "dclr"])
def test_sentence_transformers_losses_take_the_options(st_model, name):
    from test_st_cached import features
    loss_fn, columns, comp, want = _st_case(name, st_model)
    st_model.eval()
    with torch.no_grad():
        emb = [st_model(f)["sentence_embedding"] for f in features(st_model, columns)]
    emb = [e.clone().requires_grad_() for e in emb]
    kw = {"complementary": comp} if comp is not None else {}
    got = loss_fn.compute_loss_from_embeddings(emb, None, **kw)
    got_grads = torch.autograd.grad(got, emb)
    expected = want(emb)
    want_grads = torch.autograd.grad(expected, emb)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    config = loss_fn.get_config_dict()
    assert config.get("focal_m", config.get("m")) in (0.3, 0.2)
    if name == "focal-hard":
        assert config["hard_negative_weight"] == 0.5
        with pytest.raises(ValueError, match="exactly one negative column"):
            loss_fn.compute_loss_from_embeddings(emb[:2], None)
