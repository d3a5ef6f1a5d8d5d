"""Issue #46's row features on every backend: ``false_negative_margin`` (drop ``s_ij >
s_{i,p(i)} + m``) and ``positive_prior`` (Chuang et al.'s debiased loss).

Each equals a literal float64 formula written here (loss and gradients): the reference and
the tiled path in float64 within 1e-9, Triton's interpreter in float32 within its
tolerance; the compositions (layouts, guide, ids, Matryoshka) equal the reference (the
``options-rows`` cases of tests/test_matches_reference.py's grid: 1e-9 tiled, 2e-5 Triton).
"""

import math

import pytest
import torch

import fastcl
from fastcl.reference import cosine_matrix

from conftest import st_train

BACKENDS = ["reference", "tiled", "triton"]
TAU = 0.1


def _inputs(n, d, k=0, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(rows, d, generator=g, dtype=torch.float64) for rows in (n, n, k)]
    x[1] = x[1] + 0.8 * x[0]                       # positives near their anchors
    return [t.to(dtype).requires_grad_() for t in x[:2]] + (
        [x[2].to(dtype).requires_grad_()] if k else [None])


def literal(a, p, negatives=None, *, margin=None, focal_m=None, w=0.0, keep=None,
            temperature=TAU, prior=None):
    """The plain layout's loss, entry by entry in float64: logits ``s/τ`` (focal ``s²/τ`` on
    the positive, ``s(s+m)/τ`` elsewhere; ``+w`` at column N+i), a column kept where ``keep``
    and ``not s_ij > s_ii + margin`` (the positive always), then
    ``ℓ_i = −log(e^{l_ii} / Σ_kept e^{l_ij})``; with ``prior`` τ⁺ (a float or one a row)
    ``ℓ_i = −log(e^{l_ii} / (e^{l_ii} + N_g))``, ``N_g = max((Σ_{kept j≠i} e^{l_ij} −
    Q·τ⁺·e^{l_ii}) / (1 − τ⁺), Q·e^{−1/τ})``, Q the kept others."""
    cand = torch.cat([p] + ([] if negatives is None else [negatives])).double()
    a = a.double()
    s = (a / a.norm(dim=1, keepdim=True)) @ (cand / cand.norm(dim=1, keepdim=True)).T
    n = a.shape[0]
    eye = torch.zeros_like(s, dtype=torch.bool)
    eye[range(n), range(n)] = True
    logits = s / temperature if focal_m is None else torch.where(eye, s * s, s * (s + focal_m)) / temperature
    if w:
        logits = logits + w * torch.cat([torch.zeros(n, n, dtype=s.dtype), torch.eye(n, dtype=s.dtype)], 1)
    kept = torch.ones_like(eye) if keep is None else keep.clone()
    if margin is not None:
        kept &= ~(s.detach() > s.detach().diagonal()[:, None] + margin)
    kept |= eye
    if prior is None:
        total = torch.where(kept, logits.exp(), torch.zeros_like(logits)).sum(1)
        return (total.log() - logits.diagonal()).mean()
    others = kept & ~eye
    q = others.sum(1).double()
    e_pos = logits.diagonal().exp()
    n_g = torch.maximum((torch.where(others, logits.exp(), torch.zeros_like(logits)).sum(1)
                         - q * prior * e_pos) / (1 - prior), q * math.exp(-1 / temperature))
    return (-torch.log(e_pos / (e_pos + n_g))).mean()


def _clear_of_ties(a, p, negatives, margin):
    """The data keep every cosine 1e-6 away from its row's threshold (a float32 cosine may
    fall either side of a tie)."""
    cand = torch.cat([p] + ([] if negatives is None else [negatives]))
    s = cosine_matrix(a.detach().double(), cand.detach().double())
    gap = (s - s.diagonal()[:, None] - margin).abs()
    gap.diagonal().fill_(1.0)
    assert gap.min() > 1e-6


def _run(backend, a, p, negatives=None, **kw):
    """The loss and its gradients on ``backend`` (Triton: float32 copies)."""
    cast = (lambda x: x) if backend != "triton" else (
        lambda x: None if x is None else x.detach().float().requires_grad_())
    a, p, negatives = cast(a), cast(p), cast(negatives)
    loss = fastcl.contrastive(a, p, negatives, backend=backend, temperature=TAU, **kw)
    inputs = [x for x in (a, p, negatives) if x is not None]
    return loss.double(), [g.double() for g in torch.autograd.grad(loss, inputs)]


