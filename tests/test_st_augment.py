"""AugmentedPositives, the positive-view augmentations on the sentence-transformers path, on a
tiny random BERT:

- what changes: only the positive column's content tokens (token level: the input ids;
  embedding level: the embedding layer's output), never the anchors, special tokens, padding,
  nor the caller's feature dicts; DCLR's guide sees the columns as given;
- a cached loss (mini-batches of 3 of 8) gives the loss and the gradients of the plain loss,
  its second pass (in the backward) augmented like the first;
- nothing leaks into ``model.encode`` after training (SentenceTransformerTrainer, the
  docstring example), nor after a forward that failed;
- a model wrapped in DistributedDataParallel later, or replaced, still gets the augmentation;
- what sentence-transformers reads of a loss, and the errors.
"""

import copy
import inspect
import os
import textwrap

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from conftest import needs_st6

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")

import fastcl.integrations.sentence_transformers as fst  # noqa: E402
from fastcl import augment, citations  # noqa: E402
from fastcl.integrations.sentence_transformers import (  # noqa: E402
    AugmentedPositives, CachedFastDCLRLoss, CachedFastInfoNCELoss, FastDCLRLoss, FastInfoNCELoss)
from fastcl.integrations.sentence_transformers._base import preprocess  # noqa: E402
from fastcl.integrations.sentence_transformers.augment import _HOOKS  # noqa: E402
from test_evaluate import make_tiny_model  # noqa: E402

# 8 sentences of 2 to 10 words over the tiny vocabulary: padding in every mini-batch of 3
SENTENCES = ["the cat sat on the mat and the dog ran in",
             "a man plays guitar",
             "the red apple sat on the big house in the park",
             "a dog ran",
             "the happy child plays piano in the park under the tree",
             "a sad woman sleeps",
             "the small blue house",
             "a fast dog eats bread under the big tree"]
GRAD_TOL = dict(atol=1e-7, rtol=1e-5)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("st_augment") / "bert")


@pytest.fixture(scope="module")
def base(tiny):
    return st.SentenceTransformer(str(tiny), device="cpu")


@pytest.fixture
def model(base):
    """A fresh copy per test: no hooks left by another test's loss."""
    return copy.deepcopy(base)


def columns(model, sentences=SENTENCES):
    f = preprocess(model, sentences)
    return [dict(f), dict(f)]  # anchor, positive: the same sentences (dicts of their own)


def content_mask(model, features):
    return augment.content_tokens(features["input_ids"], features["attention_mask"],
                                  augment.special_ids(model.tokenizer))


def embedding_outputs(model):
    """The embedding layer's outputs, in forward order, as the backbone receives them (this
    hook runs after the augmentation's, installed before it)."""
    seen = []
    model[0].auto_model.embeddings.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    return seen


def spy_inputs(loss):
    """The columns the inner loss of ``loss`` receives, per call."""
    seen, inner = [], loss.loss
    forward = inner.forward

    def spy(features, labels=None):
        seen.append(list(features))
        return forward(features, labels)

    inner.forward = spy
    return seen


