"""The GPU check's two stage scripts, bench/e2e_cached.py and bench/largest.py, in their CPU
dry configurations (subprocesses, as bench/gpu_check.sh runs them): the JSON they write,
the agreement of fastcl's cached loss with sentence-transformers' CachedMNRL, the float64
check of the largest loss, and the time budget (stop starting work, still write the JSON)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def run_stage(script, tmp_path, *args, timeout=120):
    out = tmp_path / f"{Path(script).stem}.json"
    env = dict(os.environ, PYTHONPATH=f"{BENCH}{os.pathsep}{ROOT}", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, str(BENCH / script), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.exists(), proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


def test_e2e_cached_dry_run_losses_agree(tmp_path):
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("transformers")
    proc, report = run_stage("e2e_cached.py", tmp_path, "--dry-run", "--threads", "1",
                             "--layers", "1", "--time-budget", "90")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"environment", "settings", "rows", "agreement"} <= set(report)
    assert report["environment"]["device"] == "cpu"
    assert report["settings"]["batch"] == 32 and report["settings"]["mini_batch"] == 8
    rows = {r["impl"]: r for r in report["rows"]}
    assert set(rows) == {"fastcl", "sentence-transformers"}
    for r in rows.values():
        assert r["ok"], r
        assert r["steps_timed"] == 2 and r["median_step_s"] > 0 and r["examples_per_s"] > 0
        assert len(r["losses"]) == 3                     # the warm-up and two timed steps
    assert rows["fastcl"]["backend"] == "tiled"
    agreement = report["agreement"]
    assert agreement["ok"] and agreement["max_loss_rel_diff"] < 1e-4
    assert agreement["max_grad_norm_rel_diff"] < 1e-4
    assert rows["fastcl"]["loss"] == pytest.approx(rows["sentence-transformers"]["loss"], rel=1e-4)
    assert "loss agreement" in proc.stdout and "OK" in proc.stdout


def test_e2e_cached_spent_budget_still_writes(tmp_path):
    pytest.importorskip("sentence_transformers")
    proc, report = run_stage("e2e_cached.py", tmp_path, "--dry-run", "--threads", "1",
                             "--layers", "1", "--time-budget", "0.01")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r["steps_timed"] for r in report["rows"]] == [0, 0]
    assert all("time budget" in r["note"] for r in report["rows"])
    assert report["agreement"] is None


def test_largest_dry_run_block_check_passes(tmp_path):
    proc, report = run_stage("largest.py", tmp_path, "--dry-run", "--threads", "1",
                             "--time-budget", "60")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {"environment", "settings", "rows"} <= set(report)
    assert [r["n"] for r in report["rows"]] == [2048, 4096]
    for r in report["rows"]:
        assert r["ok"] and r["check_ok"], r
        assert r["backend"] == "tiled" and r["dtype"] == "float32" and r["d"] == 64
        assert r["median_s"] > 0 and r["repeats"] >= 1
        check = r["check"]
        assert check["rows"] == 256 and check["candidates"] == r["n"]
        assert check["block_rel_error"] < 1e-5 <= check["rtol"]
        assert check["full_ok"] and abs(check["full_z"]) < 5
    assert "PASS" in proc.stdout


def test_largest_budget_and_out_of_memory_are_rows(tmp_path):
    """A size that cannot be allocated is a row (not a crash), larger ones are not tried, and
    a size the time budget cannot hold is skipped."""
    proc, report = run_stage("largest.py", tmp_path, "--dry-run", "--threads", "1",
                             "--n", "1024,100000000000,200000000000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, huge, larger = report["rows"]
    assert first["ok"] and first["check_ok"]
    assert not huge["ok"] and huge["oom"] and "out of memory" in huge["error"]
    assert larger["skipped"] and "ran out of memory" in larger["error"]

    proc, report = run_stage("largest.py", tmp_path, "--dry-run", "--threads", "1",
                             "--n", "1024,1048576", "--time-budget", "20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    small, big = report["rows"]
    assert small["ok"] and big["skipped"] and "time budget" in big["error"]
