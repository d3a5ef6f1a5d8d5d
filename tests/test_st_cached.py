"""The cached (GradCache) fastcl losses and ``gather_across_devices`` on the
sentence-transformers path, on a tiny random BERT (conftest.tiny_sentence_transformer; the
first test also on the packaged all-MiniLM-L6-v2):

- eval mode: CachedFastInfoNCELoss equals CachedMultipleNegativesRankingLoss and
  MultipleNegativesRankingLoss (loss and parameter gradients) for several mini-batch sizes;
- train mode: the replay in pass 2 draws the dropout masks of pass 1, for every loss;
- fastcl's own GradCache (older sentence-transformers) gives the same numbers;
- two gloo processes with gather_across_devices=True give the gradients of one process;
- SentenceTransformerTrainer runs with every cached loss, and the example of docs/sentence-transformers.md runs.
"""

import importlib
import os
from contextlib import nullcontext
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

# named, not only loaded by pytest: processes the gather tests spawn (where CUDA is
# initialized) import this module without pytest, and conftest gives older
# sentence-transformers release 6's module names
import conftest  # noqa: F401
from conftest import minilm_path

st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")
from sentence_transformers.sentence_transformer.losses import (  # noqa: E402
    CachedMultipleNegativesRankingLoss, MultipleNegativesRankingLoss)

import fastcl.integrations.sentence_transformers as fst  # noqa: E402
from fastcl.encoders import dropout_rate  # noqa: E402
from fastcl.integrations.sentence_transformers._base import preprocess  # noqa: E402
from fastcl.integrations.sentence_transformers import (  # noqa: E402
    CachedFastDCLRLoss, CachedFastESCLLoss, CachedFastFocalInfoNCELoss, CachedFastGISTEmbedLoss,
    CachedFastInfoNCELoss, FastDCLRLoss, FastESCLLoss, FastFocalInfoNCELoss, FastGISTEmbedLoss,
    FastInfoNCELoss)

ROOT = Path(__file__).resolve().parents[1]

# confusable pairs, so that in-batch and hard negatives matter (the loss is far from 0)
ANCHORS = ["A man is playing a guitar.", "A woman is slicing an onion.", "A man is playing a flute.",
           "A woman is cutting a tomato.", "Two dogs run on the beach.", "A dog runs through the snow."]
POSITIVES = ["A person plays the guitar.", "Someone is cutting an onion.", "A man plays a wind instrument.",
             "A tomato is being sliced.", "Dogs are running by the sea.", "A dog is running in snow."]
NEGATIVES = ["A man is playing a piano.", "A woman is peeling a potato.", "A boy is playing a flute.",
             "A woman is cutting bread.", "Two cats sleep on the beach.", "A dog sleeps in the snow."]
N = len(ANCHORS)
GRAD_TOL = dict(atol=1e-5, rtol=1e-5)
QUERY = "encoder.layer.0.attention.self.query.weight"  # a parameter to spot-check


def query(grads):
    """The spot-checked parameter's gradient (its prefix names the module's attribute:
    ``model`` from sentence-transformers 6, ``auto_model`` before)."""
    return next(g for k, g in grads.items() if k.endswith(QUERY))


def model_path():
    return conftest.tiny_sentence_transformer()


def load_model(path=None):
    model = st.SentenceTransformer(path or model_path(), device="cpu")
    model.max_seq_length = 16
    return model


@pytest.fixture(scope="module")
def model():
    """The model whose gradients are compared (every parameter's)."""
    return load_model()


