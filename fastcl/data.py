"""Training data readers, and the UTF-8 line reader evaluation shares.

Formats, by file suffix: ``.txt`` (one sentence a line; unsupervised methods), ``.csv`` and
``.tsv`` (a header row, standard quoting), ``.json`` / ``.jsonl`` and ``.parquet`` (through
``datasets.load_dataset``), a folder of files of one such format, a
folder in SentEval's SNLI layout (supervised SimCSE), or the name of a dataset that
``datasets.load_dataset`` loads (from the Hugging Face Hub, or offline from its local cache).
Unsupervised methods read one text column (``text_column``; default ``text`` or ``sentence``,
else the only text column), supervised SimCSE reads (anchor, positive[, hard negative])
columns (``columns``; default ``sent0, sent1[, hard_neg]``). Every reader returns a
:class:`TrainingData` (a ``datasets.Dataset`` and the count of what it skipped); errors are
ValueErrors naming the file, its line where there is one and, with ``arg``, the option that
gave it.

Text files and csv files have readers of their own: ``datasets``' text builder also splits
lines on Unicode separators, and its csv builder (pandas) reads ``"a"b`` as ``ab`` without an
error and reports a quote never closed by data row; the csv module in strict mode reports
both with the file's line.
"""

from __future__ import annotations

import contextlib
import csv
import os
from dataclasses import dataclass
from pathlib import Path


# Training file formats by suffix (lower case); "tsv" is a csv with tabs.
FORMATS = {".txt": "text", ".csv": "csv", ".tsv": "tsv", ".json": "json", ".jsonl": "json",
           ".parquet": "parquet"}
SUPPORTED = ("a .txt file (one sentence a line), a .csv, .tsv, .json, .jsonl or .parquet file, "
             "a folder of such files (one format), a SentEval SNLI folder (simcse-sup), or a "
             "dataset name for datasets.load_dataset")
TEXT_COLUMNS = ("text", "sentence")
SUPERVISED = ("simcse-sup",)          # the methods whose examples are (anchor, positive[, negative])      # the default text column, in this order
PAIR_COLUMNS = ("sent0", "sent1", "hard_neg")


def _supervised(method: str) -> bool:
    return method in SUPERVISED


@dataclass
class TrainingData:
    """Examples as a ``datasets.Dataset`` plus what reading them skipped."""

    dataset: object
    kind: str          # "sentences" (column text) or "triplets" / "pairs" (sent0, sent1[, hard_neg])
    skipped: int
    source: str

    def __len__(self) -> int:
        return len(self.dataset)


def _dataset(columns: dict):
    import datasets
    return datasets.Dataset.from_dict(columns)


def read_sentences(path) -> TrainingData:
    """One sentence per line (UTF-8). Blank and whitespace-only lines are skipped and counted.

    Lines are split on LF only (a CR before it is dropped), so sentences holding other
    Unicode line separators stay whole.
    """
    path = Path(path)
    lines = text_lines(path, "--data")
    sentences = [line for line in lines if line.strip()]
    return TrainingData(_dataset({"text": sentences}), "sentences", len(lines) - len(sentences),
                        str(path))


def parse_columns(value) -> list:
    """``"anchor,positive[,hard_negative]"`` (or a sequence of them) as a list of 2 or 3
    distinct column names."""
    names = [c.strip() for c in value.split(",")] if isinstance(value, str) else list(value)
    if len(names) not in (2, 3) or not all(names) or len(set(names)) != len(names):
        raise ValueError(f"--columns takes 2 or 3 distinct comma-separated column names "
                         f"(anchor,positive[,hard_negative]), got {value!r}")
    return names


def _pair_columns(names, columns, where: str, what: str = "header") -> list:
    """The (anchor, positive[, hard negative]) columns of a table with columns ``names``."""
    if columns:
        cols = parse_columns(columns)
        missing = [c for c in cols if c not in names]
        if missing:
            raise ValueError(f"--columns: {where} has no column {', '.join(missing)} "
                             f"(its {what}: {list(names)})")
        return cols
    missing = [c for c in PAIR_COLUMNS[:2] if c not in names]
    if missing:
        raise ValueError(f"--data: {where} needs columns sent0,sent1[,hard_neg] (--columns "
                         f"names others); its {what} {list(names)} lacks {', '.join(missing)}")
    return list(PAIR_COLUMNS[:2]) + (["hard_neg"] if "hard_neg" in names else [])


