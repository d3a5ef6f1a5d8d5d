"""Every fastcl loss computed both ways: ``backend="reference"`` (full N×M matrices
through autograd) and the fast path (``--backend``, default ``auto``: the fused Triton
kernels on a GPU, the chunked ``tiled`` path on a CPU), on random embeddings. Prints both losses and the largest loss and gradient
differences; exits with status 1 if any difference exceeds 1e-4 (for gradients: 1e-4
times the gradient scale when that is below 1, so tiny gradients are checked too).

    python bench/demo.py [--n 512] [--d 384] [--seed 0] [--backend auto|tiled|triton]
"""

import argparse
import sys
from functools import partial

import torch

import fastcl

TOL = 1e-4

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--n", type=int, default=512)
p.add_argument("--d", type=int, default=384)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--backend", default="auto", choices=["auto", "tiled", "triton"],
               help="the fast path to compare with the reference")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

g = torch.Generator().manual_seed(args.seed)
n, d = args.n, args.d
# Views only weakly correlated (cosine ≈ 0.3) keep every loss O(1): the softmax spreads
# over many columns instead of being one-hot, so every column's gradient is exercised.
anchors = torch.randn(n, d, generator=g)
positives = anchors + 3.0 * torch.randn(n, d, generator=g)   # like two dropout views
negatives = torch.randn(n, d, generator=g)
sensitive = anchors + 4.0 * torch.randn(n, d, generator=g)   # the noisier "high-dropout" view
# Complementary embeddings in 16 tight clusters, so that DCLR's φ = 0.9 mask really drops
# in-batch negatives (cosines ≈ 0.96 within a cluster) instead of keeping every column.
centres = torch.randn(16, 384, generator=g)[torch.randint(16, (n,), generator=g)]
complementary = (centres + 0.2 * torch.randn(n, 384, generator=g),
                 centres + 0.2 * torch.randn(n, 384, generator=g))
anchors, positives, negatives, sensitive = (x.to(device) for x in (anchors, positives, negatives, sensitive))
complementary = tuple(x.to(device) for x in complementary)


def dclr(a, p, *, formulation, backend):
    # A fresh generator with the same seed per call: both backends draw identical noise.
    return fastcl.dclr_loss(a, p, complementary=complementary, phi=0.9, formulation=formulation,
                            generator=torch.Generator(device).manual_seed(args.seed + 1),
                            backend=backend)


CASES = {  # name: (loss function, inputs that receive gradients)
    "infonce": (fastcl.infonce, (anchors, positives)),
    "infonce hard w=1": (partial(fastcl.infonce, hard_negative_weight=1.0),
                         (anchors, positives, negatives)),
    "infonce symmetric": (partial(fastcl.infonce, symmetric=True), (anchors, positives)),
    "focal_infonce": (fastcl.focal_infonce, (anchors, positives)),
    "dclr paper": (partial(dclr, formulation="paper"), (anchors, positives)),
    "dclr released": (partial(dclr, formulation="released"), (anchors, positives)),
    "escl softplus": (partial(fastcl.escl_loss, rd="softplus"), (anchors, positives, sensitive)),
    "escl margin": (partial(fastcl.escl_loss, rd="margin"), (anchors, positives, sensitive)),
}


def loss_and_grads(fn, inputs, backend):
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    loss = fn(*leaves, backend=backend)
    loss.backward()
    return loss.item(), [x.grad for x in leaves]


print(f"N={n} d={d} seed={args.seed} device={device} backend={args.backend} "
      f"torch {torch.__version__}\n")
print(f"{'objective':<18} {'reference':>13} {args.backend:>13} {'|Δloss|':>9} {'max|Δgrad|':>10} "
      f"{'max|grad|':>9}")
failed = []
for name, (fn, inputs) in CASES.items():
    ref_loss, ref_grads = loss_and_grads(fn, inputs, "reference")
    til_loss, til_grads = loss_and_grads(fn, inputs, args.backend)
    d_loss = abs(ref_loss - til_loss)
    d_grad = max((r - t).abs().max().item() for r, t in zip(ref_grads, til_grads))
    scale = max(r.abs().max().item() for r in ref_grads)
    ok = d_loss <= TOL and d_grad <= TOL * min(1.0, scale)
    failed += [] if ok else [name]
    print(f"{name:<18} {ref_loss:>13.7g} {til_loss:>13.7g} {d_loss:>9.1e} {d_grad:>10.1e} "
          f"{scale:>9.1e}{'' if ok else '  <-- exceeds tolerance'}")

print(f"\n{'FAIL: ' + ', '.join(failed) if failed else 'OK'} (tolerance {TOL:.0e})")
sys.exit(1 if failed else 0)
