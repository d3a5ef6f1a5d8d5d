"""fastcl's losses under torch.compile: the tiled driver is one custom op
(``fastcl::tiled_contrastive``, :mod:`fastcl.tiled`), so a compiled step traces it without a
graph break, reuses its graph for other batch sizes (dynamic shapes), and gives the eager
numbers (soft targets and a learnable temperature travel through its arguments); its NaN
test still runs, inside the op."""

import logging
import os

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter

import fastcl

from conftest import make, st_train


def _inputs(n=24, d=16, k=24):
    a = make(n, d, seed=1)
    p = make(n, d, seed=2)
    x = make(k, d, seed=3)
    return a, p, x


COMP = (torch.randn(24, 8, generator=torch.Generator().manual_seed(4)),
        torch.randn(24, 8, generator=torch.Generator().manual_seed(5)))

IDS = torch.arange(40) % 7
GUIDE = torch.randn(40, 8, generator=torch.Generator().manual_seed(6))

CASES = {
    "infonce": lambda a, p, x, be: fastcl.infonce(a, p, backend=be),
    "hard": lambda a, p, x, be: fastcl.infonce(a, p, x, hard_negative_weight=0.5, backend=be),
    "focal": lambda a, p, x, be: fastcl.focal_infonce(a, p, x, backend=be),
    "dclr-mask": lambda a, p, x, be: fastcl.contrastive(a, p, complementary=tuple(c[:a.shape[0]] for c in COMP),
                                                        phi=0.3, backend=be),
    "symmetric": lambda a, p, x, be: fastcl.contrastive(a, p, symmetric=True, focal_m=0.2, backend=be),
    "matryoshka": lambda a, p, x, be: fastcl.contrastive(a, p, x, matryoshka_dims=(16, 8, 4),
                                                         backend=be),
    # fastcl.layout's rules: MNRL's four directions with hardness and duplicate ids; GIST's
    # blocks and guide with focal
    "directions": lambda a, p, x, be: fastcl.contrastive(
        a, p, x, directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
        hardness_mode="in_batch_negatives", hardness_strength=0.5,
        duplicate_ids=(IDS[:a.shape[0]], IDS[:x.shape[0]], IDS[:a.shape[0]]), backend=be),
    "gist": lambda a, p, x, be: fastcl.contrastive(
        a, p, x, directions=fastcl.layout.gist(), guide=(GUIDE[:a.shape[0]], GUIDE[:p.shape[0]],
                                                         GUIDE[:x.shape[0]], None),
        guide_margin=0.05, focal_m=0.3, backend=be),
}


@pytest.mark.parametrize("name,backend", [(name, be) for name in sorted(CASES)
                                          for be in ("tiled", "triton")])
