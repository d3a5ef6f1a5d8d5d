"""train.py and fastcl.training: data formats, views per method, the loop, the export,
interrupt and resume; integration with the packaged MiniLM on the shared wiki data."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub load

import pytest
import torch

from fastcl import checkpoint, objectives, training
from fastcl import data as data_io
from fastcl.trainer import loop as train  # the trainer: main, its log, export, set-up
from fastcl.trainer.logs import read_log
from fastcl.encoders import MLPHead, SentenceEncoder, encode, load_backbone, load_encoder
from fastcl.evaluate import evaluate
from test_evaluate import DATA, make_tiny_model, minilm_path, needs_data, random_sentence, write_sts_dir

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BERT, a tiny RoBERTa and training / STS data over their vocabulary."""
    import random

    root = tmp_path_factory.mktemp("tiny")
    rng = random.Random(5)
    make_tiny_model(root / "bert")
    make_tiny_model(root / "roberta", model_type="roberta")
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
            "--output-dir", str(out), "--batch-size", "4", "--max-steps", str(steps),
            "--max-seq-len", "16", "--lr", "1e-3"]
    for key, value in extra.items():
        flag = "--" + key.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    return args


def step_records(out):
    return [r for r in read_log(Path(out)) if r["type"] == "step"]


# ---------------------------------------------------------------------------------------
# Data

def test_read_sentences_skips_and_counts_blank_lines(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("first line\r\n\r\n   \nsecond\u2028same\rline\n\t\nlast, no newline".encode())
    data = data_io.read_sentences(path)
    assert data.dataset["text"] == ["first line", "second\u2028same\rline", "last, no newline"]
    assert data.skipped == 3 and data.kind == "sentences"


def test_read_csv_with_quoting_and_optional_hard_negatives(tmp_path):
    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\n"a, b","say ""hi""\nthere",c\nd,,f\ng,h,i\n')
    data = data_io.read_csv_triplets(path)
    assert data.kind == "triplets" and data.skipped == 1
    assert data.dataset["sent0"] == ["a, b", "g"]
    assert data.dataset["sent1"] == ['say "hi"\nthere', "h"]
    assert data.dataset["hard_neg"] == ["c", "i"]
    path.write_text("sent0,sent1\nx,y\n")
    assert data_io.read_csv_triplets(path).kind == "pairs"
    path.write_text("premise,hypothesis\nx,y\n")
    with pytest.raises(ValueError, match="--data: .*needs columns sent0,sent1.*lacks sent0, sent1"):
        data_io.read_csv_triplets(path)


def test_read_snli_makes_premise_entailment_contradiction_triplets(tmp_path):
    rows = [("p1 .", "e1", "entailment"), ("p1 .", "n1", "neutral"), ("p1 .", "c1", "contradiction"),
            ("p2", "e2", "entailment"), ("p2", "n2", "neutral"),  # no contradiction: skipped
            ("p3", "c3", "contradiction"), ("p3", "e3", "entailment"), ("p3", "e3b", "entailment")]
    for split, part in (("dev", rows[:5]), ("test", rows[5:])):
        (tmp_path / f"s1.{split}").write_text("".join(f"{p} \n" for p, _, _ in part))
        (tmp_path / f"s2.{split}").write_text("".join(f"{h} \n" for _, h, _ in part))
        (tmp_path / f"labels.{split}").write_text("".join(f"{lab}\n" for _, _, lab in part))
    data = data_io.read_snli(tmp_path)
    assert list(zip(data.dataset["sent0"], data.dataset["sent1"], data.dataset["hard_neg"])) == [
        ("p1 .", "e1", "c1"), ("p3", "e3", "c3")]
    assert data.skipped == 1
    assert len(data_io.read_snli(tmp_path, ["test"])) == 1
    with pytest.raises(ValueError, match="--snli-splits: .*lacks split.*train"):
        data_io.read_snli(tmp_path, ["train"])
    (tmp_path / "labels.dev").write_text("entailment\n")
    with pytest.raises(ValueError, match="s1/s2/labels have 5/5/1 lines"):
        data_io.read_snli(tmp_path, ["dev"])


def test_data_format_must_fit_the_method(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="--data: no such file"):
        data_io.read_training_data(tmp_path / "none.txt", "simcse")
    with pytest.raises(ValueError, match="--data: method dclr trains on a text file.*csv"):
        data_io.read_training_data(tiny / "sup.csv", "dclr")
    with pytest.raises(ValueError, match="--data: simcse-sup needs a csv"):
        data_io.read_training_data(tiny / "train.txt", "simcse-sup")
    with pytest.raises(ValueError, match="--data: method focal trains on a text file.*not a folder"):
        data_io.read_training_data(tiny / "snli", "focal")
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ValueError, match="holds no usable examples"):
        data_io.read_training_data(tmp_path / "blank.txt", "simcse")
    assert len(data_io.read_training_data(tiny / "snli", "simcse-sup")) == 12


