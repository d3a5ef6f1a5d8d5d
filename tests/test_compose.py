"""Objectives that compose: ``focal_m`` on simcse, simcse-sup and dclr, in the trainer
(``--focal-m``) and in the sentence-transformers losses; every loss equals
:func:`fastcl.contrastive` with the same options (values and gradients)."""

import pytest
import torch

import fastcl
from fastcl.trainer import run as train
from test_train import base_args, step_records, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "outside")  # trainer tests: nothing written outside tmp_path


@pytest.mark.parametrize("method", ["dclr", "simcse-sup", "simcse"])
def test_trainer_two_steps_with_focal_m(tiny, tmp_path, method):  # noqa: F811
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, method, steps=2, focal_m=0.3)) == 0
    records = step_records(out)
    assert len(records) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    config = (out / "fastcl_config.yaml").read_text()
    assert "focal_m: 0.3" in config
    assert "focal_m" in (out / "model" / "README.md").read_text()  # the model card lists it


def test_trainer_focal_m_changes_the_loss(tiny, tmp_path):  # noqa: F811
    assert train.main(base_args(tiny, tmp_path / "a", "simcse", steps=1)) == 0
    assert train.main(base_args(tiny, tmp_path / "b", "simcse", steps=1, focal_m=0.3)) == 0
    assert step_records(tmp_path / "a")[0]["loss"] != step_records(tmp_path / "b")[0]["loss"]


@pytest.mark.parametrize("method,extra,message", [
    ("focal", {"focal_m": 0.3}, "--focal_m applies to --method simcse, simcse-sup or dclr only; "
                                "--method focal takes its margin as --m"),
    ("escl", {"focal_m": 0.3}, "--focal_m applies to --method"),
    ("dclr", {"focal_m": 0.3, "dclr_formulation": "released"}, "got --focal_m as well"),
])
def test_trainer_refuses_focal_m_where_it_does_not_apply(tiny, tmp_path, capsys, method, extra,  # noqa: F811
                                                         message):
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", method, **extra))
    # by the parser (exit status 2) or where the loss is built (the one line of the exit)
    assert message in (capsys.readouterr().err if err.value.code == 2 else err.value.code)


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