def _text_column(names, texts, text_column, where: str, method: str) -> str:
    """The sentence column of a table with columns ``names`` (``texts``: those holding text)."""
    if text_column:
        if text_column not in names:
            raise ValueError(f"--text_column: {where} has no column {text_column!r} "
                             f"(its columns: {list(names)})")
        return text_column
    for name in TEXT_COLUMNS:
        if name in names:
            return name
    if len(texts) == 1:
        return texts[0]
    raise ValueError(f"--data: method {method} trains on a text file with one sentence a line "
                     f"or on one text column; {where} has columns {list(names)}, none named "
                     f"{' or '.join(TEXT_COLUMNS)}: choose one with --text_column")


def read_csv_columns(path, pick, *, delimiter: str = ",") -> tuple:
    """Read the columns ``pick(header)`` of a csv with a header row (standard csv quoting):
    ``({column: values}, skipped)``. Values are stripped; rows with an empty picked field
    are skipped and counted. Malformed quoting (a quote never closed, text after a closing
    quote) and rows with more fields than the header are errors naming the file and line:
    they are what an unbalanced quote that merges rows leaves."""
    path = Path(path)
    with utf8_errors(path, "--data"), open(path, encoding="utf-8-sig", newline="") as f:
        # strict: a quote that is never closed, or text after a closing quote, is an error
        # instead of rows merged into one field
        reader = csv.DictReader(f, delimiter=delimiter, strict=True)
        try:
            header = reader.fieldnames or []
        except csv.Error as err:
            raise ValueError(f"--data: {path}:{reader.line_num}: malformed csv ({err})") from None
        cols = pick(header)
        data = {c: [] for c in cols}
        skipped = 0
        rows = iter(reader)
        while True:
            first = reader.line_num + 1
            try:
                row = next(rows)
            except StopIteration:
                break
            except csv.Error as err:
                raise ValueError(f"--data: {path}:{first}: malformed csv ({err}); look for an "
                                 "unbalanced quote") from None
            if None in row:
                span = f"{first}-{reader.line_num}" if reader.line_num > first else str(first)
                raise ValueError(f"--data: {path}:{span}: the row has more fields than the "
                                 f"header {header}; look for an unbalanced quote")
            values = [(row.get(c) or "").strip() for c in cols]
            if not all(values):
                skipped += 1
                continue
            for c, v in zip(cols, values):
                data[c].append(v)
    return data, skipped


def _delimiter(path: Path) -> str:
    return "\t" if path.suffix.lower() == ".tsv" else ","


def read_csv_triplets(path, columns=None) -> TrainingData:
    """A csv (a .tsv: tab-separated) with a header holding ``sent0, sent1`` and optionally
    ``hard_neg`` (standard csv quoting, as SimCSE's ``nli_for_simcse.csv``), or the
    anchor, positive[, hard negative] ``columns`` (``"a,p[,n]"``). See
    :func:`read_csv_columns` for what is skipped and what is an error."""
    path = Path(path)
    data, skipped = read_csv_columns(path, lambda header: _pair_columns(header, columns, path),
                                     delimiter=_delimiter(path))
    names = dict(zip(data, PAIR_COLUMNS))
    kind = "triplets" if len(names) == 3 else "pairs"
    return TrainingData(_dataset({names[c]: v for c, v in data.items()}), kind, skipped, str(path))


def read_csv_sentences(path, text_column=None, method: str = "simcse") -> TrainingData:
    """The sentences of one column of a csv (a .tsv: tab-separated) with a header:
    ``text_column``, by default ``text`` or ``sentence``, else the only column."""
    path = Path(path)
    data, skipped = read_csv_columns(
        path, lambda header: [_text_column(header, header, text_column, path.name, method)],
        delimiter=_delimiter(path))
    (values,) = data.values()
    return TrainingData(_dataset({"text": values}), "sentences", skipped, str(path))


def snli_splits(folder) -> list:
    """Split names ``x`` with ``s1.x``, ``s2.x`` and ``labels.x`` in ``folder``."""
    folder = Path(folder)
    names = sorted(p.name[3:] for p in folder.glob("s1.*"))
    return [n for n in names if (folder / f"s2.{n}").is_file() and (folder / f"labels.{n}").is_file()]