# ---------------------------------------------------------------------------------------
# Views

def tiny_encoder(tiny, pooler="cls", family="bert"):
    backbone, tokenizer = load_backbone(tiny / family)
    head = MLPHead(32) if pooler == "cls" else None
    return SentenceEncoder(backbone, pooler, head).train(), tokenizer


SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "the man plays guitar", "red apple"]


def test_duplicated_batch_gives_two_dropout_views(tiny):
    encoder, tokenizer = tiny_encoder(tiny)
    views = training.embed_views(objectives.Objective("simcse"), encoder, tokenizer, SENTENCES, 16)
    assert views["anchors"].shape == views["positives"].shape == (4, 32)
    assert not torch.allclose(views["anchors"], views["positives"])  # different dropout masks
    with training.dropout_rate(encoder, 0.0):
        views = training.embed_views(objectives.Objective("simcse"), encoder, tokenizer, SENTENCES, 16)
    torch.testing.assert_close(views["anchors"], views["positives"])
    assert views["anchors"].requires_grad


def test_escl_sensitive_view_alone_uses_the_high_dropout(tiny):
    encoder, tokenizer = tiny_encoder(tiny)
    seen = []  # (rows, embedding dropout p, attention dropout p) per encoder forward
    emb_dropout = encoder.backbone.embeddings.dropout
    attention = encoder.backbone.encoder.layer[0].attention.self
    emb_dropout.register_forward_pre_hook(lambda m, args: seen.append([args[0].shape[0], m.p]))
    attention.register_forward_pre_hook(lambda m, args: seen[-1].append(m.dropout.p))
    obj = objectives.Objective("escl", sensitive_dropout=0.45)
    opt = torch.optim.SGD(encoder.parameters(), lr=0.0)
    sched = training.linear_schedule(opt, 10)
    out = training.train_step(obj, encoder, tokenizer, SENTENCES, opt, sched, max_length=16)
    assert seen == [[8, 0.1, 0.1], [4, 0.45, 0.45]]
    assert {m.p for m in encoder.modules() if isinstance(m, torch.nn.Dropout)} == {0.1}
    assert torch.isfinite(torch.tensor(out["loss"]))


def test_dclr_complementary_is_frozen_in_eval_mode(tiny):
    encoder, tokenizer = tiny_encoder(tiny)
    comp, comp_tok = load_encoder(tiny / "roberta", "avg")  # another family and pooler is fine
    comp.train()  # the objective must switch it to eval itself
    calls = []
    comp.backbone.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((m.training, torch.is_grad_enabled())), with_kwargs=True)
    before = {k: v.clone() for k, v in comp.state_dict().items()}
    obj = objectives.Objective("dclr", phi=0.5, complementary=comp.requires_grad_(False),
                             complementary_tokenizer=comp_tok, generator=torch.Generator().manual_seed(0))
    views = training.embed_views(obj, encoder, tokenizer, SENTENCES, 16)
    c, c_pos = views["complementary"]
    assert c is c_pos and not c.requires_grad and c.dtype == torch.float32
    assert calls == [(False, False)]
    loss = objectives.objective_loss(obj, views)
    loss.backward()
    assert all(p.grad is None for p in comp.parameters())
    assert all(torch.equal(before[k], v) for k, v in comp.state_dict().items())
    # with phi = 1 the complementary model can drop nothing: the unweighted loss
    obj_none = objectives.Objective("dclr", phi=1.0, complementary=comp, complementary_tokenizer=comp_tok,
                                  generator=torch.Generator().manual_seed(0))
    obj_off = objectives.Objective("dclr", generator=torch.Generator().manual_seed(0))
    views = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in views.items()}
    unweighted = {k: v for k, v in views.items() if k != "complementary"}
    torch.testing.assert_close(objectives.objective_loss(obj_none, views),
                               objectives.objective_loss(obj_off, unweighted))
    obj_half = objectives.Objective("dclr", phi=-1.0, generator=torch.Generator().manual_seed(0))
    assert objectives.objective_loss(obj_half, views) < objectives.objective_loss(obj_off, unweighted)


