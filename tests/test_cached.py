"""Cached (two-pass) encoding: exact gradients with dropout replay, for every method."""

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from fastcl import checkpoint, objectives, training
from fastcl.encoders import MLPHead, SentenceEncoder, load_backbone, load_encoder
from test_evaluate import make_tiny_model, random_sentence

N = 6  # examples per batch


@pytest.fixture(autouse=True)
def _one_thread():
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # the comparisons need the same thread count in every run
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cached")
    make_tiny_model(root / "bert")
    make_tiny_model(root / "roberta", model_type="roberta")
    return root


def encoder_and_tokenizer(models):
    torch.manual_seed(1)
    backbone, tokenizer = load_backbone(models / "bert")
    return SentenceEncoder(backbone, "cls", MLPHead(32)).train(), tokenizer


def objective(method, models):
    if method == "simcse-sup":
        return objectives.Objective("simcse-sup", hard_negative_weight=0.7)
    if method in ("dclr", "dclr-released"):
        # released: the authors' complementary mode, dropout on, which draws from the RNG
        comp, comp_tok = load_encoder(models / "roberta", "avg")
        return objectives.Objective("dclr", phi=0.3, noise_steps=2, complementary=comp.requires_grad_(False),
                                  complementary_tokenizer=comp_tok,
                                  complementary_mode="released" if method == "dclr-released" else "frozen",
                                  generator=torch.Generator().manual_seed(3))
    if method == "escl":
        return objectives.Objective("escl", rd_weight=0.5)  # a large weight: the third view matters
    return objectives.Objective(method)


def batch_for(method):
    rng = random.Random(7)
    if method == "simcse-sup":
        return [tuple(random_sentence(rng) for _ in range(3)) for _ in range(N)]
    return [random_sentence(rng) for _ in range(N)]


def grads_of(encoder):
    return {k: p.grad.clone() for k, p in encoder.named_parameters() if p.grad is not None}


def reset(encoder, obj):
    encoder.zero_grad(set_to_none=True)
    if obj.generator is not None:
        obj.generator.manual_seed(3)
    torch.manual_seed(1234)


def plain_step(obj, encoder, tokenizer, batch):
    """The ordinary step: one graph through the unchunked forwards."""
    reset(encoder, obj)
    loss = objectives.objective_loss(obj, training.embed_views(obj, encoder, tokenizer, batch, 16))
    loss.backward()
    return loss.detach(), grads_of(encoder), torch.get_rng_state()


def one_graph_chunked(obj, encoder, tokenizer, batch, chunk):
    """The chunked forwards of the cached step, in the same order from the same random state,
    kept in one graph and back-propagated once: the exact gradient of the loss of these
    forwards (and their dropout masks)."""
    reset(encoder, obj)
    outputs = {}
    for name, feats in training.view_inputs(obj, tokenizer, batch, 16, torch.device("cpu")):
        rows = feats["input_ids"].shape[0]
        parts = []
        for start in range(0, rows, chunk):
            with training.forward_mode(obj, encoder, name):
                parts.append(encoder(**{k: v[start:start + chunk] for k, v in feats.items()}))
        outputs[name] = torch.cat(parts)
    views = training.assemble_views(obj, outputs, len(batch))
    if obj.complementary is not None:
        views["complementary"] = training.complementary_views(obj, batch, 16, chunk)
    loss = objectives.objective_loss(obj, views)
    loss.backward()
    return loss.detach(), grads_of(encoder), torch.get_rng_state()


def cached_step(obj, encoder, tokenizer, batch, chunk):
    reset(encoder, obj)
    loss = training.cached_backward(obj, encoder, tokenizer, batch, max_length=16, mini_batch_size=chunk)
    return loss, grads_of(encoder), torch.get_rng_state()


def assert_same(a, b):
    loss_a, grads_a, rng_a = a
    loss_b, grads_b, rng_b = b
    torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for k in grads_a:
        torch.testing.assert_close(grads_a[k], grads_b[k], atol=1e-6, rtol=1e-5, msg=k)
    assert torch.equal(rng_a, rng_b)  # the next step draws as after an ordinary step


METHODS = ["simcse", "simcse-sup", "dclr", "dclr-released", "focal", "escl"]


@pytest.mark.parametrize("method", METHODS)
def test_one_chunk_equals_the_ordinary_step(models, method):
    # a chunk holding every row of each forward: pass 1 makes exactly the ordinary forwards
    encoder, tokenizer = encoder_and_tokenizer(models)
    obj, batch = objective(method, models), batch_for(method)
    assert_same(cached_step(obj, encoder, tokenizer, batch, 3 * N),
                plain_step(obj, encoder, tokenizer, batch))


