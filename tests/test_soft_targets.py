"""Soft targets (``label_smoothing``, ``labels``, ``teacher``): ``ℓ_i = −Σ_j y_ij log p_ij`` over
the row's kept candidates K_i, ``y = (1−ε)·1[P_i]/|P_i| + ε·1[K_i]/|K_i|``, with a teacher
``y ← (1−λ)·y + λ·softmax(cos(t_i, t_j)/τ_t)`` over the kept documents (fastcl.contrastive's
docstring).

The reference against literal float64 formulas (``F.cross_entropy(label_smoothing=ε)``, a
per-row loop for SupCon's L_out, gradcheck) within 1e-12; every fused backend against the
reference: the ``options-soft`` cases of tests/test_matches_reference.py's grid (tiled on
float64 inputs within 1e-9, Triton in its interpreter within its float32 tolerance, 1e-4, at
N = 1 and N, M off the tiles); here rows whose only positive is their own, rows whose every
candidate but the positive is dropped (bad values: tests/test_validation.py).
"""

import pytest
import torch
import torch.nn.functional as F

import fastcl

from conftest import make, needs_triton, st_train
TAU = 0.1


def _grads(loss, inputs):
    return [g for g in torch.autograd.grad(loss, inputs)]


# --------------------------------------------------------------------------- the reference

