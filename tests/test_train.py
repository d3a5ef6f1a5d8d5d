"""fastcl-train on sentence-transformers' trainer: data formats, augmentations, every method on
a tiny BERT (plain, and cached with a positive-view augmentation), the saved model, step 0
against the saved step, resume after SIGTERM and SIGKILL, damaged checkpoints, the output
folder's lock and guards; the packaged MiniLM on the shared data. What each augmentation
changes, and its exact replay by the cached losses: tests/test_st_augment.py."""

import csv
import errno
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastcl import augment, common
from fastcl import data as data_io
from fastcl import files
from fastcl.evaluate import sentence_transformers_pooler
from fastcl.trainer import run as train  # main, the output folder, the saved model
from fastcl.trainer.run import read_log
from conftest import single_thread
from test_evaluate import DATA, make_tiny_model, minilm_path, needs_data, random_sentence, write_sts_dir

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("simcse", "simcse-sup", "dclr", "focal", "escl")

pytestmark = pytest.mark.usefixtures("one_thread", "outside")  # nothing written outside tmp_path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BERT, the BERT as a sentence-transformers model (mean pooling, Normalize), and
    training / STS data over its vocabulary."""
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def make_tiny(root):
    """The content of :func:`tiny`, written to ``root``."""
    rng = random.Random(5)
    make_tiny_model(root / "bert")
    from sentence_transformers import SentenceTransformer
    from fastcl.integrations.sentence_transformers.models import Normalize, Pooling, Transformer
    t = Transformer(str(root / "bert"))
    SentenceTransformer(modules=[t, Pooling(t.auto_model.config.hidden_size, "mean"), Normalize()]).save(
        str(root / "st"))
    lines = [random_sentence(rng) for _ in range(64)]
    lines[10:10] = ["", "   ", "\t"]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    with open(root / "sup.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sent0", "sent1", "hard_neg"])
        w.writerows([random_sentence(rng), random_sentence(rng), random_sentence(rng)] for _ in range(40))
    snli = root / "snli"
    snli.mkdir()
    premises = [random_sentence(rng) for _ in range(12)]
    rows = [(p, random_sentence(rng), lab) for p in premises for lab in ("entailment", "neutral", "contradiction")]
    (snli / "s1.train").write_text("".join(f"{p} \n" for p, _, _ in rows))
    (snli / "s2.train").write_text("".join(f"{h} \n" for _, h, _ in rows))
    (snli / "labels.train").write_text("".join(f"{lab}\n" for _, _, lab in rows))
    write_sts_dir(root / "sts", n=30)
    return root


def base_args(tiny, out, method="simcse", steps=4, **extra):
    data = {"simcse-sup": tiny / "sup.csv"}.get(method, tiny / "train.txt")
    args = ["--method", method, "--model", str(tiny / "bert"), "--data", str(data),
            "--output_dir", str(out), "--per_device_train_batch_size", "4", "--max_steps", str(steps),
            "--max_seq_len", "16", "--learning_rate", "1e-3", "--use_cpu", "--sts_dir", "none"]
    for key, value in extra.items():
        args += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return args


def step_records(out):
    return [r for r in read_log(Path(out)) if r["type"] == "step"]


def losses(out):
    return [(r["step"], r["loss"]) for r in step_records(out)]


def trainer_process(argv, log):
    """``fastcl-train argv`` forked from this process (its imports done, one thread); its output in ``log``."""
    def run():
        sys.stdout = sys.stderr = open(log, "w", buffering=1)
        sys.exit(train.main(argv))
    proc = multiprocessing.get_context("fork").Process(target=run)
    proc.start()
    return proc


def wait_for_steps(out, n, proc, timeout=120):
    """Until the log of ``out`` holds ``n`` step records (or ``proc`` has ended)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.is_alive():
        if (Path(out) / "train_log.jsonl").is_file() and len(step_records(out)) >= n:
            return
        time.sleep(0.02)


def module_types(model_dir):
    """The class names of the sentence-transformers modules saved in ``model_dir``."""
    return [m["type"].rsplit(".", 1)[1] for m in json.loads((Path(model_dir) / "modules.json").read_text())]


def assert_plain_folder(folder):
    links = [p for p in Path(folder).rglob("*") if p.is_symlink()]
    assert not links, links


# ---------------------------------------------------------------------------------------
# Data

def test_the_plain_readers(tmp_path):
    """Sentences a line (blank ones skipped and counted), SimCSE's csv (quoting, optional hard
    negatives) and SentEval's SNLI folder (premise, entailment, contradiction)."""
    path = tmp_path / "t.txt"
    path.write_bytes("first line\r\n\r\n   \nsecond\u2028same\rline\n\t\nlast, no newline".encode())
    data = data_io.read_sentences(path)
    assert data.dataset["text"] == ["first line", "second\u2028same\rline", "last, no newline"]
    assert data.skipped == 3 and data.kind == "sentences"
    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\n"a, b","say ""hi""\nthere",c\nd,,f\ng,h,i\n')
    data = data_io.read_csv_triplets(path)
    assert data.kind == "triplets" and data.skipped == 1 and data.dataset["hard_neg"] == ["c", "i"]
    assert data.dataset["sent0"] == ["a, b", "g"] and data.dataset["sent1"] == ['say "hi"\nthere', "h"]
    path.write_text("sent0,sent1\nx,y\n")
    assert data_io.read_csv_triplets(path).kind == "pairs"
    rows = [("p1 .", "e1", "entailment"), ("p1 .", "n1", "neutral"), ("p1 .", "c1", "contradiction"),
            ("p2", "e2", "entailment"), ("p2", "n2", "neutral"),  # no contradiction: skipped
            ("p3", "c3", "contradiction"), ("p3", "e3", "entailment"), ("p3", "e3b", "entailment")]
    for split, part in (("dev", rows[:5]), ("test", rows[5:])):
        for name, column in (("s1", 0), ("s2", 1), ("labels", 2)):
            (tmp_path / f"{name}.{split}").write_text("".join(f"{r[column]}{' ' * (column < 2)}\n" for r in part))
    data = data_io.read_snli(tmp_path)
    assert list(zip(data.dataset["sent0"], data.dataset["sent1"], data.dataset["hard_neg"])) == [
        ("p1 .", "e1", "c1"), ("p3", "e3", "c3")]
    assert data.skipped == 1 and len(data_io.read_snli(tmp_path, ["test"])) == 1