@pytest.fixture(scope="module")
def minilm():
    """MiniLM, its word-embedding table (30522 × 384) frozen: each backward would otherwise
    add up a dense gradient of that size per mini-batch; every other parameter is compared."""
    model = load_model(minilm_path())
    model[0].auto_model.embeddings.word_embeddings.weight.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def guide():
    return load_model().eval()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Single-sentence forwards are dominated by thread start-up on a shared 2-core CPU."""
    yield


def features(model, columns):
    return [preprocess(model, list(c)) for c in columns]


def loss_and_grads(model, loss_fn, columns, seed=0):
    """The loss of one forward and backward from seed ``seed``, and every parameter gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(features(model, columns), None)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def assert_same(got, want, msg=""):
    (loss, grads), (want_loss, want_grads) = got, want
    torch.testing.assert_close(loss, want_loss, atol=1e-6, rtol=1e-5, msg=f"loss {msg}")
    assert grads.keys() == want_grads.keys(), msg
    for k in want_grads:
        torch.testing.assert_close(grads[k], want_grads[k], **GRAD_TOL, msg=f"{k} {msg}")


# ---------------------------------------------------------------------------------------
# eval mode: the drop-in for (Cached)MultipleNegativesRankingLoss

@pytest.mark.parametrize("which,hard_negative", [("tiny", False), ("tiny", True), ("minilm", False)],
                         ids=["pairs", "triplets", "minilm-pairs"])
def test_cached_infonce_equals_cached_mnrl_and_mnrl(which, hard_negative, request):
    model = request.getfixturevalue("model" if which == "tiny" else "minilm")
    model.eval()
    columns = [ANCHORS, POSITIVES] + ([NEGATIVES] if hard_negative else [])
    scale = 10.0
    want = loss_and_grads(model, MultipleNegativesRankingLoss(model, scale=scale), columns)
    assert want[0] > 0.02  # a loss with real gradients, not a solved batch
    for size in (1, 3, N):
        ours = loss_and_grads(model, CachedFastInfoNCELoss(model, scale, mini_batch_size=size), columns)
        theirs = loss_and_grads(model, CachedMultipleNegativesRankingLoss(model, scale, mini_batch_size=size),
                                columns)
        assert_same(ours, want, f"CachedFastInfoNCELoss vs MNRL, mini_batch_size={size}")
        assert_same(ours, theirs, f"CachedFastInfoNCELoss vs CachedMNRL, mini_batch_size={size}")


# ---------------------------------------------------------------------------------------
# train mode: pass 2 replays pass 1's dropout

def _losses(model, guide, cached, **kw):
    """name -> (a fresh loss, its columns, the forwards it makes: [(column, dropout rate)])."""
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    plain = {"infonce": lambda: FastInfoNCELoss(model, scale=10.0),
             "focal": lambda: FastFocalInfoNCELoss(model, m=0.4),
             "dclr": lambda: FastDCLRLoss(model, guide, phi=0.7, noise_steps=2, generator=gen()),
             "escl": lambda: FastESCLLoss(model, weight=0.5)}
    cache = {"infonce": lambda: CachedFastInfoNCELoss(model, scale=10.0, **kw),
             "focal": lambda: CachedFastFocalInfoNCELoss(model, m=0.4, **kw),
             "dclr": lambda: CachedFastDCLRLoss(model, guide, phi=0.7, noise_steps=2, generator=gen(), **kw),
             "escl": lambda: CachedFastESCLLoss(model, weight=0.5, **kw)}
    return cache if cached else plain


