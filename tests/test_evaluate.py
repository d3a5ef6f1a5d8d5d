"""fastcl.evaluate: STS loaders (SentEval, STS-B and SICK layouts), the scoring protocol,
poolers and the model folders the trainer saves (sentence-transformers' layout); integration on
the packaged MiniLM."""

import csv
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from conftest import minilm_path  # noqa: F401  (and for the files that import it from here)
from fastcl import evaluate as ev
from fastcl.encoders import (POOLERS, MLPHead, SentenceEncoder, dropout_rate, encode, load_backbone,
                             load_encoder)

DATA = Path(os.environ.get("FASTCL_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
needs_data = pytest.mark.skipif(not (DATA / "stsb" / "sts-dev.csv").is_file(),
                                reason=f"shared STS data not found at {DATA} (set FASTCL_DATA)")

WORDS = ("the a cat dog man woman child sat ran plays eats sleeps on in under mat park guitar "
         "piano apple bread red blue big small fast slow happy sad house tree").split()


def random_sentence(rng):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def make_tiny_model(folder, model_type="bert", seed=0, layers=2):
    """A ``layers``-layer, width-32 random encoder and a word-level tokenizer over WORDS, saved
    to folder. (On 2 layers avg_first_last and avg_top2 are the same pooler.)"""
    from transformers import BertConfig, BertModel, BertTokenizer, RobertaConfig, RobertaModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    try:
        tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(tokens)})
    except TypeError:  # transformers 4 builds it from a vocabulary file only
        (folder / "vocab.txt").write_text("\n".join(tokens) + "\n")
        tokenizer = BertTokenizer(vocab_file=str(folder / "vocab.txt"))
    assert tokenizer("the cat")["input_ids"] == [2, 5, 7, 3]  # a word-level vocabulary, no [UNK]
    size = dict(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                intermediate_size=64, initializer_range=0.5)
    torch.manual_seed(seed)
    if model_type == "bert":
        model = BertModel(BertConfig(max_position_embeddings=64, **size))
    else:
        model = RobertaModel(RobertaConfig(max_position_embeddings=66, pad_token_id=0, type_vocab_size=1,
                                           **size))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def export(src, out, pooler, *, mlp_only_train=False):
    """The model folder the trainer saves for ``pooler`` from the Hugging Face encoder (or
    sentence-transformers folder) ``src``: its model with the pooler's modules, without the
    training-only head, written by sentence-transformers' ``save_pretrained``."""
    from fastcl.trainer.build import load_model
    from fastcl.integrations.sentence_transformers.models import without_training_heads

    model = load_model(str(src), pooler, mlp_only_train=mlp_only_train, device="cpu")
    without_training_heads(model).save_pretrained(str(out))
    return Path(out)


def write_sts_dir(root, seed=0, n=40, tasks=("stsb", "sick")):
    """Synthetic STS-B dev/test and SICK trial/test files over WORDS, in the evaluator's layout."""
    rng = random.Random(seed)
    root = Path(root)
    for task in tasks:
        (root / task).mkdir(parents=True, exist_ok=True)
    for split in ("dev", "test"):
        if "stsb" in tasks:
            rows = []
            for i in range(n):
                # distinct sentences: an identical pair's cosine is 1 up to rounding, a tie
                # whose rank would depend on the last bit
                a, b = random_sentence(rng), random_sentence(rng)
                rows.append(f"main-news\tf\t2012\t{i}\t{rng.uniform(0, 5):.3f}\t{a}\t{b}\n")
            (root / "stsb" / f"sts-{split}.csv").write_text("".join(rows))
        if "sick" in tasks:
            name = "SICK_trial.txt" if split == "dev" else "SICK_test_annotated.txt"
            lines = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
            lines += [f"{i}\t{random_sentence(rng)}\t{random_sentence(rng)}\t{rng.uniform(1, 5):.1f}\tNEUTRAL"
                      for i in range(n)]
            (root / "sick" / name).write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return root


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


# ---------------------------------------------------------------------------------------
# Loaders