@pytest.mark.parametrize("name,content,method,message", [
    ("none.txt", None, "simcse", "--data: no such file"),
    ("sup.csv", "TINY", "dclr", "--data: method dclr trains on a text file.*csv"),
    ("train.txt", "TINY", "simcse-sup", "--data: simcse-sup needs a csv"),
    ("snli", "TINY", "focal", "--data: method focal trains on a text file.*not a folder"),
    ("blank.txt", b"\n \n", "simcse", "holds no usable examples"),
    ("p.csv", b"premise,hypothesis\nx,y\n", "simcse-sup", "--data: .*needs columns sent0,sent1.*lacks sent0, sent1"),
    ("q.csv", b'sent0,sent1,hard_neg\na,"b, he said,c\nd,e,f\n', "simcse-sup", "q.csv:2: malformed csv.*unbalanced quote"),
    ("f.csv", b'sent0,sent1,hard_neg\na,"b, c\nd,e",f,g\nh,i,j\n', "simcse-sup", "f.csv:2-3: the row has more fields"),
    ("mac.txt", b"first sentence\rsecond sentence\rthird\r", "simcse", "mac.txt ends its lines with CR only"),
    ("n.csv", b"sent0,sent1\nx,caf\xe9\n", "simcse-sup", "n.csv is not UTF-8 text"),
    ("snli", "SNLI:train", "simcse-sup", "--snli_splits: .*lacks split.*train"),
    ("snli", "SNLI:dev", "simcse-sup", "s1/s2/labels have 36/36/1 lines"),
])
def test_data_that_does_not_fit_is_an_error_naming_the_file(tiny, tmp_path, name, content, method, message):
    path, splits = (tiny if content == "TINY" else tmp_path) / name, None
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content and content.startswith("SNLI:"):
        path = shutil.copytree(tiny / "snli", tmp_path / "snli")
        splits = [content[5:]]
        for part in ("s1", "s2", "labels"):   # train: none; dev: a label short
            text = (path / f"{part}.train").read_text()
            (path / f"{part}.train").unlink()
            (path / f"{part}.dev").write_text(text if part != "labels" else "entailment\n")
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        data_io.read_training_data(path, method, splits)
    if content == "TINY" and method == "simcse-sup":
        assert len(data_io.read_training_data(tiny / "snli", "simcse-sup")) == 12


# ---------------------------------------------------------------------------------------
# Every method, plain and cached; the saved model

@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cached"])
def test_each_method_trains_and_saves_a_plain_model(tiny, tmp_path, method, cached):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from fastcl.evaluate import saved_pooler
    from fastcl.encoders import encode, load_encoder

    out = tmp_path / method
    extra = {"complementary": tiny / "bert"} if method == "dclr" else {}
    if cached:  # and a positive-view augmentation, which the cached losses replay
        extra["mini_batch_size"] = 3
        extra["augment"] = {"simcse": "token-cutoff", "focal": "word_deletion:0.2"}.get(method)
    assert train.main(base_args(tiny, out, method, steps=2, **{k: v for k, v in extra.items() if v})) == 0
    if extra.get("augment"):
        assert f"augment: {augment.parse(extra['augment']).spec}" in (out / "fastcl_config.yaml").read_text()
    assert [s for s, _ in losses(out)] == [1, 2] and all(v > 0 for _, v in losses(out))
    model_dir = out / train.MODEL_DIR
    assert_plain_folder(model_dir)
    # a plain encoder gets the method's pooler: cls + MLP, the MLP dropped after unsupervised training
    assert module_types(model_dir) == ["Transformer", "Pooling"] + ["Dense"] * (method == "simcse-sup")
    sentences = ["a b c", "d e f g", "h"]
    st = SentenceTransformer(str(model_dir), device="cpu").encode(sentences, convert_to_tensor=True)
    encoder, tokenizer = load_encoder(str(model_dir), saved_pooler(str(model_dir)))
    ours = encode(encoder, tokenizer, sentences)
    torch.testing.assert_close(st, ours, atol=1e-5, rtol=1e-5)
    if method != "simcse-sup":  # the raw CLS state of AutoModel is the embedding
        auto = AutoModel.from_pretrained(str(model_dir)).eval()
        batch = tokenizer(sentences, padding=True, return_tensors="pt")
        with torch.no_grad():
            cls = auto(**batch).last_hidden_state[:, 0]
        torch.testing.assert_close(cls, ours, atol=1e-5, rtol=1e-5)
    saved = json.loads((out / train.RESULTS).read_text())
    assert saved["steps"] == 2 and saved["saved_step"] == 2


def test_cached_equals_plain_step_for_step(tiny, tmp_path):
    """--mini-batch-size changes the memory, not the numbers (eval-free dropout replay)."""
    assert train.main(base_args(tiny, tmp_path / "plain", steps=3)) == 0
    assert train.main(base_args(tiny, tmp_path / "cached", steps=3, mini_batch_size=4)) == 0
    assert losses(tmp_path / "plain") == losses(tmp_path / "cached")


def test_the_pooler_option_replaces_a_sentence_transformers_models_pooling(tiny, tmp_path):
    """(Without --pooler the model keeps its own: test_a_run_that_never_beats_step_0_saves_the_base_model.)"""
    out = tmp_path / "cls"
    assert train.main(base_args(tiny, out, steps=2, model=tiny / "st", pooler="cls_before_pooler")) == 0
    assert module_types(out / "model") == ["Transformer", "Pooling"]
    assert sentence_transformers_pooler(out / "model")[0] == "cls_before_pooler"


def test_step_zero_is_evaluated_and_compared_with_the_saved_step(tiny, tmp_path, capsys):
    """With --sts_dir the run scores STS-B dev at step 0, every --eval_steps and the last step;
    the best of them is saved. Without it (no dev set ships) it says so and how to get one:
    the run of test_a_stale_lock_is_taken_over."""
    out = tmp_path / "eval"
    assert train.main(base_args(tiny, out, steps=3, eval_steps=2, sts_dir=tiny / "sts")) == 0
    printed = capsys.readouterr()
    evals = [r for r in read_log(out) if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2, 3] and "dev at step 0: stsb-dev" in printed.out
    assert all(isinstance(r["stsb-dev"], float) and "stsb-dev_alignment" in r for r in evals)
    saved = json.loads((out / train.RESULTS).read_text())
    best = max((r["stsb-dev"], -r["step"]) for r in evals)   # step 0 included; ties: the earliest
    cmp = saved["comparison"]
    assert saved["saved_step"] == -best[1] and cmp["step0"] == evals[0]["stsb-dev"] and cmp["best"] == best[0]
    assert ("did not improve on the base model" in printed.err) == (not cmp["improved"])
    records = [{"type": "eval", "step": 0, "stsb-dev": 80.0, "avg": 70.0},
               {"type": "eval", "step": 2, "stsb-dev": 75.0, "avg": 71.0}]
    assert train.comparison(records, "stsb", 2)["improved"] is False
    assert train.comparison(records, "avg", 2)["improved"] is True and train.comparison(records, "stsb", 4) is None