def test_dclr_complementary_released_mode(tiny):
    """``complementary_mode="released"``, as the authors' code: dropout on, the duplicated
    batch in one forward, c and c⁺ two dropout views; still no gradient, and eval mode after."""
    encoder, tokenizer = tiny_encoder(tiny)
    comp, comp_tok = load_encoder(tiny / "bert", "cls")       # the checkpoint's own pooler
    calls = []
    comp.backbone.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((m.training, torch.is_grad_enabled(),
                                              kwargs["input_ids"].shape[0])), with_kwargs=True)
    obj = objectives.Objective("dclr", phi=0.5, complementary=comp.requires_grad_(False),
                             complementary_tokenizer=comp_tok, complementary_mode="released",
                             generator=torch.Generator().manual_seed(0))
    c, c_pos = training.embed_views(obj, encoder, tokenizer, SENTENCES, 16)["complementary"]
    assert calls == [(True, False, 2 * len(SENTENCES))]
    assert c.shape == c_pos.shape == (len(SENTENCES), comp.backbone.config.hidden_size)
    assert not torch.equal(c, c_pos) and not comp.training


def test_supervised_views_from_triplets_and_pairs(tiny):
    encoder, tokenizer = tiny_encoder(tiny)
    obj = objectives.Objective("simcse-sup")
    triplets = [("the cat", "a cat", "the dog"), ("red apple", "an apple", "blue house")]
    views = training.embed_views(obj, encoder, tokenizer, triplets, 16)
    assert set(views) == {"anchors", "positives", "negatives"}
    assert views["negatives"].shape == (2, 32)
    views = training.embed_views(obj, encoder, tokenizer, [t[:2] for t in triplets], 16)
    assert set(views) == {"anchors", "positives"}
    with pytest.raises(ValueError, match="simcse-sup takes"):
        training.embed_views(obj, encoder, tokenizer, SENTENCES, 16)


def test_dclr_defaults_follow_the_model_family(tiny):
    parser = train.build_parser()
    for family, phi, ratio in (("bert", 0.9, 1.0), ("roberta", 0.85, 2.5)):
        args = train.resolve_args(parser, parser.parse_args(
            ["--method", "dclr", "--model", "m", "--data", "d", "--output-dir", "o"]))
        backbone, _ = load_backbone(tiny / family)
        obj = train.make_objective(args, backbone, torch.device("cpu"))
        assert (obj.phi, obj.noise_ratio, obj.noise_steps, obj.temperature) == (phi, ratio, 4, 0.05)
    args = train.resolve_args(parser, parser.parse_args(
        ["--method", "dclr", "--model", "m", "--data", "d", "--output-dir", "o", "--phi", "0.7"]))
    assert train.make_objective(args, backbone, torch.device("cpu")).phi == 0.7
    assert (args.batch_size, args.lr, args.select, args.mlp_only_train) == (128, 3e-5, "avg", True)


# ---------------------------------------------------------------------------------------
# End to end

@pytest.mark.parametrize("method,family", [("simcse", "bert"), ("simcse-sup", "bert"), ("dclr", "bert"),
                                           ("focal", "roberta"), ("escl", "bert")])