def _mini_batched(model, plain_loss, name, columns, size, seed=0):
    """One forward with a graph through exactly the mini-batches the cached loss embeds, in its
    order (column by column; ESCL's high-dropout view last), then one backward."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    feats = features(model, columns)
    helper = CachedFastInfoNCELoss(model, mini_batch_size=size)  # its mini-batch slicing
    kw = {}
    if name == "dclr":
        kw["complementary"] = plain_loss._guide_embeddings(feats, size)
    views = [(f, None) for f in feats] + ([(feats[0], plain_loss.sensitive_dropout)] if name == "escl" else [])
    embeddings = []
    for f, rate in views:
        with dropout_rate(model, rate) if rate is not None else nullcontext():
            parts = [helper.embed_minibatch(f, b, min(b + size, N), with_grad=True, copy_random_state=False)[0]
                     for b in range(0, N, size)]
        embeddings.append(torch.cat(parts))
    loss = plain_loss.compute_loss_from_embeddings(embeddings, None, **kw)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["infonce", "focal", "dclr", "escl"])
def test_train_mode_cached_gradients_equal_plain(model, guide, name):
    model.train()
    columns = [ANCHORS, ANCHORS]  # the unsupervised recipe: dropout makes the two views
    plain = loss_and_grads(model, _losses(model, guide, False)[name](), columns)
    # a mini-batch that covers each column: the forwards, so the gradients, of the plain loss
    whole = loss_and_grads(model, _losses(model, guide, True, mini_batch_size=N)[name](), columns)
    assert_same(whole, plain, f"{name}, one mini-batch per column")
    # mini-batches of 3: the gradients of one backward through those same forwards
    cached = loss_and_grads(model, _losses(model, guide, True, mini_batch_size=3)[name](), columns)
    want = _mini_batched(model, _losses(model, guide, False)[name](), name, columns, 3)
    assert_same(cached, want, f"{name}, mini-batches of 3")
    # dropout is on: other masks give other gradients (so the checks above could fail)
    other = loss_and_grads(model, _losses(model, guide, True, mini_batch_size=3)[name](), columns, seed=1)
    assert not torch.allclose(query(other[1]), query(cached[1]), **GRAD_TOL)


def test_escl_replays_the_high_dropout_view(model, guide):
    """A replay of ESCL's third view at the normal dropout rate would give other gradients."""
    model.train()
    columns = [ANCHORS, ANCHORS]
    cached = loss_and_grads(model, CachedFastESCLLoss(model, weight=0.5, mini_batch_size=3), columns)
    wrong = _mini_batched(model, FastESCLLoss(model, weight=0.5, sensitive_dropout=0.1), "escl", columns, 3)
    assert not torch.allclose(query(cached[1]), query(wrong[1]), **GRAD_TOL)


def test_no_grad_gives_the_loss_of_the_plain_path(model, guide):
    model.eval()
    columns = [ANCHORS, POSITIVES]
    for name in ("infonce", "focal", "dclr", "escl"):
        with torch.no_grad():
            got = _losses(model, guide, True, mini_batch_size=4)[name]()(features(model, columns), None)
            want = _losses(model, guide, False)[name]()(features(model, columns), None)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cached"])
def test_the_guide_embeds_a_repeated_column_once(model, guide, cached, monkeypatch):
    """Unsupervised DCLR's two columns hold the same texts: the guide (eval mode) embeds them
    once, and the loss and gradients are those of a guide forward per column; different
    columns, or the guide's dropout on, still take a forward each."""
    from fastcl.integrations.sentence_transformers import _base

    model.eval()
    calls = []
    hook = guide.register_forward_hook(lambda *_: calls.append(1))
    kw = dict(mini_batch_size=3) if cached else {}

    def loss(**options):
        return (CachedFastDCLRLoss if cached else FastDCLRLoss)(
            model, guide, phi=0.7, noise_steps=2, generator=torch.Generator().manual_seed(3), **kw, **options)

    try:
        once = loss_and_grads(model, loss(), [ANCHORS, ANCHORS])
        per_column = 2 if cached else 1              # six rows in mini-batches of three
        assert len(calls) == per_column
        with monkeypatch.context() as m:
            m.setattr(_base, "_same_inputs", lambda a, b: False)
            assert_same(once, loss_and_grads(model, loss(), [ANCHORS, ANCHORS]), "a forward per column")
        assert len(calls) == 3 * per_column
        loss_and_grads(model, loss(), [ANCHORS, POSITIVES])
        assert len(calls) == 5 * per_column
        loss_and_grads(model, loss(guide_dropout=True), [ANCHORS, ANCHORS])
        assert len(calls) == 7 * per_column
    finally:
        hook.remove()
        guide.eval()