def _ranked_sts_dir(root, model, n=30, seed=3):
    """An STS-B dev file whose gold scores are ``model``'s own cosines: it scores 100 there, so
    any training can only tie or lose."""
    rng = random.Random(seed)
    pairs = [(random_sentence(rng), random_sentence(rng)) for _ in range(n)]
    a, b = (model.encode([p[i] for p in pairs], convert_to_tensor=True) for i in (0, 1))
    cos = torch.nn.functional.cosine_similarity(a, b).tolist()
    (root / "stsb").mkdir(parents=True)
    (root / "stsb" / "sts-dev.csv").write_text("".join(
        f"main-news\tf\t2012\t{i}\t{2.5 + 2.5 * c:.6f}\t{x}\t{y}\n" for i, ((x, y), c) in enumerate(zip(pairs, cos))))
    return root


def test_a_run_that_never_beats_step_0_saves_the_base_model(tiny, tmp_path, capsys):
    """A learning rate that only hurts, on dev data the base model ranks perfectly: the saved
    model is the base model, bit for bit, and the run says so; --keep_last keeps the last step."""
    from sentence_transformers import SentenceTransformer
    base = SentenceTransformer(str(tiny / "st"), device="cpu")
    sts = _ranked_sts_dir(tmp_path / "sts", base)
    sentences = ["a b c", "d e f g", "h"]
    for keep_last in (False, True):
        out = tmp_path / f"keep_last_{keep_last}"
        argv = base_args(tiny, out, steps=3, model=tiny / "st", sts_dir=sts, eval_steps=2, learning_rate=0.5)
        assert train.main(argv + (["--keep_last"] if keep_last else [])) == 0
        saved = json.loads((out / train.RESULTS).read_text())
        evals = {r["step"]: r["stsb-dev"] for r in read_log(out) if r["type"] == "eval"}
        assert sorted(evals) == [0, 2, 3] and evals[0] == pytest.approx(100) and max(evals.values()) == evals[0]
        assert saved["saved_step"] == (3 if keep_last else 0) and not saved["comparison"]["improved"]
        trained = SentenceTransformer(str(out / "model"), device="cpu").encode(sentences, convert_to_tensor=True)
        same = torch.equal(trained, base.encode(sentences, convert_to_tensor=True))
        assert same is not keep_last
        err = capsys.readouterr().err
        assert "did not improve on the base model" in err
        assert ("the base model is saved" in err) is not keep_last
    # the last step as trained: a sentence-transformers model keeps its own modules and pooling
    assert module_types(out / "model") == ["Transformer", "Pooling", "Normalize"]
    assert sentence_transformers_pooler(out / "model")[0] == "avg"   # mean pooling


def test_build_trainer_trains_from_objects(tiny, tmp_path):
    """The Python API: a SentenceTransformer, a datasets.Dataset of one text column and
    training arguments in, sentence-transformers' trainer out, with fastcl's loss."""
    import datasets
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    from fastcl.integrations.sentence_transformers import FastFocalInfoNCELoss
    from fastcl.trainer import build_trainer

    model = SentenceTransformer(str(tiny / "st"), device="cpu")
    rng = random.Random(1)
    dataset = datasets.Dataset.from_dict({"sentence": [random_sentence(rng) for _ in range(16)]})
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "api"), max_steps=2, use_cpu=True,
                                                per_device_train_batch_size=4, logging_steps=1, report_to="none")
    trainer = build_trainer("focal", model, dataset, args=args, temperature=0.1, m=0.2)
    assert isinstance(trainer, SentenceTransformerTrainer) and isinstance(trainer.loss, FastFocalInfoNCELoss)
    assert trainer.train_dataset.column_names == ["anchor", "positive"]
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(v > 0 for v in losses)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert (tmp_path / "api" / "checkpoint-2" / files.MANIFEST).is_file()   # verified checkpoints
    with pytest.raises(ValueError, match="--phi applies to --method dclr only"):
        build_trainer("focal", model, dataset, args=args, phi=0.5)
    with pytest.raises(ValueError, match="'tau' is no objective option"):
        build_trainer("simcse", model, dataset, args=args, tau=0.5)


def test_the_loss_refuses_an_option_by_its_name_where_it_is_built(tiny, tmp_path):
    """--label_smoothing, --premise_labels, --teacher and --distill_weight: refused where they do
    not apply, a value the loss refuses is its error (at construction) with the option's name;
    the premise ids become the label column the loss reads."""
    import datasets
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainingArguments

    from fastcl.trainer import build_trainer
    model = SentenceTransformer(str(tiny / "st"), device="cpu")
    data = datasets.Dataset.from_dict({"text": ["a b", "c d"]})
    args = SentenceTransformerTrainingArguments(str(tmp_path / "o"), use_cpu=True, report_to="none")
    for method, options, message in [
            ("simcse", {"label_smoothing": 1.0}, r"^--label_smoothing must lie in \[0, 1\)"),
            ("simcse", {"premise_labels": True}, "^--premise_labels applies to --method simcse-sup only"),
            ("focal", {"teacher": "all-MiniLM-L6-v2"}, "^--teacher applies to --method simcse or simcse-sup"),
            ("simcse", {"distill_weight": 1.5}, r"^--distill_weight must lie in \[0, 1\], got 1.5"),
            ("escl", {"rd_weight": float("nan")}, "^--rd_weight must be finite")]:
        with pytest.raises(ValueError, match=message):
            build_trainer(method, model, data, args=args, **options)
    rows = datasets.Dataset.from_dict({"sent0": ["a b", "c", "a b"], "sent1": ["x", "y", "z"],
                                       "hard_neg": ["u", "v", "w"]})
    assert data_io.loss_columns(rows, "simcse-sup", premise_labels=True)["label"] == [0, 1, 0]


# ---------------------------------------------------------------------------------------
# Resume and checkpoints

