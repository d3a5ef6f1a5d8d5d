"""STS evaluation as SentEval runs it for SimCSE, without SentEval.

Protocol: embed both sentences of every pair, score the pair by the cosine of the two
embeddings, and report the Spearman rank correlation ×100 between cosines and gold scores.
STS12–STS16 pool every subset of a year into one correlation (SentEval's "all" setting);
STS-B and SICK-R use the test split (``stsb-dev`` / ``sickr-dev``: the dev split and SICK's
trial file). No regressor is trained. The average is taken over scores rounded to two
decimals. Sentences are whitespace-normalized as SentEval's tokenize-and-join does.

Data layout under ``sts_dir`` (SentEval's own ``downstream/`` names are also accepted)::

    STS12-en-test/STS.input.<subset>.txt   two tab-separated sentences a line
    STS12-en-test/STS.gs.<subset>.txt      the gold score a line (empty: pair dropped)
    ... STS13-en-test ... STS16-en-test
    stsb/sts-dev.csv, stsb/sts-test.csv    tab-separated, no quoting, 7+ fields:
                                           genre file year id score sentence1 sentence2
    sick/SICK_test_annotated.txt, sick/SICK_trial.txt
                                           tab-separated with a header naming sentence_A,
                                           sentence_B and relatedness_score

Command line::

    python -m fastcl.evaluate MODEL [--pooler cls_before_pooler] --sts-dir DIR [--tasks ...] [--json OUT]

Without ``--pooler`` the pooler is read off a sentence-transformers folder's modules, which
covers every model the trainer saves (:func:`sentence_transformers_pooler`: CLS token
``cls_before_pooler``, with the ``2_Dense`` Linear + Tanh head ``cls``, mean of tokens ``avg``,
after fastcl's WeightedLayerPooling ``avg_first_last`` / ``avg_top2``); a folder written by an
older fastcl records it in ``fastcl_pooler.json``, which comes first. A progress bar per task goes to stderr (``--quiet``: none). The exit
status is non-zero, with the reason, when no task file exists or a score is undefined (NaN).

:func:`evaluate_embeddings` scores the embeddings of any embedding function under this
protocol; :func:`evaluate` (a Hugging Face encoder) and
:class:`fastcl.integrations.sentence_transformers.SentEvalSTSEvaluator` (a
``SentenceTransformer``, inside ``SentenceTransformerTrainer``) both use it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import spearmanr
from tqdm import tqdm

from .data import text_lines
from .encoders import (HEAD_DIR, POOLERS, SentenceEncoder, check_pooler, encode, layer_weights,
                       load_encoder)
from .metrics import alignment, uniformity

SEVEN = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
DEV = ("stsb-dev", "sickr-dev")
TASKS = SEVEN + DEV

# Per task: candidate folders under sts_dir (this project's layout first, then SentEval's
# data/downstream layout) and the file(s) to read.
_YEAR_DIRS = {f"sts{y}": (f"STS{y}-en-test", f"STS/STS{y}-en-test") for y in range(12, 17)}
_STSB_DIRS = ("stsb", "STS/STSBenchmark")
_SICK_DIRS = ("sick", "SICK")
_FILES = {"stsb": "sts-test.csv", "stsb-dev": "sts-dev.csv",
          "sickr": "SICK_test_annotated.txt", "sickr-dev": "SICK_trial.txt"}


@dataclass
class STSPairs:
    """Sentence pairs with gold similarity scores."""

    task: str
    sentences1: list
    sentences2: list
    scores: np.ndarray

    def __len__(self) -> int:
        return len(self.scores)


def _norm(sentence: str) -> str:
    return " ".join(sentence.split())


def _float(value: str, path: Path, lineno: int, what: str) -> float:
    try:
        score = float(value)
    except ValueError:
        raise ValueError(f"{path}:{lineno}: {what} {value!r} is not a number") from None
    if not math.isfinite(score):
        raise ValueError(f"{path}:{lineno}: {what} {value!r} is not finite")
    return score


def _pairs(task, s1, s2, scores, path) -> STSPairs:
    if not scores:
        raise ValueError(f"{path}: no scored pairs")
    if min(scores) == max(scores):
        # Spearman against a constant is undefined (NaN): refuse rather than report it
        raise ValueError(f"{path}: every gold score is {scores[0]}; a rank correlation needs "
                         "at least two different scores")
    return STSPairs(task, s1, s2, np.asarray(scores, dtype=np.float64))


def load_sts_year(folder, task: str = "sts") -> STSPairs:
    """One STS year in SentEval layout: every ``STS.input.<subset>.txt`` with its gold file.

    Pairs whose gold line is empty are dropped; the subsets are concatenated (sorted by name).
    """
    folder = Path(folder)
    inputs = sorted(folder.glob("STS.input.*.txt"))
    if not inputs:
        raise FileNotFoundError(f"{folder}: no STS.input.<subset>.txt files")
    s1, s2, scores = [], [], []
    for path in inputs:
        subset = path.name[len("STS.input."):-len(".txt")]
        gold_path = folder / f"STS.gs.{subset}.txt"
        if not gold_path.is_file():
            raise FileNotFoundError(f"{path} has no gold file {gold_path.name}")
        pairs, gold = text_lines(path), text_lines(gold_path)
        if len(pairs) != len(gold):
            raise ValueError(f"{path} has {len(pairs)} lines but {gold_path.name} has {len(gold)}")
        for lineno, (pair, g) in enumerate(zip(pairs, gold), 1):
            if not g.strip():
                continue
            fields = pair.split("\t")
            if len(fields) < 2:
                raise ValueError(f"{path}:{lineno}: expected two tab-separated sentences")
            s1.append(_norm(fields[0]))
            s2.append(_norm(fields[1]))
            scores.append(_float(g.strip(), gold_path, lineno, "gold score"))
    return _pairs(task, s1, s2, scores, folder)


def load_stsb(path, task: str = "stsb") -> STSPairs:
    """An STS Benchmark split: tab-separated, quoting disabled (the text has unbalanced ``"``).

    Fields: genre, file, year, id, score, sentence1, sentence2 (the original release adds
    licence fields on some rows; they are ignored).
    """
    path = Path(path)
    s1, s2, scores = [], [], []
    for lineno, line in enumerate(text_lines(path), 1):
        fields = line.split("\t")
        if len(fields) < 7:
            raise ValueError(f"{path}:{lineno}: expected at least 7 tab-separated fields, "
                             f"got {len(fields)}")
        scores.append(_float(fields[4], path, lineno, "score"))
        s1.append(_norm(fields[5]))
        s2.append(_norm(fields[6]))
    return _pairs(task, s1, s2, scores, path)


def load_sick(path, task: str = "sickr") -> STSPairs:
    """A SICK file: tab-separated with a header; columns sentence_A, sentence_B, relatedness_score."""
    path = Path(path)
    lines = text_lines(path)
    if not lines:
        raise ValueError(f"{path}: empty file")
    header = lines[0].lstrip("\ufeff").split("\t")
    wanted = ("sentence_A", "sentence_B", "relatedness_score")
    missing = [c for c in wanted if c not in header]
    if missing:
        raise ValueError(f"{path}: header lacks column(s) {', '.join(missing)}")
    a, b, r = (header.index(c) for c in wanted)
    s1, s2, scores = [], [], []
    for lineno, line in enumerate(lines[1:], 2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < len(header):
            raise ValueError(f"{path}:{lineno}: expected {len(header)} fields, got {len(fields)}")
        s1.append(_norm(fields[a]))
        s2.append(_norm(fields[b]))
        scores.append(_float(fields[r], path, lineno, "relatedness_score"))
    return _pairs(task, s1, s2, scores, path)


def task_source(sts_dir, task: str) -> Path:
    """The folder (STS12–16) or file (the others) of ``task`` under ``sts_dir``.

    Raises FileNotFoundError naming the places looked at.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks are {' '.join(TASKS)}")
    root = Path(sts_dir)
    if task in _YEAR_DIRS:
        candidates = [root / d for d in _YEAR_DIRS[task]]
        found = [c for c in candidates if c.is_dir()]
    else:
        dirs = _STSB_DIRS if task.startswith("stsb") else _SICK_DIRS
        candidates = [root / d / _FILES[task] for d in dirs]
        found = [c for c in candidates if c.is_file()]
    if not found:
        raise FileNotFoundError(f"{task}: none of {', '.join(str(c) for c in candidates)}")
    return found[0]


def load_task(sts_dir, task: str) -> STSPairs:
    source = task_source(sts_dir, task)
    if task in _YEAR_DIRS:
        return load_sts_year(source, task)
    return (load_stsb if task.startswith("stsb") else load_sick)(source, task)


def cosine_spearman(emb1: torch.Tensor, emb2: torch.Tensor, gold) -> float:
    """Spearman ×100 between ``cos(emb1_i, emb2_i)`` and the gold scores."""
    cos = F.cosine_similarity(emb1.double(), emb2.double(), dim=1).numpy()
    return float(spearmanr(cos, np.asarray(gold)).statistic * 100.0)


def _finite(*embeddings: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(e).all()) for e in embeddings)