def test_arguments_and_config(model, guide):
    loss = CachedFastInfoNCELoss(model, 20.0, st.util.cos_sim, 8)  # CMNRL's positional order
    assert loss.mini_batch_size == 8 and loss.scale == 20.0
    assert loss.get_config_dict() == {
        "scale": 20.0, "directions": ("query_to_doc",), "partition_mode": "joint", "hardness_mode": None,
        "hardness_strength": 0.0, "symmetric": False, "hard_negative_weight": 0.0, "focal_m": None,
        "mask_duplicates": False, "matryoshka_dims": None, "matryoshka_weights": None,
        "false_negative_margin": None, "positive_prior": None, "label_smoothing": 0.0,
        "class_labels": False, "teacher_temperature": None, "distill_weight": 0.5,
        "gather_across_devices": False, "learnable_temperature": False, "backend": "auto",
        "mini_batch_size": 8, "mini_batch_num_tokens": None}
    assert "gao2021scaling" in loss.citation and "gao2021simcse" in loss.citation
    assert loss.uses_gradient_cache is True  # backward runs from a hook (what wrapper losses check)
    with pytest.raises(ValueError, match="mini_batch_size"):
        CachedFastFocalInfoNCELoss(model, mini_batch_size=0)
    with pytest.raises(ValueError, match="input columns"):
        CachedFastESCLLoss(model)(features(model, [ANCHORS] * 3), None)
    with pytest.raises(ValueError, match="input columns"):
        CachedFastDCLRLoss(model, guide)(features(model, [ANCHORS]), None)


def test_defaults_come_from_fastcl_common(model, guide):
    from fastcl import common
    assert FastInfoNCELoss(model).scale == CachedFastInfoNCELoss(model).scale == 1.0 / common.TEMPERATURE
    for cls in (FastFocalInfoNCELoss, CachedFastFocalInfoNCELoss):
        loss = cls(model)
        assert (loss.temperature, loss.m) == (common.TEMPERATURE, common.FOCAL_M)
    for cls in (FastDCLRLoss, CachedFastDCLRLoss):
        loss = cls(model, guide)
        assert (loss.phi, loss.noise_ratio, loss.noise_steps, loss.noise_lr, loss.noise_std, loss.temperature) \
            == (common.PHI, common.NOISE_RATIO, common.NOISE_STEPS, common.NOISE_LR, common.NOISE_STD,
                common.TEMPERATURE)
    for cls in (FastESCLLoss, CachedFastESCLLoss):
        loss = cls(model)
        assert (loss.temperature, loss.weight, loss.rd, loss.margins, loss.sensitive_dropout) == \
            (common.TEMPERATURE, common.ESCL_WEIGHT, common.ESCL_RD, common.ESCL_MARGINS,
             common.SENSITIVE_DROPOUT)


# ---------------------------------------------------------------------------------------
# fastcl's own GradCache, for sentence-transformers without CachedLossMixin

def test_own_gradcache_without_sentence_transformers_mixin(model, guide, monkeypatch):
    import fastcl.integrations as integrations
    from fastcl.integrations.sentence_transformers import _gradcache
    if fst.GRADCACHE_BASE is _gradcache.GradCache:
        pytest.skip("the installed sentence-transformers has no CachedLossMixin: every cached "
                    "test above ran on fastcl's own GradCache")
    monkeypatch.setitem(sys.modules, "sentence_transformers.base.losses", None)
    # the package and every module in it imported afresh (all restored afterwards), but the
    # fallback itself: it needs no sentence-transformers
    for name in [n for n in sys.modules if n.startswith(fst.__name__) and n != _gradcache.__name__]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(integrations, "sentence_transformers", fst)
    old = importlib.import_module("fastcl.integrations.sentence_transformers")
    assert old is not fst and old.GRADCACHE_BASE is _gradcache.GradCache

    model.eval()
    columns = [ANCHORS, POSITIVES, NEGATIVES]
    want = loss_and_grads(model, MultipleNegativesRankingLoss(model, scale=10.0), columns)
    for size in (1, 4):
        got = loss_and_grads(model, old.CachedFastInfoNCELoss(model, 10.0, mini_batch_size=size), columns)
        assert_same(got, want, f"own GradCache, mini_batch_size={size}")

    model.train()  # the replay, ESCL's third view included
    columns = [ANCHORS, ANCHORS]
    got = loss_and_grads(model, old.CachedFastESCLLoss(model, weight=0.5, mini_batch_size=4), columns)
    want = _mini_batched(model, FastESCLLoss(model, weight=0.5), "escl", columns, 4)
    assert_same(got, want, "own GradCache, ESCL in train mode")
    gen = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    got = loss_and_grads(model, old.CachedFastDCLRLoss(model, guide, phi=0.7, generator=gen(),
                                                       mini_batch_size=N), columns)
    want = loss_and_grads(model, FastDCLRLoss(model, guide, phi=0.7, generator=gen()), columns)
    assert_same(got, want, "own GradCache, DCLR in train mode")