def test_sts_year_concatenates_subsets_and_drops_empty_gold(tmp_path):
    year = tmp_path / "STS12-en-test"
    year.mkdir()
    (year / "STS.input.b.txt").write_bytes(b"one  two \tthree\r\nfour\tfive\textra\r\n")
    (year / "STS.gs.b.txt").write_bytes(b"1.5\r\n2\r\n")
    (year / "STS.input.a.txt").write_text("x y\tz\ndropped\tpair\nlast\tone\n")
    (year / "STS.gs.a.txt").write_text("4\n\n0.25\n")
    pairs = ev.load_sts_year(year, "sts12")
    # subsets in name order; the pair with an empty gold line is gone; whitespace normalized
    assert pairs.sentences1 == ["x y", "last", "one two", "four"]
    assert pairs.sentences2 == ["z", "one", "three", "five"]
    np.testing.assert_array_equal(pairs.scores, [4.0, 0.25, 1.5, 2.0])
    assert ev.load_task(tmp_path, "sts12").sentences1 == pairs.sentences1


def test_sts_year_errors_name_the_file(tmp_path):
    year = tmp_path / "STS13-en-test"
    year.mkdir()
    (year / "STS.input.x.txt").write_text("a\tb\nc\td\n")
    with pytest.raises(FileNotFoundError, match="STS.gs.x.txt"):
        ev.load_sts_year(year)
    (year / "STS.gs.x.txt").write_text("1\n")
    with pytest.raises(ValueError, match="STS.input.x.txt has 2 lines but STS.gs.x.txt has 1"):
        ev.load_sts_year(year)
    (year / "STS.gs.x.txt").write_text("1\nhigh\n")
    with pytest.raises(ValueError, match=r"STS.gs.x.txt:2: gold score 'high'"):
        ev.load_sts_year(year)
    (year / "STS.input.x.txt").write_text("a\tb\nno tab here\n")
    (year / "STS.gs.x.txt").write_text("1\n2\n")
    with pytest.raises(ValueError, match=r"STS.input.x.txt:2: expected two tab-separated"):
        ev.load_sts_year(year)


STSB_ROWS = [
    'main-news\tf\t2012\t1\t5.000\tHe said "yes.\tHe said yes.',
    'main-forums\tf\t2012\t2\t0.500\t"Open quote never closed\tNothing',
    'main-news\tf\t2012\t3\t2.750\tA b\tC "D" E\tlicence\textra',  # original release: extra fields
    'main-captions\tf\t2012\t4\t3.000\t"Quoted, with comma" she wrote\tend',
]


def test_stsb_reads_with_quoting_disabled(tmp_path):
    path = tmp_path / "sts-dev.csv"
    path.write_text("\n".join(STSB_ROWS) + "\n")
    # The trap is real for this file: csv's default quoting merges rows.
    with open(path, newline="") as f:
        assert len(list(csv.reader(f, delimiter="\t"))) < len(STSB_ROWS)
    pairs = ev.load_stsb(path)
    assert len(pairs) == 4
    assert pairs.sentences1 == ['He said "yes.', '"Open quote never closed', "A b",
                                '"Quoted, with comma" she wrote']
    assert pairs.sentences2 == ["He said yes.", "Nothing", 'C "D" E', "end"]
    np.testing.assert_array_equal(pairs.scores, [5.0, 0.5, 2.75, 3.0])


def test_stsb_malformed_row_is_an_error(tmp_path):
    path = tmp_path / "sts-test.csv"
    path.write_text(STSB_ROWS[0] + "\nmain-news\tf\t2012\t2\t1.0\tonly one sentence\n")
    with pytest.raises(ValueError, match=r"sts-test.csv:2: expected at least 7 tab-separated fields, got 6"):
        ev.load_stsb(path)
    path.write_text("main-news\tf\t2012\t2\tfive\ta\tb\n")
    with pytest.raises(ValueError, match=r"sts-test.csv:1: score 'five'"):
        ev.load_stsb(path)