@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    """The step losses of a run never stopped, run here on one thread as the processes it is
    compared with (OMP_NUM_THREADS=1: another thread count changes the last bits; a process
    of its own would add only its start-up)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    with single_thread():
        assert train.main(base_args(tiny, out, steps=8, save_steps=2)) == 0
    return losses(out)


def finish(proc, code, log, timeout=300):
    proc.join(timeout)
    assert proc.exitcode == code, Path(log).read_text()[-3000:]
    return Path(log).read_text()


def test_sigterm_then_sigkill_at_a_random_step_then_resume_gives_the_same_losses(tiny, tmp_path, uninterrupted,
                                                                                 capsys):
    """Real processes (forked): the first is stopped by SIGTERM, which checkpoints its step and
    exits 143 with no results; the second resumes and is held (SIGSTOP) once its log reaches a
    random later step, and a run started on its folder meanwhile is refused, naming the lock
    and its holder; the second is then SIGKILLed, and a third run (here, on one thread as
    the processes) resumes from the newest complete checkpoint, taking over the dead
    process's lock: the step losses are those of a run that was never stopped (so the
    refused run changed nothing)."""
    out, log = tmp_path / "stopped", tmp_path / "log"
    argv = base_args(tiny, out, steps=8, save_steps=4)  # the SIGTERM writes a checkpoint of its own
    first = trainer_process(argv, log)
    wait_for_steps(out, 2, first)
    os.kill(first.pid, signal.SIGTERM)
    assert "stopped by signal 15 after step" in finish(first, 128 + signal.SIGTERM, log, 120)
    assert not (out / train.RESULTS).exists()
    stopped_at = max(s for s, _ in losses(out))
    assert (out / f"checkpoint-{stopped_at}" / files.MANIFEST).is_file()
    assert stopped_at < 7, "the SIGTERM left no step of the resumed run to SIGKILL at"
    kill_at = random.Random().randint(stopped_at + 1, 7)   # a step of the resumed run
    second = trainer_process(argv + ["--resume"], log)
    wait_for_steps(out, kill_at, second)
    os.kill(second.pid, signal.SIGSTOP)
    try:
        with pytest.raises(SystemExit, match=re.escape(
                f"in use by another run (lock {out / files.LOCK}, held by pid {second.pid}")):
            train.main(argv + ["--resume"])
    finally:
        second.kill()
    finish(second, -signal.SIGKILL, log)
    capsys.readouterr()
    assert train.main(argv + ["--resume"]) == 0
    assert "took over the lock of a run that is no longer running" in capsys.readouterr().err
    assert losses(out) == uninterrupted, f"SIGTERM after step {stopped_at}, SIGKILL at step {kill_at}"


class Killed(BaseException):
    """A crash at a write point, in this process (as ``FASTCL_CRASH_AT`` is in another)."""


def crash_at(monkeypatch, name):
    """The next run stops dead at the write point ``name`` (its lock released, nothing
    cleaned up), as a SIGKILL there would."""
    def crash(point):
        if point == name:
            raise Killed(point)
    monkeypatch.setattr(files, "crash_point", crash)


@pytest.fixture(scope="module")
def stopped(tiny, tmp_path_factory):
    """A run of 4 steps killed after training, before its model was saved: checkpoint-2 and
    checkpoint-4 on disk. Returns (its folder, its options)."""
    out = tmp_path_factory.mktemp("stopped") / "out"
    argv = base_args(tiny, out, steps=4, save_steps=2)
    with pytest.MonkeyPatch.context() as m, pytest.raises(Killed):
        crash_at(m, "model-stage")
        train.main(argv)
    return out, argv


def copy_run(stopped, where):
    out, argv = stopped
    shutil.copytree(out, where)
    return where, [str(where) if a == str(out) else a for a in argv]


def test_a_checkpoint_torn_by_a_crash_is_removed_and_the_one_before_resumed(stopped, tmp_path, capsys):
    out, argv = copy_run(stopped, tmp_path / "torn")
    (out / "checkpoint-4" / files.MANIFEST).unlink()  # as a kill before its manifest leaves it
    before = dict(losses(out))
    assert train.main(argv + ["--resume"]) == 0
    assert f"removed {out / 'checkpoint-4'}: a checkpoint whose writing was interrupted" in capsys.readouterr().err
    starts = [r for r in read_log(out) if r["type"] == "start"]
    assert starts[-1]["step"] == 2 and starts[-1]["resumed"]
    again = dict(losses(out))  # steps 3 and 4 redone (here in this process: to the last bits aside)
    assert sorted(again) == [1, 2, 3, 4]
    for step in (3, 4):
        assert again[step] == pytest.approx(before[step], rel=1e-5)


def model_tensors(folder):
    from safetensors.torch import load_file
    return {p.relative_to(folder).as_posix(): load_file(p) for p in sorted(Path(folder).rglob("*.safetensors"))}


def untimed(record):
    """``record`` without its timings (they differ from run to run)."""
    return {k: v for k, v in record.items() if "runtime" not in k and "per_second" not in k}


def run_records(out, types=("step", "eval", "summary")):
    return [untimed(r) for r in read_log(out) if r["type"] in types]


@pytest.mark.parametrize("schedule", ["constant", "linear"])
def test_a_run_killed_after_its_last_step_resumes_to_the_uninterrupted_end(tiny, tmp_path, monkeypatch, schedule):
    """Killed while exporting the model, a run's resume only exports: no step past
    --max-steps (the trainer, resumed at its last step, would run one more), and the log,
    the checkpoints, the scheduler and the saved model are the uninterrupted run's. The
    linear schedule with --sts-dir: the best step's model is exported."""
    extra = dict(steps=4, save_steps=2, lr_scheduler_type=schedule)
    if schedule == "linear":
        extra.update(sts_dir=tiny / "sts", eval_steps=2)
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert train.main(base_args(tiny, whole, **extra)) == 0
    with monkeypatch.context() as m:
        crash_at(m, "model-stage")
        with pytest.raises(Killed):
            train.main(base_args(tiny, killed, **extra))
    assert not (killed / train.RESULTS).exists()
    assert train.main(base_args(tiny, killed, resume=True, **extra)) == 0
    assert run_records(killed) == run_records(whole)
    assert [r["step"] for r in run_records(killed, ("step",))] == [1, 2, 3, 4]
    done, again = (json.loads((o / train.RESULTS).read_text()) for o in (whole, killed))
    assert done["steps"] == again["steps"] == 4 and done["saved_step"] == again["saved_step"]
    assert [p.name for _, p in train.checkpoints(killed)] == [p.name for _, p in train.checkpoints(whole)]
    assert (killed / "checkpoint-4" / "scheduler.pt").read_bytes() == (whole / "checkpoint-4" / "scheduler.pt").read_bytes()
    states = [json.loads((o / "checkpoint-4" / "trainer_state.json").read_text()) for o in (whole, killed)]
    for state in states:  # the best checkpoint's path names its run's folder; timings differ
        state["best_model_checkpoint"] = state["best_model_checkpoint"] and Path(state["best_model_checkpoint"]).name
        state["log_history"] = [untimed(r) for r in state["log_history"]]
    assert states[0] == states[1] and states[0]["global_step"] == 4
    a, b = model_tensors(whole / "model"), model_tensors(killed / "model")
    assert a.keys() == b.keys() and all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    with pytest.raises(SystemExit, match="has finished"):  # and no further resume adds a step
        train.main(base_args(tiny, killed, resume=True, **extra))