# ---------------------------------------------------------------------------------------
# two processes (gloo) with gather_across_devices=True

WORLD = 2
GLOBAL = ANCHORS + ["A girl is riding a horse.", "A child rides a pony."]  # 8 = 2 × 4
GLOBAL_POS = POSITIVES + ["A girl rides a horse.", "A kid is on a small horse."]
GLOBAL_NEG = NEGATIVES + ["A girl is feeding a horse.", "A child rides a bike."]


def _gather_cases(model, guide, gather):
    kw = dict(gather_across_devices=gather)
    gen = lambda: torch.Generator().manual_seed(7)  # noqa: E731
    three = [GLOBAL, GLOBAL_POS, GLOBAL_NEG]
    two = [GLOBAL, GLOBAL_POS]
    return {
        "infonce-hard": (lambda: FastInfoNCELoss(model, 10.0, hard_negative_weight=0.5, **kw), three),
        "infonce-symmetric": (lambda: FastInfoNCELoss(model, 10.0, symmetric=True, **kw), two),
        "focal": (lambda: FastFocalInfoNCELoss(model, m=0.4, **kw), three),
        # generator=None: the noise comes from each process's global random state, which the
        # worker seeds differently on each rank; rank 0's noise is the one every rank uses
        "dclr": (lambda: FastDCLRLoss(model, guide, phi=0.6, noise_ratio=1.5, noise_steps=2,
                                      temperature=0.5, **kw), two),
        "escl": (lambda: FastESCLLoss(model, weight=0.5, mask_duplicates=True, **kw), two),
        "cached-infonce": (lambda: CachedFastInfoNCELoss(model, 10.0, mini_batch_size=3, **kw), three),
        "cached-focal": (lambda: CachedFastFocalInfoNCELoss(model, m=0.4, mini_batch_size=3, **kw), three),
        "cached-dclr": (lambda: CachedFastDCLRLoss(model, guide, phi=0.6, noise_ratio=1.5, noise_steps=2,
                                                   temperature=0.5, generator=gen(), mini_batch_size=3,
                                                   **kw), two),
        "cached-escl": (lambda: CachedFastESCLLoss(model, weight=0.5, mini_batch_size=3, **kw), two),
        # MNRL's options: the anchors block is the whole batch's; the text ids travel too
        "infonce-directions": (lambda: FastInfoNCELoss(
            model, 10.0, directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
            hardness_mode="in_batch_negatives", hardness_strength=1.0, mask_duplicates=True, **kw), three),
        "cached-infonce-per-direction": (lambda: CachedFastInfoNCELoss(
            model, 10.0, mini_batch_size=3, directions=("query_to_doc", "doc_to_query"),
            partition_mode="per_direction", **kw), two),
        # GIST scores each process's own anchors against each other (contrast_anchors), as
        # GISTEmbedLoss: that block is not the one-process batch's, so it is left out here
        "gist": (lambda: FastGISTEmbedLoss(model, guide, temperature=0.05, margin=0.02,
                                           contrast_anchors=False, **kw), three),
        "cached-gist": (lambda: CachedFastGISTEmbedLoss(model, guide, temperature=0.05, margin=0.02,
                                                        contrast_anchors=False, mini_batch_size=3,
                                                        **kw), three),
    }


#: The default run's gather cases: each loss plain or cached, and MNRL's and GIST's options
#: (``pytest -m slow`` runs all 13).
GATHER_DEFAULT = ("infonce-hard", "focal", "dclr", "escl", "cached-infonce", "cached-dclr",
                  "infonce-directions", "cached-infonce-per-direction", "gist")