def read_snli(folder, splits=None) -> TrainingData:
    """SentEval-layout SNLI (``s1.<split>`` premises, ``s2.<split>`` hypotheses,
    ``labels.<split>``) as (premise, entailment, contradiction) triplets.

    Hypotheses are grouped by identical premise text; a premise's k-th entailment is paired
    with its k-th contradiction (premises lacking either are skipped and counted).
    """
    folder = Path(folder)
    available = snli_splits(folder)
    splits = list(splits) if splits else available
    if not splits:
        raise ValueError(f"--data: {folder} has no s1.<split>/s2.<split>/labels.<split> files")
    absent = [s for s in splits if s not in available]
    if absent:
        raise ValueError(f"--snli_splits: {folder} lacks split(s) {', '.join(absent)} "
                         f"(found: {', '.join(available) or 'none'})")
    groups: dict = {}
    for split in splits:
        files = [folder / f"{name}.{split}" for name in ("s1", "s2", "labels")]
        s1, s2, labels = (text_lines(f, "--data") for f in files)
        if not len(s1) == len(s2) == len(labels):
            raise ValueError(f"--data: {folder} split {split}: s1/s2/labels have "
                             f"{len(s1)}/{len(s2)}/{len(labels)} lines")
        for premise, hypothesis, label in zip(s1, s2, labels):
            premise, hypothesis = premise.strip(), hypothesis.strip()
            groups.setdefault(premise, {"entailment": [], "contradiction": []})
            if label.strip() in ("entailment", "contradiction") and hypothesis:
                groups[premise][label.strip()].append(hypothesis)
    data = {"sent0": [], "sent1": [], "hard_neg": []}
    skipped = 0
    for premise, hyp in groups.items():
        pairs = list(zip(hyp["entailment"], hyp["contradiction"]))
        skipped += not pairs
        for ent, con in pairs:
            data["sent0"].append(premise)
            data["sent1"].append(ent)
            data["hard_neg"].append(con)
    return TrainingData(_dataset(data), "triplets", skipped, str(folder))


@contextlib.contextmanager
def utf8_errors(path: Path, arg: str | None = None):
    """Turn a UnicodeDecodeError while reading ``path`` into a ValueError naming it (and the
    option ``arg`` it came from)."""
    try:
        yield
    except UnicodeDecodeError as err:
        where = f"{arg}: " if arg else ""
        raise ValueError(f"{where}{path} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 4]!r}); convert it to UTF-8") from None


def text_lines(path: Path, arg: str | None = None) -> list:
    """Lines of a UTF-8 file split on LF only, a CR before the LF dropped (CRLF files)."""
    with utf8_errors(path, arg), open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    if "\n" not in text and text.rstrip("\r").count("\r") >= 1:
        # classic Mac line ends: read as LF-split text it would be one long line
        raise ValueError(f"{arg + ': ' if arg else ''}{path} ends its lines with CR only (no LF): it "
                         "would read as one line; convert it to LF or CRLF line ends")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line does not start another
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _is_text(feature) -> bool:
    return getattr(feature, "dtype", None) in ("string", "large_string")


def _all_present(batch: dict, cols: list) -> list:
    """Per row of ``batch``: every column of ``cols`` holds a non-blank string."""
    return [all(v is not None and v.strip() for v in values)
            for values in zip(*(batch[c] for c in cols))]


def from_dataset(ds, method: str, *, text_column=None, columns=None, source: str) -> TrainingData:
    """The examples of a ``datasets.Dataset`` ``ds`` for ``method``: its text column
    (unsupervised methods) or its (anchor, positive[, hard negative]) columns (simcse-sup),
    renamed to ``text`` / ``sent0, sent1[, hard_neg]``. Rows with a missing or blank field are
    skipped and counted; texts are kept as stored."""
    names = list(ds.column_names)
    texts = [n for n in names if _is_text(ds.features[n])]
    if _supervised(method):
        cols = _pair_columns(names, columns, source, "columns")
        targets = list(PAIR_COLUMNS[:len(cols)])
    else:
        cols, targets = [_text_column(names, texts, text_column, source, method)], ["text"]
    for c in cols:
        if c not in texts:
            raise ValueError(f"--data: {source}: column {c!r} holds {ds.features[c]}, not text")
    ds = ds.select_columns(cols)
    total = len(ds)
    ds = ds.filter(_all_present, batched=True, fn_kwargs={"cols": cols})
    # two renames: target names may be among the source names in another order
    ds = ds.rename_columns({c: f"__fastcl_{i}" for i, c in enumerate(cols)})
    ds = ds.rename_columns({f"__fastcl_{i}": t for i, t in enumerate(targets)})
    kind = "sentences" if targets == ["text"] else "triplets" if len(targets) == 3 else "pairs"
    return TrainingData(ds, kind, total - len(ds), source)


