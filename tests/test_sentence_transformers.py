"""fastcl losses inside sentence-transformers: same numbers as MultipleNegativesRankingLoss
on the same embeddings, on a tiny random BERT (the docstring examples train MiniLM with each
loss: tests/test_st_package.py)."""

import subprocess
import sys

import pytest
import torch

import fastcl

from conftest import correlated, make, needs_st6

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402

from fastcl.integrations.sentence_transformers import (  # noqa: E402
    CachedFastDCLRLoss, CachedFastESCLLoss, CachedFastFocalInfoNCELoss, CachedFastInfoNCELoss,
    FastDCLRLoss, FastESCLLoss, FastFocalInfoNCELoss, FastInfoNCELoss)
from fastcl.encoders import dropout_rate  # noqa: E402
from fastcl.integrations.sentence_transformers._base import preprocess  # noqa: E402
from test_st_dropins import needs_mnrl_options  # noqa: E402

# one torch thread: small batches run 3-4× faster than on two threads that share a
# busy 2-core machine
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_model():
    """A tiny random BERT (conftest.tiny_sentence_transformer)."""
    from conftest import tiny_sentence_transformer
    return st.SentenceTransformer(tiny_sentence_transformer(), device="cpu")


def _embeddings(columns, n=12, d=32):
    a = make(n, d)
    cols = [a, correlated(a, 0.8)] + [make(n, d, seed=10 + i) for i in range(columns - 2)]
    return cols


@pytest.mark.parametrize("columns", [2, 3, 4])
@pytest.mark.parametrize("scale", [20.0, 7.5])
def test_matches_multiple_negatives_ranking_loss(tiny_model, columns, scale):
    embs = _embeddings(columns)
    ours = FastInfoNCELoss(tiny_model, scale=scale).compute_loss_from_embeddings(embs, None)
    g_ours = torch.autograd.grad(ours, embs)
    theirs = MultipleNegativesRankingLoss(tiny_model, scale=scale).compute_loss_from_embeddings(embs, None)
    g_theirs = torch.autograd.grad(theirs, embs)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@needs_mnrl_options
def test_symmetric_matches_mnrl_both_directions(tiny_model):
    embs = _embeddings(2)
    ours = FastInfoNCELoss(tiny_model, symmetric=True).compute_loss_from_embeddings(embs, None)
    theirs = MultipleNegativesRankingLoss(
        tiny_model, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    ).compute_loss_from_embeddings(embs, None)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_hard_negative_weight_needs_one_negative_column(tiny_model):
    embs = _embeddings(4)
    with pytest.raises(ValueError, match="exactly one negative column"):
        FastInfoNCELoss(tiny_model, hard_negative_weight=1.0).compute_loss_from_embeddings(embs, None)
    embs = _embeddings(3)
    got = FastInfoNCELoss(tiny_model, hard_negative_weight=1.0).compute_loss_from_embeddings(embs, None)
    torch.testing.assert_close(got, fastcl.infonce(*embs, hard_negative_weight=1.0))


def test_other_similarities_are_refused(tiny_model):
    with pytest.raises(ValueError, match="cos_sim"):
        FastInfoNCELoss(tiny_model, similarity_fct=st.util.dot_score)
    with pytest.raises(ValueError, match="input columns"):
        FastDCLRLoss(tiny_model, tiny_model).compute_loss_from_embeddings(_embeddings(3), None)


@pytest.mark.parametrize("cls", [FastInfoNCELoss, CachedFastInfoNCELoss])
@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), 0.0, -20.0])
def test_a_bad_scale_is_refused_where_the_loss_is_built_by_name(tiny_model, cls, scale):
    # scale=inf used to pass here and fail at the first step as "temperature must be > 0"
    with pytest.raises(ValueError, match=r"^scale must be (finite|> 0)"):
        cls(tiny_model, scale=scale)


