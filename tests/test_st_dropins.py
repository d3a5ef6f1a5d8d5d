"""fastcl's drop-ins for the sentence-transformers losses users train with today, held to
those losses on the same model and batch:

- ``FastInfoNCELoss`` / ``CachedFastInfoNCELoss`` with MNRL's ``directions``,
  ``partition_mode``, ``hardness_mode`` and ``hardness_strength`` (and CachedMNRL's
  ``mini_batch_num_tokens``) against ``(Cached)MultipleNegativesRankingLoss``;
- ``FastGISTEmbedLoss`` / ``CachedFastGISTEmbedLoss`` against ``(Cached)GISTEmbedLoss``;
- duplicate masking: the text ids, what they drop, and how many duplicates real NLI
  batches hold;
- ``FastInfoNCELoss`` against MNRL on float32 embeddings on every sentence-transformers
  release (``symmetric``, ``scale``, the hard-negative weight), the arguments each loss
  refuses where it is built, an empty batch refused before any forward, and fastcl
  importable without sentence-transformers.

The two-process (gloo) checks of the same losses are in ``test_st_cached.py``.
"""

import copy
import dataclasses
import inspect
import itertools
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastcl
from conftest import ST_VERSION, correlated, make, needs_st6

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")
from sentence_transformers.sentence_transformer.losses import (  # noqa: E402
    CachedGISTEmbedLoss, CachedMultipleNegativesRankingLoss, GISTEmbedLoss,
    MultipleNegativesRankingLoss)

from fastcl.integrations.sentence_transformers import (  # noqa: E402
    CachedFastDCLRLoss, CachedFastESCLLoss, CachedFastFocalInfoNCELoss, CachedFastGISTEmbedLoss,
    CachedFastInfoNCELoss,
    FastDCLRLoss, FastESCLLoss, FastFocalInfoNCELoss, FastGISTEmbedLoss, FastInfoNCELoss)
from fastcl.integrations.sentence_transformers._base import preprocess, text_ids  # noqa: E402
from test_st_cached import (ANCHORS, NEGATIVES, POSITIVES, assert_same, features,  # noqa: E402,F401
                            guide, load_model, loss_and_grads, model)

DATA = Path(os.environ.get("FASTCL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
SNLI = DATA / "nli" / "snli_senteval"

def _takes(loss, argument):
    return argument in inspect.signature(loss.__init__).parameters


# What sentence-transformers' losses take depends on the release (the floor, 5.0, has none of
# these); fastcl's drop-ins are held to each where the installed release has it.
needs_mnrl_options = pytest.mark.skipif(
    not _takes(MultipleNegativesRankingLoss, "directions"),
    reason="the installed MultipleNegativesRankingLoss has no directions, partition_mode or hardness")
needs_token_budget = pytest.mark.skipif(
    not _takes(CachedMultipleNegativesRankingLoss, "mini_batch_num_tokens"),
    reason="the installed CachedMultipleNegativesRankingLoss has no mini_batch_num_tokens")
GIST_FLAGS = _takes(GISTEmbedLoss, "contrast_anchors")   # before: both blocks always on

DIRECTIONS = ["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
HARDNESS = [None, "in_batch_negatives", "hard_negatives", "all_negatives"]


def _direction_sets():
    for r in range(4):
        for extra in itertools.combinations(DIRECTIONS[1:], r):
            yield ("query_to_doc",) + extra


def _options():
    """Every (directions, partition_mode) MNRL takes."""
    for dirs in _direction_sets():
        yield dirs, "joint"
        if set(dirs) <= {"query_to_doc", "doc_to_query"}:
            yield dirs, "per_direction"


@pytest.fixture(autouse=True)
def _quiet():
    # MNRL warns when a hardness_mode comes with strength 0; the tests build that on purpose
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    yield


def _embeddings(columns, n=7, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    cols = [base, base + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64)]
    cols += [base + 1.2 * torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(columns - 2)]
    return [c.requires_grad_() for c in cols]


# ---------------------------------------------------------------------------------------
# MNRL's options

@needs_mnrl_options
@pytest.mark.parametrize("backend", ["reference", "tiled"])
@pytest.mark.parametrize("columns", [2, 3, 4])
def test_every_mnrl_option_gives_mnrl(model, backend, columns):
    """Each directions set and partition mode, with and without each hardness mode, on the
    same embeddings (float64): the loss and the gradient of every column."""
    embs = _embeddings(columns)
    for (dirs, mode), hardness in itertools.product(_options(), HARDNESS):
        kw = dict(directions=dirs, partition_mode=mode, hardness_mode=hardness,
                  hardness_strength=0.8 if hardness else 0.0)
        ours = FastInfoNCELoss(model, 7.0, backend=backend, chunk_size=3, **kw)
        theirs = MultipleNegativesRankingLoss(model, 7.0, **kw)
        got = ours.compute_loss_from_embeddings(embs, None)
        want = theirs.compute_loss_from_embeddings(embs, None)
        for a, b in zip(torch.autograd.grad(got, embs), torch.autograd.grad(want, embs)):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=f"{kw}")
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=f"{kw}")


@needs_mnrl_options
def test_every_option_on_the_model_and_cached(model):
    """Parameter gradients of a real model in eval mode: all four directions with hardness, and
    the per-direction pair, plain and cached (mini-batches of 3, or packed by 40 tokens)
    against MNRL and CachedMNRL."""
    model.eval()
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    for kw in (dict(directions=tuple(DIRECTIONS), hardness_mode="in_batch_negatives", hardness_strength=2.0),
               dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction",
                    hardness_mode="hard_negatives", hardness_strength=1.0)):
        want = loss_and_grads(model, MultipleNegativesRankingLoss(model, 10.0, **kw), columns)
        assert want[0] > 0.05
        assert_same(loss_and_grads(model, FastInfoNCELoss(model, 10.0, **kw), columns), want, f"{kw}")
        # the cached forms: mini-batches of 3 for the first, packed by 40 tokens for the second
        for size, tokens in ((3, None),) if "partition_mode" not in kw else ((32, 40),):
            theirs = loss_and_grads(model, CachedMultipleNegativesRankingLoss(
                model, 10.0, mini_batch_size=size, mini_batch_num_tokens=tokens, **kw), columns)
            ours = loss_and_grads(model, CachedFastInfoNCELoss(
                model, 10.0, mini_batch_size=size, mini_batch_num_tokens=tokens, **kw), columns)
            assert_same(ours, theirs, f"{kw} size={size} tokens={tokens}")
            assert_same(ours, want, f"{kw} size={size} tokens={tokens}")