def test_a_finished_run_is_only_replaced_when_asked_and_links_are_never_followed(tiny, tmp_path, outside):
    """The campaign's case: a finished run's checkpoint, model and TensorBoard folder replaced
    by links to a model folder, trained again with --overwrite_output_dir: the links are
    removed, what they point to is untouched, the run's entries are real folders."""
    out = tmp_path / "R"
    argv = base_args(tiny, out, steps=3, save_steps=3)
    assert train.main(argv) == 0
    with pytest.raises(SystemExit, match=r"holds a finished run \(train_results.json\).*--overwrite_output_dir"):
        train.main(argv)
    mymodel = outside / "mymodel"
    shutil.copytree(tiny / "bert", mymodel)
    outside.seal()
    before = {p.name: p.read_bytes() for p in mymodel.iterdir()}
    for name in ("checkpoint-3", "model"):
        shutil.rmtree(out / name)
    for name in ("checkpoint-3", "model", "checkpoint-9", "runs"):
        os.symlink(mymodel, out / name)
    assert train.main(argv + ["--overwrite-output-dir"]) == 0
    assert {p.name: p.read_bytes() for p in mymodel.iterdir()} == before
    assert files.verify_manifest(out / "checkpoint-3") and (out / "model" / "modules.json").is_file()
    assert_plain_folder(out)


def test_a_link_a_resume_would_write_through_is_refused_naming_it(stopped, tmp_path, outside, capsys):
    victim = outside / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("{}\n")
    outside.seal()
    out, argv = copy_run(stopped, tmp_path / "linked")
    shutil.rmtree(out / "checkpoint-4")
    os.symlink(victim, out / "checkpoint-4")  # the resume from checkpoint-2 saves step 4
    with pytest.raises(SystemExit, match=f"{out / 'checkpoint-4'} is a link .*--overwrite_output_dir"):
        train.main(argv + ["--resume"])
    (out / "checkpoint-4").unlink()
    (out / "runs").mkdir()
    os.symlink(outside / "precious.txt", out / "runs" / "events.out")  # inside a folder the run writes
    with pytest.raises(SystemExit, match=f"{out / 'runs' / 'events.out'} is a link"):
        train.main(argv + ["--resume"])
    os.symlink(victim, out / "checkpoint-4")
    assert train.main(argv + ["--resume", "--overwrite-output-dir"]) == 0  # the user agreed
    assert "removed the link" in capsys.readouterr().err
    assert os.listdir(victim) == ["config.json"] and (victim / "config.json").read_text() == "{}\n"
    assert files.verify_manifest(out / "checkpoint-4") and not (out / "checkpoint-4").is_symlink()
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4]


def test_a_link_made_during_training_is_refused_at_the_next_save(tiny, tmp_path, outside, monkeypatch):
    out = tmp_path / "planted"

    class Planting(train.GracefulStop):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.symlink(outside.folder, out / "checkpoint-2")
            return super().on_step_end(args, state, control, **kwargs)

    monkeypatch.setattr(train, "GracefulStop", Planting)
    with pytest.raises(SystemExit, match=f"{out / 'checkpoint-2'} is a link"):
        train.main(base_args(tiny, out, steps=2, save_steps=2))