def _cause(err: BaseException) -> str:
    """``err`` as ``Type: message``, through ``datasets``' wrappers to the error they hold."""
    while type(err).__name__ == "DatasetGenerationError" and err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"


def load_files(files, fmt: str, where: str):
    """``datasets.load_dataset`` of json or parquet ``files`` (one ``train`` split)."""
    import datasets
    try:
        return datasets.load_dataset(fmt, data_files=[str(f) for f in files], split="train")
    except Exception as err:  # datasets raises many kinds; each is a file it cannot read
        raise ValueError(f"--data: {where} cannot be read as {fmt}: {_cause(err)}") from None


def read_dataset(name: str, method: str, *, split: str = "train", text_column=None,
                 columns=None) -> TrainingData:
    """The ``split`` of the dataset ``name`` as ``datasets.load_dataset`` finds it (the Hub,
    or its local cache when offline); columns as in :func:`from_dataset`."""
    import datasets
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as err:  # not found, offline without a cache, unknown split...
        raise FileNotFoundError(f"--data: no such file or folder: {name}, and "
                                f"load_dataset({name!r}, split={split!r}) failed: "
                                f"{_cause(err)}") from None
    if not isinstance(ds, datasets.Dataset):
        raise ValueError(f"--data: load_dataset({name!r}, split={split!r}) gave a "
                         f"{type(ds).__name__}, not a Dataset")
    return from_dataset(ds, method, text_column=text_column, columns=columns,
                        source=f"{name} (split {split})")


def _file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"--data: {path.name}: unknown format {path.suffix or '(no suffix)'!r}; "
                         f"the data can be {SUPPORTED}")
    return fmt


def _concat(parts: list, source: str) -> TrainingData:
    if len(parts) == 1:
        return TrainingData(parts[0].dataset, parts[0].kind, parts[0].skipped, source)
    kinds = {p.kind for p in parts}
    if len(kinds) > 1:
        raise ValueError(f"--data: the files of {source} disagree: "
                         + ", ".join(f"{Path(p.source).name} has {p.kind}" for p in parts))
    import datasets
    return TrainingData(datasets.concatenate_datasets([p.dataset for p in parts]), kinds.pop(),
                        sum(p.skipped for p in parts), source)


def read_files(files: list, method: str, *, text_column=None, columns=None,
               source: str | None = None) -> TrainingData:
    """Training files of one format (a folder's, or one file) as one :class:`TrainingData`."""
    files = [Path(f) for f in files]
    source = source or str(files[0])
    formats = {_file_format(f) for f in files}
    if len(formats) > 1:
        raise ValueError(f"--data: {source} mixes formats ({', '.join(sorted(formats))}); "
                         "a folder holds files of one format")
    fmt = formats.pop()
    supervised = _supervised(method)
    if fmt == "text":
        if supervised:
            raise ValueError(f"--data: {method} needs a csv with sent0,sent1,hard_neg columns "
                             f"(or a .tsv, .json, .jsonl, .parquet file or dataset, --columns "
                             f"picking the columns) or a SentEval SNLI folder, got {files[0].name}")
        if text_column:
            raise ValueError(f"--text_column: {files[0].name} is a text file with one sentence "
                             "a line; it has no columns")
        return _concat([read_sentences(f) for f in files], source)
    if fmt in ("csv", "tsv"):
        if supervised:
            return _concat([read_csv_triplets(f, columns) for f in files], source)
        return _concat([read_csv_sentences(f, text_column, method) for f in files], source)
    where = source if len(files) > 1 else files[0].name
    return from_dataset(load_files(files, fmt, where), method, text_column=text_column,
                        columns=columns, source=source)


def folder_files(folder: Path) -> list:
    """The training files of ``folder``: its files with a suffix of :data:`FORMATS`, sorted
    (hidden files and files of other kinds, a README say, are not data)."""
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in FORMATS)


