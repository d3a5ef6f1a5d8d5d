"""fastcl-train's inputs: training data in every format (through ``datasets``), ``--config``
files, the configuration a run saves beside its model, and the shipped recipes."""

import csv
import json
import os
import random
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers / huggingface_hub load

import pytest
import yaml

from fastcl import data as data_io
from fastcl.trainer import cli
from fastcl.trainer.run import read_log
from test_evaluate import random_sentence
from test_train import base_args, step_records, tiny, train  # noqa: F401 (tiny: fixture)

pytestmark = pytest.mark.usefixtures("one_thread", "outside")  # nothing written outside tmp_path


@pytest.fixture(autouse=True)
def offline_datasets(tmp_path, monkeypatch):
    """datasets caches under tmp_path and never reaches the network."""
    import datasets
    import huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):   # the second: older datasets
        if hasattr(datasets.config, name):
            monkeypatch.setattr(datasets.config, name, True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hf-datasets"


def write_table(path, rows):
    """``rows`` (dicts, None for a missing value) as a file in the format of ``path``'s suffix."""
    path = Path(path)
    fmt = path.suffix
    names = list(rows[0])
    if fmt in (".csv", ".tsv"):
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, names, delimiter="\t" if fmt == ".tsv" else ",")
            w.writeheader()
            w.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    elif fmt == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif fmt == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({k: [r[k] for r in rows] for k in names}), path)
    else:
        raise AssertionError(fmt)
    return path


TABLES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
SENTENCES = ["the cat sat, on the mat", 'a "quoted" dog ran', None, "   ", "red apple"]


# ---------------------------------------------------------------------------------------
# Data formats

@pytest.mark.parametrize("suffix", TABLES)
def test_each_table_format_gives_its_sentence_column(tmp_path, suffix):
    rows = [{"source": f"s{i}", "sentence": s} for i, s in enumerate(SENTENCES)]
    path = write_table(tmp_path / f"wiki{suffix}", rows)
    data = data_io.read_training_data(path, "simcse")
    assert data.kind == "sentences" and data.skipped == 2  # the None and the blank one
    texts = [t.strip() for t in data.dataset["text"]]
    assert texts == ["the cat sat, on the mat", 'a "quoted" dog ran', "red apple"]
    # --text_column picks another column
    picked = data_io.read_training_data(path, "simcse", text_column="source")
    assert list(picked.dataset["text"]) == [f"s{i}" for i in range(5)] and picked.skipped == 0


@pytest.mark.parametrize("suffix", TABLES)
def test_each_table_format_gives_supervised_triplets_and_pairs(tmp_path, suffix):
    rows = [{"premise": "p1", "entailment": "e1", "contradiction": "c1"},
            {"premise": "p2", "entailment": None, "contradiction": "c2"},
            {"premise": "p3", "entailment": "e3", "contradiction": "c3"}]
    path = write_table(tmp_path / f"nli{suffix}", rows)
    data = data_io.read_training_data(path, "simcse-sup", columns="premise,entailment,contradiction")
    assert data.kind == "triplets" and data.skipped == 1
    assert list(zip(data.dataset["sent0"], data.dataset["sent1"], data.dataset["hard_neg"])) == [
        ("p1", "e1", "c1"), ("p3", "e3", "c3")]
    pairs = data_io.read_training_data(path, "simcse-sup", columns="entailment,premise")
    assert pairs.kind == "pairs" and list(pairs.dataset["sent0"]) == ["e1", "e3"]
    assert list(pairs.dataset["sent1"]) == ["p1", "p3"]
    # SimCSE's names need no --columns; without them the error says which are missing
    with pytest.raises(ValueError, match=r"--data: .*needs columns sent0,sent1.*lacks sent0, sent1"):
        data_io.read_training_data(path, "simcse-sup")
    with pytest.raises(ValueError, match=r"--columns: .*has no column hypothesis"):
        data_io.read_training_data(path, "simcse-sup", columns="premise,hypothesis")
    named = write_table(tmp_path / f"simcse{suffix}",
                        [{"sent0": "a", "sent1": "b", "hard_neg": "c"}, {"sent0": "d", "sent1": "e", "hard_neg": "f"}])
    assert len(data_io.read_training_data(named, "simcse-sup")) == 2


