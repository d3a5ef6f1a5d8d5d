"""What a training run leaves besides the model: the trackers of --report-to (TensorBoard
event files, W&B), the loss curve, the model card and sentence-transformers' config in the
export, and the checkpoint removed once the run has finished."""

import ast
import json
import os
import re
import signal
import sys
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from fastcl import citations
from fastcl.encoders import ModelCard, encode, load_backbone, load_encoder, save_sentence_encoder
from fastcl.trainer import logs, report
from fastcl.trainer.logs import read_log
from test_train import base_args, interrupt_at, step_records, tiny, train  # noqa: F401 (tiny: fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SCALARS = {"train/loss", "train/grad_norm", "train/lr", "train/examples_per_s", "train/epoch",
           "eval/stsb-dev", "eval/alignment", "eval/uniformity", "eval/metric"}


def tensorboard_scalars(out):
    """{tag: [(step, value), ...]} as TensorBoard reads OUT/runs (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / report.TENSORBOARD_DIR), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory):
    """A finished 2-step focal run with dev evaluations, reported to TensorBoard."""
    out = tmp_path_factory.mktemp("finished") / "out"
    out.mkdir()
    (out / ".loss_curve.tmp.png").write_bytes(b"a plot cut short")
    args = base_args(tiny, out, "focal", steps=2, sts_dir=tiny / "sts", eval_steps=1, m=0.25,
                     report_to="tensorboard")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    return out, args


def test_tensorboard_event_files_mirror_the_log(finished):
    out, _ = finished
    assert list((out / "runs").glob("events.out.tfevents.*"))
    scalars = tensorboard_scalars(out)
    assert SCALARS <= set(scalars)
    log = read_log(out)
    for record in log:
        if record["type"] == "step":
            for key in ("loss", "grad_norm", "lr"):
                assert (record["step"], pytest.approx(record[key], rel=1e-6)) in scalars[f"train/{key}"]
    evals = [r for r in log if r["type"] == "eval"]
    assert [s for s, _ in scalars["eval/stsb-dev"]] == [r["step"] for r in evals] == [1, 2]
    assert [v for _, v in scalars["eval/stsb-dev"]] == pytest.approx([r["stsb-dev"] for r in evals])
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]


def test_loss_curve_and_checkpoint_of_a_finished_run(finished, capsys):
    out, args = finished
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / ".loss_curve.tmp.png").exists()  # a stale temporary is removed at start
    assert not (out / train.CHECKPOINT).exists()
    with pytest.raises(SystemExit, match="has finished and its checkpoint was removed"):
        train.main(args + ["--resume"])


def test_the_model_card(finished):
    out, _ = finished
    card = (out / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    assert "library_name: sentence-transformers" in front
    assert "- fastcl\n" in front and "- focal\n" in front and "- sentence-similarity\n" in front
    assert "base_model" not in front  # a local folder is not a hub name
    log = read_log(out)
    best = [r for r in log if r["type"] == "eval" and r["best"]][-1]
    results = json.loads((out / "train_results.json").read_text())
    assert best["step"] == results["best_step"]
    start = log[0]
    for fact in (f"**Base model:** `{start['args']['model']}`", "**Method:** `focal`",
                 f"**Data:** `{start['args']['data']}`, 64 examples",
                 f"the model of step {best['step']} of 2", "| `m` | 0.25 |", "| `temperature` | 0.05 |",
                 "| `batch_size` | 4 |", "| `lr` | 0.001 |", "| `export_pooler` | cls_before_pooler |",
                 f"| stsb-dev | {best['stsb-dev']:g} |", f"alignment: {best['alignment']:g}",
                 f"python -m fastcl.evaluate {out} --sts-dir DIR",
                 f'SentenceTransformer("{out}")', f'load_encoder("{out}", "cls_before_pooler")',
                 citations.FOCAL.strip(), "Focal-InfoNCE"):
        assert fact in body, fact
    assert "gao2021simcse" not in body  # focal cites its own paper


def test_sentence_transformers_loads_the_export_with_its_config(finished):
    st = pytest.importorskip("sentence_transformers")
    out, _ = finished
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    assert config["similarity_fn_name"] == "cosine" and config["prompts"] == {}
    assert config["default_prompt_name"] is None and config["__version__"]["pytorch"] == torch.__version__
    model = st.SentenceTransformer(str(out), device="cpu")
    assert model.similarity_fn_name == "cosine"
    sentences = ["the cat sat", "a dog ran far"]
    encoder, tok = load_encoder(out, "cls_before_pooler")
    torch.testing.assert_close(torch.as_tensor(model.encode(sentences)), encode(encoder, tok, sentences),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooler", ["cls", "cls-without-model-pooler", "cls_before_pooler", "avg",
                                    "avg_first_last", "avg_top2"])
def test_the_cards_transformers_snippet_gives_the_embeddings(tiny, tmp_path, pooler, capsys):
    from transformers import BertModel

    from fastcl.encoders import MLPHead

    backbone, tok = load_backbone(tiny / "bert")
    if pooler == "cls-without-model-pooler":
        pooler, backbone = "cls", BertModel.from_pretrained(tiny / "bert", add_pooling_layer=False)
    head = MLPHead(32, 0.5) if pooler == "cls" else None
    out = tmp_path / "out"
    save_sentence_encoder(out, backbone, tok, pooler, head, card=ModelCard(method="simcse"))
    card = (out / "README.md").read_text()
    code = re.search(r"### Transformers\n\n```python\n(.*?)```", card, re.S).group(1)
    scope = {}
    exec(code, scope)
    sentences = ast.literal_eval(re.search(r"tokenizer\((\[.*?\])", code).group(1))
    encoder, tok = load_encoder(out, pooler)
    torch.testing.assert_close(scope["embeddings"], encode(encoder, tok, sentences), atol=1e-5, rtol=1e-5)
    assert citations.SIMCSE.strip() in card and "base_model" not in card


def test_a_hub_base_model_is_named_in_the_front_matter():
    card = ModelCard(base_model="bert-base-uncased", method="dclr", citations=(citations.GRADCACHE,))
    text = card.render("out", "avg", 768, 512)
    front = text.split("---\n")[1]
    assert 'base_model: "bert-base-uncased"' in front and "- dclr\n" in front
    assert citations.DCLR.strip() in text and citations.GRADCACHE.strip() in text
    assert "No dev evaluation was run" in text


def test_resume_replays_the_log_into_tensorboard(tiny, tmp_path, monkeypatch):
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "out"
    args = lambda **more: base_args(tiny, out, "simcse", steps=4, report_to="tensorboard", **more)
    with monkeypatch.context() as m:
        interrupt_at(m, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
        assert train.main(args()) == 128 + signal.SIGTERM
    assert (out / train.CHECKPOINT).is_file()  # a stopped run keeps it
    assert [s for s, _ in tensorboard_scalars(out)["train/loss"]] == [1, 2]
    stray = SummaryWriter(str(out / "runs"))  # events of steps the interrupted run did not checkpoint
    stray.add_scalar("train/loss", 123.0, 3)
    stray.close()
    time.sleep(1.0 - time.time() % 1.0)  # event files are ordered by their second of creation
    assert train.main(args(resume=True)) == 0
    losses = {r["step"]: r["loss"] for r in step_records(out)}
    assert tensorboard_scalars(out)["train/loss"] == [(s, pytest.approx(losses[s], rel=1e-6))
                                                      for s in (1, 2, 3, 4)]


class FakeWandB(types.ModuleType):
    """The part of the wandb package the trainer uses, recording the calls."""

    def __init__(self):
        super().__init__("wandb")
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, values, step):
        self.calls.append(("log", step, values))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


def test_wandb_receives_every_record(tiny, tmp_path, monkeypatch):
    fake = FakeWandB()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, "simcse", steps=2, report_to="wandb", keep_checkpoint=True)) == 0
    (init, kwargs), *logged, last = fake.calls
    assert init == "init" and kwargs["project"] == "fastcl" and kwargs["dir"] == str(out)
    assert kwargs["config"]["method"] == "simcse" and kwargs["config"]["report_to"] == ["wandb"]
    assert last == ("finish", 0)
    records = step_records(out)
    assert [(step, values["train/loss"]) for _, step, values in logged] == [(r["step"], r["loss"]) for r in records]
    assert set(logged[0][2]) == {"train/loss", "train/grad_norm", "train/lr", "train/examples_per_s", "train/epoch"}
    # without --sts-dir: the loss curve only; --keep-checkpoint keeps the checkpoint
    assert (out / "loss_curve.png").is_file() and not (out / "dev_curve.png").exists()
    assert (out / train.CHECKPOINT).is_file()


def test_wandb_missing_is_a_clear_error_before_step_1(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, out, "simcse", steps=2, report_to="wandb"))
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "--report-to wandb needs the wandb package" in message and "pip install wandb" in message
    assert not (out / train.LOG).exists()
    with pytest.raises(SystemExit):
        train.main(base_args(tiny, out, "simcse", steps=2) + ["--report-to", "none", "tensorboard"])
    assert "--report-to none cannot be combined" in capsys.readouterr().err


def test_moving_average_skips_missing_losses():
    assert logs.moving_average([1.0, 2.0, 3.0, None, 5.0, 6.0], 3) == [1.0, 1.5, 2.0, 2.5, 4.0, 5.5]
    assert report.scalars({"type": "eval", "step": 3, "stsb-dev": 50.0, "best": True, "metric": None}) == \
        {"eval/stsb-dev": 50.0}


def test_a_finished_run_is_not_overwritten_by_accident(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert train.main(base_args(tiny, out, steps=2)) == 0
    before = (out / "train_results.json").read_text()
    with pytest.raises(SystemExit) as err:
        train.main(base_args(tiny, out, steps=2))
    assert err.value.code == 2 and "holds a finished run" in capsys.readouterr().err
    assert (out / "train_results.json").read_text() == before
    assert train.main(base_args(tiny, out, steps=3, overwrite_output_dir=True)) == 0
    assert [r["step"] for r in step_records(out)] == [1, 2, 3]
    assert json.loads((out / "train_results.json").read_text())["steps"] == 3
