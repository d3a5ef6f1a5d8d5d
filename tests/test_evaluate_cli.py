"""python -m fastcl.evaluate as a command (progress, the pooler of a sentence-transformers
folder, exit status) and SentEvalSTSEvaluator, the same scores inside SentenceTransformerTrainer."""

import csv
import json
import math
import random
import runpy
import sys
from pathlib import Path

import pytest
import torch

from conftest import needs_st6
from fastcl import evaluate as ev
from fastcl.encoders import encode, load_backbone, load_encoder
from test_evaluate import (DATA, export, make_tiny_model, minilm_path, needs_data, random_sentence,
                           write_sts_dir)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def sts(tmp_path_factory):
    """Synthetic STS-B and SICK files (40 pairs a split) over the tiny model's words."""
    return write_sts_dir(tmp_path_factory.mktemp("sts"))


@pytest.fixture(scope="module")
def tiny_st_export(tiny, tmp_path_factory):
    """The tiny model saved as the trainer saves it with pooler avg."""
    return export(tiny, tmp_path_factory.mktemp("export") / "avg", "avg")


def st_folder(folder, pooling: dict, after=(), before=(), lower_case=False):
    """The tiny model as a sentence-transformers folder with this Pooling config, written
    by hand (so both config formats are covered whatever sentence-transformers is installed)."""
    folder = make_tiny_model(folder)
    kinds = [("", "Transformer"), *before, ("1_Pooling", "Pooling"), *after]
    modules = [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
               for i, (path, kind) in enumerate(kinds)]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **pooling}))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": lower_case}))
    for path, kind in after:
        if kind == "Normalize":
            (folder / path).mkdir()
    return folder


# ---------------------------------------------------------------------------------------
# Progress

def test_a_progress_bar_per_task_on_stderr_and_quiet(tiny, sts, capsys):
    args = [str(tiny), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb-dev", "sickr-dev",
            "--batch-size", "16"]
    loud = ev.main(args)
    err = capsys.readouterr().err
    for task in ("stsb-dev", "sickr-dev"):  # 40 pairs a task: 80 sentences
        assert f"{task}: 100%" in err and "80/80" in err
    quiet = ev.main(args + ["--quiet"])
    captured = capsys.readouterr()
    assert captured.err == "" and "stsb-dev" in captured.out
    assert quiet["scores"] == loud["scores"]


def test_evaluate_is_quiet_unless_asked_and_progress_changes_no_embedding(tiny, sts, capsys):
    encoder, tokenizer = load_encoder(tiny, "avg_top2")
    capsys.readouterr()
    kwargs = dict(batch_size=7, metrics=True)
    quiet = ev.evaluate(encoder, tokenizer, None, sts, ["stsb", "sickr-dev"], **kwargs)
    assert capsys.readouterr().err == ""  # the trainer's dev evaluation calls it like this
    loud = ev.evaluate(encoder, tokenizer, None, sts, ["stsb", "sickr-dev"], progress=True, **kwargs)
    assert "stsb: 100%" in capsys.readouterr().err
    # one batch at a time for the bar: the same batches, so exactly the same numbers
    assert loud["scores"] == quiet["scores"] and loud["metrics"] == quiet["metrics"]


def test_the_bar_advances_batch_by_batch(tiny):
    encoder, tokenizer = load_encoder(tiny, "avg")
    rng = random.Random(1)
    sentences = [random_sentence(rng) for _ in range(37)]
    updates = []
    got = encode(encoder, tokenizer, sentences, batch_size=8, on_batch=updates.append)
    assert updates == [8, 8, 8, 8, 5]
    # the callback changes nothing: bit for bit the embeddings of a plain call
    assert torch.equal(got, encode(encoder, tokenizer, sentences, batch_size=8))


# ---------------------------------------------------------------------------------------
# The pooler of a sentence-transformers folder