def grads_of(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def step(model, loss, seed=3):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    value = loss(columns(model), None)
    value.backward()
    return value.detach(), grads_of(model)


def same(a, b):
    """Equal losses and gradients up to float32 rounding, measured against the largest
    gradient entry of the model: mini-batches trimmed to other widths pad and sum in another
    order, which moves entries by ~1e-6 of that scale (also those whose exact value is 0,
    such as the attention keys' bias)."""
    if not (torch.allclose(a[0], b[0], **GRAD_TOL) and a[1].keys() == b[1].keys()):
        return False
    scale = max(float(g.abs().max()) for g in b[1].values())
    return all(float((a[1][k] - b[1][k]).abs().max()) <= GRAD_TOL["rtol"] * scale + GRAD_TOL["atol"]
               for k in a[1])


def fresh_copy(tiny, model):
    """The same weights in a model no augmentation ever hooked."""
    clean = st.SentenceTransformer(str(tiny), device="cpu")
    clean.load_state_dict(model.state_dict())
    return clean.eval()


# ---------------------------------------------------------------------------------------
# What changes

@pytest.mark.parametrize("name", augment.TOKEN_LEVEL)
def test_token_level_rewrites_only_the_positives_content_tokens(model, name):
    loss = AugmentedPositives(FastInfoNCELoss(model), f"{name}:0.5")
    seen = spy_inputs(loss)
    given = columns(model)
    kept = [{k: v.clone() for k, v in c.items() if torch.is_tensor(v)} for c in given]
    torch.manual_seed(0)
    loss(given, None)
    (anchor, positive), = seen
    for column, before in zip(given, kept):  # the caller's inputs, as they were (the model
        assert all(torch.equal(column[k], before[k]) for k in before)  # adds its outputs)
    assert anchor is given[0]
    ids, mask, new = given[1]["input_ids"], given[1]["attention_mask"], positive["input_ids"]
    content = content_mask(model, given[1])
    if name == "word_shuffle":  # a permutation of each row's content tokens among their positions
        assert torch.equal(positive["attention_mask"], mask)
        assert torch.equal(new[~content], ids[~content])
        for i in range(len(SENTENCES)):
            assert sorted(new[i][content[i]].tolist()) == sorted(ids[i][content[i]].tolist())
        assert not torch.equal(new, ids)
    else:  # k = max(1, round(0.5·L)) content tokens gone, the rest in order, then padding
        lengths = content.sum(1)
        k = torch.minimum(torch.round(0.5 * lengths.double()).long().clamp_min(1), lengths - 1)
        new_content = content_mask(model, positive)
        assert torch.equal(new_content.sum(1), lengths - k)
        assert torch.equal(positive["attention_mask"].sum(1), mask.sum(1) - k)
        cls, sep = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
        for i in range(len(SENTENCES)):
            row, rest = ids[i][content[i]].tolist(), new[i][new_content[i]].tolist()
            it = iter(row)
            assert all(token in it for token in rest)  # a subsequence of the original
            attended = new[i][positive["attention_mask"][i].bool()].tolist()
            assert attended == [cls, *rest, sep]


@pytest.mark.parametrize("name", augment.EMBEDDING_LEVEL)
def test_embedding_level_zeroes_only_the_positives_content_tokens(model, name):
    model.eval()  # no dropout: the embedding layer's outputs compare exactly
    rate = 0.3
    loss = AugmentedPositives(FastInfoNCELoss(model), f"{name}:{rate}")
    seen = embedding_outputs(model)
    given = columns(model)
    with torch.no_grad():
        loss(given, None)
        anchors, positives = seen
        model(dict(given[1]))
        clean = seen[2]
    assert augment.KEY not in given[1]
    assert torch.equal(anchors, clean)
    content = content_mask(model, given[1])
    zeroed = (positives == 0) & (clean != 0)
    assert ((positives == clean) | zeroed).all()
    assert not zeroed[~content].any()  # special tokens and padding: never
    lengths = content.sum(1)
    if name == "feature_cutoff":  # the same k of the 32 dimensions in every content token of a row
        k = round(rate * 32)
        for i in range(len(SENTENCES)):
            dims = zeroed[i][content[i]]
            assert torch.equal(dims, dims[:1].expand_as(dims)) and int(dims[0].sum()) == k
    else:
        tokens = zeroed.all(-1)
        assert torch.equal(zeroed.any(-1), tokens)  # whole token vectors
        assert torch.equal(tokens.sum(1), torch.round(rate * lengths.double()).long().clamp_min(1))
        if name == "span_cutoff":  # one contiguous span of content tokens
            for i in range(len(SENTENCES)):
                picked = tokens[i][content[i]].nonzero().flatten()
                assert torch.equal(picked, torch.arange(int(picked[0]), int(picked[0]) + len(picked)))


@needs_st6
def test_negatives_share_the_positives_forward_unchanged(model):
    """With negative columns the positives still merge with them into one forward (the
    negatives carry an empty mask), and only the positives change."""
    model.eval()
    loss = AugmentedPositives(FastInfoNCELoss(model), "token_cutoff:0.3")
    seen = embedding_outputs(model)
    anchors, positives = columns(model)
    negatives = preprocess(model, SENTENCES[::-1])
    with torch.no_grad():
        loss([anchors, positives, negatives], None)
        assert len(seen) == 2 and seen[1].shape[0] == 2 * len(SENTENCES)  # anchors; positives + negatives
        model(dict(negatives))
    merged, clean = seen[1][len(SENTENCES):], seen[2]
    assert torch.equal(merged[:, :clean.shape[1]], clean)
    assert (seen[1][:len(SENTENCES)] == 0).all(-1).any()


@needs_st6
def test_mini_batches_slice_the_mask_with_the_features(model):
    """sentence-transformers' mini-batches and fastcl's fallback (older releases) slice the
    mask's rows and trim its padding columns with the input ids."""
    from sentence_transformers.base.losses.gradcache import _create_minibatch
    from fastcl.integrations.sentence_transformers._gradcache import minibatch

    loss = AugmentedPositives(FastInfoNCELoss(model), "feature_cutoff")
    positive = loss._augment(columns(model)[1])
    cut = positive[augment.KEY]
    assert cut.shape == (*positive["input_ids"].shape, 32)
    for slicer in (_create_minibatch, minibatch):
        for begin, end in ((0, 3), (3, 6), (6, 8), (1, 2)):
            part = slicer(positive, begin, end)
            width = part["input_ids"].shape[1]
            assert torch.equal(part[augment.KEY], cut[begin:end, :width])
        assert width < cut.shape[1]  # (1, 2): a short sentence, trimmed


@pytest.mark.parametrize("cached", [False, True])
def test_the_guide_scores_the_columns_as_given(model, cached):
    model.eval()
    guide = copy.deepcopy(model)
    kw = dict(noise_ratio=0.0, generator=torch.Generator().manual_seed(0))
    inner = (CachedFastDCLRLoss(model, guide, mini_batch_size=3, **kw) if cached
             else FastDCLRLoss(model, guide, **kw))
    loss = AugmentedPositives(inner, "word_shuffle")
    complementary = []
    compute = inner.compute_loss_from_embeddings

    def spy(embeddings, labels=None, **kwargs):
        complementary.append(kwargs.get("complementary"))
        return compute(embeddings, labels, **kwargs)

    inner.compute_loss_from_embeddings = spy
    torch.manual_seed(0)
    loss(columns(model), None).backward()
    (a, p), = complementary
    assert torch.equal(a, p)  # the same sentences, not shuffled for the guide
    assert "_guide_embeddings" not in inner.__dict__


# ---------------------------------------------------------------------------------------
# Cached = plain

@pytest.mark.parametrize("name", ["word_deletion", "token_cutoff", "feature_cutoff"])
def test_cached_loss_gives_the_plain_loss_and_gradients(model, name):
    """Dropout off, mini-batches of 3 of 8 (trimmed to their own width): the augmentation is
    drawn once per call, so both passes of the cached loss see the plain loss's."""
    model.eval()
    spec = f"{name}:0.3"
    plain = step(model, AugmentedPositives(FastInfoNCELoss(model), spec))
    cached = step(model, AugmentedPositives(CachedFastInfoNCELoss(model, mini_batch_size=3), spec))
    assert same(cached, plain)
    assert not same(step(model, FastInfoNCELoss(model)), plain)  # the augmentation is seen
    assert not same(step(model, AugmentedPositives(FastInfoNCELoss(model), spec), seed=4), plain)


def test_cached_dclr_with_dropout_gives_the_plain_loss_and_gradients(model):
    """Train mode, one mini-batch per column: the same forwards, dropout replayed in pass 2."""
    model.train()
    guide = copy.deepcopy(model).eval()

    def dclr(cls, **kw):
        generator = torch.Generator().manual_seed(0)
        return AugmentedPositives(cls(model, guide, noise_ratio=0.5, generator=generator, **kw),
                                  "span_cutoff:0.3")

    plain = step(model, dclr(FastDCLRLoss))
    assert same(step(model, dclr(CachedFastDCLRLoss, mini_batch_size=8)), plain)


# ---------------------------------------------------------------------------------------
# Nothing leaks

def test_docstring_example_trains_and_leaves_encode_unaugmented(tiny, tmp_path, monkeypatch):
    doc = inspect.getdoc(AugmentedPositives)
    for section in ("Args:", "Inputs:", "Relations:", "References:", "Example:"):
        assert f"\n{section}\n" in doc
    assert ".. math::" in doc and "| Texts" in doc and "{inputs}" not in doc
    code = textwrap.dedent(doc.split("Example:\n    ::\n", 1)[1])
    model_id = "sentence-transformers/all-MiniLM-L6-v2"
    assert model_id in code
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code.replace(model_id, str(tiny)), "AugmentedPositives example", "exec"), namespace)
    assert namespace["trainer"].state.global_step > 0
    model = namespace["model"]
    assert model[0].__dict__[_HOOKS].cuts == {}  # disarmed
    got = model.encode(SENTENCES, convert_to_tensor=True)
    assert torch.equal(got, fresh_copy(tiny, model).encode(SENTENCES, convert_to_tensor=True))


