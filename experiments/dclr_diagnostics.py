"""What DCLR's two changes to SimCSE do to real training batches.

DCLR (Zhou et al., ACL 2022) differs from unsupervised SimCSE in two places: in-batch negatives
whose cosine under a frozen complementary model is ``>= phi`` leave the denominator, and
``K = round(noise_ratio·N)`` Gaussian noise negatives, moved by ``noise_steps`` normalized
gradient-ascent steps of size ``noise_lr``, join it. Whether either matters for a given start
model and data can be read off a few batches, without training:

- ``masked``: the share of in-batch negatives (off-diagonal pairs) the complementary model
  drops, for each ``phi`` asked for, and the distribution of those complementary cosines.
- the softmax mass of each row, split into positive, in-batch negatives and noise. Since
  ``∂L/∂l_ij = p_ij`` for every negative, a candidate group's mass is its share of the push
  that the negatives give; the noise's mass bounds how much the noise can change a step.
- ``noise_shift``: how far the ascent steps move the noise, as the change of ``cos(h_i, z_j)``.

The training encoder embeds each batch twice in train mode (two dropout views, the training
pooler), as ``train.py`` does; the complementary model embeds it once per view in eval mode.
The poolers default to train.py's: a sentence-transformers model (the packaged
all-MiniLM-L6-v2, a run's ``model/`` folder) pools as its folder records (its own modules,
which train.py keeps); a plain encoder trains with ``cls`` (its MLP) and serves as the
complementary model with ``cls_before_pooler``.

    python experiments/dclr_diagnostics.py --complementary RUN_DIR [--model START] \\
        [--data FILE] [--batches 20] [--phi 0.9 0.85 0.8] [--json OUT.json]

``RUN_DIR``: a model folder, or a train.py ``--output-dir`` (its ``model/`` is used).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for folder in (REPO, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from compare import MODEL_DIR, RUN_CONFIG, default_model  # noqa: E402
from fastcl import reference  # noqa: E402
from fastcl.encoders import POOLERS, load_encoder, tokenize  # noqa: E402
from fastcl.data import read_sentences  # noqa: E402
from fastcl.evaluate import saved_pooler  # noqa: E402

SHARED_WIKI = REPO.parent / "shared" / "data" / "wiki" / "wiki1m_for_simcse.random10k.txt"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="training encoder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--pooler", choices=POOLERS, default=None,
                   help="training pooler of --model (default, as train.py: a sentence-transformers "
                        "model's own, e.g. all-MiniLM-L6-v2's avg; cls with its MLP for a plain encoder)")
    p.add_argument("--complementary", required=True,
                   help="frozen complementary model (a trained SimCSE): a model folder, or a "
                        "train.py --output-dir (its model/)")
    p.add_argument("--complementary-pooler", choices=POOLERS, default=None,
                   help="pooler of --complementary (default, as train.py: a sentence-transformers "
                        "model's own; cls_before_pooler for a plain encoder)")
    p.add_argument("--data", default=str(SHARED_WIKI), help="training sentences, one a line")
    p.add_argument("--batches", type=int, default=20, help="batches to average over (default 20)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences a batch (default 64)")
    p.add_argument("--max-seq-len", type=int, default=32, help="max tokens a sentence (default 32)")
    p.add_argument("--temperature", type=float, default=0.05, help="τ (default 0.05)")
    p.add_argument("--phi", type=float, nargs="+", default=[0.9, 0.85, 0.8, 0.7],
                   help="thresholds to report the masked share for (default 0.9 0.85 0.8 0.7)")
    p.add_argument("--noise-ratio", type=float, default=1.0, help="K = round(noise_ratio·N) (default 1)")
    p.add_argument("--noise-steps", type=int, default=4, help="ascent steps (default 4)")
    p.add_argument("--noise-lr", type=float, default=1e-3, help="ascent step size β (default 1e-3)")
    p.add_argument("--noise-std", type=float, default=1.0, help="σ of the initial noise (default 1)")
    p.add_argument("--seed", type=int, default=0, help="batch sampling, dropout and noise (default 0)")
    p.add_argument("--json", default=None, help="also write the results here")
    return p


def check_args(parser, args) -> None:
    if args.batches < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.batch_size < 2:
        parser.error(f"--batch-size must be >= 2 (in-batch negatives), got {args.batch_size}")
    if not args.temperature > 0:
        parser.error(f"--temperature must be > 0, got {args.temperature}")
    bad = [phi for phi in args.phi if not -1.0 <= phi <= 1.0]
    if bad:
        parser.error(f"--phi must lie in [-1, 1], got {bad}")
    if args.noise_ratio < 0 or args.noise_steps < 0 or args.noise_std <= 0:
        parser.error("--noise-ratio and --noise-steps must be >= 0 and --noise-std > 0")
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")


def batch_diagnostics(h, h_pos, c, c_pos, noise0, args) -> dict:
    """The numbers of one batch; ``h, h⁺`` are the training views, ``c, c⁺`` the complementary's."""
    n = h.shape[0]
    off = ~torch.eye(n, dtype=torch.bool)
    comp = reference.cosine_matrix(c, c_pos)[off]
    out = {"masked": {str(phi): (comp >= phi).double().mean().item() for phi in args.phi},
           "comp_cos_mean": comp.mean().item(),
           "comp_cos_p99": torch.quantile(comp.double(), 0.99).item(),
           "comp_cos_max": comp.max().item()}
    z = reference.dclr_noise(h, h_pos, noise0.shape[0], steps=args.noise_steps, lr=args.noise_lr,
                             temperature=args.temperature, noise=noise0)
    logits = torch.cat([reference.cosine_matrix(h, h_pos), reference.cosine_matrix(h, z)], 1) / args.temperature
    p = torch.softmax(logits.double(), dim=1)
    pos = p.diagonal()
    noise = p[:, n:].sum(1)
    out.update(p_positive=pos.mean().item(), p_in_batch=(1 - pos - noise).mean().item(),
               p_noise=noise.mean().item(), p_noise_max=noise.max().item(),
               loss=-pos.log().mean().item())
    if noise0.shape[0]:
        before, after = reference.cosine_matrix(h, noise0), reference.cosine_matrix(h, z)
        out.update(noise_cos_max=after.max().item(), noise_shift_mean=(after - before).abs().mean().item(),
                   noise_shift_max=(after - before).abs().max().item())
    return out