def test_no_graph_break_inside_the_losses(name, backend):
    """torch._dynamo.explain over the public call: one graph, no break (Triton in its
    interpreter on a CPU-only machine; matryoshka on Triton: a call per width). On 8 rows:
    the op is opaque to the trace, so the rows change only the interpreter's work inside it
    (the graphs of 24 rows are the same, call for call)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("triton needs a GPU or the interpreter")
    dynamo.reset()
    a, p, x = _inputs(8, 16, 8)
    explained = dynamo.explain(lambda a, p, x: CASES[name](a, p, x, backend))(a, p, x)
    assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("name", ["infonce", "hard", "focal", "matryoshka", "directions", "gist"])
def test_compiled_equals_eager_and_compiles_once_for_every_batch_size(name):
    dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(lambda a, p, x: CASES[name](a, p, x, "tiled"), backend=counter, dynamic=True)
    for n in (24, 40, 17):
        a, p, x = _inputs(n, 16, n)
        got = fn(a, p, x)
        grads = torch.autograd.grad(got, (a, p, x), allow_unused=True)
        want = CASES[name](a, p, x, "tiled")
        wants = torch.autograd.grad(want, (a, p, x), allow_unused=True)
        torch.testing.assert_close(got, want)
        for g, w in zip(grads, wants):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


#: what travels through the op's arguments besides the epilogue: soft targets (labels,
#: smoothing, a teacher's embeddings) and a learnable temperature (a 0-dim tensor leaf)
AOT = {
    "infonce": lambda a, p, t: fastcl.infonce(a, p, backend="tiled"),
    "soft-targets": lambda a, p, t: fastcl.contrastive(
        a, p, labels=torch.arange(a.shape[0]) % 3, label_smoothing=0.2, backend="tiled",
        teacher=(GUIDE[:a.shape[0]], GUIDE[:p.shape[0]].flip(0))),
    "learnable-temperature": lambda a, p, t: fastcl.contrastive(a, p, temperature=t, matryoshka_dims=(4, 8),
                                                                backend="tiled"),
}


@pytest.mark.parametrize("name", list(AOT))
def test_aot_autograd_through_the_op_and_its_checks(name):
    """aot_eager runs the op's fake kernel and its registered backward, with no graph break
    (fullgraph: a break is an error): the eager loss and every gradient (τ's too); bad
    values are still refused, by the op, at run time."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    a, p, _ = _inputs()
    tau = torch.tensor(0.2, requires_grad=True)
    dynamo.reset()
    fn = torch.compile(AOT[name], backend="aot_eager", dynamic=True, fullgraph=True)
    got = torch.autograd.grad(fn(a, p, tau), (a, p, tau), allow_unused=True)
    want = torch.autograd.grad(AOT[name](a, p, tau), (a, p, tau), allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w)
    bad = a.detach().clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        fn(bad.requires_grad_(), p, tau)
    if name == "learnable-temperature":
        with pytest.raises(ValueError, match="temperature must be > 0"):
            fn(a, p, torch.tensor(-1.0, requires_grad=True))


def test_the_op_refuses_double_backward():
    a, p, _ = _inputs()
    plain = fastcl.spec.Epilogue(0.05).op_args()      # InfoNCE's epilogue, as the op takes it
    loss = fastcl.tiled.tiled_contrastive_op(a, [p], *plain, "torch", 0b11, True, None)[0]
    (g,) = torch.autograd.grad(loss, a)
    torch.testing.assert_close(loss, fastcl.infonce(a, p, backend="tiled"))
    with pytest.raises(RuntimeError, match="differentiated twice"):
        loss = fastcl.tiled.tiled_contrastive_op(a, [p], *plain, "torch", 0b11, True, None)[0]
        torch.autograd.grad(loss, a, create_graph=True)


st = pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (the dev extra)")


def test_sentence_transformers_losses_trace_without_a_break(tmp_path):
    from test_evaluate import make_tiny_model

    from fastcl.integrations.sentence_transformers import FastGISTEmbedLoss, FastInfoNCELoss
    model = st.SentenceTransformer(str(make_tiny_model(tmp_path / "bert")), device="cpu")
    a, p, x = _inputs()
    for loss in (FastInfoNCELoss(model, backend="tiled"),
                 FastInfoNCELoss(model, matryoshka_dims=(16, 8), backend="tiled"),
                 FastInfoNCELoss(model, directions=("query_to_doc", "query_to_query", "doc_to_query"),
                                 hardness_mode="all_negatives", hardness_strength=1.0, backend="tiled")):
        dynamo.reset()
        explained = dynamo.explain(lambda a, p, x: loss.compute_loss_from_embeddings([a, p, x]))(a, p, x)
        assert explained.graph_break_count == 0, [str(r.reason)[:300] for r in explained.break_reasons]
    assert FastGISTEmbedLoss(model, model)._layout is not None   # built once, not per call


def test_trainer_two_steps_with_torch_compile(tmp_path):
    """SentenceTransformerTrainer with torch_compile=True (the aot_eager backend: no C++
    toolchain needed) trains two steps with fastcl's loss. Every sentence is 6 words (one
    token each), so both steps' batches have one shape and one compile serves them (a new
    length recompiles the encoder, sentence-transformers' code, not fastcl's)."""
    import random

    from fastcl.integrations.sentence_transformers import FastInfoNCELoss
    from test_evaluate import WORDS, make_tiny_model
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    model = st.SentenceTransformer(str(make_tiny_model(tmp_path / "bert")), device="cpu")
    rng = random.Random(0)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(16)]
    _, result = st_train(model, FastInfoNCELoss(model, backend="tiled"), tmp_path / "out", torch_compile=True,
                         torch_compile_backend="aot_eager", dataloader_drop_last=True,
                         columns={"anchor": sentences, "positive": sentences})
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