def alignment_uniformity(emb1, emb2, gold, threshold: float = 4.0) -> dict:
    """Wang & Isola on STS pairs: alignment over pairs with gold ≥ ``threshold``,
    uniformity over every sentence of both sides; NaN for both when an embedding is not
    finite (the score is NaN then too, and its reason is reported with it)."""
    if not _finite(emb1, emb2):
        return {"uniformity": math.nan, "alignment": math.nan}
    keep = torch.as_tensor(np.asarray(gold) >= threshold)
    out = {"uniformity": float(uniformity(torch.cat([emb1, emb2]).double()))}
    out["alignment"] = float(alignment(emb1[keep].double(), emb2[keep].double())) if keep.any() else None
    return out


def rounded_average(scores: dict):
    """Mean of the scores each rounded to two decimals (SimCSE's table), None if empty."""
    if not scores:
        return None
    return float(np.mean([round(s, 2) for s in scores.values()]))


def undefined_reason(emb1: torch.Tensor, emb2: torch.Tensor) -> str:
    """Why the cosines of these embeddings have no rank correlation with the gold scores."""
    if not _finite(emb1, emb2):
        return "the embeddings contain NaN or Inf"
    return "the model gives every pair the same cosine (constant embeddings?)"


def evaluate_embeddings(embed, sts_dir, tasks=SEVEN, *, metrics: bool = False,
                        data: dict | None = None) -> dict:
    """Score an embedding function on STS tasks under SentEval's protocol.

    Args:
        embed: ``embed(task, sentences) -> N×d`` embeddings (a tensor or an array), row ``i``
            for ``sentences[i]``. Called once per task with both sides of every pair
            (``sentences1 + sentences2``).
        sts_dir: the data folder (layout in the module docstring).
        tasks: names from ``sts12 sts13 sts14 sts15 sts16 stsb sickr stsb-dev sickr-dev``.
        metrics: also give alignment and uniformity per task.
        data: optional cache ``task -> STSPairs`` (filled as tasks are read).

    Returns ``{"scores": {task: spearman×100}, "pairs": {task: n}, "missing": {task: why},
    "avg": mean of rounded scores or None, "metrics": {task: {"alignment", "uniformity"}},
    "undefined": {task: why}}``. Missing task files are reported in ``missing`` and skipped;
    a score that is NaN (constant or non-finite embeddings) is kept in ``scores`` and its
    reason given in ``undefined``.
    """
    tasks = check_tasks(tasks)
    result = {"scores": {}, "pairs": {}, "missing": {}, "avg": None, "metrics": {}, "undefined": {}}
    data = {} if data is None else data
    for task in tasks:
        if task not in data:
            try:
                data[task] = load_task(sts_dir, task)
            except FileNotFoundError as err:
                result["missing"][task] = str(err)
                continue
        pairs = data[task]
        emb = torch.as_tensor(embed(task, pairs.sentences1 + pairs.sentences2))
        if emb.ndim != 2 or emb.shape[0] != 2 * len(pairs):
            raise ValueError(f"{task}: embed gave shape {tuple(emb.shape)} for "
                             f"{2 * len(pairs)} sentences; expected ({2 * len(pairs)}, d)")
        emb1, emb2 = emb[:len(pairs)], emb[len(pairs):]
        with warnings.catch_warnings():  # constant cosines: the reason goes in "undefined"
            warnings.filterwarnings("ignore", message="An input array is constant")
            score = cosine_spearman(emb1, emb2, pairs.scores)
        result["scores"][task] = score
        result["pairs"][task] = len(pairs)
        if not math.isfinite(score):
            result["undefined"][task] = undefined_reason(emb1, emb2)
        if metrics:
            result["metrics"][task] = alignment_uniformity(emb1, emb2, pairs.scores)
    result["avg"] = rounded_average(result["scores"])
    return result