@pytest.mark.parametrize("name,content,kw,message", [
    ("one.jsonl", [{"id": 1, "body": "a b"}], {"text_column": "id"}, r"column 'id' holds .*int64.*not text"),
    ("two.parquet", [{"title": "t", "body": "a b"}], {}, r"--data: method focal trains on .*\['title', 'body'\].*--text_column"),
    ("two.parquet", [{"title": "t", "body": "a b"}], {"text_column": "text"},
     r"--text_column: .*two.parquet has no column 'text'.*\['title', 'body'\]"),
    ("one.jsonl", [{"id": 1, "body": "a b"}], {"split": "test"}, r"--data_split applies to a dataset name; .*one.jsonl is a local file"),
    ("data.xml", "<s>a</s>\n", {}, r"--data: data.xml: unknown format '.xml'; .*\.jsonl.*\.parquet"),
    ("wiki", "a line\n", {}, r"unknown format '\(no suffix\)'"),
    ("bad.parquet", "PAR1 not really parquet", {}, "--data: bad.parquet cannot be read as parquet: ArrowInvalid"),
    ("bad.jsonl", '{"text": "a"}\n{"text": \n', {}, "--data: bad.jsonl cannot be read as json"),
    ("blank.jsonl", [{"text": " "}, {"text": None}], {}, "holds no usable examples"),
    ("bad.tsv", 'text\n"unclosed\tx\n', {}, r"bad.tsv:2: malformed csv.*unbalanced quote"),  # strict quoting
    ("t.txt", b"one\ntwo \xe9t\xe9\n", {}, "t.txt is not UTF-8 text"),
])
def test_a_table_that_does_not_fit_is_an_error_naming_it(tmp_path, name, content, kw, message):
    path = tmp_path / name
    if isinstance(content, list):
        write_table(path, content)
    else:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=message):
        data_io.read_training_data(path, "focal", **kw)


def test_the_one_text_column_is_the_default(tmp_path):
    """(--columns and --text_column where they do not apply: test_train's bad options.)"""
    one = write_table(tmp_path / "one.jsonl", [{"id": 1, "body": "a b"}, {"id": 2, "body": "c"}])
    assert list(data_io.read_training_data(one, "focal").dataset["text"]) == ["a b", "c"]


def test_a_folder_of_files_of_one_format(tmp_path):
    folder = tmp_path / "parts"
    folder.mkdir()
    write_table(folder / "b.jsonl", [{"text": "third"}])
    write_table(folder / "a.jsonl", [{"text": "first"}, {"text": ""}, {"text": "second"}])
    (folder / "README.md").write_text("# not data\n")
    (folder / ".hidden.jsonl").write_text("not json\n")
    data = data_io.read_training_data(folder, "simcse")
    assert list(data.dataset["text"]) == ["first", "second", "third"] and data.skipped == 1
    # text files and csv files are read by fastcl's own readers, then joined
    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "1.txt").write_text("one\n\ntwo\n")
    (lines / "2.txt").write_text("three\n")
    data = data_io.read_training_data(lines, "escl")
    assert list(data.dataset["text"]) == ["one", "two", "three"] and data.skipped == 1
    write_table(lines / "3.csv", [{"text": "x"}])
    with pytest.raises(ValueError, match="mixes formats"):
        data_io.read_training_data(lines, "escl")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("x\n")
    with pytest.raises(ValueError, match="holds no training files .*not a SentEval SNLI folder"):
        data_io.read_training_data(empty, "simcse-sup")
    sup = tmp_path / "sup"
    sup.mkdir()
    write_table(sup / "x.csv", [{"sent0": "a", "sent1": "b", "hard_neg": "c"}])
    write_table(sup / "y.csv", [{"sent0": "d", "sent1": "e"}])
    with pytest.raises(ValueError, match="disagree: x.csv has triplets, y.csv has pairs"):
        data_io.read_training_data(sup, "simcse-sup")