# (N, d, K): N = 1 (the row has only its positive), chunk and tile edges (19 rows in
# chunks of 8; the interpreter's tiles are 16), an odd d
SHAPES = [(1, 5, 0), (1, 5, 1), (19, 7, 0), (19, 7, 19), (33, 16, 5)]
CASES = {
    "plain": {},
    "focal": dict(focal_m=0.3),
    "hard": dict(hard_negative_weight=0.7),
    "mask": dict(complementary=True),
}


# a hard negative a row needs K = N; by default two shapes (N = 1, and the chunk and tile
# edges with an odd d and negatives), the others `slow`
FAST = {(1, 5, 1), (19, 7, 19)}
GRID = [pytest.param(case, shape, marks=() if shape in FAST else pytest.mark.slow)
        for case in CASES for shape in SHAPES if case != "hard" or shape[0] == shape[2]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,shape", GRID, ids=lambda x: x if isinstance(x, str) else "x".join(map(str, x)))
@pytest.mark.parametrize("features", [dict(margin=0.05), dict(margin=-0.2), dict(prior=0.15),
                                      dict(prior="rows", margin=0.05)],
                         ids=["margin", "negative-margin", "prior", "prior-rows-margin"])
def test_row_features_equal_the_literal_formula(backend, shape, case, features):
    n, d, k = shape
    kw = dict(CASES[case])
    a, p, neg = _inputs(n, d, k)
    margin, prior = features.get("margin"), features.get("prior")
    if margin is not None:
        _clear_of_ties(a, p, neg, margin)
        kw["false_negative_margin"] = margin
    if prior == "rows":            # one τ⁺ a row, up to 0.95: rows on both sides of the max
        prior = torch.linspace(0.0, 0.95, n, dtype=torch.float64)
    if prior is not None:
        kw["positive_prior"] = prior if not torch.is_tensor(prior) or backend != "triton" else prior.float()
    keep = None
    if kw.pop("complementary", False):
        g = torch.Generator().manual_seed(1)
        comp = (torch.randn(n, 3, generator=g, dtype=torch.float64),
                torch.randn(n, 3, generator=g, dtype=torch.float64))
        kw.update(complementary=comp if backend != "triton" else tuple(c.float() for c in comp), phi=0.3)
        keep = torch.cat([cosine_matrix(*comp) < 0.3, torch.ones(n, k, dtype=torch.bool)], 1)
    want = literal(a, p, neg, margin=margin, focal_m=kw.get("focal_m"),
                   w=kw.get("hard_negative_weight", 0.0), keep=keep, prior=prior)
    loss, grads = _run(backend, a, p, neg, chunk_size=8, **kw)
    tol = dict(atol=1e-9, rtol=1e-9) if backend != "triton" else dict(atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(loss, want, **tol)
    for g, r in zip(grads, torch.autograd.grad(want, [x for x in (a, p, neg) if x is not None])):
        torch.testing.assert_close(g, r, **tol)


def test_the_rows_grid_takes_both_branches_of_the_max():
    """The grid's "prior-rows" data put rows on each side of ``N_g``'s max (the corrected sum
    and its floor ``Q·e^{−1/τ}``), so that both subgradients are held to the formula."""
    a, p, _ = _inputs(19, 7)
    s = cosine_matrix(a.detach(), p.detach())
    keep = ~(s > s.diagonal()[:, None] + 0.05)
    keep.fill_diagonal_(False)
    e = torch.where(keep, (s / TAU).exp(), torch.zeros_like(s)).sum(1)
    q = keep.sum(1).double()
    corrected = (e - q * torch.linspace(0.0, 0.95, 19, dtype=torch.float64) * (s.diagonal() / TAU).exp())
    floor = q * math.exp(-1 / TAU) * (1 - torch.linspace(0.0, 0.95, 19, dtype=torch.float64))
    assert (corrected > floor).any() and (corrected < floor).any()


def test_prior_gradcheck():
    """The reference's gradients through the max (float64 finite differences)."""
    a, p, neg = _inputs(5, 4, 3)
    tau = torch.tensor([0.0, 0.3, 0.6, 0.9, 0.5], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda x, y, z: fastcl.contrastive(x, y, z, positive_prior=tau, temperature=0.5,
                                           backend="reference"), (a, p, neg))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prior", [None, 0.5])
def test_every_candidate_dropped_but_the_positive(backend, prior):
    """m = −2: every other cosine exceeds s_ii − 2, each row keeps its positive alone (Q = 0):
    loss and gradients 0."""
    a, p, neg = _inputs(19, 7, 6)
    loss, grads = _run(backend, a, p, neg, false_negative_margin=-2.0, focal_m=0.3, chunk_size=8,
                       positive_prior=prior)
    assert loss.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in grads)


# compositions with the layouts, the guide, ids and Matryoshka against the reference (itself
# the literal above where they meet): the ``options-rows`` cases of tests/test_matches_reference.py

def test_infonce_and_focal_infonce_take_both():
    a, p, neg = _inputs(9, 5, 9)
    kw = dict(temperature=TAU, false_negative_margin=0.05, positive_prior=0.2, backend="tiled")
    want = literal(a, p, neg, margin=0.05, prior=0.2, w=0.5)
    assert abs(fastcl.infonce(a, p, neg, hard_negative_weight=0.5, **kw).item() - want.item()) < 1e-9
    want = literal(a, p, margin=0.05, prior=0.2, focal_m=0.3)
    assert abs(fastcl.focal_infonce(a, p, m=0.3, **kw).item() - want.item()) < 1e-9


def test_symmetric_is_each_direction_against_its_own_positive():
    """½(L→ + L←), each direction the literal formula with the pair's cosine as threshold."""
    a, p, _ = _inputs(9, 5)
    loss = fastcl.contrastive(a, p, symmetric=True, false_negative_margin=0.0, backend="reference",
                              temperature=TAU)
    want = 0.5 * (literal(a, p, margin=0.0) + literal(p, a, margin=0.0))
    assert abs(loss.item() - want.item()) < 1e-12


@pytest.mark.parametrize("loss_name,options", [
    ("FastInfoNCELoss", dict(false_negative_margin=0.1)),
    ("CachedFastFocalInfoNCELoss", dict(positive_prior=0.1, mini_batch_size=4))])
def test_sentence_transformers_losses_train(tmp_path, loss_name, options):
    """The losses with each feature train a few steps in SentenceTransformerTrainer on a tiny
    random BERT, and log the options."""
    pytest.importorskip("sentence_transformers")
    from test_evaluate import export, make_tiny_model

    from fastcl.integrations import sentence_transformers as fst
    from fastcl.trainer.build import load_model

    model = load_model(str(export(make_tiny_model(tmp_path / "bert"), tmp_path / "st", "avg")), "avg",
                       device="cpu")
    loss = getattr(fst, loss_name)(model, backend="tiled", **options)
    assert {k: v for k, v in loss.get_config_dict().items() if k in options} == options
    st_train(model, loss, tmp_path / "run")


def test_fastcl_train_takes_both(tiny, tmp_path, capsys):
    """fastcl-train --false_negative_margin --positive_prior trains (simcse, two steps on the
    tiny BERT), and a bad value or method is refused naming the option."""
    from test_train import base_args, losses, train

    out = tmp_path / "run"
    assert train.main(base_args(tiny, out, "simcse", steps=2, false_negative_margin=0.1,
                                positive_prior=0.1)) == 0
    assert [s for s, _ in losses(out)] == [1, 2] and all(math.isfinite(v) for _, v in losses(out))
    for change, message in (({"positive_prior": 1.0}, "--positive_prior (τ⁺, a class prior) must lie in [0, 1)"),
                            ({"false_negative_margin": 0.1, "method": "escl"},
                             "--false_negative_margin applies to --method")):
        change = dict(change)
        with pytest.raises(SystemExit) as err:
            train.main(base_args(tiny, tmp_path / "bad", change.pop("method", "simcse"), **change))
        assert message in (capsys.readouterr().err if err.value.code == 2 else err.value.code)