def test_each_method_trains_and_exports(tiny, tmp_path, method, family):
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel

    out = tmp_path / "out"
    args = base_args(tiny, out, method, steps=4, sts_dir=tiny / "sts", eval_steps=2)
    args[args.index("--model") + 1] = str(tiny / family)
    if method == "dclr":
        args += ["--complementary", str(tiny / "bert")]
    assert train.main(args) == 0
    steps = step_records(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in steps)
    assert steps[0]["lr"] == 1e-3 and steps[-1]["lr"] == pytest.approx(2.5e-4)  # linear decay
    evals = [r for r in read_log(out) if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert {"stsb-dev", "alignment", "uniformity", "metric"} <= set(evals[0])
    assert ("sickr-dev" in evals[0]) == (method == "dclr")  # DCLR selects on the mean of both
    for name in ("dev_curve.png", "align_uniform.png", "config.json", "model.safetensors",
                 "modules.json", "1_Pooling/config.json", "train_results.json"):
        assert (out / name).is_file(), name
    assert not (out / "checkpoint.pt").exists()  # a finished run removes it
    pooler = "cls" if method == "simcse-sup" else "cls_before_pooler"
    assert (out / "2_Dense").is_dir() == (pooler == "cls")
    assert json.loads((out / "train_results.json").read_text())["eval_pooler"] == pooler
    AutoModel.from_pretrained(out)
    encoder, tok = load_encoder(out, pooler)
    ours = encode(encoder, tok, SENTENCES)
    theirs = torch.as_tensor(st.SentenceTransformer(str(out), device="cpu").encode(SENTENCES))
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_supervised_on_snli_folder(tiny, tmp_path):
    out = tmp_path / "out"
    args = base_args(tiny, out, "simcse-sup", steps=3)
    args[args.index("--data") + 1] = str(tiny / "snli")
    assert train.main(args + ["--hard-negative-weight", "0.5"]) == 0
    assert len(step_records(out)) == 3


def test_the_best_model_is_kept(tiny, tmp_path):
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, "simcse", steps=6, sts_dir=tiny / "sts", eval_steps=1,
                                pooler="avg")) == 0
    evals = [r for r in read_log(out) if r["type"] == "eval"]
    best = max(evals, key=lambda r: r["metric"])
    assert len({round(r["metric"], 6) for r in evals}) > 1, "scores should move at lr 1e-3"
    summary = json.loads((out / "train_results.json").read_text())
    assert summary["best_step"] == best["step"] and summary["best_metric"] == best["metric"]
    encoder, tok = load_encoder(out, "avg")
    again = evaluate(encoder, tok, None, tiny / "sts", ["stsb-dev"])["scores"]["stsb-dev"]
    assert again == pytest.approx(best["stsb-dev"], abs=1e-6)


def test_without_sts_dir_the_last_model_is_saved(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, "focal", steps=3, keep_checkpoint=True)) == 0
    printed = capsys.readouterr().out
    assert printed.count("no --sts-dir: no dev evaluation") == 1
    assert not [r for r in read_log(out) if r["type"] == "eval"]
    last = checkpoint.read_checkpoint(out / "checkpoint.pt")["model"]
    saved, _ = load_backbone(out)
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, last[f"backbone.{name}"], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# Interrupt and resume

def interrupt_at(monkeypatch, step, action):
    """Run ``action`` right after optimizer step ``step`` of the next training run."""
    real = training.train_step
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        out = real(*args, **kwargs)
        count["n"] += 1
        if count["n"] == step:
            action()
        return out
    monkeypatch.setattr(training, "train_step", wrapped)