def cache_dataset(cache: Path, tmp_path, name: str, rows: list) -> None:
    """Put ``rows`` in the datasets cache as the ``train`` split of the dataset ``name``, as
    an earlier online ``load_dataset(name)`` leaves it."""
    import datasets
    source = write_table(tmp_path / "source.jsonl", rows)
    built = tmp_path / "built"
    datasets.load_dataset("json", data_files=[str(source)], split="train", cache_dir=str(built))
    (info,) = built.glob("json/*/0.0.0/*/dataset_info.json")
    owner, _, short = name.partition("/")
    target = cache / f"{owner}___{short}" / "default" / "0.0.0" / info.parent.name
    target.mkdir(parents=True)
    shutil.copy(info, target / "dataset_info.json")
    shutil.copy(info.parent / "json-train.arrow", target / f"{short}-train.arrow")


def test_a_dataset_name_loads_offline_from_the_cache(tmp_path, offline_datasets):
    rows = [{"text": "first sentence", "label": "x"}, {"text": "", "label": "y"},
            {"text": "second one", "label": "z"}]
    cache_dataset(offline_datasets, tmp_path, "someone/tiny-wiki", rows)
    data = data_io.read_training_data("someone/tiny-wiki", "simcse")
    assert list(data.dataset["text"]) == ["first sentence", "second one"] and data.skipped == 1
    assert data.source == "someone/tiny-wiki (split train)"
    assert list(data_io.read_training_data("someone/tiny-wiki", "simcse", text_column="label")
                .dataset["text"]) == ["x", "y", "z"]
    with pytest.raises(FileNotFoundError, match=r"--data: no such file or folder: someone/tiny-wiki, "
                       r"and load_dataset\('someone/tiny-wiki', split='test'\) failed: .*test"):
        data_io.read_training_data("someone/tiny-wiki", "simcse", split="test")


def test_a_dataset_names_fingerprint_follows_its_rows(tmp_path, offline_datasets):
    """A run on a dataset name records the training dataset's fingerprint (the rows it
    trains on): the same rows give the same one, other rows another, which a resume names."""
    from fastcl import files

    def fingerprint(rows, where):
        shutil.rmtree(offline_datasets, ignore_errors=True)
        where.mkdir()
        cache_dataset(offline_datasets, where, "someone/tiny-wiki", rows)
        args = parse(["--method", "simcse", "--model", "m", "--data", "someone/tiny-wiki",
                      "--output_dir", str(tmp_path / "o"), "--per_device_train_batch_size", "2"])
        # as the trainer records it (check_data): the loaded dataset, whose rows' own fingerprint counts
        return files.data_fingerprint(args.data, data_io.read_training_data(args.data, args.method).dataset)

    rows = [{"text": f"sentence {i}"} for i in range(4)]
    first = fingerprint(rows, tmp_path / "a")
    assert first["dataset"] == "someone/tiny-wiki" and first["fingerprint"]
    assert fingerprint(rows, tmp_path / "b") == first
    again = fingerprint(rows[::-1], tmp_path / "c")
    assert files.fingerprint_changes("someone/tiny-wiki", first, again) == [
        f"the dataset someone/tiny-wiki has another fingerprint ({first['fingerprint']} at the "
        f"start, {again['fingerprint']} now)"]


