"""experiments/compare.py end to end at a tiny budget (a tiny random encoder, synthetic STS data),
and its resumability: a second invocation retrains and re-evaluates nothing."""

import importlib
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


# ---------------------------------------------------------------------------------------
# experiments/sweep.py: compare.py's functions, runs and work dir

SWEEP = REPO / "experiments" / "sweep.py"


def sweep(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SWEEP), *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def sweep_args(root, results):
    # the same start, data, budget and work dir as the compare.py test: its SimCSE run is reused
    return ["--seeds", "0", "--steps", "2", "--batch-size", "4", "--eval-steps", "1",
            "--model", root / "model", "--data-dir", root / "wiki", "--data-files", "a.txt", "b.txt",
            "--sts-dir", root / "sts", "--work-dir", root / "work", "--results-dir", results,
            "--phis", "0.5", "0.7", "--ms", "0.1", "--augments", "token_cutoff:0.2", "--diag-batches", "1"]


def test_sweep_dry_run_prints_the_plan_and_the_estimate():
    out = sweep("--dry-run")
    for name in ("simcse-seed0", "dclr-phi0.5-seed1", "dclr-phi0.7-seed0", "focal-m0.1-seed0",
                 "focal-m0.5-seed1", "simcse-aug-feature_cutoff-seed0"):
        assert f"[{name}]" in out
    assert "--phi 0.6" in out and "--m 0.5" in out and "--augment feature_cutoff:0.2" in out
    assert "estimate: total:" in out



def test_sweep_verdict_needs_one_sign_and_more_than_the_spread():
    sys.path.insert(0, str(REPO / "experiments"))
    try:
        verdict = importlib.import_module("sweep").verdict
    finally:
        sys.path.remove(str(REPO / "experiments"))
    assert verdict([0.5, 0.7], 0.3) == "better"
    assert verdict([-0.5, -0.7], 0.3) == "worse"
    assert verdict([0.5, 0.7], 0.8) == "within"      # the mean is inside the spread
    assert verdict([1.5, -0.1], 0.1) == "within"     # the sign changes across seeds
    assert verdict([2.0], 0.0) == "within"           # one seed has no spread
    assert verdict([0.4, None, 0.6], 0.2) == "better"  # a seed without a score is left out

def test_sweep_end_to_end_and_resumable(setup):
    root = setup[0]
    results = root / "sweep-results"
    out = sweep(*sweep_args(root, results))
    assert "[simcse-seed0] evaluating" in out and "[simcse-seed0] training" not in out  # reused
    summary = json.loads((results / "sweep.json").read_text())
    labels = [r["label"] for r in summary["rows"]]
    assert labels[:4] == ["SimCSE (dropout only)", "DCLR φ=0.5", "DCLR φ=0.7", "Focal m=0.1"]
    assert labels[4] == "SimCSE + token_cutoff:0.2"
    assert summary["best_phi"] in (0.5, 0.7)
    assert labels[5] == f"DCLR φ={summary['best_phi']:g} + Focal m=0.3"
    combo = json.loads((results / "runs" / f"dclr-phi{summary['best_phi']:g}-focal0.3-seed0.json").read_text())
    assert "--focal-m 0.3" in combo["train_command"] and "--complementary" in combo["train_command"]
    aug = json.loads((results / "runs" / "simcse-aug-token_cutoff-seed0.json").read_text())
    assert "--augment token_cutoff:0.2" in aug["train_command"]
    for r in summary["rows"]:
        assert r["avg"]["mean"] is not None and set(r["diff_to_simcse"]) == {"0"}
        if r["group"] == "phi":
            assert 0.0 <= r["masked"] <= 1.0
    assert summary["rows"][0]["diff_to_simcse"] == {"0": 0.0}
    assert {r["vs_simcse"] for r in summary["rows"]} == {"within"}  # one seed: no spread to beat
    assert set(summary["plots"]) == {"phi.png", "m.png"}
    table = (results / "sweep.md").read_text()
    assert "| DCLR φ=0.5 | 1 |" in table and summary["command"] in table
    assert all(p.suffix in {".json", ".md", ".png"} for p in results.rglob("*") if p.is_file())
    again = sweep(*sweep_args(root, results))
    log = again[:again.index("# Sensitivity sweep")]  # the progress lines, before the table
    assert "] training" not in log and "] evaluating" not in log and "[masked-seed0]" not in log, log
    assert log.count("done, skipped") == 7, log  # the start and six runs