def assert_same_run(reference, resumed):
    ref, res = step_records(reference), step_records(resumed)
    assert [r["step"] for r in res] == [r["step"] for r in ref]
    for a, b in zip(ref, res):  # exact: fp32 on CPU with the same seeds and states
        assert (a["loss"], a["grad_norm"], a["lr"]) == (b["loss"], b["grad_norm"], b["lr"]), a["step"]
    evals = lambda out: [(r["step"], r["stsb-dev"]) for r in read_log(out) if r["type"] == "eval"]
    assert evals(reference) == evals(resumed)
    a = checkpoint.read_checkpoint(reference / "checkpoint.pt")["model"]
    b = checkpoint.read_checkpoint(resumed / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_sigterm_gives_the_same_losses(tiny, tmp_path, monkeypatch):
    extra = dict(sts_dir=tiny / "sts", eval_steps=3, select="stsb", complementary=tiny / "bert",
                 noise_steps=2, keep_checkpoint=True)  # assert_same_run reads the checkpoints
    ref, cut = tmp_path / "reference", tmp_path / "interrupted"
    handler = signal.getsignal(signal.SIGTERM)
    assert train.main(base_args(tiny, ref, "dclr", steps=8, **extra)) == 0
    with monkeypatch.context() as m:
        interrupt_at(m, 5, lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert train.main(base_args(tiny, cut, "dclr", steps=8, **extra)) == 128 + signal.SIGTERM
    assert [r["step"] for r in step_records(cut)] == [1, 2, 3, 4, 5]
    assert checkpoint.read_checkpoint(cut / "checkpoint.pt")["state"]["step"] == 5
    assert signal.getsignal(signal.SIGTERM) is handler  # handlers restored
    assert train.main(base_args(tiny, cut, "dclr", steps=8, resume=True, **extra)) == 0
    assert_same_run(ref, cut)


def test_resume_from_a_periodic_checkpoint_after_a_crash(tiny, tmp_path, monkeypatch):
    # 64 sentences in batches of 4: 16 steps an epoch, so the run crosses into a second epoch
    args = lambda out, **more: base_args(tiny, out, "escl", steps=20, checkpoint_steps=7,
                                         eval_steps=10, sts_dir=tiny / "sts", keep_checkpoint=True,
                                         **more)
    ref, cut = tmp_path / "reference", tmp_path / "crashed"
    assert train.main(args(ref)) == 0

    def crash():
        raise RuntimeError("power cut")
    with monkeypatch.context() as m:
        interrupt_at(m, 17, crash)
        with pytest.raises(RuntimeError, match="power cut"):
            train.main(args(cut))
    assert checkpoint.read_checkpoint(cut / "checkpoint.pt")["state"]["step"] == 14
    assert train.main(args(cut, resume=True)) == 0
    assert [r["step"] for r in step_records(cut)] == list(range(1, 21))
    assert step_records(cut)[-1]["epoch"] == 1
    assert_same_run(ref, cut)


def test_resume_checks_its_inputs(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--resume: no checkpoint at"):
        train.main(base_args(tiny, out, resume=True))
    assert train.main(base_args(tiny, out, steps=2, keep_checkpoint=True)) == 0
    with pytest.raises(SystemExit):
        train.main(base_args(tiny, out, steps=2))
    assert "holds a checkpoint: pass --resume" in capsys.readouterr().err
    args = base_args(tiny, out, steps=2, resume=True)
    args[args.index("--lr") + 1] = "5e-4"
    with pytest.raises(SystemExit, match=r"--resume needs the options.*--lr 0.0005 \(checkpoint: 0.001\)"):
        train.main(args)


def test_sigterm_to_a_training_process_writes_a_checkpoint(tiny, tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *base_args(tiny, out, steps=100000)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if (out / train.LOG).is_file() and len(step_records(out)) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "continue with --resume" in output
    ckpt = checkpoint.read_checkpoint(out / "checkpoint.pt")
    assert ckpt["state"]["step"] == step_records(out)[-1]["step"] >= 3
    assert not [p for p in out.iterdir() if ".tmp" in p.name]


# ---------------------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("change,message", [
    ({"batch_size": 1}, "--batch-size must be >= 2"),
    ({"lr": -1}, "--lr must be > 0"),
    ({"max_steps": 0}, "--max-steps must be >= 1"),
    ({"temperature": 0}, "--temperature must be > 0"),
    ({"phi": 0.9}, "--phi applies to --method dclr only"),
    ({"rd_weight": 1.0}, "--rd-weight applies to --method escl only"),
    ({"pooler": "avg", "mlp_only_train": True}, "apply to --pooler cls only"),
    ({"sts_dir": "/nonexistent/sts"}, "--sts-dir: no such folder"),
])
def test_bad_options_name_the_option(tiny, tmp_path, capsys, change, message):
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", **change))
    assert err.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("change,message", [
    ({"complementary_mode": "released"}, "--complementary-mode released needs --complementary"),
    ({"complementary_pooler": "avg"}, "--complementary-pooler needs --complementary"),
])
def test_complementary_options_need_a_complementary_model(tiny, tmp_path, capsys, change, message):
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, tmp_path / "o", "dclr", **change))
    assert err.value.code == 2
    assert message in capsys.readouterr().err