@needs_token_budget
def test_token_budget_packs_the_mini_batches(model):
    """mini_batch_num_tokens decides the forwards of pass 1 (and pass 2 replays them)."""
    model.eval()
    sizes = []
    loss = CachedFastInfoNCELoss(model, 10.0, mini_batch_size=32, mini_batch_num_tokens=30)
    hook = model[0].register_forward_hook(lambda m, a, out: sizes.append(len(a[0]["input_ids"])))
    try:
        loss_and_grads(model, loss, [ANCHORS, POSITIVES])
    finally:
        hook.remove()
    assert 1 < max(sizes) < len(ANCHORS), sizes            # more than one, fewer than all per forward
    assert len(sizes) % 2 == 0 and sizes[:len(sizes) // 2] == sizes[len(sizes) // 2:]   # replayed


@pytest.mark.parametrize("build,error,match", [
    (lambda m: FastFocalInfoNCELoss(m, m=float("nan")), ValueError, "^m must be finite"),
    (lambda m: FastFocalInfoNCELoss(m, temperature=True), TypeError, "temperature must be a real"),
    (lambda m: CachedFastFocalInfoNCELoss(m, m=float("inf")), ValueError, "^m must be finite"),
    (lambda m: FastDCLRLoss(m, m, phi=2), ValueError, "phi is a cosine threshold"),
    (lambda m: FastDCLRLoss(m, None, noise_steps=-1), ValueError, "noise_steps must be"),
    (lambda m: FastDCLRLoss(m, None, formulation="authors"), ValueError, "formulation must be"),
    (lambda m: CachedFastDCLRLoss(m, m, phi=-1.5), ValueError, "phi is a cosine threshold"),
    (lambda m: FastESCLLoss(m, weight=float("inf")), ValueError, "weight must be finite"),
    (lambda m: FastESCLLoss(m, rd="hinge"), ValueError, "rd must be one of"),
    (lambda m: CachedFastESCLLoss(m, weight=float("nan")), ValueError, "weight must be finite"),
    (lambda m: FastInfoNCELoss(m, hard_negative_weight=float("nan")), ValueError,
     "hard_negative_weight must be finite"),
    (lambda m: FastGISTEmbedLoss(m, m, temperature=True), TypeError, "temperature must be a real"),
    (lambda m: FastInfoNCELoss(m, directions=("doc_to_query",)), ValueError, "query_to_doc"),
    (lambda m: FastInfoNCELoss(m, directions=("query_to_doc", "doc_to_doc"), partition_mode="per_direction"),
     ValueError, "per_direction"),
    (lambda m: FastInfoNCELoss(m, hardness_mode="hardest"), ValueError, "hardness_mode"),
    (lambda m: FastInfoNCELoss(m, hardness_mode="hard_negatives", hardness_strength=-1.0), ValueError,
     "hardness_strength"),
    (lambda m: FastInfoNCELoss(m, symmetric=True, directions=("query_to_doc", "query_to_query")), ValueError,
     "symmetric"),
    (lambda m: CachedFastInfoNCELoss(m, mini_batch_num_tokens=0), ValueError, "mini_batch_num_tokens"),
    (lambda m: FastInfoNCELoss(m, matryoshka_dims=(64, 0)), ValueError, "positive integers"),
    (lambda m: FastInfoNCELoss(m, similarity_fct=st.util.dot_score), ValueError, "cos_sim"),
    # None used to raise AttributeError: 'NoneType' object has no attribute 'tokenizer'
    (lambda m: FastDCLRLoss(m, "all-MiniLM-L6-v2"), TypeError, r"^guide must be a SentenceTransformer .* got str$"),
    (lambda m: CachedFastDCLRLoss(m, "all-MiniLM-L6-v2"), TypeError, r"^guide must be a SentenceTransformer .* got str$"),
], ids=["focal-m", "focal-temperature", "cached-focal-m", "dclr-phi", "dclr-steps",
        "dclr-formulation", "cached-dclr-phi", "escl-weight", "escl-rd", "cached-escl-weight",
        "infonce-weight", "gist-temperature", "directions", "partition", "hardness-mode",
        "hardness-strength", "symmetric", "num-tokens", "matryoshka-dims", "similarity",
        "dclr-guide", "cached-dclr-guide"])
def test_arguments_are_refused_where_the_loss_is_built(model, build, error, match):
    """One policy: a bad argument fails where the loss is built, naming the argument as that
    class calls it (issue #42: m=nan, phi=2, weight=inf ran until the first step, and the
    focal loss's error named focal_m). fastcl.contrastive's own: tests/test_validation.py."""
    with pytest.raises(error, match=match):
        build(model)


def _float32_embeddings(columns, n=12, d=32):
    a = make(n, d)
    return [a, correlated(a, 0.8)] + [make(n, d, seed=10 + i) for i in range(columns - 2)]


@pytest.mark.parametrize("columns", [2, 3, 4])
@pytest.mark.parametrize("scale", [20.0, 7.5])
def test_matches_multiple_negatives_ranking_loss_in_float32(model, columns, scale):
    """The default backend on float32 embeddings, on every sentence-transformers release."""
    embs = _float32_embeddings(columns)
    ours = FastInfoNCELoss(model, scale=scale).compute_loss_from_embeddings(embs, None)
    g_ours = torch.autograd.grad(ours, embs)
    theirs = MultipleNegativesRankingLoss(model, scale=scale).compute_loss_from_embeddings(embs, None)
    g_theirs = torch.autograd.grad(theirs, embs)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@needs_mnrl_options
def test_symmetric_matches_mnrl_both_directions(model):
    embs = _float32_embeddings(2)
    ours = FastInfoNCELoss(model, symmetric=True).compute_loss_from_embeddings(embs, None)
    theirs = MultipleNegativesRankingLoss(
        model, directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"
    ).compute_loss_from_embeddings(embs, None)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_a_loss_refuses_columns_it_cannot_take(model):
    embs = _float32_embeddings(4)
    with pytest.raises(ValueError, match="exactly one negative column"):
        FastInfoNCELoss(model, hard_negative_weight=1.0).compute_loss_from_embeddings(embs, None)
    embs = _float32_embeddings(3)
    got = FastInfoNCELoss(model, hard_negative_weight=1.0).compute_loss_from_embeddings(embs, None)
    torch.testing.assert_close(got, fastcl.infonce(*embs, hard_negative_weight=1.0))
    with pytest.raises(ValueError, match="input columns"):
        FastDCLRLoss(model, model).compute_loss_from_embeddings(embs, None)


@pytest.mark.parametrize("cls", [FastInfoNCELoss, CachedFastInfoNCELoss])
@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan"), 0.0, -20.0])
def test_a_bad_scale_is_refused_where_the_loss_is_built_by_name(model, cls, scale):
    # scale=inf used to pass here and fail at the first step as "temperature must be > 0"
    with pytest.raises(ValueError, match=r"^scale must be (finite|> 0)"):
        cls(model, scale=scale)


@pytest.mark.parametrize("cls", [FastInfoNCELoss, CachedFastInfoNCELoss])
@pytest.mark.parametrize("scale", ["20", b"20", True, None, [20.0]],
                         ids=["str", "bytes", "bool", "None", "list"])
def test_a_scale_that_is_not_a_number_is_a_type_error_naming_it(model, cls, scale):
    # "20" used to raise "'>' not supported between instances of 'str' and 'int'"; True passed
    with pytest.raises(TypeError, match=r"^scale must be a real number, got "):
        cls(model, scale=scale)
    assert cls(model, scale=torch.tensor(20.0)).scale == 20.0  # a number in any form is one


@pytest.mark.parametrize("cls", [FastDCLRLoss, CachedFastDCLRLoss])
def test_dclr_without_a_guide_takes_the_noise_negatives_only(model, cls):
    """guide=None: no instance weighting (a guide that is not a model: the refusals above)."""
    g = torch.Generator().manual_seed(0)
    a, p = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    kw = dict(noise_ratio=1.0, noise_steps=2)
    unguided = cls(model, None, generator=torch.Generator().manual_seed(1), **kw)
    got = unguided.compute_loss_from_embeddings([a, p], None, complementary=None)
    want = fastcl.dclr_loss(a, p, generator=torch.Generator().manual_seed(1), **kw)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("empty", [pytest.param("no-text", marks=needs_st6), "zero-rows", "positives-only"])
def test_an_empty_batch_is_refused_before_any_forward(model, monkeypatch, empty):
    # an empty batch used to reach BERT ("You must specify exactly one of input_ids or
    # inputs_embeds"), or was encoded and then refused by the loss as "anchors is an empty batch"
    some = preprocess(model, ["A man is playing a guitar.", "A dog runs."])
    none = preprocess(model, []) if empty == "no-text" else {k: v[:0] for k, v in some.items()}
    columns = [some if empty == "positives-only" else none, none]
    empty_column = 1 if empty == "positives-only" else 0

    def encoder_ran(*args, **kwargs):
        raise AssertionError("the encoder ran on an empty batch")

    monkeypatch.setattr(model, "forward", encoder_ran)
    for loss in (FastInfoNCELoss(model), FastFocalInfoNCELoss(model), FastDCLRLoss(model, model),
                 FastESCLLoss(model), CachedFastInfoNCELoss(model), CachedFastFocalInfoNCELoss(model),
                 CachedFastDCLRLoss(model, model), CachedFastESCLLoss(model)):
        with pytest.raises(ValueError, match=rf"^{type(loss).__name__} got an empty batch: input column "
                                             rf"{empty_column} has no rows"):
            loss([dict(c) for c in columns], None)


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


# ---------------------------------------------------------------------------------------
# GISTEmbedLoss

@pytest.fixture(scope="module")
def other_guide():
    """A guide that disagrees with the model: the model with noise on its weights."""
    g = load_model().eval()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in g.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return g


def _masked_share(model, guide_model, columns, margin):
    """The share of anchor–positive guide cosines above the row's threshold (absolute)."""
    with torch.no_grad():
        a, p = (guide_model.encode(c, convert_to_tensor=True) for c in columns[:2])
        cos = torch.nn.functional.normalize(a, dim=1) @ torch.nn.functional.normalize(p, dim=1).T
    return float((cos > cos.diagonal()[:, None] - margin).float().mean())


@pytest.mark.parametrize("backend,strategy,margin", [
    pytest.param("tiled", "absolute", 0.0, marks=pytest.mark.slow), ("tiled", "absolute", 0.05),
    ("tiled", "relative", 0.1), ("reference", "absolute", 0.05)])
def test_gist_equals_gistembedloss(model, other_guide, strategy, margin, backend):
    """Every contrast flag with pairs and triplets: loss and parameter gradients."""
    model.eval()
    triplets = [ANCHORS, POSITIVES, NEGATIVES]
    assert 0.05 < _masked_share(model, other_guide, triplets, 0.05) < 0.95   # the filter acts
    flags = ((True, True, 3), (False, True, 2), (True, False, 2), (False, False, 3))
    for contrast_anchors, contrast_positives, cols in flags if GIST_FLAGS else flags[:1]:
        kw = dict(temperature=0.05, margin_strategy=strategy, margin=margin)
        if GIST_FLAGS:
            kw.update(contrast_anchors=contrast_anchors, contrast_positives=contrast_positives)
        columns = triplets[:cols]
        want = loss_and_grads(model, GISTEmbedLoss(model, other_guide, **kw), columns)
        got = loss_and_grads(model, FastGISTEmbedLoss(model, other_guide, backend=backend, chunk_size=4,
                                                      **kw), columns)
        assert_same(got, want, f"{kw} columns={cols}")


def test_a_guide_with_a_shorter_window_reads_the_texts_retokenized(model, other_guide):
    """A guide that reads fewer tokens than the model (or has another vocabulary) embeds the
    decoded texts with its own tokenizer, as GISTEmbedLoss does; plain and cached."""
    model.eval()
    short = copy.deepcopy(other_guide)
    short.max_seq_length = 6
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    kw = dict(temperature=0.05, margin=0.05)
    want = loss_and_grads(model, GISTEmbedLoss(model, short, **kw), columns)
    for ours in (FastGISTEmbedLoss(model, short, **kw), CachedFastGISTEmbedLoss(model, short, mini_batch_size=4, **kw)):
        assert ours.must_retokenize
        assert_same(loss_and_grads(model, ours, columns), want, type(ours).__name__)
    # the window matters here: read whole, the guide's filter gives another loss
    whole = loss_and_grads(model, FastGISTEmbedLoss(model, other_guide, **kw), columns)
    assert not torch.allclose(whole[0], want[0])


def test_cached_gist_equals_cached_gistembedloss(model, other_guide):
    model.eval()
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    kw = dict(temperature=0.05, margin=0.05)
    want = loss_and_grads(model, GISTEmbedLoss(model, other_guide, **kw), columns)
    theirs = loss_and_grads(model, CachedGISTEmbedLoss(model, other_guide, mini_batch_size=4, **kw), columns)
    ours = loss_and_grads(model, CachedFastGISTEmbedLoss(model, other_guide, mini_batch_size=4, **kw), columns)
    assert_same(ours, theirs, "cached")
    assert_same(ours, want, "cached vs plain GIST")


def repeated_nli_batch():
    """A batch of SNLI dev triplets (premise, entailment, contradiction) in which texts repeat
    as they do in real NLI data: a positive that is another row's hard negative (three such
    pairs), an anchor equal to its own positive, two rows with the same positive, two with
    the same hard negative. Found in the data, not written here."""
    from collections import defaultdict

    from fastcl.data import read_snli
    rows = read_snli(SNLI, ["dev"]).dataset
    a, p, n = (list(rows[c]) for c in rows.column_names)
    negative_at = defaultdict(list)
    for i, t in enumerate(n):
        negative_at[t].append(i)
    picked = []
    for i, t in enumerate(p):
        if len(picked) < 6 and negative_at.get(t) and negative_at[t][0] != i:
            picked += [i, negative_at[t][0]]
    picked.append(next(i for i in range(len(a)) if a[i] == p[i]))
    for column in (p, n):
        seen = {}
        for i, t in enumerate(column):
            if t in seen and i not in picked and seen[t] not in picked:
                picked += [seen[t], i]
                break
            seen.setdefault(t, i)
    return [[column[i] for i in picked] for column in (a, p, n)]


@pytest.mark.skipif(not (SNLI / "s1.dev").exists(), reason=f"needs the SNLI sample in {SNLI}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_gist_equals_gistembedloss_on_repeated_nli_texts(dtype):
    """Real NLI batches repeat texts. GISTEmbedLoss embeds the guide's columns in one forward,
    so equal texts have equal guide embeddings, their guide cosines tie exactly with the
    row's γ and its strict ``>`` keeps them at margin 0; the fused filter formed the same
    cosines by other products, an ulp apart, and dropped them (issue #42: fastcl 0.2–3 %
    lower). Now equal (loss and parameter gradients), the guide being the model itself:
    float64 against GISTEmbedLoss and CachedGISTEmbedLoss; float32 against GISTEmbedLoss
    (CachedGISTEmbedLoss embeds the guide per mini-batch, whose padding moves a text's
    embedding in its last bits from column to column, and then drops some equal texts by
    chance: on this batch 2.5277 against its own plain loss's 2.5366)."""
    columns = repeated_nli_batch()
    texts = [t for c in columns for t in c]
    assert len(set(texts)) <= len(texts) - 6, "the batch repeats texts"
    model = load_model().to(dtype).eval()
    model[0].auto_model.embeddings.word_embeddings.weight.requires_grad_(False)
    guide_model = load_model().to(dtype).eval()
    for kw in (dict(temperature=1.0, margin=0.0, contrast_anchors=False, contrast_positives=False),
               dict(temperature=0.05, margin=0.0)):
        if not GIST_FLAGS:
            kw = {k: v for k, v in kw.items() if not k.startswith("contrast")}
        want = loss_and_grads(model, GISTEmbedLoss(model, guide_model, **kw), columns)
        assert_same(loss_and_grads(model, FastGISTEmbedLoss(model, guide_model, **kw), columns),
                    want, f"plain {kw}")
        cached = loss_and_grads(model, CachedFastGISTEmbedLoss(model, guide_model, mini_batch_size=4,
                                                               **kw), columns)
        assert_same(cached, want, f"cached vs GISTEmbedLoss {kw}")
        if dtype == torch.float64:
            theirs = loss_and_grads(model, CachedGISTEmbedLoss(model, guide_model, mini_batch_size=4,
                                                               **kw), columns)
            assert_same(cached, theirs, f"cached {kw}")


@pytest.mark.parametrize("backend", ["reference", "tiled"])
def test_gist_never_scores_a_row_against_itself(backend):
    """The self scores (a_i, a_i) and (p_i, p_i) leave the softmax whatever the guide says:
    with a threshold no guide cosine reaches (margin −3), the loss is cross-entropy over
    [a·pᵀ | a·nᵀ | a·aᵀ | p·pᵀ] / τ with the two diagonals at −∞, by hand."""
    a, p, n = _embeddings(3, n=6)
    guide_embeddings = tuple(x.detach() for x in (a, p, n))
    tau = 0.1
    unit = [torch.nn.functional.normalize(x, dim=1) for x in (a, p, n)]
    eye = torch.eye(6, dtype=torch.bool)
    blocks = [unit[0] @ unit[1].T, unit[0] @ unit[2].T,
              (unit[0] @ unit[0].T).masked_fill(eye, float("-inf")),
              (unit[1] @ unit[1].T).masked_fill(eye, float("-inf"))]
    want = torch.nn.functional.cross_entropy(torch.cat(blocks, dim=1) / tau, torch.arange(6))
    got = fastcl.contrastive(a, p, n, temperature=tau, guide=guide_embeddings, guide_margin=-3.0,
                             directions=fastcl.layout.gist(True, True), backend=backend, chunk_size=4)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for x, y in zip(torch.autograd.grad(got, (a, p, n)), torch.autograd.grad(want, (a, p, n))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


@pytest.mark.skipif(ST_VERSION < (6, 3),
                    reason="GISTEmbedLoss drops the self scores whatever the guide says from "
                           "sentence-transformers 6.3 (before, only where its filter does)")
def test_gist_equals_gistembedloss_where_the_guide_keeps_the_self_scores(model, other_guide):
    """A negative margin (θ above every guide cosine) and an anchor identical to its positive
    (γ = 1 at margin 0): the self scores are the guide filter's to keep, and both losses drop
    them."""
    model.eval()
    for margin, columns in ((-1.5, [ANCHORS, POSITIVES, NEGATIVES]),
                            (0.0, [ANCHORS, [ANCHORS[0]] + POSITIVES[1:]])):
        kw = dict(temperature=0.05, margin=margin)
        want = loss_and_grads(model, GISTEmbedLoss(model, other_guide, **kw), columns)
        got = loss_and_grads(model, FastGISTEmbedLoss(model, other_guide, chunk_size=4, **kw), columns)
        assert_same(got, want, f"margin={margin}")


def test_gist_composes_with_focal_and_noise():
    """The guide's filter on any objective: with focal and DCLR's noise negatives, the tiled
    path equals the reference (the noise is never filtered)."""
    a, p, n = _embeddings(3, n=9)
    g = [x.detach() + 0.3 * torch.randn_like(x) for x in (a, p, n)]
    kw = dict(guide=tuple(g), guide_margin=0.1, focal_m=0.3, temperature=0.1,
              noise=torch.randn(5, a.shape[1], dtype=a.dtype), noise_steps=2,
              directions=fastcl.layout.gist(True, True))
    ref = fastcl.contrastive(a, p, n, backend="reference", **kw)
    got = fastcl.contrastive(a, p, n, backend="tiled", chunk_size=4, **kw)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    for x, y in zip(torch.autograd.grad(got, (a, p, n)), torch.autograd.grad(ref, (a, p, n))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


def test_gist_needs_its_guide(model):
    with pytest.raises(TypeError, match="guide"):
        FastGISTEmbedLoss(model, None)
    with pytest.raises(ValueError, match="guide's embeddings"):
        FastGISTEmbedLoss(model, model).compute_loss_from_embeddings(_embeddings(2), None)
    with pytest.raises(ValueError, match="margin_strategy"):
        FastGISTEmbedLoss(model, model, margin_strategy="ratio")


@needs_mnrl_options
def test_the_drop_ins_on_the_triton_kernels(model, other_guide):
    """The Triton backend (the interpreter on a CPU-only machine) with MNRL's options, GIST's
    filter, duplicate masking and Matryoshka, plain and cached: the model's loss and parameter gradients
    equal sentence-transformers' losses (tests/test_matches_reference.py holds the kernels to the
    reference over every option)."""
    model.eval()
    triplets = [ANCHORS, POSITIVES, NEGATIVES]
    kw = dict(directions=tuple(DIRECTIONS), hardness_mode="in_batch_negatives", hardness_strength=2.0)
    want = loss_and_grads(model, MultipleNegativesRankingLoss(model, 10.0, **kw), triplets)
    assert_same(loss_and_grads(model, FastInfoNCELoss(model, 10.0, backend="triton", **kw), triplets),
                want, f"{kw}")
    cached = loss_and_grads(model, CachedFastInfoNCELoss(model, 10.0, mini_batch_size=4, backend="triton", **kw),
                            triplets)
    assert_same(cached, loss_and_grads(model, CachedMultipleNegativesRankingLoss(
        model, 10.0, mini_batch_size=4, **kw), triplets), "cached")
    gist = dict(temperature=0.05, margin=0.05)
    want = loss_and_grads(model, GISTEmbedLoss(model, other_guide, **gist), triplets)
    assert_same(loss_and_grads(model, FastGISTEmbedLoss(model, other_guide, backend="triton", chunk_size=4,
                                                        **gist), triplets), want, "gist")
    assert_same(loss_and_grads(model, CachedFastGISTEmbedLoss(model, other_guide, mini_batch_size=4,
                                                              backend="triton", **gist), triplets),
                loss_and_grads(model, CachedGISTEmbedLoss(model, other_guide, mini_batch_size=4, **gist),
                               triplets), "cached gist")
    duplicated = list(_duplicated_batch())
    want = loss_and_grads(model, FastInfoNCELoss(model, 10.0, mask_duplicates=True, backend="reference"),
                          duplicated)
    assert_same(loss_and_grads(model, FastInfoNCELoss(model, 10.0, mask_duplicates=True, backend="triton"),
                               duplicated), want, "duplicates")
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
    want = loss_and_grads(model, MatryoshkaLoss(model, MultipleNegativesRankingLoss(model, 10.0), MODEL_DIMS[:3]),
                          triplets)
    assert_same(loss_and_grads(model, CachedFastInfoNCELoss(model, 10.0, mini_batch_size=4, backend="triton",
                                                            matryoshka_dims=MODEL_DIMS[:3]), triplets),
                want, "matryoshka")


# ---------------------------------------------------------------------------------------
# duplicate masking

def test_text_ids_are_equal_exactly_for_equal_texts(model):
    one = preprocess(model, ["a b c", "a b", "a b c", "x"])
    two = preprocess(model, ["a b c d e f g h", "a b"])            # another padded width
    i, j = text_ids(one), text_ids(two)
    assert i[0] == i[2] and i[1] == j[1] and len({*i.tolist(), j[0].item()}) == 4
    model.tokenizer.padding_side = "left"
    try:
        left = text_ids(preprocess(model, ["a b", "a b c d e f"]))
    finally:
        model.tokenizer.padding_side = "right"
    assert left[0] == i[1]                                             # padding on either side


def _duplicated_batch():
    anchors = ANCHORS[:4] + [ANCHORS[1], ANCHORS[2]]                   # rows 4, 5 repeat 1, 2
    positives = POSITIVES[:4] + [POSITIVES[1], POSITIVES[2]]
    return anchors, positives


def test_duplicates_leave_the_softmax(model):
    """With mask_duplicates, a batch whose rows 4 and 5 repeat rows 1 and 2 gives the
    reference loss with those pairs dropped; without duplicates it is MNRL itself."""
    model.eval()
    anchors, positives = _duplicated_batch()
    ids = [text_ids(f) for f in features(model, [anchors, positives])]
    embs = [model.encode(c, convert_to_tensor=True).clone().requires_grad_() for c in (anchors, positives)]
    loss = FastInfoNCELoss(model, 10.0, mask_duplicates=True)
    got = loss.compute_loss_from_embeddings(embs, None, duplicate_ids=ids)
    want = fastcl.contrastive(*embs, temperature=0.1, backend="reference", duplicate_ids=(ids[1],))
    torch.testing.assert_close(got, want)
    # by hand: row i's softmax over the positives whose text differs from its own positive's
    sim = fastcl.reference.cosine_matrix(*embs) * 10.0
    same = torch.tensor([[positives[i] == positives[j] and i != j for j in range(6)] for i in range(6)])
    by_hand = torch.nn.functional.cross_entropy(sim.masked_fill(same, float("-inf")), torch.arange(6))
    torch.testing.assert_close(got, by_hand)
    assert got < MultipleNegativesRankingLoss(model, 10.0).compute_loss_from_embeddings(embs, None)
    # no duplicates: nothing dropped
    clean = [ANCHORS, POSITIVES]
    want = loss_and_grads(model, MultipleNegativesRankingLoss(model, 10.0), clean)
    assert_same(loss_and_grads(model, FastInfoNCELoss(model, 10.0, mask_duplicates=True), clean), want)


def test_duplicates_every_loss_plain_and_cached(model, guide):
    """Each loss with mask_duplicates: the cached form equals the plain one, and the mask
    changes the loss on a batch with duplicates."""
    model.eval()
    anchors, positives = _duplicated_batch()
    cols = [anchors, positives]
    gen = lambda: torch.Generator().manual_seed(2)  # noqa: E731
    pairs = {
        "infonce": (lambda **k: FastInfoNCELoss(model, 10.0, directions=tuple(DIRECTIONS), **k),
                    lambda **k: CachedFastInfoNCELoss(model, 10.0, directions=tuple(DIRECTIONS),
                                                      mini_batch_size=3, **k)),
        "dclr": (lambda **k: FastDCLRLoss(model, None, noise_steps=1, generator=gen(), temperature=0.5, **k),
                 lambda **k: CachedFastDCLRLoss(model, None, noise_steps=1, generator=gen(),
                                                temperature=0.5, mini_batch_size=3, **k)),
        "escl": (lambda **k: FastESCLLoss(model, weight=0.5, **k),
                 lambda **k: CachedFastESCLLoss(model, weight=0.5, mini_batch_size=3, **k)),
        "gist": (lambda **k: FastGISTEmbedLoss(model, guide, temperature=0.05, margin=-0.5, **k),
                 lambda **k: CachedFastGISTEmbedLoss(model, guide, temperature=0.05, margin=-0.5,
                                                     mini_batch_size=3, **k)),
    }
    for name, (plain, cached) in pairs.items():
        masked = loss_and_grads(model, plain(mask_duplicates=True), cols)
        assert_same(loss_and_grads(model, cached(mask_duplicates=True), cols), masked, name)
        assert not torch.isclose(masked[0], loss_and_grads(model, plain(), cols)[0]), name
    focal = FastFocalInfoNCELoss(model, mask_duplicates=True)
    with pytest.raises(ValueError, match="duplicate_ids"):
        focal.compute_loss_from_embeddings(_embeddings(2), None)


@pytest.mark.skipif(not (SNLI / "s1.dev").exists(), reason=f"needs the SNLI sample in {SNLI}")
def test_real_nli_batches_hold_duplicates_and_the_ids_find_each():
    """Supervised SimCSE's (premise, entailment, contradiction) triplets from SNLI, shuffled
    into a batch of 512: the (row, candidate) pairs that mask_duplicates drops — a positive or
    hard negative with the same text as another row's positive ("A man is outside.") — found
    from the token ids are exactly those found by comparing the strings, and there are some."""
    from transformers import BertTokenizerFast

    from fastcl.data import read_snli
    rows = read_snli(SNLI, ["dev"]).dataset
    anchor, positive, negative = rows.column_names
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    batch = rows.select(order[:512])
    texts = {c: [t.lower() for t in batch[c]] for c in (positive, negative)}
    vocab = sorted({w for c in texts for t in texts[c] for w in t.split()})
    tok = BertTokenizerFast.from_pretrained(_write_vocab(vocab))
    ids = {c: text_ids(dict(tok(texts[c], padding=True, return_tensors="pt"))) for c in texts}
    candidates = texts[positive] + texts[negative]
    cand_ids = torch.cat([ids[positive], ids[negative]])
    n = len(texts[positive])
    by_string = sum(1 for i, key in enumerate(texts[positive]) for j, t in enumerate(candidates)
                    if t == key and j != i)
    same = cand_ids[None, :] == ids[positive][:, None]
    same[torch.arange(n), torch.arange(n)] = False                 # the positive itself stays
    assert int(same.sum()) == by_string > 0
    print(f"SNLI dev, a shuffled batch of 512 triplets: {by_string} (row, candidate) pairs "
          f"have the text of the row's positive")


def _write_vocab(words):
    import tempfile
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words))
    return folder


# ---------------------------------------------------------------------------------------
# Matryoshka in one pass

DIMS = (384, 256, 128, 64, 32)
MODEL_DIMS = (16, 12, 8, 4, 2)      # the tiny model's width and its prefixes


def test_one_pass_matryoshka_equals_the_literal_sum():
    """The tiled path's one pass over the width against the reference's sum of prefix losses,
    with each feature it takes (float64, values and gradients)."""
    g = torch.Generator().manual_seed(1)
    n, d = 9, 24
    a = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    p = (a.detach() + 0.8 * torch.randn(n, d, generator=g, dtype=torch.float64)).requires_grad_()
    neg = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    comp = (torch.randn(n, 5, generator=g, dtype=torch.float64),
            torch.randn(n, 5, generator=g, dtype=torch.float64))
    # τ = 0.01 puts the logits beyond the bound where a row's loss is read off its softmax
    for kw, negs in ((dict(), None), (dict(focal_m=0.3), neg), (dict(hard_negative_weight=0.7), neg),
                     (dict(complementary=comp, phi=0.2), neg), (dict(symmetric=True, focal_m=-0.2), None),
                     (dict(temperature=0.01, hard_negative_weight=0.7), neg),
                     (dict(temperature=0.01, focal_m=0.3, complementary=comp, phi=0.2), None)):
        for dims, w in (((24, 16, 8, 4), None), ((3,), (2.0,)), ((24, 1, 7), (1.0, 0.5, 0.25))):
            args = dict(matryoshka_dims=dims, matryoshka_weights=w, temperature=0.1) | kw
            leaves = [a, p] + ([neg] if negs is not None else [])
            want = fastcl.contrastive(a, p, negs, backend="reference", **args)
            got = fastcl.contrastive(a, p, negs, backend="tiled", chunk_size=4, **args)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
            for x, y in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
                torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


def test_one_pass_matryoshka_with_layout_rules_equals_the_literal_sum():
    """The one pass with fastcl.layout's rules (a positive side, joint or per-direction
    softmax, MNRL's hardness, GIST's guide, duplicate ids, focal on the positive side's own
    anchor, gathered rows) against the reference's sum of prefix losses, over chunk edges."""
    g = torch.Generator().manual_seed(4)
    n, d = 7, 18
    t = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    a = t(n, d).requires_grad_()
    p = (a.detach() + 0.9 * t(n, d)).requires_grad_()
    neg = t(n, d).requires_grad_()
    guide = (t(n, 5), t(n, 5), t(n, 5), None)
    ids = (torch.tensor([0, 1, 2, 1, 4, 5, 0]), torch.tensor([7, 1, 8, 9, 4, 10, 11]),
           torch.tensor([12, 13, 2, 14, 15, 5, 16]))
    every = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
    cases = [
        dict(directions=every),
        dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction", focal_m=0.3),
        dict(directions=("query_to_doc", "doc_to_query"), hardness_mode="all_negatives",
             hardness_strength=0.8, negatives=True),
        dict(directions=("query_to_doc", "query_to_query"), hardness_mode="in_batch_negatives",
             hardness_strength=0.5, focal_m=-0.2),
        dict(directions=fastcl.layout.gist(), guide=guide, guide_margin=0.05, negatives=True),
        # a guide that filters every column of some rows' positive side (all of them at 5)
        dict(directions=fastcl.layout.gist(), guide=guide, guide_margin=0.8, negatives=True),
        dict(directions=fastcl.layout.gist(), guide=guide[:2] + (None, None), guide_margin=5.0, focal_m=0.3),
        dict(directions=dataclasses.replace(fastcl.layout.gist(), joint=False), guide=guide,
             margin_strategy="relative", guide_margin=0.1, duplicate_ids=ids, negatives=True),
        dict(duplicate_ids=ids[:2] + (None,), hard_negative_weight=0.6, negatives=True, temperature=0.01),
    ]
    for case in cases:
        kw = dict(case)
        negs = neg if kw.pop("negatives", False) else None
        leaves = [a, p] + ([negs] if negs is not None else [])
        args = dict(temperature=0.1, matryoshka_dims=(18, 11, 4), matryoshka_weights=(1.0, 0.5, 2.0)) | kw
        want = fastcl.contrastive(a, p, negs, backend="reference", **args)
        want_grads = torch.autograd.grad(want, leaves)
        for chunk in (3, None):
            got = fastcl.contrastive(a, p, negs, backend="tiled", chunk_size=chunk, **args)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=lambda m: f"{case}: {m}")
            for x, y in zip(torch.autograd.grad(got, leaves), want_grads):
                torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10, msg=lambda m: f"{case}: {m}")
    # rows of a larger batch (gather_across_devices): the anchors block is the whole batch's
    whole_a = t(2 * n, d).requires_grad_()
    args = dict(temperature=0.1, matryoshka_dims=(18, 5), directions=every, anchor_offset=n,
                anchor_candidates=whole_a, focal_m=0.2)
    want = fastcl.contrastive(whole_a[n:], p.repeat(2, 1), backend="reference", **args)
    got = fastcl.contrastive(whole_a[n:], p.repeat(2, 1), backend="tiled", chunk_size=4, **args)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for x, y in zip(torch.autograd.grad(got, (whole_a, p)), torch.autograd.grad(want, (whole_a, p))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


def test_one_pass_matryoshka_keeps_losses_beyond_the_softmax_range():
    """Positives opposite their anchors at τ = 0.005: each row's loss (≈ 2/τ = 400) is far
    beyond what a float32 softmax entry can express (e^−400 is 0), yet finite and equal."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(6, 16, generator=g, requires_grad=True)
    p = (-a.detach() + 0.01 * torch.randn(6, 16, generator=g)).requires_grad_()
    args = dict(matryoshka_dims=(16, 8), temperature=0.005)
    want = fastcl.contrastive(a.double(), p.double(), backend="reference", **args)
    got = fastcl.contrastive(a, p, backend="tiled", **args)
    assert torch.isfinite(got) and got.item() > 300
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)
    for x, y in zip(torch.autograd.grad(got, (a, p)), torch.autograd.grad(want, (a, p))):
        assert torch.isfinite(x).all()
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-6)


def test_matryoshka_equals_matryoshkaloss_around_mnrl(model):
    """FastInfoNCELoss(matryoshka_dims=...) and its cached form against sentence-transformers'
    MatryoshkaLoss around MNRL and CachedMNRL; MatryoshkaLoss around fastcl's losses too."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
    model.eval()
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    weights = (1.0, 0.5, 0.5, 0.25, 0.25)
    want = loss_and_grads(model, MatryoshkaLoss(model, MultipleNegativesRankingLoss(model, 10.0), MODEL_DIMS,
                                                weights), columns)
    ours = loss_and_grads(model, FastInfoNCELoss(model, 10.0, matryoshka_dims=MODEL_DIMS,
                                                 matryoshka_weights=weights), columns)
    assert_same(ours, want, "one pass")
    cached = loss_and_grads(model, CachedFastInfoNCELoss(model, 10.0, mini_batch_size=4, matryoshka_dims=MODEL_DIMS,
                                                         matryoshka_weights=weights), columns)
    assert_same(cached, want, "cached one pass")
    theirs = loss_and_grads(model, MatryoshkaLoss(model, CachedMultipleNegativesRankingLoss(
        model, 10.0, mini_batch_size=4), MODEL_DIMS, weights), columns)
    assert_same(cached, theirs, "cached vs MatryoshkaLoss(CachedMNRL)")
    wrapped = loss_and_grads(model, MatryoshkaLoss(model, FastInfoNCELoss(model, 10.0), MODEL_DIMS, weights), columns)
    assert_same(wrapped, want, "MatryoshkaLoss(FastInfoNCELoss)")
    wrapped = MatryoshkaLoss(model, CachedFastInfoNCELoss(model, 10.0, mini_batch_size=4), MODEL_DIMS, weights)
    try:
        from sentence_transformers.base.losses.gradcache import uses_gradient_cache  # noqa: F401
    except ImportError:   # its MatryoshkaLoss truncates in the forward only: a clear error
        with pytest.raises(RuntimeError, match="matryoshka_dims= instead"):
            loss_and_grads(model, wrapped, columns)
    else:
        assert_same(loss_and_grads(model, wrapped, columns), want, "MatryoshkaLoss(CachedFastInfoNCELoss)")


@needs_mnrl_options
def test_matryoshka_with_mnrl_options_and_gist(model, other_guide):
    """With MNRL's options or GIST's filter, in the same one pass over the width: the same
    numbers as MatryoshkaLoss around the sentence-transformers loss."""
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss
    model.eval()
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    kw = dict(directions=tuple(DIRECTIONS), hardness_mode="all_negatives", hardness_strength=1.0)
    want = loss_and_grads(model, MatryoshkaLoss(model, MultipleNegativesRankingLoss(model, 10.0, **kw),
                                                MODEL_DIMS[:3]), columns)
    assert_same(loss_and_grads(model, FastInfoNCELoss(model, 10.0, matryoshka_dims=MODEL_DIMS[:3], **kw), columns),
                want, "mnrl options")
    want = loss_and_grads(model, MatryoshkaLoss(model, GISTEmbedLoss(model, other_guide, temperature=0.05),
                                                MODEL_DIMS[:3]), columns)
    got = loss_and_grads(model, FastGISTEmbedLoss(model, other_guide, temperature=0.05,
                                                  matryoshka_dims=MODEL_DIMS[:3]), columns)
    assert_same(got, want, "gist")
