"""A learnable temperature: ``temperature`` a 0-dim tensor that requires grad.

∂L/∂τ on every backend equals autograd through the reference (the ``options-tau`` cases of
tests/test_matches_reference.py's grid, over every feature), which equals the
literal formula ``−(1/τ²)·(1/N)·Σ_ij (p_ij − y_ij)·f_ij``, f the logits' numerator: s, or
focal's s² on the positive and s(s+m) elsewhere); the reference passes float64 gradcheck.
Tolerances: the reference against the formula 1e-9 (relative), tiled float64
``conftest.TOL[float64]``, Triton's interpreter on float32 inputs ``atol = rtol = 1e-4``.
"""

import logging

import pytest
import torch

import fastcl

from conftest import ST_VERSION, TOL, TRITON_TOL, correlated, make, needs_triton, st_train
from test_matches_reference import TAU_SHAPES

TAU = 0.2
#: the sentence-transformers losses take learnable_temperature from 6.2, whose trainer clears the
#: gradients of the parameters a loss owns each step (they refuse it on earlier releases)
ST_LEARNS = ST_VERSION is None or ST_VERSION >= (6, 2)
needs_st62 = pytest.mark.skipif(not ST_LEARNS, reason="learnable_temperature needs sentence-transformers "
                                                       ">= 6.2 (its trainer zero-grads a loss's own parameters)")


def _literal(a, p, x, tau, focal_m=None):
    """−(1/τ²)·(1/N)·Σ_ij (p_ij − y_ij)·f_ij, in float64, from the whole matrix."""
    s = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(
        torch.cat([p, x]), dim=1).T
    eye = torch.zeros_like(s, dtype=torch.bool)
    eye[range(a.shape[0]), range(a.shape[0])] = True
    f = s if focal_m is None else torch.where(eye, s * s, s * (s + focal_m))
    y = eye.double()
    return -((torch.softmax(f / tau, dim=1) - y) * f).sum() / (tau * tau * a.shape[0])


@pytest.mark.parametrize("focal_m", [None, 0.3])
@pytest.mark.parametrize("shape", TAU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_reference_is_the_literal_formula_and_passes_gradcheck(shape, focal_m):
    n, k, d = shape
    a, x = make(n, d, dtype=torch.float64, grad=False), make(k, d, dtype=torch.float64, seed=3, grad=False)
    p = correlated(a, 0.8)
    tau = torch.tensor(TAU, dtype=torch.float64, requires_grad=True)
    loss = fastcl.contrastive(a, p, x, temperature=tau, focal_m=focal_m, backend="reference")
    (got,) = torch.autograd.grad(loss, tau)
    want = _literal(a, p, x, TAU, focal_m)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-9)
    assert torch.autograd.gradcheck(
        lambda t: fastcl.contrastive(a, p, x, temperature=t, focal_m=focal_m, backend="reference"),
        (tau,))


@pytest.mark.parametrize("backend", ["tiled", pytest.param("triton", marks=needs_triton)])
def test_only_the_temperature_learns(backend):
    """Embeddings without grad: the backward still forms the rows' sums ∂L/∂τ reads."""
    dtype = torch.float64 if backend == "tiled" else torch.float32
    a, x = make(7, 5, dtype=dtype, grad=False), make(7, 5, dtype=dtype, seed=3, grad=False)
    p = correlated(a, 0.8)
    tau = torch.tensor(TAU, dtype=dtype, requires_grad=True)
    (got,) = torch.autograd.grad(fastcl.infonce(a, p, x, temperature=tau, backend=backend), tau)
    want = _literal(a.double(), p.double(), x.double(), TAU)
    torch.testing.assert_close(got.double(), want, **(TOL[dtype] if backend == "tiled" else TRITON_TOL))
    if backend == "tiled":
        assert torch.autograd.gradcheck(lambda t: fastcl.infonce(a, p, x, temperature=t, backend="tiled"),
                                        (tau,))


