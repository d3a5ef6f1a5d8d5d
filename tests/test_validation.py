"""Bad input fails early with an error that names the argument: one grid of bad calls. The
checks run where the loss spec is built, before a backend is chosen, so each runs once (on
the default backend); the backend's own refusals (Triton's) follow it."""

import math
import re

import pytest
import torch

import fastcl

from conftest import make, needs_triton
from test_matches_reference import Batch

A = make(4, 8, grad=False)
P = make(4, 8, seed=1, grad=False)


def nan_at(x, i=0):
    x = x.clone()
    x.view(-1)[i] = math.nan
    return x


B = Batch(6, 8)
SPARSE = {"coo": lambda t: t.to_sparse(), "csr": lambda t: t.to_sparse_csr()}
TINY_TEMPERATURE = {
    "infonce": lambda t: fastcl.infonce(A, P, temperature=t),
    "focal": lambda t: fastcl.focal_infonce(A, P, temperature=t),
    "contrastive": lambda t: fastcl.contrastive(A, P, temperature=t, focal_m=0.3),
    "dclr": lambda t: fastcl.dclr_loss(A, P, temperature=t),
    "dclr noise_temperature": lambda t: fastcl.dclr_loss(A, P, noise_temperature=t),
    "dclr_noise": lambda t: fastcl.dclr_noise(A, P, 4, temperature=t),
    "escl": lambda t: fastcl.escl_loss(A, P, P.flip(0), temperature=t),
}

LITERAL = [
    # (call, exception, words the message must contain)
    (lambda: fastcl.infonce(A, make(5, 8, grad=False)), ValueError, "positives has 5 rows"),
    (lambda: fastcl.infonce(A, make(4, 7, grad=False)), ValueError, "positives has width 7"),
    (lambda: fastcl.infonce(A, P, make(3, 6, grad=False)), ValueError, "negatives has width 6"),
    (lambda: fastcl.infonce(A[0], P), ValueError, "anchors must be 2-D"),
    (lambda: fastcl.infonce(A.long(), P), TypeError, "anchors must have a floating dtype"),
    (lambda: fastcl.infonce(A, P.double()), TypeError, "positives has dtype torch.float64"),
    (lambda: fastcl.infonce(A.tolist(), P), TypeError, "anchors must be a torch.Tensor"),
    (lambda: fastcl.infonce(A[:0], P[:0]), ValueError, "anchors is an empty batch"),
    (lambda: fastcl.infonce(nan_at(A), P), ValueError, "anchors contains NaN or Inf"),
    (lambda: fastcl.infonce(A, P * math.inf), ValueError, "positives contains NaN or Inf"),
    (lambda: fastcl.infonce(A, P, temperature=0), ValueError, "temperature must be > 0"),
    (lambda: fastcl.infonce(A, P, temperature=-0.05), ValueError, "temperature must be > 0"),
    (lambda: fastcl.infonce(A, P, temperature=math.nan), ValueError, "temperature must be finite"),
    (lambda: fastcl.infonce(A, P, temperature="hot"), TypeError, "temperature must be a real number"),
    (lambda: fastcl.infonce(A, P, make(3, 8, grad=False), hard_negative_weight=1.0), ValueError,
     "hard_negative_weight needs one hard negative per anchor"),
    (lambda: fastcl.infonce(A, P, hard_negative_weight=1.0), ValueError, "hard_negative_weight"),
    (lambda: fastcl.infonce(A, P, backend="cuda"), ValueError, "backend must be one of"),
    (lambda: fastcl.infonce(A, P, chunk_size=0), ValueError, "chunk_size"),
    (lambda: fastcl.focal_infonce(A, P, m=math.inf), ValueError, "m must be finite"),
    (lambda: fastcl.focal_infonce(A, P, temperature=0.0), ValueError, "temperature"),
    (lambda: fastcl.dclr_loss(A, P, phi=1.5), ValueError, "phi"),
    (lambda: fastcl.dclr_loss(A, P, phi=-1.01), ValueError, "phi"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A[:3], P)), ValueError, "complementary[0] has 3 rows"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A, make(4, 5, grad=False))), ValueError,
     "complementary[1] has width 5"),
    (lambda: fastcl.dclr_loss(A, P, complementary=A), TypeError, "complementary must be a pair"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(A, P.double())), TypeError,
     "complementary[1] is torch.float64 but complementary[0] is torch.float32"),
    (lambda: fastcl.infonce(A, P, symmetric="False"), TypeError, "symmetric must be True or False"),
    (lambda: fastcl.dclr_loss(A, P, complementary=(nan_at(A), P)), ValueError, "complementary[0] contains NaN"),
    (lambda: fastcl.dclr_loss(A, P, noise=make(3, 5, grad=False)), ValueError, "noise has width 5"),
    (lambda: fastcl.dclr_loss(A, P, noise_steps=-1), ValueError, "noise_steps"),
    (lambda: fastcl.dclr_loss(A, P, noise_steps=1.5), ValueError, "noise_steps"),
    (lambda: fastcl.dclr_loss(A, P, noise_ratio=-1), ValueError, "noise_ratio"),
    (lambda: fastcl.dclr_loss(A, P, noise_std=0), ValueError, "noise_std"),
    (lambda: fastcl.dclr_loss(A, P, noise_temperature=0), ValueError, "noise_temperature"),
    (lambda: fastcl.dclr_loss(A, P, formulation="bce"), ValueError, "formulation"),
    (lambda: fastcl.dclr_noise(A, P, -2), ValueError, "num"),
    (lambda: fastcl.dclr_noise(A, P, 3, noise=make(4, 8, grad=False)), ValueError, "noise has 4 rows but num=3"),
    (lambda: fastcl.escl_loss(A, P, make(3, 8, grad=False)), ValueError, "sensitive has 3 rows"),
    (lambda: fastcl.escl_loss(A, P, P, rd="hinge"), ValueError, "rd must be one of"),
    (lambda: fastcl.escl_loss(A, P, P, weight=math.nan), ValueError, "weight must be finite"),
    (lambda: fastcl.escl_loss(A, P, P, margins=(0.1,)), ValueError, "margins"),
    (lambda: fastcl.alignment(A, P[:2]), ValueError, "y has 2 rows"),
    (lambda: fastcl.alignment(A, P, alpha=0), ValueError, "alpha"),
    (lambda: fastcl.uniformity(A[:1]), ValueError, "at least 2 rows"),
    (lambda: fastcl.uniformity(A, t=-1), ValueError, "t must be > 0"),
]