def test_sick_crlf_header_and_bom(tmp_path):
    path = tmp_path / "SICK_test_annotated.txt"
    # sentence_B last: with CRLF a naive reader leaves '\r' on it
    lines = ["\ufeffpair_ID\trelatedness_score\tsentence_A\tsentence_B",
             "1\t4.5\tA man plays\tA man is playing ",
             "2\t1.0\tA dog\tA cat"]
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode("utf-8"))
    pairs = ev.load_sick(path)
    assert pairs.sentences1 == ["A man plays", "A dog"]
    assert pairs.sentences2 == ["A man is playing", "A cat"]
    np.testing.assert_array_equal(pairs.scores, [4.5, 1.0])
    path.write_text("pair_ID\tsentence_A\tscore\n1\ta\t1\n")
    with pytest.raises(ValueError, match="lacks column.*sentence_B.*relatedness_score"):
        ev.load_sick(path)


def test_task_sources_in_both_layouts(tmp_path):
    write_sts_dir(tmp_path / "ours")
    assert ev.task_source(tmp_path / "ours", "stsb-dev") == tmp_path / "ours" / "stsb" / "sts-dev.csv"
    assert ev.task_source(tmp_path / "ours", "sickr") == tmp_path / "ours" / "sick" / "SICK_test_annotated.txt"
    senteval = tmp_path / "downstream"
    (senteval / "STS" / "STSBenchmark").mkdir(parents=True)
    (senteval / "STS" / "STS14-en-test").mkdir(parents=True)
    (senteval / "STS" / "STSBenchmark" / "sts-test.csv").write_text(STSB_ROWS[0] + "\n")
    assert ev.task_source(senteval, "stsb").parent.name == "STSBenchmark"
    assert ev.task_source(senteval, "sts14").name == "STS14-en-test"
    with pytest.raises(FileNotFoundError, match="sts15: none of"):
        ev.task_source(senteval, "sts15")
    with pytest.raises(ValueError, match="unknown task 'sts17'"):
        ev.task_source(senteval, "sts17")


# ---------------------------------------------------------------------------------------
# Scoring

def test_rounded_average():
    assert ev.rounded_average({"a": 70.126, "b": 80.126}) == pytest.approx(75.13)
    assert ev.rounded_average({}) is None


def test_scores_equal_scipy_spearman_of_cosines(tiny, tmp_path):
    sts = write_sts_dir(tmp_path)
    encoder, tokenizer = load_encoder(tiny, "avg")
    result = ev.evaluate(encoder, tokenizer, None, sts, ["stsb-dev", "sickr"], batch_size=7)
    assert result["pairs"] == {"stsb-dev": 40, "sickr": 40}
    for task in ("stsb-dev", "sickr"):
        pairs = ev.load_task(sts, task)
        # the same forward passes as the evaluator (encode is deterministic), scored here
        emb = encode(encoder, tokenizer, pairs.sentences1 + pairs.sentences2, batch_size=7)
        a, b = emb[:len(pairs)].double().numpy(), emb[len(pairs):].double().numpy()
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        expected = spearmanr(cos, pairs.scores).statistic * 100
        assert result["scores"][task] == pytest.approx(expected, abs=1e-9)
    assert result["avg"] == pytest.approx(np.mean([round(s, 2) for s in result["scores"].values()]))


def test_missing_tasks_are_reported_and_skipped(tiny, tmp_path):
    sts = write_sts_dir(tmp_path, tasks=("stsb",))
    encoder, tokenizer = load_encoder(tiny, "avg")
    result = ev.evaluate(encoder.backbone, tokenizer, "avg", sts)
    assert list(result["scores"]) == ["stsb"]
    assert set(result["missing"]) == {"sts12", "sts13", "sts14", "sts15", "sts16", "sickr"}
    assert result["avg"] == pytest.approx(round(result["scores"]["stsb"], 2))
    table = ev.format_table(result)
    assert "stsb" in table and "missing sts12, skipped" in table


def test_evaluate_checks_tasks_and_pooler(tiny, tmp_path):
    encoder, tokenizer = load_encoder(tiny, "avg")
    with pytest.raises(ValueError, match="tasks: unknown sts17"):
        ev.evaluate(encoder, tokenizer, None, tmp_path, ["stsb", "sts17"])
    with pytest.raises(ValueError, match="pooler must be one of"):
        ev.evaluate(encoder.backbone, tokenizer, "mean", tmp_path, ["stsb"])