def evaluate(model, tokenizer, pooler: str, sts_dir, tasks=SEVEN, *, head=None,
             batch_size: int = 64, max_length: int | None = None, metrics: bool = False,
             data: dict | None = None, progress: bool = False) -> dict:
    """Score a Hugging Face encoder on STS tasks.

    Args:
        model: the encoder (``AutoModel``) or a :class:`~fastcl.encoders.SentenceEncoder`
            (then ``pooler`` and ``head`` come from it when ``pooler`` is None).
        tokenizer: its tokenizer.
        pooler: one of :data:`fastcl.encoders.POOLERS`; ``cls`` needs ``head``.
        sts_dir: the data folder (layout in the module docstring).
        tasks: names from ``sts12 sts13 sts14 sts15 sts16 stsb sickr stsb-dev sickr-dev``.
        metrics: also give alignment and uniformity per task.
        data: optional cache ``task -> STSPairs`` (filled as tasks are read).
        progress: show a progress bar per task on stderr (the command line does; off by
            default so that callers such as the trainer's dev evaluation stay quiet).

    Returns the dict of :func:`evaluate_embeddings`.
    """
    tasks = check_tasks(tasks)
    if isinstance(model, SentenceEncoder):
        encoder = model if pooler is None else SentenceEncoder(
            model.backbone, check_pooler(pooler), head if head is not None else model.head)
    else:
        encoder = SentenceEncoder(model, check_pooler(pooler), head)

    def embed(task, sentences):
        if not progress:
            return encode(encoder, tokenizer, sentences, batch_size=batch_size, max_length=max_length)
        with tqdm(total=len(sentences), desc=task, unit="sent", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            return encode(encoder, tokenizer, sentences, batch_size=batch_size,
                          max_length=max_length, on_batch=bar.update)

    return evaluate_embeddings(embed, sts_dir, tasks, metrics=metrics, data=data)


def check_tasks(tasks) -> tuple:
    """``tasks`` (a name or names) as a tuple; an empty or unknown one is a ValueError."""
    if isinstance(tasks, str):
        tasks = (tasks,)
    tasks = tuple(tasks)
    if not tasks:
        raise ValueError("tasks is empty")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise ValueError(f"tasks: unknown {', '.join(unknown)}; choose from {' '.join(TASKS)}")
    return tasks


def format_table(result: dict) -> str:
    """A two-row text table of the scores (and the average), then the missing tasks."""
    names = list(result["scores"]) + (["avg"] if result["scores"] else [])
    values = [f"{s:.2f}" for s in result["scores"].values()]
    if result["scores"]:
        values.append(f"{result['avg']:.2f}")
    widths = [max(len(n), len(v)) for n, v in zip(names, values)]
    lines = []
    if names:
        lines.append(" | ".join(n.rjust(w) for n, w in zip(names, widths)))
        lines.append(" | ".join(v.rjust(w) for v, w in zip(values, widths)))
    for task, why in result["missing"].items():
        lines.append(f"missing {task}, skipped: {why}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastcl.evaluate",
        description="Spearman x100 of cosine similarities on the STS tasks (SentEval's protocol).")
    p.add_argument("model", help="model folder (Hugging Face or sentence-transformers layout, "
                                 "e.g. OUT/model of python -m fastcl.trainer) or a hub name")
    p.add_argument("--pooler", choices=POOLERS, default=None,
                   help="how token states become a sentence embedding; 'cls' uses the MLP head "
                        "saved with the model (2_Dense/) or the model's own pooler (default: read "
                        "off the modules of a sentence-transformers folder, as the trainer saves "
                        "it: CLS token -> cls_before_pooler, with the 2_Dense Linear + Tanh head "
                        "-> cls, mean of tokens -> avg, after fastcl's WeightedLayerPooling -> "
                        "avg_first_last / avg_top2; MODEL/fastcl_pooler.json of an older fastcl "
                        "export comes first)")
    p.add_argument("--sts-dir", required=True, metavar="DIR", help="data folder holding STS12-en-test/ ... "
                   "STS16-en-test/, stsb/ and sick/")
    p.add_argument("--tasks", nargs="+", default=list(SEVEN), choices=TASKS, metavar="TASK",
                   help=f"tasks to run (default: the seven). Choices: {' '.join(TASKS)}")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per forward (default 64)")
    p.add_argument("--max-length", type=int, default=None,
                   help="truncate inputs to this many tokens (default: the model's limit)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--json", dest="json_out", default=None, metavar="FILE", help="also write the results here")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars or notes on stderr (the table is still printed)")
    return p


# sentence-transformers' Pooling modes fastcl reproduces, by the mode names of its config
# (``pooling_mode``: sentence-transformers >= 6; ``pooling_mode_<x>`` booleans before).
_ST_POOLING = {"cls": "cls_before_pooler", "mean": "avg"}
_ST_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                    "pooling_mode_mean_tokens": "mean",
                    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                    "pooling_mode_weightedmean_tokens": "weightedmean",
                    "pooling_mode_lasttoken": "lasttoken"}