def test_a_missing_dataset_name_says_both_what_was_tried(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        data_io.read_training_data("nobody/no-such-dataset", "simcse")
    message = str(err.value)
    assert message.startswith("--data: no such file or folder: nobody/no-such-dataset, and "
                              "load_dataset('nobody/no-such-dataset', split='train') failed: ")
    assert "ConnectionError" in message or "NotFound" in message, message
    # a name that can only be a path is not looked up as a dataset
    with pytest.raises(FileNotFoundError, match=r"^--data: no such file or folder: [^,]*missing.jsonl$"):
        data_io.read_training_data(tmp_path / "missing.jsonl", "simcse")


# ---------------------------------------------------------------------------------------
# Training on the new formats

def test_training_on_jsonl_and_parquet(tiny, tmp_path):
    rng = random.Random(3)
    rows = [{"id": i, "body": random_sentence(rng)} for i in range(20)] + [{"id": 20, "body": None}]
    data = write_table(tmp_path / "wiki.jsonl", rows)
    out = tmp_path / "out"
    args = base_args(tiny, out, steps=2)
    args[args.index("--data") + 1] = str(data)
    assert train.main(args) == 0
    (start,) = [r for r in read_log(out) if r["type"] == "start"]
    assert start["examples"] == 20 and start["skipped"] == 1
    assert [r["step"] for r in step_records(out)] == [1, 2]
    assert all(r["loss"] > 0 for r in step_records(out))
    with pytest.raises(SystemExit, match=r"--data_split applies to a dataset name"):
        train.main(args + ["--overwrite_output_dir", "--data_split", "test"])
    # supervised pairs from parquet with --columns
    sup = write_table(tmp_path / "nli.parquet", [{"q": random_sentence(rng), "a": random_sentence(rng)}
                                                  for _ in range(12)])
    args = base_args(tiny, tmp_path / "sup", "simcse-sup", steps=2, columns="q,a")
    args[args.index("--data") + 1] = str(sup)
    assert train.main(args) == 0
    assert len(step_records(tmp_path / "sup")) == 2


# ---------------------------------------------------------------------------------------
# --config

def parse(argv):
    parser = cli.build_parser()
    return cli.resolve_args(parser, cli.parse_args(parser, argv))


def options(args):
    return {k: v for k, v in vars(args).items() if k != "config"}


def test_config_round_trip_repeats_the_run(tiny, tmp_path):
    rng = random.Random(4)
    data = write_table(tmp_path / "wiki.jsonl", [{"text": random_sentence(rng)} for _ in range(16)])
    config = tmp_path / "run.yaml"
    config.write_text(f"""# a run as a config file
method: simcse
model: {tiny / 'bert'}
data: {data}
output-dir: {tmp_path / 'first'}   # the flag's other spelling works too
per_device_train_batch_size: 4
max_steps: 2
max_seq_len: 16
learning_rate: 1e-3   # YAML reads this as a string: the option's own type converts it
pooler: cls
mlp_only_train: false
use_cpu: true
sts_dir: none
bf16: null          # null: the default
""")
    assert train.main(["--config", str(config), "--seed", "7"]) == 0  # flags override the file
    first = tmp_path / "first"
    (start,) = [r for r in read_log(first) if r["type"] == "start"]
    assert start["args"]["seed"] == 7 and start["args"]["per_device_train_batch_size"] == 4
    assert start["args"]["learning_rate"] == 1e-3 and start["args"]["mlp_only_train"] is False
    saved = yaml.safe_load((first / cli.CONFIG_FILE).read_text())
    assert saved["seed"] == 7 and saved["data"] == str(data.resolve()) and "resume" not in saved
    assert saved["output_dir"] == str(first.resolve()) and "phi" not in saved  # dclr's only
    # the saved file repeats the run: same options, same losses
    second = tmp_path / "second"
    assert train.main(["--config", str(first / cli.CONFIG_FILE), "--output_dir", str(second)]) == 0
    (again,) = [r for r in read_log(second) if r["type"] == "start"]
    drop = ("output_dir", "config")
    assert {k: v for k, v in again["args"].items() if k not in drop} == \
        {k: v for k, v in start["args"].items() if k not in drop}
    assert [r["loss"] for r in step_records(second)] == [r["loss"] for r in step_records(first)]
    # JSON holds the same options
    as_json = tmp_path / "run.json"
    as_json.write_text(json.dumps(saved))
    assert options(parse(["--config", str(as_json)])) == \
        options(parse(["--config", str(first / cli.CONFIG_FILE)]))
    # as HF's scripts take one: the file as the only argument
    assert options(parse([str(config)])) == options(parse(["--config", str(config)]))


@pytest.mark.parametrize("method,extra", [
    ("simcse", ["--sts_dir", "none"]), ("simcse-sup", ["--pooler", "avg", "--snli_splits", "dev", "test"]),
    ("dclr", ["--phi", "0.5", "--complementary", "x", "--mlp_only_train", "false", "--bf16"]),
    ("escl", ["--rd", "margin", "--mini_batch_size", "3", "--keep_last"]), ("focal", ["--pooler", "avg_top2"]),
])
def test_the_saved_config_parses_back_to_the_same_options(tmp_path, method, extra):
    argv = ["--method", method, "--model", "m", "--data", "d", "--output_dir", str(tmp_path), *extra]
    args = parse(argv)
    if method == "dclr":
        args.noise_ratio = 1.0  # resolved from the model family at set-up
    path = cli.write_config(tmp_path, args)
    again = parse(["--config", str(path)])
    assert options(again) == {**options(args), "output_dir": str(tmp_path.resolve())}


@pytest.mark.parametrize("name,text,message", [
    ("run.yaml", "method: simcse\nbatch_sise: 4\n", r"run.yaml: unknown key 'batch_sise'"),
    ("run.yaml", "per_device_train_batch_size: many\n",
     r"run.yaml: argument --per_device_train_batch_size.*: invalid int value: 'many'"),
    ("run.yaml", "mlp_only_train: maybe\n", r"run.yaml: argument --mlp_only_train.*: Truthy value expected: got maybe"),
    ("run.yaml", "learning_rate: true\n", r"run.yaml: argument --learning_rate.*: invalid float value: 'True'"),
    ("run.yaml", "pooler: max\n", r"run.yaml: argument --pooler: invalid choice: 'max'"),
    ("run.yaml", "- method\n- simcse\n", r"run.yaml must hold a mapping of option names to values, not a list"),
    ("run.yaml", "method: [unclosed\n", r"run.yaml is not valid YAML"),
    ("run.yaml", "config: other.yaml\n", r"unknown key 'config'"),
    ("none.yaml", None, r"--config: no such file"),
    ("run.toml", "", r"a config file is YAML \(.yaml, .yml\) or JSON"),
    ("recipe:simcse-large", None, r"no recipe 'simcse-large'; the recipes are dclr-bert"),
])
def test_config_errors_name_the_file_and_key(tmp_path, capsys, name, text, message):
    spec = name if name.startswith("recipe:") else str(tmp_path / name)
    if text is not None:
        (tmp_path / name).write_text(text)
    with pytest.raises(SystemExit) as err:
        parse(["--config", spec, "--method", "simcse", "--model", "m", "--data", "d", "--output_dir", "o"])
    assert err.value.code == 2
    assert __import__("re").search(message, capsys.readouterr().err)


def test_the_method_may_come_from_the_config_file(tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"model": "m", "data": "d"}))
    with pytest.raises(SystemExit):
        parse(["--config", str(path)])
    assert "the following arguments are required: --method" in capsys.readouterr().err
    assert parse(["--config", str(path), "--method", "simcse"]).method == "simcse"
    path.write_text(json.dumps({"method": "escl", "model": "m"}))
    assert parse(["--config", str(path)]).method == "escl"