class RunsCode:
    """A pickle that would create ``path`` when loaded (a code-running checkpoint file)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("damage,message", [
    ("flip", r"checkpoint-4/optimizer.pt is damaged"), ("truncate", r"checkpoint-4/optimizer.pt is damaged"),
    ("remove", r"checkpoint-4/optimizer.pt is missing"),
    ("pickle:rng_state.pth", r"checkpoint-4/rng_state.pth cannot be loaded: not plain tensor data"),
    ("pickle:optimizer.pt", r"checkpoint-4/optimizer.pt cannot be loaded: not plain tensor data"),
    ({"files": {"config.json": "abc"}}, r"fastcl_manifest.json is damaged: the record of 'config.json' is 'abc'"),
    ({"files": ["config.json"]}, r"fastcl_manifest.json is damaged: 'files' is a list"),
    ({"files": {"../../x": {"bytes": 1, "sha256": "0"}}}, r"fastcl_manifest.json is damaged: it lists '../../x'"),
    ("trainer_state.json:{\"global_step\": 4", r"checkpoint-4/trainer_state.json cannot be loaded: JSONDecodeError"),
    ("trainer_state.json:[]", r"checkpoint-4/trainer_state.json is damaged: not the trainer state of step 4"),
    ("trainer_state.json:{\"global_step\": 3, \"max_steps\": 4}", r"trainer_state.json is damaged: not the trainer state of step 4 \(global_step: 3"),
    ("model.safetensors:not a safetensors file", r"checkpoint-4/model.safetensors cannot be loaded"),
    ("scheduler.pt:", r"checkpoint-4/scheduler.pt cannot be loaded"),
    ("trainer_state.json:{\"global_step\": 4, \"max_steps\": 4, \"log_history\": [], \"x\": 1}",
     r"trainer_state.json is damaged: .*unexpected keyword argument 'x'"),
    ("rng_state.pth", r"checkpoint-4/rng_state.pth is damaged: it holds no python, numpy, cpu"),
    ("optimizer.pt", r"checkpoint-4/optimizer.pt is damaged: it holds no param_groups"),
])
def test_a_crafted_or_damaged_checkpoint_file_is_one_line_naming_it(stopped, tmp_path, damage, message):
    """Damaged (its manifest differs), or crafted with a manifest rewritten to match (a pickle
    that would run code, other content): one line naming the file; nothing of it runs."""
    out, argv = copy_run(stopped, tmp_path / "damaged")
    folder, ran = out / "checkpoint-4", tmp_path / "ran"
    data = bytearray((folder / "optimizer.pt").read_bytes())
    if isinstance(damage, dict):  # a manifest of another shape
        (folder / files.MANIFEST).write_text(json.dumps(damage))
    elif damage in ("flip", "truncate", "remove"):
        data[len(data) // 2] ^= 0x01
        (folder / "optimizer.pt").write_bytes(bytes(data[:-7] if damage == "truncate" else data))
        if damage == "remove":
            (folder / "optimizer.pt").unlink()
    elif damage.startswith("pickle:"):
        torch.save(RunsCode(ran), folder / damage[7:])
        files.write_manifest(folder)
    elif ":" in damage:  # a file's content replaced, the manifest rewritten to match
        name, _, text = damage.partition(":")
        (folder / name).write_text(text)
        files.write_manifest(folder)
    else:  # tensors, not what transformers reads there
        torch.save({"state": {}}, folder / damage)
        files.write_manifest(folder)
    with pytest.raises(SystemExit) as err:
        train.main(argv + ["--resume"])
    assert re.search(message, str(err.value)) and "\n" not in str(err.value), str(err.value)
    assert not ran.exists()


def test_a_full_disk_while_writing_a_checkpoint_is_one_line_and_loses_nothing(tiny, tmp_path, monkeypatch):
    out = tmp_path / "full"
    argv = base_args(tiny, out, steps=4, save_steps=2)
    save = torch.save

    def full_at_step_4(obj, f, *args, **kwargs):
        if "checkpoint-4" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(torch, "save", full_at_step_4)
        with pytest.raises(SystemExit) as err:
            train.main(argv)
    message = str(err.value)
    assert f"writing {out / 'checkpoint-4'} failed: no space left on device" in message
    assert "\n" not in message and "--resume" in message
    assert train.main(argv + ["--resume"]) == 0  # space freed: checkpoint-2 continues
    assert [s for s, _ in losses(out)] == [1, 2, 3, 4] and (out / train.RESULTS).is_file()


def test_a_failed_write_names_the_folder_and_other_errors_pass(tmp_path):
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
                        "writing file data/0: file write failed")
    assert str(files.write_failure(torn, tmp_path / "checkpoint-2")).startswith(
        f"writing {tmp_path / 'checkpoint-2'} failed: ")
    assert files.write_failure(RuntimeError("a bug"), tmp_path) is None
    assert str(files.write_failure(OSError(errno.ENOSPC, "x"), tmp_path / "c")).endswith(
        "failed: no space left on device")


def test_a_checkpoint_loads_as_the_model_its_dev_score_measured(stopped, tmp_path):
    """Trained at --max-seq-len 16, a checkpoint keeps the model's own input limit (the one
    its step's dev evaluation used): it encodes a long text as OUT/model exported from it
    does. (SimCSE's training-only MLP is fastcl's module: trust_remote_code loads it; it acts
    in training only.)"""
    from sentence_transformers import SentenceTransformer
    out, argv = copy_run(stopped, tmp_path / "ck")
    assert train.main(argv + ["--resume"]) == 0  # the training had ended: exports checkpoint-4
    model = SentenceTransformer(str(out / "model"), device="cpu")
    assert model.max_seq_length > 40
    from test_evaluate import WORDS
    rng = random.Random(1)
    long = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(3)]  # 42 tokens: past the cut
    for _, folder in train.checkpoints(out):
        checkpoint = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
        assert checkpoint.max_seq_length == model.max_seq_length
    torch.testing.assert_close(checkpoint.encode(long, convert_to_tensor=True),
                               model.encode(long, convert_to_tensor=True), atol=1e-6, rtol=1e-6)


def test_resume_refuses_changed_data_naming_the_file(tiny, tmp_path, monkeypatch, capsys):
    data = tmp_path / "wiki.txt"
    shutil.copy(tiny / "train.txt", data)
    out = tmp_path / "run"
    argv = base_args(tiny, out, steps=4, save_steps=2)
    argv[argv.index("--data") + 1] = str(data)
    with monkeypatch.context() as m:
        crash_at(m, "model-stage")
        with pytest.raises(Killed):
            train.main(argv)
    assert json.loads((out / train.DATA_RECORD).read_text())["files"]["wiki.txt"]["bytes"] == data.stat().st_size
    lines = data.read_text().splitlines()
    random.Random(0).shuffle(lines)
    data.write_text("\n".join(lines[:-5]) + "\n")  # shuffled and cut
    with pytest.raises(SystemExit) as err:
        train.main(argv + ["--resume"])
    message = str(err.value)
    assert f"the training data changed since the run started: {data} changed (size " in message
    assert "--allow_changed_data" in message and "\n" not in message
    assert train.main(argv + ["--resume", "--allow-changed-data"]) == 0
    assert f"continuing on changed data: {data} changed" in capsys.readouterr().err


def test_the_data_record_of_a_resume(tmp_path, capsys):
    """A run an earlier fastcl wrote has no record: its resume says the data is not compared,
    and records it; a damaged record is an error naming it."""
    from argparse import Namespace
    data, out = tmp_path / "d.txt", tmp_path / "out"
    data.write_text("a\nb\n")
    out.mkdir()
    args = Namespace(data=str(data), allow_changed_data=False)
    train.check_data(args, out, None, resumed=True)
    assert "fastcl_data.json is missing (a run of an earlier fastcl)" in capsys.readouterr().err
    train.check_data(args, out, None, resumed=True)  # recorded: the same data passes
    (out / train.DATA_RECORD).write_text("[1")
    with pytest.raises(files.DamagedError, match=f"{out / train.DATA_RECORD} is damaged"):
        train.check_data(args, out, None, resumed=True)


def test_the_data_fingerprint_sees_each_kind_of_change(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    big = folder / "a.txt"
    big.write_bytes(b"x" * (3 * files.BLOCK))
    (folder / ".hidden").write_text("not data")
    saved = files.data_fingerprint(folder)
    assert list(saved["files"]) == ["a.txt"] and not files.fingerprint_changes(folder, saved, saved)
    with open(big, "r+b") as f:  # the middle of a large file: only its time tells
        f.seek(files.BLOCK + 10)
        f.write(b"y")
    os.utime(big, ns=(1, 1))
    (folder / "b.txt").write_text("new\n")
    changes = files.fingerprint_changes(folder, saved, files.data_fingerprint(folder))
    assert changes == [f"{big} changed (modified since)", f"{folder / 'b.txt'} appeared"]
    hub = files.fingerprint_changes("someone/wiki", {"dataset": "someone/wiki", "fingerprint": "a1"},
                                    {"dataset": "someone/wiki", "fingerprint": "b2"})
    assert hub == ["the dataset someone/wiki has another fingerprint (a1 at the start, b2 now)"]


def test_resume_checks_its_options(tiny, stopped, tmp_path):
    out, argv = copy_run(stopped, tmp_path / "r")
    with pytest.raises(SystemExit, match=r"--resume needs the options.*--learning-rate 0.01 \(checkpoint: 0.001\)"):
        train.main(argv + ["--resume", "--learning_rate", "1e-2"])
    with pytest.raises(SystemExit, match="holds an unfinished run.*--resume"):
        train.main(argv)
    with pytest.raises(SystemExit, match="holds no fastcl run"):
        train.main(base_args(tiny, tmp_path / "none", resume=True))
    assert train.main(argv + ["--resume"]) == 0
    with pytest.raises(SystemExit, match="has finished"):
        train.main(argv + ["--resume"])


def test_a_dclr_resume_is_not_refused_for_its_family_defaults(tiny, tmp_path):
    """phi and the noise ratio are resolved from the model after the options are checked; the
    saved config holds them resolved, a resume's options do not yet."""
    from fastcl.trainer import cli

    out = tmp_path / "dclr"
    out.mkdir()
    parser = cli.build_parser()
    argv = base_args(tiny, out, "dclr", steps=2, complementary=tiny / "bert")
    first = cli.resolve_args(parser, cli.parse_args(parser, argv))
    first.phi, first.noise_ratio = 0.9, 1.0
    cli.write_config(out, first)
    again = cli.resolve_args(parser, cli.parse_args(parser, argv + ["--resume"]))
    train._check_same_run(again, out)  # no error
    with pytest.raises(ValueError, match=r"--phi 0.5 \(checkpoint: 0.9\)"):
        train._check_same_run(cli.resolve_args(parser, cli.parse_args(parser, argv + ["--phi", "0.5"])), out)