def test_hard_negative_weight_needs_a_hard_negative_column(tiny, tmp_path):
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\n" + "".join(f"a{i} b,c{i} d\n" for i in range(8)))
    args = base_args(tiny, tmp_path / "o", "simcse-sup", hard_negative_weight=0.5)
    args[args.index("--data") + 1] = str(pairs)
    with pytest.raises(SystemExit, match="--hard-negative-weight 0.5 weighs each anchor's hard "
                                         "negative, but --data .* has pairs"):
        train.main(args)

@pytest.mark.parametrize("flag,value,message", [
    ("--data", "missing.txt", "--data: no such file or folder"),
    ("--model", "no-such-org/no-such-model", "--model: cannot load 'no-such-org/no-such-model'.*local path"),
    ("--model", "./no/such/folder", "--model: no such model folder"),
    ("--batch-size", "1000", "fewer than --batch-size 1000"),
    ("--snli-splits", "dev", "--snli-splits applies to a SentEval SNLI folder"),
])
def test_bad_inputs_name_the_option(tiny, tmp_path, monkeypatch, flag, value, message):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # fail at once, no network retries
    args = base_args(tiny, tmp_path / "o")
    if flag not in args:
        args += [flag, "x"]
    args[args.index(flag) + 1] = str(tmp_path / value) if value == "missing.txt" else value
    with pytest.raises(SystemExit, match=message):
        train.main(args)


def test_dclr_select_avg_needs_sick_dev(tiny, tmp_path):
    write_sts_dir(tmp_path / "sts", tasks=("stsb",))
    with pytest.raises(SystemExit, match="sickr-dev: none of"):
        train.main(base_args(tiny, tmp_path / "o", "dclr", sts_dir=tmp_path / "sts"))


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    text = capsys.readouterr().out
    for action in train.build_parser()._actions:
        for flag in action.option_strings:
            assert flag in text
        assert action.help, action.option_strings


# ---------------------------------------------------------------------------------------
# Integration: a few steps of every method on the packaged MiniLM and the shared wiki data