RECIPES = ["dclr-bert", "dclr-roberta", "escl-bert", "escl-roberta", "focal-bert", "focal-roberta",
           "simcse-bert", "simcse-roberta", "simcse-sup-bert"]


def test_the_papers_recipes_ship_and_resolve(capsys):
    assert cli.recipe_names() == RECIPES
    args = {name: parse(["--config", f"recipe:{name}"]) for name in RECIPES}
    for name, a in args.items():
        assert a.method == name.rsplit("-", 1)[0] and a.temperature == 0.05 and a.max_seq_len == 32
        assert a.model == {"bert": "bert-base-uncased", "roberta": "roberta-base"}[name.rsplit("-", 1)[1]]
        assert a.eval_steps == 125 and a.pooler == "cls" and a.sts_dir is None
    simcse = args["simcse-bert"]
    assert (simcse.per_device_train_batch_size, simcse.learning_rate, simcse.num_train_epochs) == (64, 3e-5, 1)
    assert args["simcse-bert"].mlp_only_train and args["simcse-bert"].select == "stsb"
    sup = args["simcse-sup-bert"]
    assert (sup.per_device_train_batch_size, sup.learning_rate, sup.num_train_epochs, sup.mlp_only_train) == \
        (512, 5e-5, 3, False)
    dclr = args["dclr-bert"]
    assert (dclr.phi, dclr.noise_ratio, dclr.per_device_train_batch_size) == (0.9, 1.0, 128)
    assert (args["dclr-roberta"].phi, args["dclr-roberta"].noise_ratio) == (0.85, 2.5)
    assert args["dclr-roberta"].complementary == "runs/simcse-roberta-base/model" and args["dclr-bert"].select == "avg"
    assert args["focal-bert"].m == 0.3
    assert (args["escl-bert"].rd_weight, args["escl-bert"].sensitive_dropout) == (2.5e-3, 0.45)
    # the command line overrides a recipe
    assert parse(["--config", "recipe:simcse-bert", "--per_device_train_batch_size", "32"]).per_device_train_batch_size == 32
    # --help lists them
    with pytest.raises(SystemExit):
        parse(["--help"])
    assert "recipe:NAME" in capsys.readouterr().out