@pytest.mark.parametrize("method", METHODS)
def test_small_chunks_replay_the_dropout_exactly(models, method, monkeypatch):
    # Chunks of 5 rows: the duplicated batch's pairs and the triplets straddle chunk borders,
    # and ESCL's sensitive view is chunked too. A chunked forward draws other dropout masks
    # than the unchunked one (the masks are drawn per forward call), so the reference is the
    # same chunked forwards kept in one graph: matching it proves that pass 2 reproduces the
    # masks of pass 1 and that the cached embedding gradients give the exact gradient.
    encoder, tokenizer = encoder_and_tokenizer(models)
    obj, batch = objective(method, models), batch_for(method)
    reference = one_graph_chunked(obj, encoder, tokenizer, batch, 5)
    assert_same(cached_step(obj, encoder, tokenizer, batch, 5), reference)
    # The comparison sees the dropout: without the replay the gradients differ.
    monkeypatch.setattr(training, "_rng_restore", lambda state, device: None)
    _, grads, _ = cached_step(obj, encoder, tokenizer, batch, 5)
    assert any(not torch.allclose(grads[k], reference[1][k], atol=1e-4) for k in grads)


def test_escl_third_view_is_replayed_at_its_own_dropout(models):
    encoder, tokenizer = encoder_and_tokenizer(models)
    obj, batch = objective("escl", models), batch_for("escl")
    seen = []
    encoder.backbone.embeddings.dropout.register_forward_pre_hook(
        lambda m, args: seen.append((args[0].shape[0], m.p, torch.is_grad_enabled())))
    cached_step(obj, encoder, tokenizer, batch, 5)
    # pass 1: 12 duplicated rows in 5 + 5 + 2, then the 6-row sensitive view in 5 + 1; pass 2 again
    pass1 = [(5, 0.1), (5, 0.1), (2, 0.1), (5, 0.45), (1, 0.45)]
    assert seen == [(*s, False) for s in pass1] + [(*s, True) for s in pass1]
    assert {m.p for m in encoder.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}


def test_dclr_complementary_runs_once(models):
    encoder, tokenizer = encoder_and_tokenizer(models)
    obj, batch = objective("dclr", models), batch_for("dclr")
    calls = []
    obj.complementary.backbone.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((kwargs["input_ids"].shape[0], torch.is_grad_enabled())),
        with_kwargs=True)
    cached_step(obj, encoder, tokenizer, batch, 4)
    assert calls == [(4, False), (2, False)]


def test_mini_batch_size_must_be_positive(models):
    encoder, tokenizer = encoder_and_tokenizer(models)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="mini_batch_size must be a positive integer"):
            training.cached_backward(objectives.Objective("simcse"), encoder, tokenizer, batch_for("simcse"),
                                     max_length=16, mini_batch_size=bad)


# ---------------------------------------------------------------------------------------
# the trainer's --mini-batch-size (and its deprecated alias --chunk-size)

from test_train import base_args, step_records, train  # noqa: E402
from test_train import tiny  # noqa: E402,F401  (a fixture)


def test_train_with_one_chunk_repeats_the_ordinary_run_and_resumes(tiny, tmp_path):
    # batch 4, escl: the duplicated batch is 8 inputs, so --mini-batch-size 8 makes the same forwards
    plain, chunked = tmp_path / "plain", tmp_path / "chunked"
    assert train.main(base_args(tiny, plain, "escl", steps=3)) == 0
    assert train.main(base_args(tiny, chunked, "escl", steps=3, mini_batch_size=8)) == 0
    a, b = step_records(plain), step_records(chunked)
    assert [(r["loss"], r["grad_norm"]) for r in a] == [(r["loss"], r["grad_norm"]) for r in b]
    # small mini-batches train and resume; the mini-batch size defines the run
    small = tmp_path / "small"
    assert train.main(base_args(tiny, small, "simcse-sup", steps=2, mini_batch_size=3,
                                keep_checkpoint=True)) == 0
    assert all(r["loss"] > 0 for r in step_records(small))
    with pytest.raises(SystemExit, match="--mini-batch-size 5 .*checkpoint: 3"):
        train.main(base_args(tiny, small, "simcse-sup", steps=2, mini_batch_size=5, resume=True))
    # the deprecated --chunk-size still names the same setting, with a warning
    assert train.main(base_args(tiny, small, "simcse-sup", steps=2, chunk_size=3, resume=True)) == 0
    assert [r["step"] for r in step_records(small)] == [1, 2]


@pytest.mark.parametrize("value", ["0", "-4"])
def test_bad_mini_batch_size_names_the_option(tiny, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", mini_batch_size=value))
    assert err.value.code == 2
    assert f"--mini-batch-size must be >= 1, got {value}" in capsys.readouterr().err


def test_chunk_size_is_a_deprecated_alias_that_warns(tiny, tmp_path, capsys):
    parser = train.build_parser()
    args = train.resolve_args(parser, parser.parse_args(base_args(tiny, tmp_path / "o", chunk_size=6)))
    assert args.mini_batch_size == 6 and not hasattr(args, "chunk_size")
    assert "--chunk-size is deprecated, use --mini-batch-size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        train.resolve_args(parser, parser.parse_args(
            base_args(tiny, tmp_path / "o", chunk_size=6, mini_batch_size=4)))
    assert err.value.code == 2 and "disagree" in capsys.readouterr().err