def mean_over(rows: list) -> dict:
    out = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: sum(r[key][k] for r in rows) / len(rows) for k in value}
        else:
            out[key] = sum(r[key] for r in rows) / len(rows)
    return out


def model_folder(path: str) -> str:
    """A train.py --output-dir stands for its trained model, ``OUT/model``."""
    run = Path(path)
    if (run / RUN_CONFIG).is_file() and (run / MODEL_DIR).is_dir():
        return str(run / MODEL_DIR)
    return path


def default_pooler(model: str, plain: str) -> str:
    """train.py's pooler of ``model``: the one a sentence-transformers folder records (train.py
    keeps its modules), else ``plain``."""
    if (Path(model) / "modules.json").is_file():
        return saved_pooler(model)
    return plain


@torch.no_grad()
def diagnose(args) -> dict:
    model = args.model or default_model()
    complementary = model_folder(args.complementary)
    pooler = args.pooler or default_pooler(model, "cls")
    comp_pooler = args.complementary_pooler or default_pooler(complementary, "cls_before_pooler")
    encoder, tok = load_encoder(model, pooler)
    comp, comp_tok = load_encoder(complementary, comp_pooler, arg="--complementary")
    encoder.train()  # dropout on: the two views differ as in training
    comp.eval()
    sentences = read_sentences(args.data).dataset["text"]  # read as train.py reads it
    if len(sentences) < args.batch_size:
        raise SystemExit(f"--data has {len(sentences)} sentences, fewer than --batch-size {args.batch_size}")
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    k = reference.noise_count(args.noise_ratio, args.batch_size)
    rows = []
    for _ in range(args.batches):
        batch = rng.sample(sentences, args.batch_size)
        feats = tokenize(tok, batch, args.max_seq_len)
        h, h_pos = encoder(**feats).float(), encoder(**feats).float()
        c_feats = tokenize(comp_tok, batch, args.max_seq_len)
        c, c_pos = comp(**c_feats).float(), comp(**c_feats).float()
        noise0 = reference.draw_noise(k, h.shape[1], std=args.noise_std, generator=gen)
        rows.append(batch_diagnostics(h, h_pos, c, c_pos, noise0, args))
    return {"model": str(model), "complementary": str(complementary), "data": str(args.data),
            "pooler": pooler, "complementary_pooler": comp_pooler,
            "batches": args.batches, "batch_size": args.batch_size, "noise": k,
            "settings": {key: getattr(args, key) for key in ("temperature", "noise_ratio", "noise_steps",
                                                               "noise_lr", "noise_std", "max_seq_len", "seed")},
            "mean": mean_over(rows)}


def render(res: dict) -> str:
    m = res["mean"]
    lines = [f"{res['batches']} batches of {res['batch_size']}, {res['noise']} noise negatives each; "
             f"pooler {res['pooler']}, complementary pooler {res['complementary_pooler']}",
             "", "| quantity | mean over batches |", "|---|---|"]
    for phi, share in m["masked"].items():
        lines.append(f"| in-batch negatives masked at phi={phi} | {100 * share:.3f}% |")
    lines += [f"| complementary cosine of negatives: mean / p99 / max | {m['comp_cos_mean']:.3f} / "
              f"{m['comp_cos_p99']:.3f} / {m['comp_cos_max']:.3f} |",
              f"| softmax mass: positive | {m['p_positive']:.4f} |",
              f"| softmax mass: in-batch negatives | {m['p_in_batch']:.2e} |",
              f"| softmax mass: noise negatives (mean / max row) | {m['p_noise']:.2e} / {m['p_noise_max']:.2e} |",
              f"| InfoNCE loss with noise | {m['loss']:.4f} |"]
    if "noise_shift_mean" in m:
        lines += [f"| noise: max cos(h, z) after the steps | {m['noise_cos_max']:.3f} |",
                  f"| noise: change of cos(h, z) by the steps, mean / max | {m['noise_shift_mean']:.1e} / "
                  f"{m['noise_shift_max']:.1e} |"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    res = diagnose(args)
    res["command"] = " ".join(["python", "experiments/dclr_diagnostics.py",
                               *(argv if argv is not None else sys.argv[1:])])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(render(res))
    bad = [k for k, v in res["mean"].items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        print(f"warning: non-finite {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