def test_the_shipped_samples_are_the_defaults_and_small(tmp_path):
    """Nothing to download: the unsupervised methods train on the shipped Wikipedia sample
    (licence in samples/README.md); no dev set ships (--sts_dir names one)."""
    args = parse(["--method", "simcse"])
    assert args.data == str(cli.SAMPLES / "wiki-sample.txt") and args.sts_dir is None
    assert args.model == "all-MiniLM-L6-v2"
    sizes = [p.stat().st_size for p in cli.SAMPLES.rglob("*") if p.is_file()]
    assert sum(sizes) <= 1_000_000
    assert len(data_io.read_training_data(args.data, "simcse")) > 5000
    licence = (cli.SAMPLES / "README.md").read_text()
    assert "CC BY-SA" in licence and "wiki-sample.txt" in licence
    with pytest.raises(SystemExit):   # no supervised sample ships
        parse(["--method", "simcse-sup"])


def test_mask_duplicates_follows_the_sampler(tmp_path):
    """simcse-sup masks duplicate texts where its batches may hold them (the plain sampler);
    its default no_duplicates sampler keeps them out already; every method takes the option."""
    base = ["--model", "m", "--data", "d", "--output_dir", str(tmp_path / "o")]
    assert parse(base + ["--method", "simcse-sup"]).mask_duplicates is False
    assert parse(base + ["--method", "simcse-sup", "--batch_sampler", "batch_sampler"]).mask_duplicates is True
    assert parse(base + ["--method", "simcse"]).mask_duplicates is False
    assert parse(base + ["--method", "simcse", "--mask_duplicates", "true"]).mask_duplicates is True
    assert parse(base + ["--method", "escl", "--mask_duplicates", "true"]).mask_duplicates is True