# ---------------------------------------------------------------------------------------
# The output folder: one run at a time (a second run on a folder in use: the SIGKILL
# test above), nothing foreign removed, no link followed

def test_a_stale_lock_is_taken_over(tiny, tmp_path, capsys):
    """(The run, without --sts_dir, is also test_step_zero_is_evaluated_and_compared_with_the_saved_step's
    run without a dev set.)"""
    out = tmp_path / "stale"
    out.mkdir()
    (out / files.LOCK).write_text("pid 999999 on elsewhere\n")  # a killed run's file, no lock held
    argv = base_args(tiny, out, steps=1)
    del argv[argv.index("--sts_dir"):argv.index("--sts_dir") + 2]
    assert train.main(argv) == 0
    printed = capsys.readouterr()
    assert "took over the lock of a run that is no longer running (pid 999999 on elsewhere)" in printed.err
    assert "no --sts_dir: no dev evaluation" in printed.out    # no dev set ships: it says so
    assert not [r for r in read_log(out) if r["type"] == "eval"]


def test_a_folder_that_is_not_a_fastcl_run_is_refused(tiny, tmp_path):
    out = tmp_path / "model_copy"
    shutil.copytree(tiny / "bert", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for extra in ({}, {"overwrite_output_dir": True}):
        with pytest.raises(SystemExit, match="is not empty and holds no fastcl run"):
            train.main(base_args(tiny, out, steps=1, **extra))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_interrupted_swap_is_finished_at_the_next_start(tmp_path):
    out = tmp_path / "o"
    (out / "model").mkdir(parents=True)
    (out / "model" / "a").write_text("old")
    stage = files.stage_dir(out / "model")
    (stage / "a").write_text("new")

    def swap_killed():   # in a forked process: FASTCL_CRASH_AT SIGKILLs it between the renames
        os.environ["FASTCL_CRASH_AT"] = "swap"
        files.swap_in(stage, out / "model")

    child = multiprocessing.get_context("fork").Process(target=swap_killed)
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert not (out / "model").exists()  # between the two renames
    messages = files.recover_swaps(out)
    assert (out / "model" / "a").read_text() == "old" and any("restored" in m for m in messages)
    assert not list(out.glob(".*"))


# ---------------------------------------------------------------------------------------
# Options

def test_augmentation_names_rates_and_defaults():
    assert augment.parse("token-cutoff") == augment.Augmentation("token_cutoff", common.AUGMENT_RATES["token_cutoff"])
    assert augment.parse("word_deletion:0.3").spec == "word_deletion:0.3"
    assert augment.parse(None) is None
    for bad, message in (("crop", "unknown augmentation 'crop'"), ("token_cutoff:x", "not a number"),
                         ("span_cutoff:0", r"must be in \(0, 1\]"), ("feature_cutoff:1.5", r"\(0, 1\]")):
        with pytest.raises(ValueError, match=message):
            augment.parse(bad)


def test_the_parser_refuses_augment_where_it_does_not_apply(tiny, tmp_path, capsys):
    for method, spec, message in (("simcse-sup", "token_cutoff", "--augment applies to the unsupervised"),
                                  ("simcse", "crop", "--augment: unknown augmentation 'crop'")):
        with pytest.raises(SystemExit) as err:
            train.main(base_args(tiny, tmp_path / "o", method, augment=spec))
        assert err.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    ({"per_device_train_batch_size": 1}, "a batch needs >= 2 examples"),
    # the objective's options: refused where the method's loss takes none, values by build_spec
    ({"temperature": 0}, "--temperature must be > 0"),
    ({"phi": 0.5}, "--phi applies to --method dclr only"),
    ({"phi": 2, "method": "dclr"}, "--phi is a cosine threshold and must lie in [-1, 1], got 2.0"),
    ({"noise_std": 0, "method": "dclr"}, "--noise_std must be > 0"),
    ({"noise_steps": -1, "method": "dclr"}, "--noise_steps must be a non-negative integer"),
    ({"focal_m": 0.3, "dclr_formulation": "released", "method": "dclr"}, "got --focal_m as well"),
    ({"m": "nan", "method": "focal"}, "--m must be"),
    ({"focal_m": 0.2, "method": "focal"}, "--method focal takes its margin as --m"),
    ({"rd": "margin"}, "--rd applies to --method escl only"),
    ({"temperature_learning_rate": 0.1}, "--temperature_learning_rate 0.1: a learning rate > 0 of --learnable"),
    ({"temperature_learning_rate": 0, "learnable_temperature": True}, "--temperature_learning_rate 0: a"),
    ({"sensitive_dropout": 1.5, "method": "escl"}, "sensitive_dropout must lie in [0, 1), got 1.5"),  # by the loss
    ({"hard_negative_weight": 1}, "--hard_negative_weight needs one hard negative per anchor"),
    ({"complementary_pooler": "avg", "method": "dclr"}, "need --complementary"),
    ({"complementary_mode": "released", "method": "dclr"}, "need --complementary"),
    ({"complementary": "x"}, "--complementary applies to --method dclr only"),
    ({"columns": "a,b"}, "--columns applies to simcse-sup"),
    ({"mini_batch_size": 0}, "mini_batch_size must be a positive int, got 0"),
    ({"text_column": "x", "method": "simcse-sup"}, "--text_column applies to unsupervised"),
    ({"columns": "a", "method": "simcse-sup"}, "--columns takes 2 or 3"),
    ({"sts_dir": "SAME", "save_steps": 3, "eval_steps": 2}, "--save_steps 3 must be a multiple of --eval_steps 2"),
    ({"resume_from_checkpoint": "x"}, "fastcl-train resumes with --resume"),
    ({"mlp_only_train": "true", "pooler": "avg"}, "--mlp_only_train applies to --pooler cls only"),
    ({"lr": 0.1}, "unrecognized arguments: --lr"),   # HF's names only, no abbreviations
    ({"allow_changed_data": True}, "--allow_changed_data applies to --resume only"),
])
def test_bad_options_name_the_option(tiny, tmp_path, capsys, change, message):
    """Refused before a step is run: by the parser (exit status 2), or where the data or the
    loss is read (one line)."""
    change = dict(change)
    method = change.pop("method", "simcse")
    if change.get("sts_dir") == "SAME":
        change["sts_dir"] = tiny / "sts"
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", method, **change))
    assert message in (capsys.readouterr().err if err.value.code == 2 else err.value.code)
    assert not (tmp_path / "o" / "train_log.jsonl").exists()