def test_label_smoothing_is_torch_cross_entropy():
    """All candidates kept: the target is F.cross_entropy's with label_smoothing=ε."""
    a, p, neg = make(9, 5, dtype=torch.float64), make(9, 5, dtype=torch.float64, seed=1), \
        make(4, 5, dtype=torch.float64, seed=2)
    for eps in (0.0, 0.1, 0.7):
        got = fastcl.contrastive(a, p, neg, temperature=TAU, label_smoothing=eps,
                                 backend="reference")
        logits = F.normalize(a, dim=1) @ F.normalize(torch.cat([p, neg]), dim=1).T / TAU
        want = F.cross_entropy(logits, torch.arange(9), label_smoothing=eps)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        for x, y in zip(_grads(got, (a, p, neg)), _grads(want, (a, p, neg))):
            torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    # symmetric: each direction its own smoothed target, averaged
    got = fastcl.contrastive(a, p, temperature=TAU, label_smoothing=0.3, symmetric=True,
                             backend="reference")
    s = F.normalize(a, dim=1) @ F.normalize(p, dim=1).T / TAU
    want = 0.5 * sum(F.cross_entropy(x, torch.arange(9), label_smoothing=0.3) for x in (s, s.T))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for x, y in zip(_grads(got, (a, p)), _grads(want, (a, p))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def test_labels_are_supcon_l_out():
    """A row at a time: the mean over the positives-block columns of the anchor's label of
    −log p, smoothed by ε over every column; the columns a duplicate id drops leave both."""
    n, eps = 8, 0.2
    a, p, neg = (make(n, 6, dtype=torch.float64, seed=s) for s in (0, 1, 2))
    labels = torch.tensor([0, 1, 0, 2, 1, 0, 3, 0])
    ids = torch.tensor([0, 1, 2, 3, 4, 2, 6, 7])        # column 5 repeats row 2's positive
    got = fastcl.contrastive(a, p, neg, temperature=TAU, labels=labels, label_smoothing=eps,
                             duplicate_ids=(ids, ids + 100), backend="reference")
    s = F.normalize(a, dim=1) @ F.normalize(torch.cat([p, neg]), dim=1).T / TAU
    total = 0.0
    for i in range(n):
        kept = [j for j in range(2 * n) if j == i or j >= n or ids[j] != ids[i]]
        log_p = torch.log_softmax(s[i, kept], dim=0)
        pos = [k for k, j in enumerate(kept) if j < n and labels[j] == labels[i]]
        total = total + (1 - eps) * -log_p[pos].mean() + eps * -log_p.mean()
    want = total / n
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for x, y in zip(_grads(got, (a, p, neg)), _grads(want, (a, p, neg))):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def test_teacher_is_cross_entropy_against_its_softmax():
    """``y = (1−λ)·one-hot + λ·softmax(cos(t_i, t_j)/τ_t)`` written out, every column kept."""
    a, p, neg = (make(7, 4, dtype=torch.float64, seed=s) for s in (0, 1, 2))
    t = (make(7, 6, dtype=torch.float64, seed=3, grad=False),
         make(14, 6, dtype=torch.float64, seed=4, grad=False))
    got = fastcl.contrastive(a, p, neg, temperature=TAU, teacher=t, teacher_temperature=0.2,
                             distill_weight=0.4, backend="reference")
    log_p = torch.log_softmax(F.normalize(a, dim=1) @ F.normalize(torch.cat([p, neg]), dim=1).T
                              / TAU, dim=1)
    q = torch.softmax(F.normalize(t[0], dim=1) @ F.normalize(t[1], dim=1).T / 0.2, dim=1)
    y = 0.6 * F.one_hot(torch.arange(7), 14).double() + 0.4 * q
    want = -(y * log_p).sum(dim=1).mean()
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    for x, w in zip(_grads(got, (a, p, neg)), _grads(want, (a, p, neg))):
        torch.testing.assert_close(x, w, atol=1e-12, rtol=0)


def test_reference_gradcheck():
    labels = torch.tensor([0, 1, 0, 1, 2])
    inputs = [make(5, 3, dtype=torch.float64, seed=s) for s in range(3)]
    assert torch.autograd.gradcheck(
        lambda a, p, x: fastcl.contrastive(a, p, x, temperature=0.5, focal_m=0.3, labels=labels,
                                           label_smoothing=0.3, backend="reference"), inputs)


# --------------------------------------------------------------------------- edges
# (fused = reference: the ``options-soft`` cases of tests/test_matches_reference.py's grid)

@pytest.mark.parametrize("backend", ["reference", "tiled",
                                     pytest.param("triton", marks=needs_triton)])
def test_edges(backend):
    """Labels all distinct: only the own positive, the plain smoothed loss. Every candidate
    but the positive dropped (one duplicate id for all): y is one-hot, the loss and its
    gradients 0."""
    dtype = torch.float64 if backend != "triton" else torch.float32
    a, p = make(6, 4, dtype=dtype), make(6, 4, dtype=dtype, seed=1)
    own = fastcl.contrastive(a, p, temperature=TAU, labels=torch.arange(6) * 7,
                             label_smoothing=0.2, backend=backend)
    plain = fastcl.contrastive(a, p, temperature=TAU, label_smoothing=0.2, backend="reference")
    torch.testing.assert_close(own.double(), plain.double(), atol=1e-5, rtol=1e-5)
    same = torch.zeros(6, dtype=torch.long)
    alone = fastcl.contrastive(a, p, temperature=TAU, labels=same, label_smoothing=0.4,
                               duplicate_ids=(same,), backend=backend)
    assert abs(float(alone.detach())) < 1e-6
    assert all(float(g.abs().max()) < 1e-6 for g in _grads(alone, (a, p)))


# --------------------------------------------------------------------------- sentence-transformers

def test_sentence_transformers_loss_trains(tmp_path, one_thread):
    """FastInfoNCELoss with label smoothing, class labels (the dataset's ``label`` column) and
    a teacher (another tiny random BERT) computes fastcl.contrastive's loss and trains a few
    steps in SentenceTransformerTrainer; its config says each; a bad value fails where the
    loss is built."""
    st = pytest.importorskip("sentence_transformers")
    from fastcl.integrations.sentence_transformers import FastInfoNCELoss
    from fastcl.integrations.sentence_transformers._base import preprocess
    from test_evaluate import make_tiny_model, random_sentence
    import random

    model = st.SentenceTransformer(str(make_tiny_model(tmp_path / "bert")), device="cpu")
    teacher = st.SentenceTransformer(str(make_tiny_model(tmp_path / "teacher", seed=1)), device="cpu")
    rng = random.Random(3)
    anchors = [random_sentence(rng) for _ in range(16)]
    loss = FastInfoNCELoss(model, label_smoothing=0.1, class_labels=True, teacher=teacher,
                           teacher_temperature=0.1, distill_weight=0.3, backend="tiled")
    assert {"label_smoothing": 0.1, "class_labels": True, "teacher_temperature": 0.1,
            "distill_weight": 0.3}.items() <= loss.get_config_dict().items()
    # the loss of a batch: fastcl.contrastive's with the teacher's embeddings (eval mode)
    model.eval()
    features = [preprocess(model, anchors[:8]) for _ in range(2)]
    with torch.no_grad():
        emb = [model(dict(f))["sentence_embedding"] for f in features]
        t = [teacher(dict(f))["sentence_embedding"] for f in features]
        want = fastcl.contrastive(*emb, temperature=0.05, labels=torch.arange(8) % 4,
                                  label_smoothing=0.1, teacher=(t[0], t[1]),
                                  teacher_temperature=0.1, distill_weight=0.3)
        torch.testing.assert_close(loss(features, torch.arange(8) % 4), want)
    model.train()
    st_train(model, loss, tmp_path / "run", steps=3,
             columns={"anchor": anchors, "positive": anchors, "label": [i % 4 for i in range(16)]})
    with pytest.raises(ValueError, match="label_smoothing"):
        FastInfoNCELoss(model, label_smoothing=1.5)
    with pytest.raises(ValueError, match="distill_weight"):
        FastInfoNCELoss(model, teacher=teacher, distill_weight=2.0)
    with pytest.raises(ValueError, match="teacher"):
        FastInfoNCELoss(model, teacher=teacher, symmetric=True)
    with pytest.raises(ValueError, match="labels cannot be combined with a positive side"):
        FastInfoNCELoss(model, class_labels=True, directions=("query_to_doc", "doc_to_query"))


def test_soft_targets_beside_the_margin_and_not_the_prior():
    """label_smoothing with false_negative_margin: the smoothing is uniform over the row's
    kept candidates (the margin's drops left out), literal float64 formula within 1e-12 on
    the reference, the tiled path within 1e-9, Triton's interpreter on float32 inputs within
    1e-4. positive_prior with soft targets is refused everywhere."""
    n, eps, m = 7, 0.2, 0.05
    a = make(n, 5, dtype=torch.float64)
    p = make(n, 5, dtype=torch.float64, seed=1)
    s = F.normalize(a, dim=1) @ F.normalize(p, dim=1).T
    drop = (s > s.diagonal()[:, None] + m) & ~torch.eye(n, dtype=torch.bool)
    assert drop.any()
    log_p = torch.log_softmax((s / TAU).masked_fill(drop, float("-inf")), dim=1).masked_fill(drop, 0.0)
    kept = (~drop).to(s.dtype)
    y = (1 - eps) * torch.eye(n, dtype=s.dtype) + eps * kept / kept.sum(dim=1, keepdim=True)
    want = -(y * log_p).sum(dim=1).mean()
    kw = dict(temperature=TAU, label_smoothing=eps, false_negative_margin=m)
    want_grads = _grads(want, (a, p))
    for backend, tol in (("reference", 1e-12), ("tiled", 1e-9)):
        got = fastcl.contrastive(a, p, backend=backend, chunk_size=3, **kw)
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        for x, w in zip(_grads(got, (a, p)), want_grads):
            torch.testing.assert_close(x, w, atol=tol, rtol=0)
    if fastcl.spec.triton_problem(a.detach().float()) is None:
        x = [t.detach().float().requires_grad_() for t in (a, p)]
        got = fastcl.contrastive(*x, backend="triton", chunk_size=3, **kw)
        assert fastcl.spec.build_spec(*x, None, backend="triton", **kw)[0].backend == "triton"
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)
        for g, w in zip(_grads(got, x), want_grads):
            torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="positive_prior cannot be combined with label_smoothing"):
        fastcl.contrastive(a, p, temperature=TAU, label_smoothing=eps, positive_prior=0.1)


def test_triton_teacher_beside_the_guide_or_the_mask_runs_tiled():
    """The teacher's cosines take the similarity kernel's slots of the guide's and DCLR's
    mask's: Triton refuses the teacher beside either by name, "auto" runs it tiled; beside
    the other options it is Triton's (the grid above)."""
    x = make(6, 4)
    if fastcl.spec.triton_problem(x) is not None:
        pytest.skip(fastcl.spec.triton_problem(x))
    teacher = (make(6, 3, seed=1, grad=False), make(6, 3, seed=2, grad=False))
    for extra in (dict(guide=(x, x)), dict(complementary=(x, x), phi=0.5)):
        with pytest.raises(ValueError, match="teacher beside guide or complementary"):
            fastcl.spec.build_spec(x, x, None, backend="triton", teacher=teacher, **extra)
        assert fastcl.spec.build_spec(x, x, None, backend="auto", teacher=teacher,
                                      **extra)[0].backend == "tiled"
    assert fastcl.spec.build_spec(x, x, None, backend="triton", teacher=teacher,
                                  focal_m=0.3)[0].backend == "triton"