def test_infonce_dclr_and_escl_take_it_too():
    a, p = make(6, 4, dtype=torch.float64), correlated(make(6, 4, dtype=torch.float64))
    s = correlated(a, 1.0, seed=5).detach()
    for fn in (lambda t, be: fastcl.infonce(a, p, temperature=t, symmetric=True, backend=be),
               lambda t, be: fastcl.dclr_loss(a, p, temperature=t, noise=p.detach(), noise_steps=1,
                                              backend=be),
               lambda t, be: fastcl.escl_loss(a, p, s, temperature=t, backend=be)):
        got, want = ((tau := torch.tensor(TAU, dtype=torch.float64, requires_grad=True),
                      torch.autograd.grad(fn(tau, be), (tau, a, p)))[1] for be in ("tiled", "reference"))
        torch.testing.assert_close(got, want, **TOL[torch.float64])


# --------------------------------------------------------------------------- sentence-transformers

def _st_model(tmp_path):
    st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")
    from test_evaluate import make_tiny_model
    return st.SentenceTransformer(str(make_tiny_model(tmp_path / "bert")), device="cpu")


@needs_st62
def test_st_losses_learn_their_temperature_in_the_trainer(tmp_path):
    """The loss's log_scale is in the trainer's optimizer, moves over a few steps, and the
    cached loss gives it the plain loss's gradient through GradCache's two passes."""
    from fastcl.integrations.sentence_transformers import CachedFastInfoNCELoss, FastInfoNCELoss
    from test_evaluate import random_sentence
    import random
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    model = _st_model(tmp_path)
    rng = random.Random(0)
    sentences = [random_sentence(rng) for _ in range(16)]
    embs = [torch.randn(8, 32, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    losses = [cls(model, scale=20.0, learnable_temperature=True, backend="tiled")
              for cls in (FastInfoNCELoss, CachedFastInfoNCELoss)]
    model.eval()          # the same embeddings in both passes
    features = [model.tokenize(sentences[:8]), model.tokenize(sentences[8:])]
    for loss in losses:
        assert loss.current_temperature == pytest.approx(0.05)
        loss([dict(f) for f in features], None).backward()
    torch.testing.assert_close(losses[1].log_scale.grad, losses[0].log_scale.grad)
    want = torch.autograd.grad(fastcl.contrastive(
        *embs, temperature=torch.exp(-losses[0].log_scale), backend="reference"), losses[0].log_scale)
    got = torch.autograd.grad(losses[0].compute_loss_from_embeddings(embs), losses[0].log_scale)
    torch.testing.assert_close(got, want)

    model.train()
    loss = FastInfoNCELoss(model, learnable_temperature=True, backend="tiled")
    trainer, _ = st_train(model, loss, tmp_path / "out", steps=3, learning_rate=0.05,
                          dataloader_drop_last=True)     # (the sentences above)
    assert any(p is loss.log_scale for group in trainer.optimizer.param_groups for p in group["params"])
    assert loss.current_temperature != pytest.approx(0.05, rel=1e-3)
    assert loss.get_config_dict()["learnable_temperature"] is True


def test_st_losses_refuse_a_bad_option_where_they_are_built(tmp_path):
    """Every option through build_spec's checks at construction, named as the constructor
    names it (the spec calls focal's m focal_m and GIST's margin guide_margin)."""
    from fastcl.integrations.sentence_transformers import (FastFocalInfoNCELoss, FastGISTEmbedLoss,
                                                           FastInfoNCELoss)
    model = _st_model(tmp_path)
    for build, match in [
            (lambda: FastInfoNCELoss(model, hardness_mode="easy"), r"^hardness_mode must be one of"),
            (lambda: FastInfoNCELoss(model, matryoshka_dims=(4, 4)), r"^matryoshka_dims has a width twice"),
            (lambda: FastInfoNCELoss(model, backend="cuda"), r"^backend must be one of"),
            (lambda: FastInfoNCELoss(model, false_negative_margin=float("nan")),
             r"^false_negative_margin must be finite"),
            (lambda: FastInfoNCELoss(model, positive_prior=1.0), r"^positive_prior .* must lie in \[0, 1\)"),
            (lambda: FastInfoNCELoss(model, positive_prior=0.1, symmetric=True),
             r"^positive_prior debiases a row's one softmax"),
            (lambda: FastFocalInfoNCELoss(model, positive_prior=-0.1), r"^positive_prior .* must lie"),
            (lambda: FastFocalInfoNCELoss(model, m=float("nan")), r"^m must be finite"),
            (lambda: FastFocalInfoNCELoss(model, learnable_temperature=True, backend="triton"),
             r"learnable temperature .* with m has its gradient on backend='reference' or 'tiled'"
             if ST_LEARNS else r"^learnable_temperature needs sentence-transformers >= 6.2"),
            (lambda: FastGISTEmbedLoss(model, model, margin=float("inf")), r"^margin must be finite")]:
        with pytest.raises((TypeError, ValueError), match=match):
            build()


@needs_st62
def test_fastcl_train_learns_logs_and_checkpoints_the_temperature(tiny, tmp_path, monkeypatch):
    """fastcl-train --learnable_temperature (at --temperature_learning_rate): the value in each
    step's log record, moving; each checkpoint holds it and a resumed trainer takes it back."""
    from fastcl.trainer import run as train
    from fastcl.trainer.build import Trainer
    from fastcl.trainer.run import read_log
    from test_train import base_args
    out = tmp_path / "run"
    assert train.main(base_args(tiny, out, steps=4, learnable_temperature=True, save_steps=2,
                                temperature=0.1, temperature_learning_rate=0.05)) == 0
    assert "temperature_learning_rate: 0.05" in (out / "fastcl_config.yaml").read_text()
    values = [r["temperature"] for r in read_log(out) if r["type"] == "step"]
    assert len(values) == 4 and values[-1] != pytest.approx(0.1, rel=1e-3)
    saved = torch.load(out / "checkpoint-4" / Trainer.LOSS_PARAMETERS)
    assert float(torch.exp(-saved["own.0"])) == pytest.approx(values[-1], rel=1e-4)

    import datasets
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    from fastcl.trainer import build_trainer
    trainer = build_trainer("simcse", SentenceTransformer(str(out / train.MODEL_DIR), device="cpu"),
                            datasets.Dataset.from_dict({"sentence": ["a b", "c d"]}),
                            args=SentenceTransformerTrainingArguments(str(tmp_path / "again"), use_cpu=True,
                                                                      report_to="none"),
                            temperature=0.1, learnable_temperature=True)
    assert trainer.loss.current_temperature == pytest.approx(0.1)
    # what --resume calls (the model's own part, sentence-transformers', left out here)
    monkeypatch.setattr(SentenceTransformerTrainer, "_load_from_checkpoint", lambda self, path: None)
    trainer._load_from_checkpoint(str(out / "checkpoint-4"))
    assert trainer.loss.current_temperature == pytest.approx(values[-1], rel=1e-4)


@needs_st62
def test_fastcl_train_temperature_learning_rate_is_its_own_undecayed_group(tiny, tmp_path):
    """--temperature_learning_rate: the loss's log_scale in an optimizer group of its own at that
    rate and no weight decay (the model's groups keep theirs); τ moves further than at the
    model's rate. Without it, log_scale stays with the model's rate, undecayed too."""
    import datasets
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    from fastcl.trainer import build_trainer
    data = datasets.Dataset.from_dict({"text": (tiny / "train.txt").read_text().split("\n")[:24]})
    moved = {}
    for rate in (None, 0.05):
        args = SentenceTransformerTrainingArguments(
            str(tmp_path / f"out-{rate}"), max_steps=3, per_device_train_batch_size=8, learning_rate=3e-5,
            weight_decay=0.01, use_cpu=True, report_to="none", save_strategy="no", seed=0)
        trainer = build_trainer("simcse", SentenceTransformer(str(tiny / "bert"), device="cpu"), data,
                                args=args, temperature=0.05, learnable_temperature=True,
                                temperature_learning_rate=rate)
        trainer.train()
        group, = [g for g in trainer.optimizer.param_groups
                  if any(p is trainer.loss.log_scale for p in g["params"])]
        assert group["initial_lr"] == (rate or 3e-5) and group["weight_decay"] == 0.0
        assert len(group["params"]) == 1 or rate is None   # its own group with a rate
        assert any(g["weight_decay"] == 0.01 for g in trainer.optimizer.param_groups)
        assert args.learning_rate_mapping == {}   # the caller's arguments untouched
        moved[rate] = abs(trainer.loss.current_temperature - 0.05)
    assert moved[0.05] > 100 * moved[None] > 0
    with pytest.raises(ValueError, match="--temperature_learning_rate 0.1: a learning rate > 0 of "
                                         "--learnable_temperature"):
        build_trainer("simcse", None, data, temperature_learning_rate=0.1)