@pytest.mark.parametrize("cls", [FastInfoNCELoss, CachedFastInfoNCELoss])
@pytest.mark.parametrize("scale", ["20", b"20", True, None, [20.0]],
                         ids=["str", "bytes", "bool", "None", "list"])
def test_a_scale_that_is_not_a_number_is_a_type_error_naming_it(tiny_model, cls, scale):
    # "20" used to raise "'>' not supported between instances of 'str' and 'int'"; True passed
    with pytest.raises(TypeError, match=r"^scale must be a real number, got "):
        cls(tiny_model, scale=scale)
    assert cls(tiny_model, scale=torch.tensor(20.0)).scale == 20.0  # a number in any form is one


@pytest.mark.parametrize("cls", [FastDCLRLoss, CachedFastDCLRLoss])
def test_dclr_guide_is_a_model_or_none(tiny_model, cls):
    # None used to raise AttributeError: 'NoneType' object has no attribute 'tokenizer'
    with pytest.raises(TypeError, match=r"^guide must be a SentenceTransformer .* got str$"):
        cls(tiny_model, "all-MiniLM-L6-v2")
    # None: no instance weighting, the noise negatives only
    g = torch.Generator().manual_seed(0)
    a, p = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    kw = dict(noise_ratio=1.0, noise_steps=2)
    unguided = cls(tiny_model, None, generator=torch.Generator().manual_seed(1), **kw)
    got = unguided.compute_loss_from_embeddings([a, p], None, complementary=None)
    want = fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(1), **kw)
    torch.testing.assert_close(got, want)


def _every_loss(model):
    return {"infonce": FastInfoNCELoss(model), "focal": FastFocalInfoNCELoss(model),
            "dclr": FastDCLRLoss(model, model), "escl": FastESCLLoss(model),
            "cached-infonce": CachedFastInfoNCELoss(model), "cached-focal": CachedFastFocalInfoNCELoss(model),
            "cached-dclr": CachedFastDCLRLoss(model, model), "cached-escl": CachedFastESCLLoss(model)}


@pytest.mark.parametrize("empty", [pytest.param("no-text", marks=needs_st6), "zero-rows", "positives-only"])
def test_an_empty_batch_is_refused_before_any_forward(tiny_model, monkeypatch, empty):
    # an empty batch used to reach BERT ("You must specify exactly one of input_ids or
    # inputs_embeds"), or was encoded and then refused by the loss as "anchors is an empty batch"
    some = preprocess(tiny_model, ["A man is playing a guitar.", "A dog runs."])
    none = preprocess(tiny_model, []) if empty == "no-text" else {k: v[:0] for k, v in some.items()}
    columns = [some if empty == "positives-only" else none, none]
    empty_column = 1 if empty == "positives-only" else 0

    def encoder_ran(*args, **kwargs):
        raise AssertionError("the encoder ran on an empty batch")

    monkeypatch.setattr(tiny_model, "forward", encoder_ran)
    for name, loss in _every_loss(tiny_model).items():
        with pytest.raises(ValueError, match=rf"^{type(loss).__name__} got an empty batch: input column "
                                             rf"{empty_column} has no rows"):
            loss([dict(c) for c in columns], None)


def test_dropout_rate_is_restored(tiny_model):
    dropouts = [m for m in tiny_model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts
    before = [m.p for m in dropouts]
    with dropout_rate(tiny_model, 0.45):
        assert all(m.p == 0.45 for m in dropouts)
    assert [m.p for m in dropouts] == before


def test_importing_fastcl_does_not_need_sentence_transformers():
    code = ("import sys; sys.modules['sentence_transformers'] = None\n"
            "import fastcl\n"
            "try:\n"
            "    import fastcl.integrations.sentence_transformers\n"
            "except ImportError as e:\n"
            "    print('ImportError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "ImportError: fastcl.integrations.sentence_transformers needs the sentence-transformers" \
        in out.stdout
    assert "pip install sentence-transformers" in out.stdout

