"""Positive-view augmentations (fastcl.augment): what each changes (only the second copy, about
its rate, never special tokens or padding), determinism under the seed, exact replay by the
cached two-pass encoding, and the trainer's --augment."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from fastcl import augment, common, objectives, training
from fastcl.encoders import MLPHead, SentenceEncoder, load_backbone
from fastcl.trainer import loop as train
from test_train import base_args, step_records, tiny  # noqa: F401  (tiny: the fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

# long sentences (10 content tokens each), so that a rate is visible in the counts
SENTENCES = ["the cat sat on the mat and the dog ran in the park",
             "a man plays guitar under a tree and a woman eats bread",
             "the red apple sat on the big house in the small park",
             "a dog ran to the cat and sat on the blue mat in the house",
             "the happy child plays piano in the park under the big tree",
             "a sad woman sleeps"]  # a short one: padding in the batch
CPU = torch.device("cpu")


def encoder_and_tokenizer(tiny):  # noqa: F811
    torch.manual_seed(1)
    backbone, tokenizer = load_backbone(tiny / "bert")
    return SentenceEncoder(backbone, "cls", MLPHead(32)).train(), tokenizer


def doubled(obj, tokenizer, seed=0):
    torch.manual_seed(seed)
    (name, feats), = training.view_inputs(obj, tokenizer, SENTENCES, 32, CPU)
    assert name == "doubled"
    return feats


def content_counts(feats, tokenizer):
    where = augment.content_tokens(feats["input_ids"], feats["attention_mask"], augment.special_ids(tokenizer))
    return where.sum(1)


# ---------------------------------------------------------------------------------------
# Parsing and where it applies

def test_parse_names_rates_and_defaults():
    assert augment.parse("token-cutoff") == augment.Augmentation("token_cutoff", common.AUGMENT_RATES["token_cutoff"])
    assert augment.parse("word_deletion:0.3").spec == "word_deletion:0.3"
    assert augment.parse(None) is None
    for bad, message in (("crop", "unknown augmentation 'crop'"), ("token_cutoff:x", "not a number"),
                         ("span_cutoff:0", r"must be in \(0, 1\]"), ("feature_cutoff:1.5", r"\(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            augment.parse(bad)
    with pytest.raises(ValueError, match="unsupervised methods"):
        objectives.Objective("simcse-sup", augment="token_cutoff")
    with pytest.raises(ValueError, match="unknown augmentation"):
        objectives.Objective("simcse", augment="crop")


# ---------------------------------------------------------------------------------------
# Token level: the input ids of the second copies

@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_word_deletion_deletes_about_the_rate_from_the_second_copies_only(tiny, rate):  # noqa: F811
    _, tokenizer = encoder_and_tokenizer(tiny)
    clean = doubled(objectives.Objective("simcse"), tokenizer)
    feats = doubled(objectives.Objective("simcse", augment=f"word_deletion:{rate}"), tokenizer)
    assert torch.equal(feats["input_ids"][0::2], clean["input_ids"][0::2])  # first copies untouched
    assert torch.equal(feats["attention_mask"][0::2], clean["attention_mask"][0::2])
    before, after = content_counts(clean, tokenizer)[1::2], content_counts(feats, tokenizer)[1::2]
    assert torch.equal(before - after, torch.round(rate * before.double()).long().clamp_min(1))
    for row_clean, row in zip(clean["input_ids"][1::2], feats["input_ids"][1::2]):
        kept = row[row != tokenizer.pad_token_id].tolist()
        assert kept[0] == tokenizer.cls_token_id and kept[-1] == tokenizer.sep_token_id
        full = row_clean.tolist()
        it = iter(full)
        assert all(t in it for t in kept)  # a subsequence: order kept, only deletions
    mask = feats["attention_mask"][1::2]
    assert torch.equal(mask, (feats["input_ids"][1::2] != tokenizer.pad_token_id).long())


def test_word_shuffle_permutes_content_tokens_of_the_second_copies_only(tiny):  # noqa: F811
    _, tokenizer = encoder_and_tokenizer(tiny)
    clean = doubled(objectives.Objective("simcse"), tokenizer)
    feats = doubled(objectives.Objective("simcse", augment="word_shuffle"), tokenizer)
    assert torch.equal(feats["input_ids"][0::2], clean["input_ids"][0::2])
    assert torch.equal(feats["attention_mask"], clean["attention_mask"])
    special = ~augment.content_tokens(clean["input_ids"], clean["attention_mask"], augment.special_ids(tokenizer))
    assert torch.equal(feats["input_ids"][special], clean["input_ids"][special])  # CLS, SEP, padding
    moved = 0
    for a, b in zip(clean["input_ids"][1::2], feats["input_ids"][1::2]):
        assert sorted(a.tolist()) == sorted(b.tolist())
        moved += int((a != b).sum())
    assert moved > 0.5 * int(content_counts(clean, tokenizer)[1::2].sum())  # rate 1: most tokens move


# ---------------------------------------------------------------------------------------
# Embedding level: the embedding layer's output inside the forward

def embedding_output(obj, encoder, tokenizer, seed=0):
    """What the embedding layer passes on in the doubled forward (eval mode: no dropout, so
    the clean and augmented outputs differ only by the augmentation)."""
    seen = []
    feats = doubled(obj, tokenizer, seed)
    module = augment.embedding_module(encoder.backbone)
    with augment.on_embeddings(augment.parse(obj.augment), encoder.backbone, feats.get(augment.KEY)):
        handle = module.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
        try:
            training.forward(obj, encoder.eval(), "doubled", feats)
        finally:
            handle.remove()
    return seen[0], feats


@pytest.mark.parametrize("name", ["token_cutoff", "span_cutoff", "feature_cutoff"])
def test_cutoffs_zero_about_the_rate_of_the_second_copies_only(tiny, name):  # noqa: F811
    encoder, tokenizer = encoder_and_tokenizer(tiny)
    rate = 0.3
    clean, feats = embedding_output(objectives.Objective("simcse"), encoder, tokenizer)
    got, _ = embedding_output(objectives.Objective("simcse", augment=f"{name}:{rate}"), encoder, tokenizer)
    assert torch.equal(got[0::2], clean[0::2])  # first copies untouched
    content = augment.content_tokens(feats["input_ids"], feats["attention_mask"], augment.special_ids(tokenizer))
    assert torch.equal(got[~content], clean[~content])  # CLS, SEP and padding untouched
    zeroed = (got == 0) & (clean != 0)
    assert zeroed.any()
    lengths = content.sum(1)[1::2]
    if name == "feature_cutoff":
        dims = zeroed[1::2].any(1)  # per row, the cut dimensions
        assert (dims.sum(1) == round(rate * got.shape[-1])).all()
        # the same dimensions in every content token of the row
        for r in range(1, got.shape[0], 2):
            rows = zeroed[r][content[r]]
            assert (rows == dims[r // 2]).all()
    else:
        tokens = (got[1::2] == 0).all(-1)
        k = torch.round(rate * lengths.double()).long().clamp_min(1)
        assert torch.equal(tokens.sum(1), k)
        if name == "span_cutoff":  # contiguous
            for row in tokens:
                idx = torch.nonzero(row).flatten()
                assert torch.equal(idx, torch.arange(idx[0], idx[0] + len(idx)))


# ---------------------------------------------------------------------------------------
# Determinism and exact replay

@pytest.mark.parametrize("name", augment.NAMES)
def test_same_seed_same_views_other_seed_other_views(tiny, name):  # noqa: F811
    encoder, tokenizer = encoder_and_tokenizer(tiny)
    obj = objectives.Objective("simcse", augment=name)

    def views(seed):
        torch.manual_seed(seed)
        with training.dropout_rate(encoder, 0.0):  # differences come from the augmentation only
            v = training.embed_views(obj, encoder.train(), tokenizer, SENTENCES, 32)
        return v["anchors"].detach(), v["positives"].detach()

    a1, p1 = views(0)
    a2, p2 = views(0)
    a3, p3 = views(1)
    assert torch.equal(a1, a2) and torch.equal(p1, p2)
    assert torch.equal(a1, a3)  # anchors: never augmented
    assert not torch.allclose(p1, a1) and not torch.allclose(p1, p3)


def grads_of(encoder):
    return {k: p.grad.clone() for k, p in encoder.named_parameters() if p.grad is not None}


def plain_chunked(obj, encoder, tokenizer, chunk):
    """The forwards of the cached step, in the same order from the same random state, in one
    graph: the exact gradient of the loss of these forwards and their masks."""
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    outputs = {}
    for name, feats in training.view_inputs(obj, tokenizer, SENTENCES, 32, CPU):
        rows = feats["input_ids"].shape[0]
        outputs[name] = torch.cat([training.forward(obj, encoder, name, {k: v[s:s + chunk] for k, v in feats.items()})
                                   for s in range(0, rows, chunk)])
    loss = objectives.objective_loss(obj, training.assemble_views(obj, outputs, len(SENTENCES)))
    loss.backward()
    return loss.detach(), grads_of(encoder), torch.get_rng_state()


def cached(obj, encoder, tokenizer, chunk):
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = training.cached_backward(obj, encoder, tokenizer, SENTENCES, max_length=32, mini_batch_size=chunk)
    return loss, grads_of(encoder), torch.get_rng_state()


def same(a, b):
    if not torch.allclose(a[0], b[0], atol=1e-6, rtol=1e-6) or a[1].keys() != b[1].keys():
        return False
    return all(torch.allclose(a[1][k], b[1][k], atol=1e-6, rtol=1e-5) for k in a[1]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("name", augment.NAMES)
def test_cached_encoding_replays_the_augmentation_exactly(tiny, name, monkeypatch):  # noqa: F811
    encoder, tokenizer = encoder_and_tokenizer(tiny)
    obj = objectives.Objective("escl" if name == "span_cutoff" else "simcse", augment=f"{name}:0.3")
    n = len(SENTENCES)
    # one chunk holding every row: the ordinary step
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = objectives.objective_loss(obj, training.embed_views(obj, encoder, tokenizer, SENTENCES, 32))
    loss.backward()
    assert same(cached(obj, encoder, tokenizer, 2 * n), (loss.detach(), grads_of(encoder), torch.get_rng_state()))
    # chunks of 3 rows: pairs straddle the chunk borders
    reference = plain_chunked(obj, encoder, tokenizer, 3)
    assert same(cached(obj, encoder, tokenizer, 3), reference)
    if augment.parse(obj.augment).embedding_level:
        # the comparison sees the augmentation: replaying dropout but redrawing the cutoff
        # masks gives other gradients
        real = augment._EMBEDDING[augment.parse(obj.augment).name]
        calls = {"n": 0}

        def redrawn(embeddings, where, rate):
            calls["n"] += 1
            if calls["n"] > (2 * n + 2) // 3:  # pass 2: draw new masks after the replayed state
                torch.rand(7)
            return real(embeddings, where, rate)

        monkeypatch.setitem(augment._EMBEDDING, augment.parse(obj.augment).name, redrawn)
        assert not same(cached(obj, encoder, tokenizer, 3), reference)


# ---------------------------------------------------------------------------------------
# The trainer

@pytest.mark.parametrize("spec", ["token-cutoff", "word_deletion:0.2"])
def test_trainer_two_steps_with_augment(tiny, tmp_path, spec):  # noqa: F811
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, "simcse", steps=2, augment=spec, mini_batch_size=3)) == 0
    assert len(step_records(out)) == 2
    canonical = augment.parse(spec).spec
    assert f"augment: {canonical}" in (out / "fastcl_config.yaml").read_text()


def test_trainer_refuses_augment_where_it_does_not_apply(tiny, tmp_path, capsys):  # noqa: F811
    for method, spec, message in (("simcse-sup", "token_cutoff", "--augment applies to the unsupervised"),
                                  ("simcse", "crop", "--augment: unknown augmentation 'crop'")):
        with pytest.raises(SystemExit) as err:
            train.main(base_args(tiny, tmp_path / "o", method, augment=spec))
        assert err.value.code == 2 and message in capsys.readouterr().err
