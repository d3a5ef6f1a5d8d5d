"""experiments/dclr_diagnostics.py: its per-batch numbers against hand-built cases and the
reference DCLR loss, and the script end to end on a tiny random encoder."""

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

from fastcl import reference
from test_evaluate import make_tiny_model, random_sentence

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "dclr_diagnostics.py"
spec = importlib.util.spec_from_file_location("dclr_diagnostics", SCRIPT)
diag = importlib.util.module_from_spec(spec)
spec.loader.exec_module(diag)


def settings(**kw):
    args = diag.build_parser().parse_args(["--complementary", "unused"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_masked_share_counts_off_diagonal_pairs():
    # Complementary embeddings: rows 0 and 1 nearly parallel (cos 0.995 both ways), the rest orthogonal.
    c = torch.eye(5, 8)
    c[1] = torch.tensor([1.0, 0.1, 0, 0, 0, 0, 0, 0])
    h = torch.randn(5, 8)
    args = settings(phi=[0.99, 1.0, -1.0], noise_steps=0)
    out = diag.batch_diagnostics(h, h.clone(), c, c.clone(), torch.zeros(0, 8), args)
    assert out["masked"]["0.99"] == pytest.approx(2 / 20)  # pairs (0,1) and (1,0) of 5·4
    assert out["masked"]["1.0"] == 0.0
    assert out["masked"]["-1.0"] == 1.0
    assert out["comp_cos_max"] == pytest.approx(1 / 1.01 ** 0.5, rel=1e-6)
    assert out["p_noise"] == 0.0 and "noise_shift_mean" not in out


@pytest.mark.parametrize("steps", [0, 4])
def test_softmax_mass_and_loss_match_the_reference(steps):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 24, generator=g, dtype=torch.float64)
    h_pos = h + 0.3 * torch.randn(6, 24, generator=g, dtype=torch.float64)
    noise0 = reference.draw_noise(6, 24, generator=g).double()
    args = settings(temperature=0.5, noise_steps=steps, noise_lr=0.1)
    out = diag.batch_diagnostics(h, h_pos, h, h_pos, noise0, args)
    expect = reference.dclr_loss(h, h_pos, noise=noise0, noise_steps=steps, noise_lr=0.1, temperature=0.5)
    assert out["loss"] == pytest.approx(expect.item(), rel=1e-10)
    assert out["p_positive"] + out["p_in_batch"] + out["p_noise"] == pytest.approx(1.0, abs=1e-12)
    assert 0 < out["p_noise"] <= out["p_noise_max"] < 1
    if steps == 0:
        assert out["noise_shift_mean"] == 0.0
    else:  # ascent moves the noise towards the anchors
        assert 0 < out["noise_shift_mean"] <= out["noise_shift_max"]


def test_script_end_to_end(tmp_path, one_thread):
    model = make_tiny_model(tmp_path / "model")
    comp = make_tiny_model(tmp_path / "comp", seed=1)
    rng = random.Random(0)
    data = tmp_path / "wiki.txt"
    data.write_text("\n".join(random_sentence(rng) for _ in range(40)) + "\n\n")
    out = tmp_path / "diag.json"
    args = ["--model", str(model), "--complementary", str(comp), "--data", str(data), "--batches", "3",
            "--batch-size", "8", "--noise-ratio", "1.5", "--phi", "0.9", "-1", "--json", str(out)]
    assert diag.main(args) == 0
    res = json.loads(out.read_text())
    assert res["noise"] == 12 and res["batches"] == 3 and res["command"].endswith(str(out))
    m = res["mean"]
    assert m["masked"]["-1.0"] == 1.0 and 0.0 <= m["masked"]["0.9"] <= 1.0
    assert m["p_positive"] + m["p_in_batch"] + m["p_noise"] == pytest.approx(1.0, abs=1e-9)
    assert m["loss"] > 0 and m["noise_shift_mean"] > 0
    # the same seed gives the same numbers: batches, dropout and noise are all seeded
    assert diag.main(args[:-1] + [str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["mean"] == m


@pytest.mark.parametrize("bad, message", [
    (["--phi", "1.5"], "--phi must lie in [-1, 1]"),
    (["--batch-size", "1"], "--batch-size must be >= 2"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--data", "/nonexistent/file.txt"], "--data /nonexistent/file.txt: no such file"),
])
def test_bad_arguments_are_named(tmp_path, capsys, bad, message):
    data = tmp_path / "d.txt"
    data.write_text("a b\n")
    with pytest.raises(SystemExit):
        diag.main(["--complementary", "x", "--data", str(data), *bad])
    assert message in capsys.readouterr().err
