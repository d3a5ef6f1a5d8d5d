"""bench/_alternatives.py: each alternative a user would pick instead of fastcl (PyTorch's
chunked linear_cross_entropy, Cut Cross-Entropy, memeff, Inf-CL) computes the reference's
loss and gradients on every objective it claims (float64 reference, the tolerances of
``_alternatives.TOLERANCE``), where its package is installed and the machine can run it;
a wrong implementation is a row saying so and is not timed; an objective it cannot express,
a missing package or a missing GPU is a skipped row with the reason. Tiny shapes (CPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import _alternatives as alt  # noqa: E402
import _runner  # noqa: E402

PAIRS = [(impl, obj) for impl in alt.ALTERNATIVES for obj in alt.SUPPORTS[impl]]


def spec(impl, objective, n=96, d=32, dtype="float32"):
    return {"kind": "case", "objective": objective, "impl": impl, "n": n, "d": d, "dtype": dtype,
            "seed": 0, "threads": 1, "repeats": 1, "check_n": 1024}


@pytest.mark.parametrize("impl,objective", [
    pytest.param(i, o, marks=[pytest.mark.slow] if (i, o) == ("cce", "infonce-hard") else [])
    for i, o in PAIRS])
def test_alternative_matches_reference(impl, objective):
    why = alt.unavailable(impl, objective, "cpu")
    if why:
        pytest.skip(why)
    result = alt.check(spec(impl, objective), "cpu")
    assert result["check_n"] == 96
    assert result["check_ok"], result
    assert result["check_loss_rel"] < 1e-4 and result["check_grad_rel"] < 1e-3


def test_torch_lce_matches_reference_bf16():
    """PyTorch's chunked op (no extra package) in bfloat16, with the 16-bit tolerances."""
    why = alt.unavailable("torch-lce", "infonce", "cpu")
    if why:
        pytest.skip(why)
    result = alt.check(spec("torch-lce", "infonce", dtype="bfloat16"), "cpu")
    assert result["check_ok"], result
    assert result["check_tolerance"] == list(alt.TOLERANCE["bfloat16"])


def test_unsupported_missing_and_gpu_only_are_reasons():
    assert "does not express infonce-hard" in alt.unavailable("memeff", "infonce-hard", "cpu")
    assert "does not express dclr" in alt.unavailable("torch-lce", "dclr", "cpu")
    for impl in alt.CUDA_ONLY:
        why = alt.unavailable(impl, "infonce", "cpu")
        installed = alt.version(impl) is not None
        assert why.startswith("no GPU") if installed else "is not installed" in why
    assert alt.unavailable("fastcl", "infonce", "cpu") is None       # not an alternative


def test_unavailable_case_is_a_skipped_row_without_a_worker(monkeypatch):
    args = SimpleNamespace(system_malloc=False, seed=0, threads=1, repeats=1, no_input_checks=False,
                           check_n=64, chunk_size=None, in_process=False, case_timeout=5)
    monkeypatch.setattr(_runner, "run_fresh_process", lambda *a, **k: pytest.fail("worker started"))
    runner = _runner.Runner(args, "cpu")
    [row] = runner.run({"kind": "case", "objective": "infonce-hard", "impl": "memeff", "n": 64,
                        "m": 128, "d": 32, "dtype": "float32"})
    assert row["skipped"] and not row["ok"] and "does not express" in row["error"]
    assert row["package"] == "memeff" and "package_version" in row
    assert _runner.status_line(row).endswith(row["error"]) and "skipped" in _runner.status_line(row)


def test_wrong_implementation_is_reported_not_timed(monkeypatch):
    """An adapter 1 % off is caught by the check before the case is measured."""
    import _cases

    real = _cases.alternative_loss

    def off_by_one_percent(*a, **k):
        fn, note = real(*a, **k)
        return (lambda *xs: 1.01 * fn(*xs)), note

    monkeypatch.setattr(_cases, "alternative_loss", off_by_one_percent)
    monkeypatch.setattr(_runner, "measure_cpu", lambda *a, **k: pytest.fail("a wrong case was timed"))
    out = _runner.worker(spec("torch-lce", "infonce"))
    assert not out["ok"] and out["error"].startswith("wrong:") and "not timed" in out["error"]
    assert out["check_loss_rel"] == pytest.approx(0.01, rel=1e-3)


def test_alternatives_stage_in_process(tmp_path):
    """The GPU check's alternatives stage in its dry configuration (in-process, tiny): every
    row checked before it is timed, the CUDA-only ones skipped with "no GPU" (or missing),
    the versions in the JSON, the output where --out-stem says."""
    stem = tmp_path / "alt"
    env = dict(os.environ, PYTHONPATH=f"{BENCH}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--device", "cpu", "--threads", "1", "--in-process",
         "--objective", "infonce", "--impl", "fastcl,torch-lce,memeff,inf-cl,reference",
         "--n", "128", "--d", "32", "--repeats", "1", "--no-plots", "--out-stem", str(stem)],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(Path(f"{stem}.json").read_text())
    assert set(report["environment"]["alternatives"]) == {"torch", "cut-cross-entropy", "memeff",
                                                         "inf-cl"}
    rows = {r["impl"]: r for r in report["results"]}
    for impl in ("fastcl", "torch-lce"):
        assert rows[impl]["ok"] and rows[impl]["check_ok"] and rows[impl]["median_s"] > 0
    assert rows["torch-lce"]["package_version"] == report["environment"]["torch"]
    assert rows["reference"]["ok"] and "check_ok" not in rows["reference"]
    for impl in ("memeff", "inf-cl"):
        assert rows[impl]["skipped"]
        assert rows[impl]["error"].startswith("no GPU") or "not installed" in rows[impl]["error"]
    assert "skipped: no GPU" in proc.stdout or "not installed" in proc.stdout