def test_a_failed_forward_disarms_the_hook(tiny, model):
    model.eval()
    AugmentedPositives(FastInfoNCELoss(model), "token_cutoff")
    features = columns(model)[1]
    with pytest.raises(ValueError, match="does not match the augmentation's mask"):
        model({**features, augment.KEY: torch.zeros(3, 2, dtype=torch.bool)})
    assert model[0].__dict__[_HOOKS].cuts == {}
    with torch.no_grad():
        assert torch.equal(model(dict(features))["sentence_embedding"],
                           fresh_copy(tiny, model)(dict(features))["sentence_embedding"])


# ---------------------------------------------------------------------------------------
# Wrapped or replaced models; what sentence-transformers reads

class _Trainer:
    override_model_in_loss = st.SentenceTransformerTrainer.override_model_in_loss


def test_ddp_wrapped_model_gets_the_augmentation(model, tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model.eval()
    loss = AugmentedPositives(CachedFastInfoNCELoss(model, mini_batch_size=3), "token_cutoff:0.3")
    reference = step(model, loss)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        _Trainer().override_model_in_loss(loss, ddp)  # what the trainer does once it wraps the model
        assert loss.model is ddp and loss.loss.model is ddp
        assert same(step(model, loss), reference)
    finally:
        dist.destroy_process_group()


def test_a_replaced_model_is_hooked_at_the_next_call(tiny, model, base):
    model.eval()
    loss = AugmentedPositives(FastInfoNCELoss(model), "token_cutoff:0.3")
    other = copy.deepcopy(base).eval()
    _Trainer().override_model_in_loss(loss, other)  # as after model_init
    assert loss.model is other and loss.loss.model is other
    with torch.no_grad():
        loss(columns(other), None)
        assert _HOOKS in other[0].__dict__
        seen = embedding_outputs(other)  # after the augmentation's hook
        loss(columns(other), None)
    assert (seen[1] == 0).all(-1).any() and not (seen[0] == 0).all(-1).any()


@needs_st6
def test_what_sentence_transformers_reads_of_the_loss(model):
    from sentence_transformers.base.model_card import get_losses
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss

    inner = CachedFastInfoNCELoss(model, mini_batch_size=4)
    loss = AugmentedPositives(inner, augment.Augmentation("feature_cutoff", 0.25))
    assert "AugmentedPositives" in fst.__all__ and fst.AugmentedPositives is AugmentedPositives
    assert loss.model is model and loss.loss is inner and loss.uses_gradient_cache
    assert not AugmentedPositives(FastInfoNCELoss(model), "word_shuffle").uses_gradient_cache
    assert loss.get_config_dict() == {"loss": "CachedFastInfoNCELoss", **inner.get_config_dict(),
                                      "augmentation": "feature_cutoff:0.25"}
    assert loss.citation == inner.citation == citations.SIMCSE + citations.GRADCACHE
    # the model card lists each, the cached loss's plain loss too (as sentence-transformers'
    # own cached losses, which hold theirs)
    assert get_losses(loss) == [loss, inner, inner.loss]
    # MatryoshkaLoss decorates the cached loss's calculate_loss through the wrapper
    matryoshka = MatryoshkaLoss(model, loss, [32, 16])
    assert matryoshka.uses_gradient_cache and inner.calculate_loss is loss.calculate_loss
    torch.manual_seed(0)
    matryoshka(columns(model), None).backward()
    assert all(p.grad is not None for p in model[0].auto_model.encoder.parameters())


def test_errors(model):
    with pytest.raises(ValueError, match="unknown augmentation 'crop'"):
        AugmentedPositives(FastInfoNCELoss(model), "crop")
    with pytest.raises(ValueError, match="needs an augmentation"):
        AugmentedPositives(FastInfoNCELoss(model), None)
    with pytest.raises(TypeError, match="wraps a sentence-transformers loss"):
        AugmentedPositives(torch.nn.Linear(2, 2), "token_cutoff")

    class OneColumn(FastInfoNCELoss):
        _column_counts = (1, 1)

    with pytest.raises(ValueError, match="takes at most 1 input column"):
        AugmentedPositives(OneColumn(model), "word_shuffle")
    with pytest.raises(ValueError, match="got 1 input column"):
        AugmentedPositives(FastInfoNCELoss(model), "word_shuffle")(columns(model)[:1], None)
    # a first module without an embedding layer: StaticEmbedding (token ids into an EmbeddingBag)
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    static = st.SentenceTransformer(modules=[StaticEmbedding(model.tokenizer, embedding_dim=8)], device="cpu")
    with pytest.raises(ValueError, match="StaticEmbedding.* has no embedding layer"):
        AugmentedPositives(FastInfoNCELoss(static), "token_cutoff")