@pytest.mark.parametrize("pooling, pooler", [
    ({"pooling_mode": "cls"}, "cls_before_pooler"),              # sentence-transformers >= 6
    pytest.param({"pooling_mode": ["mean"]}, "avg", marks=needs_st6),  # a list: version 6's form
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls_before_pooler"),
    ({"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}, "avg"),
    ({}, "avg"),                                                 # sentence-transformers' default
])
def test_pooling_config_maps_to_the_pooler_with_the_same_embeddings(tmp_path, pooling, pooler):
    st = pytest.importorskip("sentence_transformers")
    folder = st_folder(tmp_path / "st", pooling, after=[("2_Normalize", "Normalize")])
    assert ev.sentence_transformers_pooler(folder) == (pooler, folder / "1_Pooling" / "config.json")
    sentences = ["the cat sat on the mat", "a dog", "big red house under the tree", "man plays piano"]
    theirs = torch.as_tensor(st.SentenceTransformer(str(folder), device="cpu").encode(sentences))
    ours = torch.nn.functional.normalize(encode(*load_encoder(folder, pooler), sentences), dim=1)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


def test_cli_reads_a_sentence_transformers_pooling_config(tmp_path, sts, capsys):
    folder = st_folder(tmp_path / "st", {"pooling_mode_cls_token": True})
    result = ev.main([str(folder), "--sts-dir", str(sts), "--tasks", "stsb"])
    source = folder / "1_Pooling" / "config.json"
    assert f"pooler cls_before_pooler (from {source})" in capsys.readouterr().err
    encoder, tokenizer = load_encoder(folder, "cls_before_pooler")
    assert result["scores"] == ev.evaluate(encoder, tokenizer, None, sts, ["stsb"])["scores"]


def _set_json(path: Path, **changes):
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _changed_export(tmp_path, change: str) -> Path:
    """A model folder the trainer saved (a 3-layer model), then changed by hand."""
    from safetensors.torch import save_file

    src = make_tiny_model(tmp_path / "src", layers=3)
    if change in ("activation", "mean pooling"):
        out = export(src, tmp_path / "cls", "cls")
        if change == "activation":
            _set_json(out / "2_Dense" / "config.json",
                      activation_function="torch.nn.modules.linear.Identity")
        else:
            _set_json(out / "1_Pooling" / "config.json", pooling_mode="mean")
        return out
    out = export(src, tmp_path / "layers", "avg_first_last")
    layers = out / "1_WeightedLayerPooling"
    weights = {"weights": [1.0, 0.0, 2.0], "layer start": [0.0, 1.0, 0.0, 1.0]}.get(change)
    if weights is not None:
        save_file({"layer_weights": torch.tensor(weights)}, str(layers / "model.safetensors"))
    if change == "layer start":
        _set_json(layers / "config.json", layer_start=0)
    if change == "num_hidden_layers":
        _set_json(layers / "config.json", num_hidden_layers=12)
    if change == "cls pooling":
        _set_json(out / "2_Pooling" / "config.json", pooling_mode="cls")
    if change == "no hidden states":
        _set_json(out / "config.json", output_hidden_states=False)
    return out


@pytest.mark.parametrize("change, match", [
    # a sentence-transformers folder (Transformer, then Pooling) with this pooling or these modules
    ({"pooling_mode": "max"}, r"pooling max has no fastcl pooler"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True}, r"pooling max \+ mean"),
    ({"pooling_mode_weightedmean_tokens": True}, "pooling weightedmean"),
    ({"pooling_mode": "lasttoken"}, "pooling lasttoken"),
    ({"pooling_mode": "mean", "after": [("2_Dense", "Dense")]}, "Dense after mean pooling has no"),
    ({"pooling_mode": "cls", "after": [("2_Normalize", "Normalize"), ("3_Dense", "Dense")]},
     "Dense after Pooling changes"),
    ({"pooling_mode": "mean", "before": [("1_CNN", "CNN")]}, "Transformer -> CNN -> Pooling"),
    ({"pooling_mode": "mean", "lower_case": True}, "lower-cases its input"),
    # a folder the trainer saved, then changed by hand
    ("weights", r"WeightedLayerPooling from layer 1 with weights \[1, 0, 2\] .* none of fastcl's poolers"),
    ("layer start", r"from layer 0 with weights \[0, 1, 0, 1\]"),
    ("num_hidden_layers", r"num_hidden_layers 12, the model has 3"),
    ("cls pooling", r"cls pooling after WeightedLayerPooling has no fastcl pooler"),
    ("no hidden states", r"output_hidden_states is off.*fastcl's avg, not avg_first_last"),
    ("activation", r"this Dense is not the cls pooler's head"),
    ("mean pooling", r"Dense after mean pooling has no fastcl pooler"),
])
def test_what_fastcl_cannot_reproduce_is_a_clear_error(tmp_path, sts, change, match):
    """The pooler cannot be read: an error naming why, and the command asks for --pooler,
    which then comes first."""
    if isinstance(change, dict):
        change = dict(change)
        modules = {k: change.pop(k) for k in ("after", "before", "lower_case") if k in change}
        folder = st_folder(tmp_path / "st", change, **modules)
    else:
        folder = _changed_export(tmp_path, change)
    with pytest.raises(ValueError, match=match):
        ev.sentence_transformers_pooler(folder)
    with pytest.raises(SystemExit) as err:
        ev.main([str(folder), "--sts-dir", str(sts), "--tasks", "stsb"])
    assert isinstance(err.value.code, str) and "pass --pooler explicitly" in err.value.code
    assert ev.main([str(folder), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb",
                    "--quiet"])["scores"]


def test_proportional_layer_weights_are_the_same_pooler(tmp_path):
    """sentence-transformers divides by the weights' sum: [2, 0, 2] is avg_first_last too."""
    st = pytest.importorskip("sentence_transformers")
    from safetensors.torch import save_file

    src = make_tiny_model(tmp_path / "src", layers=3)
    out = export(src, tmp_path / "layers", "avg_first_last")
    save_file({"layer_weights": torch.tensor([2.0, 0.0, 2.0])},
              str(out / "1_WeightedLayerPooling" / "model.safetensors"))
    assert ev.saved_pooler(out) == "avg_first_last"
    sentences = ["the cat sat on the mat", "a dog runs", "big red house"]
    theirs = torch.as_tensor(st.SentenceTransformer(str(out), device="cpu").encode(sentences))
    torch.testing.assert_close(theirs, encode(*load_encoder(out, "avg_first_last"), sentences),
                               atol=1e-5, rtol=1e-5)


def test_fastcl_pooler_json_comes_before_the_pooling_config(tiny, tmp_path, sts, capsys):
    """A folder an older fastcl exported records its pooler in fastcl_pooler.json."""
    out = export(tiny, tmp_path / "export", "avg")
    assert ev.sentence_transformers_pooler(out) == ("avg", out / "1_Pooling" / "config.json")
    (out / "fastcl_pooler.json").write_text(json.dumps({"pooler": "cls_before_pooler"}))
    capsys.readouterr()
    ev.main([str(out), "--sts-dir", str(sts), "--tasks", "stsb"])
    assert f"pooler cls_before_pooler (from {out / 'fastcl_pooler.json'})" in capsys.readouterr().err
    (out / "fastcl_pooler.json").write_text(json.dumps({"pooling": "avg"}))
    with pytest.raises(SystemExit, match="not a fastcl pooler record"):
        ev.main([str(out), "--sts-dir", str(sts), "--tasks", "stsb"])
    assert ev.sentence_transformers_pooler(tiny) is None  # a plain Hugging Face folder


# ---------------------------------------------------------------------------------------
# Exit status

def _constant_model(tiny, folder, value: float):
    """The tiny model with its last LayerNorm's weight zeroed: every token state is its
    bias (+ value), so the CLS embedding of every sentence is the same vector."""
    backbone, tokenizer = load_backbone(tiny)
    norm = backbone.encoder.layer[-1].output.LayerNorm
    with torch.no_grad():
        norm.weight.zero_()
        norm.bias.copy_(torch.linspace(-1, 1, norm.bias.numel()) + value)
    backbone.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_undefined_score_exits_non_zero_with_the_reason(tiny, tmp_path, sts, capsys):
    constant = _constant_model(tiny, tmp_path / "constant", 0.0)
    with pytest.raises(SystemExit) as err:
        ev.main([str(constant), "--pooler", "cls_before_pooler", "--sts-dir", str(sts), "--tasks",
                 "stsb-dev", "sickr-dev", "--quiet"])
    assert isinstance(err.value.code, str)  # Python exits with status 1 and prints it
    assert err.value.code.startswith("python -m fastcl.evaluate: error: no correlation for ")
    assert "stsb-dev: the model gives every pair the same cosine" in err.value.code
    assert "sickr-dev: the model gives every pair the same cosine" in err.value.code
    assert "nan" in capsys.readouterr().out  # the table comes first
    broken = _constant_model(tiny, tmp_path / "nan", math.nan)
    with pytest.raises(SystemExit) as err:
        ev.main([str(broken), "--pooler", "cls_before_pooler", "--sts-dir", str(sts), "--tasks", "stsb",
                 "--quiet"])
    assert "no correlation for stsb: the embeddings contain NaN or Inf" in err.value.code



def test_non_finite_embeddings_give_nan_metrics_not_an_error(sts):
    """The trainer's dev evaluation asks for alignment and uniformity too: NaN embeddings give
    a NaN score with its reason and NaN metrics, which the trainer never takes as the best."""
    def embed(task, sentences):
        return torch.full((len(sentences), 8), math.nan)
    res = ev.evaluate_embeddings(embed, sts, ["stsb-dev"], metrics=True)
    assert math.isnan(res["scores"]["stsb-dev"])
    assert res["undefined"]["stsb-dev"] == "the embeddings contain NaN or Inf"
    assert all(math.isnan(v) for v in res["metrics"]["stsb-dev"].values())

def test_nothing_to_score_exits_non_zero(tiny, tmp_path, monkeypatch, capsys):
    sts = write_sts_dir(tmp_path / "sts", tasks=("stsb",))
    # 'python -m fastcl.evaluate ARGS' as run (runpy; here, its imports done): a SystemExit whose
    # code is the message is exit status 1, the message on stderr
    monkeypatch.setattr(sys, "argv", ["fastcl.evaluate", str(tiny), "--pooler", "avg", "--sts-dir", str(sts),
                                      "--tasks", "sickr", "sts12"])
    with pytest.raises(SystemExit) as done, pytest.warns(RuntimeWarning, match="found in sys.modules"):
        runpy.run_module("fastcl.evaluate", run_name="__main__", alter_sys=True)
    message = done.value.code
    assert isinstance(message, str) and capsys.readouterr().out == ""
    assert "error: nothing to score: no task file found under" in message
    assert "sickr: none of" in message and "sts12: none of" in message


# ---------------------------------------------------------------------------------------
# SentEvalSTSEvaluator

def test_evaluator_scores_equal_evaluate_on_the_same_export(tiny_st_export, sts):
    st = pytest.importorskip("sentence_transformers")
    from fastcl.integrations.sentence_transformers_evaluation import SentEvalSTSEvaluator

    evaluator = SentEvalSTSEvaluator(sts, metrics=True, batch_size=16)
    got = evaluator(st.SentenceTransformer(str(tiny_st_export), device="cpu"))
    encoder, tokenizer = load_encoder(tiny_st_export, "avg")
    want = ev.evaluate(encoder, tokenizer, None, sts, ev.DEV, metrics=True)
    assert set(got) == {"senteval_stsb-dev", "senteval_sickr-dev", "senteval_avg",
                        *(f"senteval_{t}_{k}" for t in ev.DEV for k in ("alignment", "uniformity"))}
    for task in ev.DEV:
        assert got[f"senteval_{task}"] == pytest.approx(want["scores"][task], abs=1e-6)
        for k in ("alignment", "uniformity"):
            assert got[f"senteval_{task}_{k}"] == pytest.approx(want["metrics"][task][k], abs=1e-5)
    assert got["senteval_avg"] == pytest.approx(want["avg"], abs=1e-6)
    assert evaluator.primary_metric == "senteval_avg" and evaluator.greater_is_better
    one = SentEvalSTSEvaluator(sts, tasks="stsb", name="")
    assert one.primary_metric == "stsb"
    with pytest.raises(FileNotFoundError, match="sts12: none of"):
        SentEvalSTSEvaluator(sts, tasks=["stsb-dev", "sts12"])
    with pytest.raises(ValueError, match="tasks: unknown sts17"):
        SentEvalSTSEvaluator(sts, tasks=["sts17"])


@pytest.fixture(scope="module")
def sts_subset(tmp_path_factory):
    """The first 150 STS-B dev and 100 SICK trial pairs of the shared data."""
    if not (DATA / "stsb" / "sts-dev.csv").is_file() or not (DATA / "sick" / "SICK_trial.txt").is_file():
        pytest.skip(f"shared STS data not found at {DATA} (set FASTCL_DATA)")
    root = tmp_path_factory.mktemp("sts-subset")
    for folder, name, lines in (("stsb", "sts-dev.csv", 150), ("sick", "SICK_trial.txt", 101)):
        (root / folder).mkdir()
        with open(DATA / folder / name, encoding="utf-8", newline="") as f:
            (root / folder / name).write_text("".join(f.readlines()[:lines]), encoding="utf-8", newline="")
    return root


@needs_data
def test_evaluator_on_minilm_equals_the_cli(sts_subset, capsys):
    """The packaged model (mean pooling + Normalize) in the evaluator and in the command line
    reading its pooling. (A fastcl export of it with each of the other poolers, loaded by
    sentence-transformers, encodes as fastcl does: test_evaluate's
    test_minilm_export_matches_sentence_transformers; the evaluator, which scores the model's
    ``encode``, on a fastcl export equals fastcl.evaluate on it:
    test_evaluator_scores_equal_evaluate_on_the_same_export.)"""
    st = pytest.importorskip("sentence_transformers")
    from fastcl.integrations.sentence_transformers_evaluation import SentEvalSTSEvaluator

    evaluator = SentEvalSTSEvaluator(sts_subset)
    assert {t: len(p) for t, p in evaluator.data.items()} == {"stsb-dev": 150, "sickr-dev": 100}
    got = evaluator(st.SentenceTransformer(minilm_path(), device="cpu"))
    cli = ev.main([minilm_path(), "--sts-dir", str(sts_subset), "--tasks", *ev.DEV])
    assert "pooler avg (from" in capsys.readouterr().err
    for task in ev.DEV:
        assert got[f"senteval_{task}"] == pytest.approx(cli["scores"][task], abs=1e-6)
    assert 85 < got["senteval_stsb-dev"] < 98  # all-MiniLM-L6-v2 is a strong STS model (93.9 here)


def test_evaluator_inside_sentence_transformer_trainer(tiny_st_export, sts, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from fastcl.integrations.sentence_transformers_evaluation import SentEvalSTSEvaluator

    rng = random.Random(5)
    model = st.SentenceTransformer(str(tiny_st_export), device="cpu")
    anchors = [random_sentence(rng) for _ in range(16)]
    data = Dataset.from_dict({"anchor": anchors, "positive": anchors})  # dropout makes the views
    evaluator = SentEvalSTSEvaluator(sts)
    args = SentenceTransformerTrainingArguments(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8, learning_rate=1e-3,
        eval_strategy="steps", eval_steps=1, report_to="none", save_strategy="no", logging_steps=1,
        seed=0, use_cpu=True, disable_tqdm=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=data,
                                         loss=MultipleNegativesRankingLoss(model), evaluator=evaluator)
    trainer.train()
    assert any(not torch.equal(v.detach(), before[k]) for k, v in model.named_parameters())
    evals = [r for r in trainer.state.log_history if "eval_senteval_avg" in r]
    assert [r["step"] for r in evals] == [1, 2]
    keys = {"eval_senteval_stsb-dev", "eval_senteval_sickr-dev", "eval_senteval_avg"}
    assert all(keys <= set(r) and all(math.isfinite(r[k]) for k in keys) for r in evals)
    # the last evaluation saw the final weights: the same numbers as fastcl.evaluate on them
    model.save(str(tmp_path / "final"))
    encoder, tokenizer = load_encoder(tmp_path / "final", "avg")
    want = ev.evaluate(encoder, tokenizer, None, sts, ev.DEV)
    for task in ev.DEV:
        assert evals[-1][f"eval_senteval_{task}"] == pytest.approx(want["scores"][task], abs=1e-6)
    # and a row per evaluation in the trainer's eval folder
    with open(tmp_path / "run" / "eval" / "senteval_sts_results_senteval.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["epoch", "steps", "stsb-dev", "sickr-dev", "avg"]
    assert [r[1] for r in rows[1:]] == ["1", "2"]
    assert float(rows[2][4]) == pytest.approx(evals[-1]["eval_senteval_avg"])


# ---------------------------------------------------------------------------------------
# Damaged files and output paths (issue 28)

@pytest.mark.parametrize("text, why", [
    ("{not json", "cannot read the pooler"),
    ("", "cannot read the pooler"),
    ('["avg"]', "not a fastcl pooler record"),
    ('{"pool": "avg"}', "not a fastcl pooler record"),
    ('{"pooler": "max"}', "must be one of"),
    ('{"pooler": ["avg"]}', "must be one of"),
])
def test_a_damaged_pooler_record_names_the_file(tiny, sts, tmp_path, text, why):
    import shutil

    model = tmp_path / "export"
    shutil.copytree(tiny, model)
    (model / "fastcl_pooler.json").write_text(text)
    with pytest.raises(SystemExit) as err:
        ev.main([str(model), "--sts-dir", str(sts), "--tasks", "stsb-dev", "--quiet"])
    message = err.value.code
    assert isinstance(message, str) and str(model / "fastcl_pooler.json") in message
    assert why in message and "--pooler" in message
    # --pooler still overrides the record
    assert ev.main([str(model), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb-dev",
                    "--quiet"])["scores"]


def test_json_output_path_is_checked_before_scoring(tiny, sts, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [str(tiny), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb-dev", "--quiet"]
    for target, why in [("nodir/x.json", "--json: no such folder: nodir"),
                        (str(tmp_path), "is a folder")]:
        with pytest.raises(SystemExit) as err:
            ev.main(args + ["--json", target])
        assert isinstance(err.value.code, str) and why in err.value.code
        assert capsys.readouterr().out == ""            # nothing was scored
    ev.main(args + ["--json", "x.json"])
    assert json.loads((tmp_path / "x.json").read_text())["scores"]