_ST_UNSUPPORTED = ("; pass --pooler explicitly, or score the SentenceTransformer model itself "
                   "(fastcl.integrations.sentence_transformers.SentEvalSTSEvaluator)")


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: cannot read {what} ({err})") from None


def _st_pooling_modes(config: dict) -> tuple:
    """The pooling modes of a sentence-transformers Pooling config, as its loader reads them."""
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        return (mode,) if isinstance(mode, str) else tuple(mode)
    modes = tuple(m for key, m in _ST_LEGACY_MODES.items() if config.get(key))
    return modes or ("mean",)  # sentence-transformers' default


def _saved_layer_weights(folder: Path) -> torch.Tensor:
    """The ``layer_weights`` a sentence-transformers WeightedLayerPooling saved in ``folder``."""
    safetensors, pickled = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if safetensors.is_file():
            from safetensors.torch import load_file
            state = load_file(str(safetensors))
        elif pickled.is_file():
            state = torch.load(pickled, map_location="cpu", weights_only=True)
        else:
            raise ValueError(f"{folder}: no WeightedLayerPooling weights (model.safetensors)")
        return state["layer_weights"].detach().double().flatten()
    except (OSError, RuntimeError, KeyError, AttributeError) as err:
        raise ValueError(f"{folder}: cannot read the WeightedLayerPooling weights "
                         f"({type(err).__name__}: {err})") from None