def test_cli_writes_table_and_json(tiny, tmp_path, capsys):
    sts = write_sts_dir(tmp_path / "sts")
    year = sts / "STS16-en-test"
    year.mkdir()
    rng = random.Random(3)
    (year / "STS.input.news.txt").write_text(
        "".join(f"{random_sentence(rng)}\t{random_sentence(rng)}\n" for _ in range(30)))
    (year / "STS.gs.news.txt").write_text("".join(f"{rng.uniform(0, 5):.2f}\n" for _ in range(30)))
    out = tmp_path / "res.json"
    ev.main([str(tiny), "--pooler", "avg_first_last", "--sts-dir", str(sts), "--json", str(out),
             "--batch-size", "16"])
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["pooler"] == "avg_first_last"
    assert list(saved["scores"]) == ["sts16", "stsb", "sickr"]
    assert set(saved["missing"]) == {"sts12", "sts13", "sts14", "sts15"}
    assert saved["pairs"]["sts16"] == 30
    assert f"{saved['avg']:.2f}" in printed and "missing sts12" in printed
    with pytest.raises(SystemExit, match="--sts-dir: no such folder"):
        ev.main([str(tiny), "--pooler", "avg", "--sts-dir", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--pooler is needed: .*no fastcl_pooler.json"):
        ev.main([str(tiny), "--sts-dir", str(sts)])


def test_cli_reads_the_exported_pooler_and_reports_load_errors(tmp_path, capsys, offline):
    sts = write_sts_dir(tmp_path / "sts", tasks=("stsb",))
    src = make_tiny_model(tmp_path / "src", layers=3)  # avg_top2 is not avg_first_last here
    out = export(src, tmp_path / "export", "avg_top2")
    capsys.readouterr()
    result = ev.main([str(out), "--sts-dir", str(sts), "--tasks", "stsb"])
    source = out / "1_WeightedLayerPooling" / "config.json"
    assert f"pooler avg_top2 (from {source})" in capsys.readouterr().err
    encoder, tok = load_encoder(src, "avg_top2")
    assert result["scores"] == ev.evaluate(encoder, tok, None, sts, ["stsb"])["scores"]
    with pytest.raises(SystemExit, match="cannot load 'no-such-org/model'.*local path"):
        ev.main(["no-such-org/model", "--pooler", "avg", "--sts-dir", str(sts)])


# ---------------------------------------------------------------------------------------
# Encoders, poolers, loading, export

def test_poolers_follow_their_formulas(tiny):
    backbone, tokenizer = load_backbone(tiny)
    backbone.eval()
    sentences = ["the cat sat on the mat", "a dog", "the big red dog plays guitar fast"]
    feats = tokenizer(sentences, padding=True, return_tensors="pt")
    out = backbone(**feats, output_hidden_states=True)
    m = feats["attention_mask"].unsqueeze(-1).float()
    mean = lambda h: (h * m).sum(1) / m.sum(1)
    hs = out.hidden_states
    head = MLPHead(32)
    expected = {
        "cls": torch.tanh(head.dense(hs[-1][:, 0])),
        "cls_before_pooler": hs[-1][:, 0],
        "avg": mean(hs[-1]),
        "avg_first_last": mean((hs[1] + hs[-1]) / 2),
        "avg_top2": mean((hs[-2] + hs[-1]) / 2),
    }
    for pooler in POOLERS:
        enc = SentenceEncoder(backbone, pooler, head)
        got = encode(enc, tokenizer, sentences, batch_size=2)
        torch.testing.assert_close(got, expected[pooler].detach(), atol=1e-5, rtol=1e-5)
        # padding and batching do not change an embedding
        alone = torch.cat([encode(enc, tokenizer, [s]) for s in sentences])
        torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    assert len(set(POOLERS)) == 5
    with pytest.raises(ValueError, match="pooler must be one of"):
        SentenceEncoder(backbone, "max")
    with pytest.raises(ValueError, match="needs its MLP head"):
        SentenceEncoder(backbone, "cls")


def test_dropout_rate_sets_and_restores(tiny):
    backbone, _ = load_backbone(tiny)
    rates = lambda: {m.p for m in backbone.modules() if isinstance(m, torch.nn.Dropout)}
    assert rates() == {0.1}
    with dropout_rate(backbone, 0.45):
        assert rates() == {0.45}
    with pytest.raises(RuntimeError):
        with dropout_rate(backbone, 0.3):
            raise RuntimeError
    assert rates() == {0.1}
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\)"):
        with dropout_rate(backbone, 1.0):
            pass


@pytest.fixture
def offline(monkeypatch):
    """Hub look-ups fail at once, whatever the environment said when huggingface_hub loaded."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_loading_errors_are_clear(tiny, tmp_path, offline):
    with pytest.raises(OSError, match="--model: cannot load 'no-such-org/no-such-model'.*local path"):
        load_backbone("no-such-org/no-such-model", arg="--model")
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        load_backbone(str(tmp_path / "absent" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_backbone(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="pooler must be one of"):
        load_encoder(tiny, "mean")


def test_cls_without_head_or_model_pooler_is_an_error(tmp_path):
    from transformers import DistilBertConfig, DistilBertModel

    make_tiny_model(tmp_path / "bert")  # for its tokenizer files
    model = DistilBertModel(DistilBertConfig(vocab_size=5 + len(WORDS), dim=32, n_layers=1, n_heads=2,
                                             hidden_dim=64, max_position_embeddings=64))
    model.save_pretrained(tmp_path / "distil")
    load_backbone(tmp_path / "bert")[1].save_pretrained(tmp_path / "distil")
    with pytest.raises(ValueError, match="pooler 'cls' needs an MLP head"):
        load_encoder(tmp_path / "distil", "cls")
    encoder, tokenizer = load_encoder(tmp_path / "distil", "avg")  # any AutoModel encoder works
    assert encode(encoder, tokenizer, ["the cat", "a dog"]).shape == (2, 32)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_saved_models_give_sentence_transformers_embeddings(tmp_path, model_type):
    """Every pooler's folder as the trainer saves it: evaluate's pooler and load_encoder
    reproduce SentenceTransformer(folder).encode."""
    st = pytest.importorskip("sentence_transformers")

    src = make_tiny_model(tmp_path / "src", model_type, layers=3)
    sentences = ["the cat sat on the mat", "a dog runs", "big red house under the tree", "man"]
    got = {}
    for pooler in POOLERS:
        out = export(src, tmp_path / pooler, pooler)
        assert ev.saved_pooler(out) == pooler
        encoder, tok = load_encoder(out, ev.saved_pooler(out))
        got[pooler] = ours = encode(encoder, tok, sentences)
        model = st.SentenceTransformer(str(out), device="cpu")
        theirs = torch.as_tensor(model.encode(sentences))
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
        if pooler == "cls":  # the Dense head (Linear + Tanh) round-trips
            torch.testing.assert_close(encoder.head.dense.weight, model[2].linear.weight)
            torch.testing.assert_close(encoder.head.dense.bias, model[2].linear.bias)
    # five poolers, five embeddings: none was read as another
    for a in POOLERS:
        for b in POOLERS[POOLERS.index(a) + 1:]:
            assert not torch.allclose(got[a], got[b], atol=1e-3), (a, b)


def test_a_model_trained_with_mlp_only_train_is_saved_without_its_head(tiny, tmp_path):
    st = pytest.importorskip("sentence_transformers")

    out = export(tiny, tmp_path / "unsup", "cls", mlp_only_train=True)
    assert ev.saved_pooler(out) == "cls_before_pooler"
    sentences = ["the cat sat on the mat", "a dog runs"]
    theirs = torch.as_tensor(st.SentenceTransformer(str(out), device="cpu").encode(sentences))
    torch.testing.assert_close(theirs, encode(*load_encoder(out, "cls_before_pooler"), sentences),
                               atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Integration: the packaged MiniLM and the shared data

@needs_data
def test_real_files_load_completely():
    counts = {"stsb-dev": 1500, "stsb": 1379, "sickr-dev": 500, "sickr": 4927}
    for task, n in counts.items():
        pairs = ev.load_task(DATA, task)
        assert len(pairs) == n
        assert all(s and s == s.strip() and "\r" not in s for s in pairs.sentences1 + pairs.sentences2)
        lo, hi = (0, 5) if task.startswith("stsb") else (1, 5)
        assert pairs.scores.min() >= lo and pairs.scores.max() <= hi


@needs_data
@pytest.mark.slow   # the whole STS-B dev through MiniLM (28 s); test_evaluate_cli scores it on slices
def test_minilm_on_stsb_dev():
    encoder, tokenizer = load_encoder(minilm_path(), "avg")
    result = ev.evaluate(encoder, tokenizer, None, DATA, ["stsb-dev", "sts12"], batch_size=128)
    # all-MiniLM-L6-v2 (mean pooling) is a strong STS model: about 86.7 on STS-B dev
    assert 84.0 < result["scores"]["stsb-dev"] < 90.0
    assert "sts12" in result["missing"]


def test_minilm_export_matches_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    sentences = ["A man is playing a guitar.", "A woman slices a tomato.", "Stocks fell on Monday.",
                 "The cat sleeps on the warm windowsill while the rain keeps falling outside."]
    for pooler in POOLERS:  # a 6-layer model: avg_first_last weighs layers 1 and 6 only
        out = export(minilm_path(), tmp_path / pooler, pooler)
        assert ev.saved_pooler(out) == pooler
        encoder, tok = load_encoder(out, pooler)
        ours = encode(encoder, tok, sentences)
        theirs = torch.as_tensor(st.SentenceTransformer(str(out), device="cpu").encode(sentences))
        torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    # the packaged model's own sentence-transformers pipeline is mean pooling + normalize
    packaged = st.SentenceTransformer(minilm_path(), device="cpu").encode(sentences)
    ours = torch.nn.functional.normalize(encode(*load_encoder(tmp_path / "avg", "avg"), sentences), dim=1)
    torch.testing.assert_close(torch.as_tensor(packaged), ours, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Bad data and undefined scores are clear errors

def test_cli_without_any_task_file_is_an_error(tiny, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as err:
        ev.main([str(tiny), "--pooler", "avg", "--sts-dir", str(tmp_path / "empty")])
    assert err.value.code != 0 and "no task file found under" in str(err.value.code)
    assert "stsb: none of" in str(err.value.code)


def test_constant_gold_scores_are_refused(tiny, tmp_path):
    sts = write_sts_dir(tmp_path / "sts", tasks=("stsb",))
    path = sts / "stsb" / "sts-test.csv"
    path.write_text("".join("\t".join(line.split("\t")[:4] + ["3.0"] + line.split("\t")[5:])
                            for line in path.read_text().splitlines(keepends=True)))
    with pytest.raises(ValueError, match=f"{path}: every gold score is 3.0"):
        ev.load_stsb(path)
    with pytest.raises(SystemExit) as err:
        ev.main([str(tiny), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb"])
    assert "stsb:" in str(err.value.code) and "every gold score is 3.0" in str(err.value.code)


def test_cli_data_errors_name_the_file_without_a_traceback(tiny, tmp_path):
    sts = write_sts_dir(tmp_path / "sts", tasks=("stsb", "sick"))
    bad = sts / "sick" / "SICK_test_annotated.txt"
    bad.write_bytes(bad.read_bytes().replace(b"\tNEUTRAL", b"\tNEUTRAL\t\xff", 1))
    with pytest.raises(ValueError, match=f"{bad} is not UTF-8 text"):
        ev.load_sick(bad)
    bad.write_text("pair_ID\tsentence_A\n1\tx\n")
    with pytest.raises(SystemExit) as err:
        ev.main([str(tiny), "--pooler", "avg", "--sts-dir", str(sts), "--tasks", "stsb", "sickr"])
    assert isinstance(err.value.code, str)
    assert f"sickr: {bad}: header lacks column(s) sentence_B, relatedness_score" in err.value.code