RELEASED_REFUSES = "formulation='released' {}.*{}.*formulation='paper'"
CASES = [pytest.param(c, e, re.escape(w), id=w) for c, e, w in LITERAL] + [pytest.param(*c, id=c[2]) for c in [

    (lambda: fastcl.contrastive(B.a, B.p, hard_negative_weight=0.5), ValueError,
     "hard_negative_weight needs one hard negative per anchor"),
    (lambda: fastcl.contrastive(B.a, B.p, B.neg[:3], hard_negative_weight=0.5), ValueError,
     r"hard_negative_weight needs .*\(6 negatives\), got 3 negatives"),
    (lambda: fastcl.contrastive(B.a[:3], B.p, symmetric=True, anchor_offset=0), ValueError,
     "symmetric=True needs every anchor"),
    (lambda: fastcl.contrastive(B.a, B.p, symmetric="yes"), TypeError, "symmetric must be True or False"),
    (lambda: fastcl.contrastive(B.a, B.p, focal_m=float("nan")), ValueError, "focal_m must be finite"),
    (lambda: fastcl.contrastive(B.a, B.p, focal_m="0.3x"), TypeError, "focal_m must be a real number"),
    (lambda: fastcl.contrastive(B.a, B.p, noise_ratio=-1.0), ValueError, "noise_ratio must be >= 0"),
    (lambda: fastcl.contrastive(B.a, B.p, noise=B.z[:, :3]), ValueError, "noise has width 3"),
    (lambda: fastcl.contrastive(B.a, B.p, noise_steps=-1, noise_ratio=1.0), ValueError,
     "noise_steps must be a non-negative integer"),
    (lambda: fastcl.contrastive(B.a, B.p, complementary=(B.comp[0], B.comp[1][:2])), ValueError,
     r"complementary\[1\] has 2 rows"),
    (lambda: fastcl.contrastive(B.a, B.p, complementary=B.comp, phi=1.5), ValueError,
     r"phi is a cosine threshold and must lie in \[-1, 1\]"),
    (lambda: fastcl.contrastive(B.a, B.p, formulation="authors"), ValueError,
     "formulation must be one of 'paper', 'released'"),
    (lambda: fastcl.contrastive(B.a, B.p, temperature=0.0), ValueError, "temperature must be > 0"),
    (lambda: fastcl.contrastive(B.a, B.p, B.neg[:, :4]), ValueError, "negatives has width 4"),
    # issue #42: each of these ran, or failed naming nothing
    (lambda: fastcl.contrastive(B.a, B.p, directions=None), TypeError,
     "directions must be a tuple of names"),
    (lambda: fastcl.contrastive(B.a, B.p, margin_strategy="x"), ValueError,
     "margin_strategy must be one of"),
    (lambda: fastcl.contrastive(B.a, B.p, temperature=True), TypeError,
     "temperature must be a real number, got True"),
    (lambda: fastcl.infonce(B.a, B.p, temperature=True), TypeError,
     "temperature must be a real number, got True"),
    # anchor_offset
    (lambda: fastcl.infonce(A[:2], B.p, anchor_offset=8), ValueError, "anchor_offset=8 with 2 anchors needs at least 10"),
    (lambda: fastcl.infonce(B.a[:2], B.p, anchor_offset=2, symmetric=True), ValueError, "symmetric=True"),
    (lambda: fastcl.infonce(B.a[:4], B.p, anchor_offset=-1), ValueError, "anchor_offset"),
    (lambda: fastcl.dclr_loss(B.a[:4], B.p, complementary=(B.comp[0][:4], B.comp[1][:4]), anchor_offset=2),
     ValueError, r"complementary\[1\] has 4 rows but 6"),
    (lambda: fastcl.infonce(B.a[:4], B.p, B.neg[:2], hard_negative_weight=1.0, anchor_offset=2), ValueError,
     "hard_negative_weight needs one hard negative per anchor"),
    # formulation="released": what the authors' code lacks, every extra option named
    *[(lambda o=o, v=v: fastcl.contrastive(B.a, B.p, B.neg if o in ("negatives", "hard_negative_weight") else None,
                                           formulation="released", complementary=B.comp,
                                           **({} if o == "negatives" else {o: v})),
       ValueError, f"formulation='released'.*{o}.*formulation='paper'")
      for o, v in [("focal_m", 0.3), ("hard_negative_weight", 0.5), ("symmetric", True), ("negatives", True)]],
    (lambda: fastcl.contrastive(B.a, B.p, B.neg, focal_m=0.3, hard_negative_weight=1.0, symmetric=True,
                                formulation="released"), ValueError,
     "got focal_m, negatives, hard_negative_weight, symmetric"),
    (lambda: fastcl.escl_loss(A, P, P, rd="margin", margins=None), ValueError, "margins must be a pair"),
    # a temperature too small for float32 (issue 28): its bound named
    *[(lambda f=f, t=t: f(t), ValueError,
       rf"{'noise_temperature' if 'noise_temperature' in k else 'temperature'}=.* is too small.* must be >= 1\.\d+e-19")
      for k, f in TINY_TEMPERATURE.items() for t in (1e-39, 2.9e-39, 1e-30, 1e-20)],
    (lambda: fastcl.focal_infonce(A, P, m=1e20), ValueError, "temperature=0.05 is too small with focal_m=1e"),
    (lambda: fastcl.infonce(A, P, P.flip(0), hard_negative_weight=1e300), ValueError, "hard_negative_weight"),
    (lambda: fastcl.infonce(A.double(), P.double(), temperature=1e-160), ValueError, "temperature"),
    # a generator of the wrong type, in every call that draws noise
    *[(lambda f=f, g=g: f(g), TypeError, "generator must be a torch.Generator or None, got")
      for g in (1, "seed", torch.tensor(3), object())
      for f in (lambda g: fastcl.dclr_loss(A, P, generator=g),
                lambda g: fastcl.contrastive(A, P, noise_ratio=1.0, generator=g),
                lambda g: fastcl.dclr_noise(A, P, 3, generator=g))],
    # sparse inputs name the argument
    *[(lambda call=call, sp=sp: call(sp), TypeError, rf"^{name} must be a dense \(strided\) tensor")
      for sp in SPARSE.values() for call, name in [
          (lambda sp: fastcl.infonce(sp(A), P), "anchors"),
          (lambda sp: fastcl.infonce(A, sp(P), backend="reference"), "positives"),
          (lambda sp: fastcl.infonce(A, P, sp(P)), "negatives"),
          (lambda sp: fastcl.dclr_loss(A, P, noise=sp(P)), "noise"),
          (lambda sp: fastcl.dclr_loss(A, P, complementary=(sp(A), P)), r"complementary\[0\]"),
          (lambda sp: fastcl.escl_loss(A, P, sp(P)), "sensitive"),
          (lambda sp: fastcl.alignment(A, sp(P)), "y"),
          (lambda sp: fastcl.uniformity(sp(A)), "x")]],
    (lambda: fastcl.alignment(torch.empty(4, 3, device="meta"), torch.randn(4, 3)), ValueError,
     "^y is on cpu but x is on meta$"),
    (lambda: fastcl.alignment(P, P.double()), TypeError, "^y has dtype torch.float64 but x has torch.float32$"),
    # the layout's options, Matryoshka's widths, duplicate ids
    (lambda: fastcl.contrastive(B.a, B.p, directions="query_to_doc"), TypeError, "string"),
    (lambda: fastcl.contrastive(A, P, matryoshka_dims=(8, 9)), ValueError, r"\[1, 8\]"),
    (lambda: fastcl.contrastive(A, P, matryoshka_dims=(6, 6)), ValueError, "twice"),
    (lambda: fastcl.contrastive(A, P, matryoshka_dims=(6, 3), matryoshka_weights=(1.0,)), ValueError, "entries"),
    (lambda: fastcl.contrastive(A, P, matryoshka_dims=(6,), noise_ratio=1.0), ValueError, "noise"),
    (lambda: fastcl.contrastive(A, P, P, matryoshka_dims=(6,), backend="triton", hard_negative_weight=0.5,
                                directions=("query_to_doc", "query_to_query")), ValueError,
     "backend='triton' does not compute hard_negative_weight"),
    (lambda: fastcl.contrastive(A, P, duplicate_ids=(torch.zeros(4),)), TypeError, "integer"),
    (lambda: fastcl.contrastive(A, P, duplicate_ids=(torch.zeros(3, dtype=torch.long),)), ValueError,
     r"shape \(4,\)"),
    (lambda: fastcl.contrastive(A, P, directions=("query_to_doc", "query_to_query"),
                                duplicate_ids=(torch.arange(4),)), ValueError, "anchor candidates"),
    (lambda: fastcl.contrastive(A, P, formulation="released", duplicate_ids=(torch.arange(4),)), ValueError,
     "released"),
    # issue #46's row features: false_negative_margin, positive_prior
    *[(lambda v=v: fastcl.contrastive(A, P, false_negative_margin=v), (TypeError, ValueError),
       "false_negative_margin") for v in (math.nan, math.inf, -math.inf, "margin", True)],
    *[(lambda v=v: fastcl.contrastive(A, P, positive_prior=v), (TypeError, ValueError), "positive_prior")
      for v in (1.0, -0.1, math.nan, "x", True, torch.full((3,), 0.1), torch.zeros(4, dtype=torch.long),
                torch.tensor([0.1, 0.2, 1.0, 0.3]), torch.zeros(4, 1))],
    *[(lambda o=o: fastcl.contrastive(A, P, formulation="released", **{o: 0.1}), ValueError, o)
      for o in ("false_negative_margin", "positive_prior")],
    *[(lambda kw=kw: fastcl.contrastive(A, P, positive_prior=0.1, **kw), ValueError, "positive_prior")
      for kw in (dict(symmetric=True), dict(directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"),
                 dict(directions=("query_to_doc", "doc_to_query"), backend="triton"))],
    # soft targets: label_smoothing, labels, a teacher
    *[(lambda kw=kw: fastcl.contrastive(A, P, **kw), e, m) for kw, e, m in [
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(label_smoothing=1.0), ValueError, "label_smoothing"),
        (dict(label_smoothing=float("nan")), ValueError, "label_smoothing"),
        (dict(labels=torch.zeros(4)), TypeError, "labels"),
        (dict(labels=torch.zeros(3, dtype=torch.long)), ValueError, "labels"),
        (dict(labels=torch.zeros(4, 1, dtype=torch.long)), ValueError, "labels"),
        (dict(labels=[0, 1, 2, 3]), TypeError, "labels"),
        (dict(label_smoothing=0.1, formulation="released"), ValueError, "label_smoothing"),
        (dict(labels=torch.zeros(4, dtype=torch.long), directions=("query_to_doc", "doc_to_doc")),
         ValueError, "labels"),
        (dict(label_smoothing=0.1, directions=("query_to_doc", "doc_to_query")), ValueError,
         "label_smoothing"),
        (dict(teacher=(torch.zeros(4, 2),)), TypeError, "teacher"),
        (dict(teacher=(torch.randn(4, 2), torch.randn(3, 2))), ValueError, r"teacher\[1\]"),
        (dict(teacher=(torch.randn(4, 2), torch.randn(4, 3))), ValueError, r"teacher\[1\]"),
        (dict(teacher=(torch.randn(4, 2), torch.randn(4, 2)), distill_weight=1.5), ValueError,
         "distill_weight"),
        (dict(teacher=(torch.randn(4, 2), torch.randn(4, 2)), teacher_temperature=0.0), ValueError,
         "teacher_temperature"),
        (dict(teacher=(torch.randn(4, 2), torch.randn(4, 2)), symmetric=True), ValueError, "teacher")]],
    # a learnable temperature (a 0-dim tensor that requires grad)
    *[(lambda v=v, kw=kw: fastcl.contrastive(A, P, temperature=torch.tensor(v).requires_grad_(), **kw),
       ValueError, m) for v, kw, m in [
          ([0.1, 0.2], {}, "^temperature must be a number or a tensor of one"),
          (-0.1, {}, "^temperature must be > 0"), (0.0, {}, "^temperature must be > 0"),
          (math.nan, {}, "^temperature must be finite"), (math.inf, {}, "^temperature must be finite"),
          (0.2, dict(focal_m=0.3, backend="triton"), r"^a learnable temperature .* with focal_m has its "
           r"gradient on backend='reference' or 'tiled' only"),
          (0.2, dict(focal_m=0.3, matryoshka_dims=(2, 3)), r"^a learnable temperature .* with focal_m and "
           r"matryoshka_dims has its gradient on backend='reference' only")]],
]]