def _transformer_layers(folder: Path) -> tuple:
    """``(num_hidden_layers, output_hidden_states)`` of the Hugging Face model in ``folder``,
    as sentence-transformers' Transformer loads it (its ``config_kwargs`` override config.json)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise ValueError(f"{folder}: cannot read the model's config.json ({err})") from None
    st_config = folder / "sentence_bert_config.json"
    overrides = {}
    if st_config.is_file():
        record = _read_json(st_config, "the Transformer config")
        overrides = record.get("config_kwargs") or record.get("config_args") or {}
    hidden = overrides.get("output_hidden_states", getattr(config, "output_hidden_states", False))
    return config.num_hidden_layers, bool(hidden)


def _layer_pooler(folder: Path, transformer: Path) -> str:
    """``avg_first_last`` or ``avg_top2``: the pooler whose layers and weights the
    WeightedLayerPooling in ``folder`` (before mean pooling) has; else a ValueError."""
    config_path = folder / "config.json"
    config = _read_json(config_path, "the WeightedLayerPooling config")
    # sentence-transformers' defaults for keys a config leaves out
    start, declared = config.get("layer_start", 4), config.get("num_hidden_layers", 12)
    weights = _saved_layer_weights(folder)
    num_layers, hidden = _transformer_layers(transformer)
    found = None
    for pooler in ("avg_first_last", "avg_top2"):  # the same module on a 2-layer model
        want_start, want = layer_weights(pooler, num_layers)
        want = torch.tensor(want, dtype=torch.float64)
        if (start == want_start and declared == num_layers and weights.shape == want.shape
                and bool(torch.allclose(weights / weights.sum(), want / want.sum(), atol=1e-6))):
            found = pooler
            break
    if found is None:
        shown = ", ".join(format(w, "g") for w in weights.tolist())
        raise ValueError(
            f"{folder}: WeightedLayerPooling from layer {start} with weights [{shown}] "
            f"(num_hidden_layers {declared}, the model has {num_layers}) is none of fastcl's "
            f"poolers: avg_first_last is layer_start 1 with weight 1 on the first and last layers "
            f"and 0 between, avg_top2 layer_start {num_layers - 1} with weights [1, 1]"
            + _ST_UNSUPPORTED)
    if not hidden:
        raise ValueError(
            f"{transformer / 'config.json'}: output_hidden_states is off, so the "
            f"WeightedLayerPooling in {folder.name} gets no layer states and sentence-transformers "
            f"passes the last layer through (fastcl's avg, not {found})" + _ST_UNSUPPORTED)
    return found


def _check_head(folder: Path, dim: int | None) -> None:
    """A ValueError unless the Dense in ``folder`` is the ``cls`` pooler's head: a square
    Linear with bias, then Tanh, on the sentence embedding."""
    config_path = folder / "config.json"
    config = _read_json(config_path, "the Dense config")
    square = config.get("in_features") == config.get("out_features") and (
        dim is None or config.get("in_features") == dim)
    tanh = str(config.get("activation_function", "")).rpartition(".")[2] == "Tanh"
    on_embedding = all(config.get(key, "sentence_embedding") == "sentence_embedding"
                       for key in ("module_input_name", "module_output_name"))
    if not (square and tanh and config.get("bias", True) and on_embedding):
        raise ValueError(f"{config_path}: this Dense is not the cls pooler's head (a square "
                         f"Linear with bias, then Tanh, on the sentence embedding), so fastcl has "
                         f"no pooler for it" + _ST_UNSUPPORTED)


def sentence_transformers_pooler(folder) -> tuple | None:
    """``(pooler, config path)`` that reproduces a sentence-transformers folder's embeddings
    up to their length, or None when ``folder`` has no ``modules.json`` with a Pooling module.

    Every folder the trainer saves is recognized. The modules must be one of

    - Transformer → Pooling: CLS token ``cls_before_pooler``, mean of the tokens ``avg``;
    - Transformer → Pooling (CLS token) → Dense in ``2_Dense`` (square Linear + Tanh, the
      MLP head): ``cls``;
    - Transformer → WeightedLayerPooling → Pooling (mean): ``avg_first_last`` or
      ``avg_top2`` when the layers and weights are those of
      :func:`fastcl.integrations.sentence_transformers.models.pooling_modules` (the weights
      up to a common factor: they are divided by their sum) and the model returns every layer's states
      (``output_hidden_states``); on a 2-layer model the two are the same, ``avg_first_last``;

    each optionally followed by Normalize (it does not change a cosine). The config path is
    the WeightedLayerPooling's for ``avg_first_last`` / ``avg_top2``, else the Pooling's.
    Anything else (max, weighted-mean, last-token or concatenated pooling, other layer
    weights, another Dense or any other module, a lower-casing Transformer) raises a
    ValueError saying what fastcl cannot reproduce.
    """
    folder = Path(folder)
    path = folder / "modules.json"
    if not path.is_file():
        return None
    modules = _read_json(path, "the sentence-transformers module list")
    try:
        kinds = [str(m["type"]).rpartition(".")[2] for m in modules]
    except (TypeError, KeyError) as err:
        raise ValueError(f"{path}: not a sentence-transformers module list ({err!r})") from None
    if "Pooling" not in kinds:
        return None
    pooling = kinds.index("Pooling")
    layers = kinds[:pooling] == ["Transformer", "WeightedLayerPooling"]
    if kinds[:pooling] != ["Transformer"] and not layers:
        raise ValueError(f"{path}: modules {' -> '.join(kinds)}: fastcl reproduces Transformer -> "
                         f"[WeightedLayerPooling ->] Pooling [-> Dense] [-> Normalize] only"
                         + _ST_UNSUPPORTED)
    rest = kinds[pooling + 1:]
    head = rest[:1] == ["Dense"] and modules[pooling + 1].get("path") == HEAD_DIR
    extra = [k for k in rest[1 if head else 0:] if k != "Normalize"]
    if extra:
        raise ValueError(f"{path}: {', '.join(extra)} after Pooling changes the embeddings and "
                         f"fastcl has no such pooler" + _ST_UNSUPPORTED)
    config_path = folder / modules[pooling].get("path", "") / "config.json"
    pooling_config = _read_json(config_path, "the Pooling config")
    modes = _st_pooling_modes(pooling_config)
    if len(modes) != 1 or modes[0] not in _ST_POOLING:
        raise ValueError(f"{config_path}: pooling {' + '.join(map(str, modes))} has no fastcl pooler "
                         f"(fastcl reproduces cls -> cls_before_pooler and mean -> avg)"
                         + _ST_UNSUPPORTED)
    transformer = folder / modules[0].get("path", "")
    st_config = transformer / "sentence_bert_config.json"
    if st_config.is_file() and _read_json(st_config, "the Transformer config").get("do_lower_case"):
        raise ValueError(f"{st_config}: the model lower-cases its input (do_lower_case), which "
                         f"fastcl's encoder does not" + _ST_UNSUPPORTED)
    pooler = _ST_POOLING[modes[0]]
    if head:
        if pooler != "cls_before_pooler" or layers:
            raise ValueError(f"{path}: Dense after {modes[0]} pooling"
                             + (" of WeightedLayerPooling" if layers else "")
                             + " has no fastcl pooler (fastcl's cls is the CLS token through "
                               "Linear + Tanh)" + _ST_UNSUPPORTED)
        dim = pooling_config.get("embedding_dimension", pooling_config.get("word_embedding_dimension"))
        _check_head(folder / HEAD_DIR, dim)
        pooler = "cls"
    if layers:
        if pooler != "avg":
            raise ValueError(f"{config_path}: {modes[0]} pooling after WeightedLayerPooling has no "
                             f"fastcl pooler (avg_first_last and avg_top2 take the mean of the "
                             f"tokens)" + _ST_UNSUPPORTED)
        layer_folder = folder / modules[pooling - 1].get("path", "")
        pooler = _layer_pooler(layer_folder, transformer)
        config_path = layer_folder / "config.json"
    return pooler, config_path


def pooler_of(model) -> tuple:
    """``(pooler, where it was read)`` for a model folder given without ``--pooler``:
    ``fastcl_pooler.json`` of an export by an older fastcl, else the modules of a
    sentence-transformers folder (:func:`sentence_transformers_pooler`). Raises SystemExit when there is neither or it cannot be
    reproduced."""
    path = Path(model) / "fastcl_pooler.json"
    if path.is_file():
        try:
            record = _read_json(path, "the pooler a fastcl export was saved with")
            if not isinstance(record, dict) or "pooler" not in record:
                raise ValueError(f"{path}: not a fastcl pooler record: expected "
                                 f'{{"pooler": NAME}}, got {json.dumps(record)[:80]}')
            return check_pooler(record["pooler"], name=str(path)), path
        except ValueError as err:
            raise SystemExit(f"python -m fastcl.evaluate: error: {err} (pass --pooler to "
                             f"override it)") from None
    found = None
    if Path(model).is_dir():
        try:
            found = sentence_transformers_pooler(model)
        except ValueError as err:
            raise SystemExit(f"python -m fastcl.evaluate: error: {err}") from None
    if found is None:
        raise SystemExit(f"--pooler is needed: {model} has no fastcl_pooler.json and no "
                         f"sentence-transformers Pooling module (modules.json) "
                         f"(choose from {', '.join(POOLERS)})")
    return found


def saved_pooler(model) -> str:
    """The pooler recorded with a model folder (see :func:`pooler_of`)."""
    return pooler_of(model)[0]


@contextlib.contextmanager
def _quiet_loading(quiet: bool):
    """Without transformers' own progress bars (loading the weights) when ``quiet``."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and was:
            hf_logging.enable_progress_bar()