def _looks_like_a_path(name: str) -> bool:
    """Whether ``name`` can only be a file path (not a dataset name like ``owner/name``)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name
            or name.count("/") > 1 or Path(name).suffix.lower() in FORMATS)


def read_training_data(path, method: str, snli=None, *, text_column=None, columns=None,
                       split: str = "train") -> TrainingData:
    """Read ``path`` in the format ``method`` needs: a file (:data:`FORMATS`), a folder of
    such files, a SentEval SNLI folder (simcse-sup; ``snli``: its splits), or else a dataset
    name for ``datasets.load_dataset`` (its ``split``). ``text_column`` (unsupervised
    methods) and ``columns`` (simcse-sup: ``"anchor,positive[,hard_negative]"``) pick the
    fields of tables."""
    name = str(path)
    path = Path(path)
    supervised = _supervised(method)
    if columns and not supervised:
        raise ValueError(f"--columns applies to simcse-sup; method {method} reads one text "
                         "column (--text_column)")
    if text_column and supervised:
        raise ValueError(f"--text_column applies to unsupervised methods; {method} reads "
                         "anchor,positive[,hard_negative] columns (--columns)")
    if columns:
        parse_columns(columns)
    if snli and not path.is_dir():
        raise ValueError(f"--snli_splits applies to a SentEval SNLI folder, not to {path.name}")
    if split != "train" and path.exists():
        raise ValueError(f"--data_split applies to a dataset name; {path} is a local "
                         f"{'folder' if path.is_dir() else 'file'}")
    if not path.exists():
        if _looks_like_a_path(name):
            raise FileNotFoundError(f"--data: no such file or folder: {path}")
        data = read_dataset(name, method, split=split, text_column=text_column, columns=columns)
    elif path.is_dir() and snli_splits(path):
        if not supervised:
            raise ValueError(f"--data: method {method} trains on a text file with one sentence "
                             f"a line, not a folder in SentEval's SNLI layout ({path}); that is "
                             "simcse-sup's format")
        if text_column or columns:
            raise ValueError(f"--columns: {path} is a SentEval SNLI folder; its columns are fixed")
        data = read_snli(path, snli)
    elif path.is_dir():
        if snli:
            raise ValueError(f"--snli_splits applies to a SentEval SNLI folder; {path} holds no "
                             "s1.<split>/s2.<split>/labels.<split> files")
        files = folder_files(path)
        if not files:
            raise ValueError(f"--data: {path} holds no training files (.txt, .csv, .tsv, .json, "
                             ".jsonl, .parquet) and is not a SentEval SNLI folder "
                             "(s1.<split>, s2.<split>, labels.<split>)")
        data = read_files(files, method, text_column=text_column, columns=columns,
                          source=str(path))
    else:
        data = read_files([path], method, text_column=text_column, columns=columns)
    if len(data) == 0:
        raise ValueError(f"--data: {data.source} holds no usable examples")
    return data


def loss_columns(dataset, method: str, hard_negative_weight: float = 0.0, premise_labels: bool = False):
    """``dataset`` with the columns sentence-transformers' losses read: one text column (or
    ``anchor``) made ``anchor`` and ``positive``; pairs and triplets' ``sent0, sent1, hard_neg``
    renamed; ``premise_labels``: a ``label`` column, the id of each row's anchor text (the rows of
    one premise share it)."""
    names = dataset.column_names
    if not _supervised(method) and names != ["anchor", "positive"]:
        text = next((c for c in ("anchor", "text") if c in names), names[0] if len(names) == 1 else None)
        if text is None:
            raise ValueError(f"{method} trains on one text column, got columns {', '.join(names)}")
        dataset = dataset.select_columns([text]).rename_column(text, "anchor")
        dataset = dataset.add_column("positive", dataset["anchor"])
    elif _supervised(method):
        dataset = dataset.rename_columns({k: v for k, v in zip(PAIR_COLUMNS, ("anchor", "positive", "negative"))
                                          if k in names})
    if hard_negative_weight and "negative" not in dataset.column_names:
        raise ValueError(f"--hard_negative_weight needs one hard negative per anchor, but the data has "
                         f"none (--method {method}, columns {', '.join(dataset.column_names)})")
    if premise_labels:
        ids: dict = {}
        dataset = dataset.add_column("label", [ids.setdefault(t, len(ids)) for t in dataset["anchor"]])
    return dataset