@needs_data
@pytest.mark.parametrize("method", ["simcse", "simcse-sup", "dclr", "focal", "escl"])
def test_minilm_few_steps_then_stsb_dev(method, tmp_path):
    model = minilm_path()
    wiki = DATA / "wiki" / "wiki1m_for_simcse.random10k.txt"
    snli = DATA / "nli" / "snli_senteval"
    if not wiki.is_file() or (method == "simcse-sup" and not (snli / "s1.dev").is_file()):
        pytest.skip(f"shared training data not found under {DATA}")
    # The first 300 STS-B dev pairs (and 150 SICK trial pairs) keep this test short; the
    # evaluator's tests score the full dev set.
    sts = tmp_path / "sts"
    (sts / "stsb").mkdir(parents=True)
    (sts / "sick").mkdir()
    lines = (DATA / "stsb" / "sts-dev.csv").read_text(encoding="utf-8").split("\n")
    (sts / "stsb" / "sts-dev.csv").write_text("\n".join(lines[:300]) + "\n", encoding="utf-8")
    lines = (DATA / "sick" / "SICK_trial.txt").read_text(encoding="utf-8").split("\n")
    (sts / "sick" / "SICK_trial.txt").write_text("\n".join(lines[:151]) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    args = ["--method", method, "--model", model, "--data", str(snli if method == "simcse-sup" else wiki),
            "--output-dir", str(out), "--max-steps", "2", "--batch-size", "8", "--max-seq-len", "32",
            "--sts-dir", str(sts), "--eval-steps", "2", "--eval-batch-size", "128"]
    if method == "simcse-sup":
        args += ["--snli-splits", "dev"]
    if method == "dclr":
        args += ["--complementary", model]
    assert train.main(args) == 0
    steps = step_records(out)
    assert len(steps) == 2 and all(0 < r["loss"] < 50 for r in steps)
    (result,) = [r for r in read_log(out) if r["type"] == "eval"]
    # all-MiniLM-L6-v2's CLS scores about 80 on STS-B dev; two small steps keep it there
    assert 70 < result["stsb-dev"] < 95
    assert result["alignment"] > 0 and result["uniformity"] < 0


# ---------------------------------------------------------------------------------------
# Errors inside the loop, bad data found at start, results that must stay valid

def loop_args(tiny, out, **more):
    return base_args(tiny, out, "simcse", steps=6, sts_dir=tiny / "sts", eval_steps=2,
                     checkpoint_steps=100, pooler="avg", keep_checkpoint=True, **more)


@pytest.fixture(scope="module")
def loop_reference(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("loop") / "reference"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that compare with it
    try:
        assert train.main(loop_args(tiny, out)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def fail_on_call(monkeypatch, owner, name, n, error):
    """Make ``owner.name`` raise ``error`` on its ``n``-th call."""
    real = getattr(owner, name)
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        count["n"] += 1
        if count["n"] == n:
            raise error
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapped)


@pytest.mark.parametrize("where,n", [("dev_evaluation", 2), ("export", 1)])
def test_disk_full_in_evaluation_writes_an_emergency_checkpoint(tiny, tmp_path, monkeypatch,
                                                                 loop_reference, capsys, where, n):
    import errno
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        fail_on_call(m, train, where, n, OSError(errno.ENOSPC, "No space left on device"))
        with pytest.raises(SystemExit, match="No space left on device"):
            train.main(loop_args(tiny, out))
    step = 2 * n  # evaluations at steps 2, 4, 6; the first one exports
    assert checkpoint.read_checkpoint(out / "checkpoint.pt")["state"]["step"] == step
    assert f"emergency checkpoint written to {out / 'checkpoint.pt'} at step {step}" in capsys.readouterr().err
    assert train.main(loop_args(tiny, out, resume=True)) == 0
    assert_same_run(loop_reference, out)
    assert read_records(out, "eval") == read_records(loop_reference, "eval")


def read_records(out, kind):
    return [{k: v for k, v in r.items() if k != "examples_per_s"}
            for r in read_log(out) if r["type"] == kind]


def test_an_error_before_the_update_checkpoints_the_start_of_the_step(tiny, tmp_path, monkeypatch,
                                                                      loop_reference):
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        fail_on_call(m, training, "objective_loss", 5, RuntimeError("out of memory"))
        with pytest.raises(RuntimeError, match="out of memory"):
            train.main(loop_args(tiny, out))
    # step 5 had drawn its batch and dropout masks, not changed the model: it is redone
    assert checkpoint.read_checkpoint(out / "checkpoint.pt")["state"]["step"] == 4
    assert train.main(loop_args(tiny, out, resume=True)) == 0
    assert_same_run(loop_reference, out)


def test_an_error_writing_a_step_record_keeps_it_for_the_resume(tiny, tmp_path, monkeypatch,
                                                                loop_reference):
    out = tmp_path / "out"
    real = train.append_log

    def append(path, record, rank=0):
        if record["type"] == "step" and record["step"] == 3:
            raise OSError(28, "No space left on device")
        real(path, record, rank)
    with monkeypatch.context() as m:
        m.setattr(train, "append_log", append)
        with pytest.raises(SystemExit):
            train.main(loop_args(tiny, out))
    assert checkpoint.read_checkpoint(out / "checkpoint.pt")["state"]["step"] == 3
    assert [r["step"] for r in step_records(out)] == [1, 2]
    assert train.main(loop_args(tiny, out, resume=True)) == 0
    assert_same_run(loop_reference, out)


def test_a_malformed_dev_file_is_an_error_before_step_1(tiny, tmp_path):
    sts = write_sts_dir(tmp_path / "sts")
    bad = sts / "stsb" / "sts-dev.csv"
    bad.write_text(bad.read_text() + "main-news\tf\t2012\t99\tnot-a-score\ta b\tc d\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit, match=f"fastcl-train: error: {bad}:41: score 'not-a-score' is not a number"):
        train.main(base_args(tiny, out, sts_dir=sts))
    assert not step_records(out) and not (out / "checkpoint.pt").exists()


def test_a_nan_dev_metric_is_never_the_best(tiny, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = train.dev_evaluation
    calls = {"n": 0}

    def first_is_nan(run):
        calls["n"] += 1
        res = real(run)
        return {**res, "stsb-dev": float("nan"), "metric": float("nan")} if calls["n"] == 1 else res
    monkeypatch.setattr(train, "dev_evaluation", first_is_nan)
    assert train.main(base_args(tiny, out, steps=4, sts_dir=tiny / "sts", eval_steps=2, pooler="avg")) == 0

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    records = [strict(line) for line in (out / train.LOG).read_text().splitlines()]
    evals = [r for r in records if r["type"] == "eval"]
    assert [(r["step"], r["metric"], r["best"]) for r in evals][0] == (2, None, False)
    assert evals[1]["best"] and evals[1]["metric"] is not None
    summary = strict((out / "train_results.json").read_text())
    assert summary["best_step"] == 4  # the step after the NaN could still be exported
    encoder, tok = load_encoder(out, "avg")
    assert evaluate(encoder, tok, None, tiny / "sts", ["stsb-dev"])["scores"]["stsb-dev"] == \
        pytest.approx(evals[1]["stsb-dev"], abs=1e-6)



def test_no_finite_dev_score_exports_nothing_and_fails(tiny, tmp_path, monkeypatch, capsys):
    """Every dev score NaN: no model to export. The run says so and exits 1; the model an
    earlier run left in the folder (--overwrite-output-dir) is not passed off as this one."""
    out = tmp_path / "out"
    args = base_args(tiny, out, steps=2, sts_dir=tiny / "sts", eval_steps=1, pooler="avg")
    assert train.main(args) == 0 and (out / "config.json").exists()
    real = train.dev_evaluation
    monkeypatch.setattr(train, "dev_evaluation",
                        lambda run: {**real(run), "stsb-dev": float("nan"), "metric": float("nan")})
    assert train.main(args + ["--overwrite-output-dir"]) == 1
    captured = capsys.readouterr()
    assert "removed the model an earlier run exported" in captured.out
    assert "no dev evaluation gave a finite score" in captured.err and "no model exported" in captured.err
    assert not (out / "config.json").exists() and not (out / "train_results.json").exists()
    assert (out / "checkpoint.pt").exists()

def test_resume_with_another_sts_dir_is_refused(tiny, tmp_path):
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, steps=2, sts_dir=tiny / "sts", keep_checkpoint=True)) == 0
    other = write_sts_dir(tmp_path / "other", seed=1)
    with pytest.raises(SystemExit, match="--resume needs the options.*--sts-dir"):
        train.main(base_args(tiny, out, steps=2, sts_dir=other, resume=True))


def test_a_csv_with_an_unbalanced_quote_is_an_error(tmp_path):
    path = tmp_path / "nli.csv"
    path.write_text('sent0,sent1,hard_neg\na,"b, he said,c\nd,e,f\ng,h,i\n')
    with pytest.raises(ValueError, match=f"--data: {path}:2: malformed csv.*unbalanced quote"):
        data_io.read_csv_triplets(path)
    path.write_text('sent0,sent1,hard_neg\na,"b, c\nd,e",f,g\nh,i,j\n')
    with pytest.raises(ValueError, match=f"--data: {path}:2-3: the row has more fields"):
        data_io.read_csv_triplets(path)


def test_non_utf8_data_names_the_file(tmp_path):
    for name, text in (("t.txt", b"one\ntwo \xe9t\xe9\n"), ("n.csv", b"sent0,sent1\nx,caf\xe9\n")):
        (tmp_path / name).write_bytes(text)
        method = "simcse-sup" if name.endswith(".csv") else "simcse"
        with pytest.raises(ValueError, match=f"--data: {tmp_path / name} is not UTF-8 text"):
            data_io.read_training_data(tmp_path / name, method)
