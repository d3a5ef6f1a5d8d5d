"""bench/grad_filter.py's tile statistics against a brute-force count on the full matrix
(CPU, N = 256: 2×2 tiles of 128; the script works in float32, the count in float64: 2e-3
relative), and the sentence pool of the wiki sample."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import grad_filter as gf  # noqa: E402


@pytest.mark.parametrize("rows", [128, 256])
def test_tile_stats_match_brute_force(rows):
    torch.manual_seed(0)
    n, tau, tile = 256, 0.05, 128
    a = torch.randn(n, 32)
    p_ = a + 0.3 * torch.randn(n, 32)
    # rows 0..127 of the anchors copy candidates 128..255: an off-diagonal tile that is not skippable
    a[:128] = p_[128:] + 0.01 * torch.randn(128, 32)
    out = gf.tile_stats(a, p_, tau, rows=rows, tile=tile)
    logits = (F.normalize(a, dim=-1) @ F.normalize(p_, dim=-1).T).double() / tau
    p = torch.softmax(logits, dim=1)
    tmax = logits.view(2, tile, 2, tile).amax(dim=(1, 3)) - 1 / tau
    for name, u in gf.UNIT_ROUNDOFF.items():
        skip = tmax < math.log(u)
        assert out[name]["bounded_fraction"] == pytest.approx(skip.double().mean().item())
        mass = (p.view(2, tile, 2, tile).sum(dim=3) * skip[:, None, :]).sum(dim=2).reshape(-1)
        neg = p.sum(dim=1) - p.diagonal()
        assert out[name]["dropped_mass_max"] == pytest.approx(mass.max().item(), rel=2e-3, abs=1e-9)
        assert out[name]["dropped_share_max"] == pytest.approx((mass / neg).max().item(), rel=2e-3,
                                                               abs=1e-9)
        q = p.clone()
        q.fill_diagonal_(0)
        tile_mass = q.view(2, tile, 2, tile).sum(dim=3)                  # (block, row, tile)
        exact = (tile_mass <= (u / 2) * neg.view(2, tile, 1)).all(dim=1)
        exact.fill_diagonal_(False)
        assert out[name]["exact_fraction"] == exact.double().mean().item()
    assert out["bfloat16"]["bounded_fraction"] == 0.5       # the two tiles away from the copies


def test_sentence_pool_is_distinct():
    root = gf.data_dir()
    if not (root / "wiki").is_dir():
        pytest.skip(f"no wiki sample under {root}")
    pool = gf.sentence_pool(root)
    assert len(pool) > 20000 and len(set(pool)) == len(pool)
    assert all(len(s) >= 20 for s in pool[:1000])
