"""experiments/compare.py end to end at a tiny budget (a tiny random encoder, synthetic STS data),
and its resumability: a second invocation retrains and re-evaluates nothing."""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_evaluate import make_tiny_model, random_sentence, write_sts_dir

REPO = Path(__file__).resolve().parents[1]
COMPARE = REPO / "experiments" / "compare.py"


def compare(*args, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, str(COMPARE), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, time.perf_counter() - tic


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    rng = random.Random(3)
    make_tiny_model(root / "model")
    write_sts_dir(root / "sts", n=30)
    wiki = root / "wiki"
    wiki.mkdir()
    a = [random_sentence(rng) for _ in range(40)]
    b = a[:10] + [random_sentence(rng) for _ in range(30)]  # 10 repeats across the files
    (wiki / "a.txt").write_text("\n".join(a) + "\nthe cut last line")  # no newline: dropped
    (wiki / "b.txt").write_text("\n".join(b) + "\n")
    expected = len(dict.fromkeys(a + b))
    args = ["--methods", "simcse", "dclr", "--seeds", "0", "--steps", "2", "--batch-size", "4",
            "--eval-steps", "1", "--model", root / "model", "--data-dir", wiki,
            "--data-files", "a.txt", "b.txt", "--sts-dir", root / "sts",
            "--work-dir", root / "work", "--results-dir", root / "results"]
    out, _ = compare(*args)
    return root, args, out, expected


def test_compare_writes_results_and_no_weights(setup):
    root, _, out, expected = setup
    results, work = root / "results", root / "work"
    train_txt = (work / "data" / "train.txt").read_text().splitlines()
    assert len(train_txt) == expected and "the cut last line" not in train_txt
    for name in ("start", "simcse-seed0", "dclr-seed0"):
        r = json.loads((results / "runs" / f"{name}.json").read_text())
        assert set(r["scores"]) == {"stsb", "sickr"} and r["avg"] is not None
        assert r["alignment"] is not None and r["uniformity"] is not None
        if name != "start":
            assert (work / "runs" / name / "model.safetensors").is_file()
            assert [c["step"] for c in r["dev_curve"]] == [1, 2]
            assert not (work / "runs" / name / "checkpoint.pt").exists()
    dclr = json.loads((results / "runs" / "dclr-seed0.json").read_text())
    assert "--complementary" in dclr["train_command"] and "simcse-seed0" in dclr["train_command"]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["order"] == ["start", "simcse", "dclr"]
    assert summary["data"]["sentences"] == expected
    assert summary["command"].startswith("python experiments/compare.py --methods simcse dclr")
    assert summary["wall_s"] > 0 and set(summary["plots"]) == {"average.png", "uniformity_simcse_dclr.png"}
    table = (results / "results.md").read_text()
    assert "| SimCSE | 1 |" in table and "| DCLR | 1 |" in table and summary["command"] in table
    files = [p for p in results.rglob("*") if p.is_file()]
    assert files and all(p.suffix in {".json", ".md", ".png"} for p in files)


def test_rerun_does_not_retrain(setup):
    root, args, _, _ = setup
    watched = [p for p in (root / "work" / "runs").rglob("*") if p.is_file()]
    watched += list((root / "results" / "runs").glob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in watched}
    out, seconds = compare(*args)
    assert out.count("done, skipped") == 3 and "] training" not in out and "] evaluating" not in out
    assert {p: p.stat().st_mtime_ns for p in watched} == before
    assert seconds < 30
    # a run whose training finished but whose scores are missing is only re-evaluated
    (root / "results" / "runs" / "dclr-seed0.json").unlink()
    model = root / "work" / "runs" / "dclr-seed0" / "model.safetensors"
    stamp = model.stat().st_mtime_ns
    out, _ = compare(*args)
    assert "[dclr-seed0] evaluating" in out and "[dclr-seed0] training" not in out
    assert model.stat().st_mtime_ns == stamp


def test_other_settings_are_refused(setup):
    root, args, _, _ = setup
    changed = [*args[:args.index("--steps")], "--steps", "3", *args[args.index("--steps") + 2:]]
    proc = subprocess.run([sys.executable, str(COMPARE), *map(str, changed)], cwd=REPO,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "other settings" in proc.stderr + proc.stdout