def _check_writable(path: Path) -> None:
    """``--json``: a file whose folder exists and which may be created or replaced."""
    folder = path.parent
    if path.is_dir():
        raise SystemExit(f"--json: {path} is a folder; give a file name")
    if not folder.is_dir():
        raise SystemExit(f"--json: no such folder: {folder} (for {path})")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise SystemExit(f"--json: cannot write {path} (permission denied)")


def main(argv=None) -> dict:
    """The command line. Exits non-zero with the reason when an argument or a data file is
    wrong, when no task file exists under ``--sts-dir``, when the model cannot be loaded, and
    when a score is undefined (NaN: constant or non-finite embeddings; the table is printed
    first)."""
    args = build_parser().parse_args(argv)
    if args.batch_size < 1:
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_length is not None and args.max_length < 2:
        raise SystemExit(f"--max-length must be >= 2, got {args.max_length}")
    if not Path(args.sts_dir).is_dir():
        raise SystemExit(f"--sts-dir: no such folder: {args.sts_dir}")
    if args.json_out:
        # before the scoring (minutes): a path that cannot be written is an error now
        _check_writable(Path(args.json_out))
    if args.pooler:
        pooler = args.pooler
    else:
        pooler, source = pooler_of(args.model)
        if not args.quiet:
            print(f"pooler {pooler} (from {source})", file=sys.stderr)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # Read every task before loading the model: a malformed file is an error naming it.
    data, missing = {}, {}
    for task in args.tasks:
        try:
            data[task] = load_task(args.sts_dir, task)
        except FileNotFoundError as err:
            missing[task] = str(err)
        except ValueError as err:
            raise SystemExit(f"python -m fastcl.evaluate: error: {task}: {err}") from None
    if not data:
        raise SystemExit(f"python -m fastcl.evaluate: error: nothing to score: no task file found "
                         f"under {args.sts_dir}:\n" + "\n".join(f"  {why}" for why in missing.values()))
    try:
        with _quiet_loading(args.quiet):
            encoder, tokenizer = load_encoder(args.model, pooler, arg="model", device=device)
    except (ValueError, OSError) as err:
        raise SystemExit(f"python -m fastcl.evaluate: error: {err}") from err
    result = evaluate(encoder, tokenizer, None, args.sts_dir, args.tasks, batch_size=args.batch_size,
                      max_length=args.max_length, data=data, progress=not args.quiet)
    print(format_table(result))
    if result["undefined"]:
        raise SystemExit("python -m fastcl.evaluate: error: no correlation for " + "; ".join(
            f"{task}: {why}" for task, why in result["undefined"].items()))
    if args.json_out:
        out = {"model": args.model, "pooler": pooler, "sts_dir": str(args.sts_dir), **result}
        Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