@pytest.mark.parametrize("call,exc,pattern", CASES)
def test_bad_input(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@needs_triton
def test_triton_backend_refuses_where_it_cannot_run(monkeypatch):
    """float64, meta tensors, a CPU without the interpreter: refused, saying why; "auto" and
    the reference take meta tensors (the NaN scan skipped, shapes only)."""
    with pytest.raises(ValueError, match="backend='triton' cannot run here: .*float64"):
        fastcl.infonce(A.double(), P.double(), backend="triton")
    meta = torch.empty(8, 16, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match="backend='triton' cannot run here: the embeddings are meta"):
        fastcl.infonce(meta, meta, backend="triton")
    for backend in ("auto", "reference"):
        loss = fastcl.infonce(meta, meta.detach(), backend=backend)
        assert loss.device.type == "meta" and loss.shape == ()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fastcl.infonce(A, P, backend="triton")


def test_finite_checks_can_be_switched_off():
    previous = fastcl.set_input_checks(False)
    try:
        assert previous is True                         # on by default
        assert torch.isnan(fastcl.infonce(nan_at(A), P))
        assert fastcl.set_input_checks(False) is False  # each call returns the setting it replaced
    finally:
        fastcl.set_input_checks(previous)
    with pytest.raises(ValueError, match="anchors"):
        fastcl.infonce(nan_at(A), P)


def test_empty_negatives_are_allowed():
    """An empty queue (K = 0) is the same as no negatives."""
    torch.testing.assert_close(fastcl.infonce(A, P, A[:0]), fastcl.infonce(A, P))