def test_the_training_arguments_follow_the_options(tiny, tmp_path):
    from fastcl.trainer import cli

    parser = cli.build_parser()
    args = cli.resolve_args(parser, cli.parse_args(parser, base_args(
        tiny, tmp_path / "o", "simcse-sup", sts_dir=tiny / "sts", per_device_train_batch_size=8,
        gradient_accumulation_steps=2, warmup_steps=3, lr_scheduler_type="cosine", save_total_limit=3,
        report_to="tensorboard")))
    a = cli.training_arguments(args)
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps) == (8, 2)
    assert a.warmup_steps == 3 and a.lr_scheduler_type == "cosine" and a.save_total_limit == 3
    assert a.report_to == ["tensorboard"] and a.eval_on_start and a.load_best_model_at_end
    assert a.save_steps == a.eval_steps == 125 and a.logging_steps == 1 and a.use_cpu
    assert a.metric_for_best_model == "eval_dev_stsb-dev" and a.dataloader_drop_last
    assert a.batch_sampler == "no_duplicates"  # simcse-sup: duplicate texts are false negatives
    assert args.batch_sampler == "no_duplicates" and not args.mask_duplicates
    # the method's recipe fills what neither a flag nor a config file gives
    args = cli.resolve_args(parser, cli.parse_args(parser, ["--method", "dclr"]))
    assert (args.per_device_train_batch_size, args.learning_rate, args.num_train_epochs) == (128, 3e-5, 3)
    assert args.select == "avg" and args.output_dir == "runs/dclr" and args.model == "all-MiniLM-L6-v2"


# ---------------------------------------------------------------------------------------
# Two processes

def test_several_cpu_processes_train_on_the_cpu(monkeypatch):
    """Asked for, or the only device: either way the run goes to accelerate as a CPU run
    (else it leaves each process to train alone there)."""
    from argparse import Namespace

    from fastcl.trainer import build
    for cuda, world, use_cpu, cpu in ((False, 2, False, True), (False, 2, True, True), (False, 1, True, True),
                                      (False, 1, False, False), (True, 2, False, False), (True, 2, True, True)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        monkeypatch.setenv("WORLD_SIZE", str(world))
        assert build.on_cpu(Namespace(use_cpu=use_cpu)) is cpu, (cuda, world, use_cpu)


def torchrun(argv, port):
    """``torchrun --nproc_per_node 2 -m fastcl.trainer argv`` (gloo on a CPU, one thread each)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(port + os.getpid() % 1000), "-m", "fastcl.trainer",
                           *map(str, argv)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("device", [
    # where a GPU is the default, asking for the CPU is another run (on a CPU-only machine
    # the same one as 'auto': test_several_cpu_processes_train_on_the_cpu)
    pytest.param("cpu", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the same run as 'auto' here")),
    pytest.param("auto", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="'auto' takes the GPU here"))])
def test_two_processes_equal_one_on_the_same_global_batch(tiny, tmp_path, device):
    """torchrun, 2 gloo processes of 2 examples, against one process of 4: DCLR, cached, so
    that the gather, the noise broadcast and GradCache act together; the same examples each
    step, candidates gathered across the processes, gradients averaged: the same losses
    (dropout off, so that both runs see the same encoder; plain SGD, whose step is linear in
    the gradient, so that the summation order's rounding stays at its size: Adam divides by
    the gradient's own scale and turns a difference in the last bits of a near-zero entry into
    a full step; tolerance: summation order). One process logs (each step once) and the model
    is saved, whether the CPU is asked for or the only device."""
    model = tmp_path / "bert-no-dropout"
    shutil.copytree(tiny / "bert", model)
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (model / "config.json").write_text(json.dumps(config))
    runs = {}
    for world in (2, 1):   # the one process here: the tolerance covers its thread set-up
        out = tmp_path / f"world{world}"
        argv = base_args(tiny, out, "dclr", steps=3, model=model, per_device_train_batch_size=4 // world,
                         mini_batch_size=1, optim="sgd", learning_rate=0.5)
        if world == 2:   # (the one process here: on the CPU, asked for)
            torchrun([a for a in argv if device == "cpu" or a != "--use_cpu"], 29600)
        else:
            train.main(argv)
        runs[world] = losses(out)
    (start,) = [r for r in read_log(tmp_path / "world2") if r["type"] == "start"]
    assert start["processes"] == 2 and [s for s, _ in runs[2]] == [1, 2, 3]
    assert (tmp_path / "world2" / "model" / "modules.json").is_file()
    assert runs[1][0][1] != pytest.approx(runs[1][-1][1], rel=1e-2)   # the steps moved the model
    for (_, one), (_, two) in zip(runs[1], runs[2]):
        assert two == pytest.approx(one, rel=1e-4)


# ---------------------------------------------------------------------------------------
# The packaged MiniLM

def _stsb_slice(root, pairs=100):
    """The first ``pairs`` pairs of the real STS-B dev file, alone in the evaluator's layout (a
    folder without SICK: the trainer scores the dev sets it holds; both: the tiny runs above;
    the full sets' scores: test_evaluate)."""
    (Path(root) / "stsb").mkdir(parents=True)
    with open(DATA / "stsb" / "sts-dev.csv", "rb") as f:
        lines = f.read().splitlines(keepends=True)
    (Path(root) / "stsb" / "sts-dev.csv").write_bytes(b"".join(lines[:pairs]))
    return root


@needs_data
def test_minilm_keeps_its_mean_pooling_and_is_scored_at_step_0(tmp_path):
    out = tmp_path / "minilm"
    wiki = DATA / "wiki" / "wiki1m_for_simcse.random10k.txt"
    if not wiki.is_file():
        pytest.skip(f"no Wikipedia sample at {wiki}")
    sts = _stsb_slice(tmp_path / "sts")
    minilm_path()  # skips where the package is not installed
    assert train.main(["--method", "simcse", "--model", "all-MiniLM-L6-v2", "--data", str(wiki),  # its short name
                       "--output_dir", str(out), "--sts_dir", str(sts), "--per_device_train_batch_size", "16",
                       "--max_steps", "1", "--eval_steps", "10", "--use_cpu"]) == 0  # step 0 and the last
    assert module_types(out / "model") == ["Transformer", "Pooling", "Normalize"]
    (step0,) = [r for r in read_log(out) if r["type"] == "eval" and r["step"] == 0]
    assert step0["stsb-dev"] > 80 and "sickr-dev" not in step0  # all-MiniLM-L6-v2 as its users use it