def _gather_worker(rank, port, out, path, names=None):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    model, guide = load_model(path).eval(), load_model(path).eval()
    rows = slice(rank * len(GLOBAL) // WORLD, (rank + 1) * len(GLOBAL) // WORLD)
    results = {}
    one = _gather_cases(model, guide, gather=False)
    for name, (make, columns) in _gather_cases(model, guide, gather=True).items():
        if names is not None and name not in names:
            continue
        loss, _ = loss_and_grads(model, make(), [c[rows] for c in columns], seed=rank)
        for p in model.parameters():  # averaged over processes, as DistributedDataParallel does
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= WORLD
        mean_loss = torch.tensor([float(loss)], dtype=torch.float64)
        dist.all_reduce(mean_loss)
        if rank != 0:      # the reduced loss and gradients are the same on every process
            continue
        got = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        want_loss, want = loss_and_grads(model, one[name][0](), columns)  # one process, whole batch
        results[name] = {"loss": float(mean_loss) / WORLD, "want_loss": float(want_loss),
                         "grads": {k: (got[k] - want[k]).abs().max().item() for k in want},
                         "keys": got.keys() == want.keys(),
                         "scale": max(g.abs().max().item() for g in want.values())}
    if rank == 0:
        torch.save(results, os.path.join(out, "rank0.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("names", [pytest.param(GATHER_DEFAULT, id="default"),
                                   pytest.param(None, id="all", marks=pytest.mark.slow)])
def test_gather_across_devices_two_processes_equal_one(tmp_path, names):
    import torch.multiprocessing as mp
    path = model_path()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # forked, the processes start from this one's imports (spawned, each imports torch,
    # transformers and sentence-transformers again: two thirds of the test's CPU time); a
    # process that has initialized CUDA cannot fork one that runs, so it spawns
    method = "spawn" if torch.cuda.is_initialized() else "fork"
    mp.start_processes(_gather_worker, args=(port, str(tmp_path), path, names), nprocs=WORLD, join=True,
                       start_method=method)
    results = torch.load(tmp_path / "rank0.pt")
    assert len(results) == (13 if names is None else len(names))
    for name, r in results.items():
        assert r["loss"] == pytest.approx(r["want_loss"], rel=1e-5, abs=1e-6), name
        assert r["keys"] and r["scale"] > 1e-3, name
        worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5 * r["scale"], (name, worst, r["scale"])


# ---------------------------------------------------------------------------------------
# SentenceTransformerTrainer

TRAIN = ANCHORS + POSITIVES + NEGATIVES[:4]  # 16 sentences


@pytest.mark.parametrize("name", ["infonce", "focal", "dclr", "escl"])
def test_trainer_two_steps_with_cached_loss(guide, name, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = load_model()  # a fresh copy to train
    loss = _losses(model, guide, True, mini_batch_size=3)[name]()
    data = Dataset.from_dict({"anchor": TRAIN, "positive": TRAIN})
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, learning_rate=5e-5,
        report_to="none", save_strategy="no", logging_steps=1, seed=0, use_cpu=True,
        dataloader_drop_last=True)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data, loss=loss)
    result = trainer.train()
    assert result.global_step == 2
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = [k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])]
    assert len(moved) > len(before) // 2, f"only {len(moved)} of {len(before)} tensors changed"


def test_docs_cached_example_runs(tmp_path, monkeypatch):
    minilm_path()                               # the example loads MiniLM
    doc = "docs/sentence-transformers.md"
    text = (ROOT / doc).read_text(encoding="utf-8")
    match = re.search(re.escape("<!-- example: st-cached") + r".*?\n```python\n(.*?)```", text, re.S)
    assert match, f"{doc} has no python block after '<!-- example: st-cached'"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(match.group(1), f"{doc} (st-cached example)", "exec"), namespace)
    assert (tmp_path / "runs" / "st-cached" / "final" / "config.json").exists()
