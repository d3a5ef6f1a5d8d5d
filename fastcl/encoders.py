"""Sentence encoders around Hugging Face models: loading, pooling, encoding, export.

A sentence embedding is a pooled view of the encoder's token states ``H`` (B×T×d) under the
attention mask ``m`` (SimCSE's poolers):

- ``cls``: ``tanh(W·H[:, 0] + b)``, the CLS state through an MLP head (Linear(d, d) + Tanh)
  that fastcl owns and trains; it is not the model's pretrained pooler.
- ``cls_before_pooler``: ``H[:, 0]``, the raw CLS state.
- ``avg``: ``Σ_t m_t H_t / Σ_t m_t`` over the last layer.
- ``avg_first_last``: the masked mean of ``(H¹ + H^L) / 2`` (first and last transformer layers,
  ``hidden_states[1]`` and ``hidden_states[-1]``).
- ``avg_top2``: the masked mean of ``(H^{L-1} + H^L) / 2``.

:func:`save_sentence_encoder` writes a folder that loads with ``AutoModel.from_pretrained``
and with ``sentence_transformers.SentenceTransformer``, giving the same embeddings as
:func:`encode` with the same pooler.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

POOLERS = ("cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2")

# Where save_sentence_encoder puts the MLP head of the `cls` pooler (a sentence-transformers
# Dense module: Linear + Tanh).
HEAD_DIR = "2_Dense"


def check_pooler(pooler: str, name: str = "pooler") -> str:
    if pooler not in POOLERS:
        raise ValueError(f"{name} must be one of {', '.join(POOLERS)}, got {pooler!r}")
    return pooler


class MLPHead(nn.Module):
    """SimCSE's training head ``z = tanh(W h + b)`` with ``W ∈ R^{d×d}``.

    Initialized like a BERT linear layer (``W ~ N(0, std²)``, ``b = 0``).
    """

    def __init__(self, dim: int, init_std: float = 0.02):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.activation = nn.Tanh()
        nn.init.normal_(self.dense.weight, std=init_std)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(x))


def _masked_mean(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.unsqueeze(-1).to(states.dtype)
    return (states * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def pool(outputs, attention_mask: torch.Tensor, pooler: str) -> torch.Tensor:
    """The pooled embedding (B×d) before any head; see the module docstring."""
    if pooler in ("cls", "cls_before_pooler"):
        return outputs.last_hidden_state[:, 0]
    if pooler == "avg":
        return _masked_mean(outputs.last_hidden_state, attention_mask)
    hidden = outputs.hidden_states
    if hidden is None:
        raise ValueError(f"pooler {pooler!r} needs the model's hidden_states "
                         "(run it with output_hidden_states=True)")
    if pooler == "avg_first_last":
        return _masked_mean((hidden[1] + hidden[-1]) / 2.0, attention_mask)
    if pooler == "avg_top2":
        return _masked_mean((hidden[-2] + hidden[-1]) / 2.0, attention_mask)
    raise ValueError(check_pooler(pooler))


class SentenceEncoder(nn.Module):
    """A Hugging Face encoder plus a pooler; pooler ``cls`` also applies ``head``.

    ``forward(**features)`` takes the tokenizer's output (input_ids, attention_mask and,
    if the tokenizer gives them, token_type_ids) and returns B×d embeddings.
    """

    def __init__(self, backbone: nn.Module, pooler: str, head: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.pooler = check_pooler(pooler)
        if pooler == "cls" and head is None:
            raise ValueError("pooler 'cls' needs its MLP head (head=None was given)")
        self.head = head if pooler == "cls" else None

    def forward(self, input_ids, attention_mask, token_type_ids=None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        outputs = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=self.pooler in ("avg_first_last", "avg_top2"),
                                return_dict=True, **extra)
        z = pool(outputs, attention_mask, self.pooler)
        return self.head(z) if self.head is not None else z


@contextlib.contextmanager
def dropout_rate(module: nn.Module, p: float):
    """Temporarily set the rate of every ``nn.Dropout`` in ``module`` to ``p``.

    Hugging Face BERT-style models read their attention dropout from these modules too
    (``self.dropout.p``), so this covers hidden and attention dropout alike.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {p}")
    dropouts = [m for m in module.modules() if isinstance(m, nn.Dropout)]
    saved = [m.p for m in dropouts]
    try:
        for m in dropouts:
            m.p = p
        yield
    finally:
        for m, old in zip(dropouts, saved):
            m.p = old


def default_max_length(tokenizer, backbone=None) -> int:
    """The longest input the model takes: the tokenizer's limit, capped by the position table."""
    limit = tokenizer.model_max_length if tokenizer.model_max_length < 1_000_000 else 512
    positions = getattr(getattr(backbone, "config", None), "max_position_embeddings", None)
    return min(limit, positions) if positions else limit


def tokenize(tokenizer, sentences, max_length: int, device=None) -> dict:
    features = tokenizer(list(sentences), padding=True, truncation=True, max_length=max_length,
                         return_tensors="pt")
    keep = ("input_ids", "attention_mask", "token_type_ids")
    return {k: v.to(device) if device is not None else v for k, v in features.items() if k in keep}


@torch.no_grad()
def encode(encoder: SentenceEncoder, tokenizer, sentences, *, batch_size: int = 64,
           max_length: int | None = None, on_batch=None) -> torch.Tensor:
    """Embed ``sentences`` in eval mode (no dropout); returns a float32 CPU tensor (N×d).

    Sentences are batched in order of length (less padding) and returned in input order.
    Longer inputs are truncated to ``max_length`` tokens (default: the model's limit).
    ``on_batch(n)`` is called after each batch of n sentences (a progress bar's update).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sentences = list(sentences)
    if not sentences:
        raise ValueError("sentences is empty")
    device = next(encoder.parameters()).device
    max_length = max_length or default_max_length(tokenizer, encoder.backbone)
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    out = [None] * len(sentences)
    was_training = encoder.training
    encoder.eval()
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            feats = tokenize(tokenizer, [sentences[i] for i in idx], max_length, device)
            emb = encoder(**feats).float().cpu()
            for row, i in enumerate(idx):
                out[i] = emb[row]
            if on_batch is not None:
                on_batch(len(idx))
    finally:
        encoder.train(was_training)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------
# Loading

def _looks_like_path(name: str) -> bool:
    return (name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def _transformer_folder(path: Path) -> Path:
    """The folder holding the Hugging Face model of a sentence-transformers folder."""
    modules = path / "modules.json"
    if modules.is_file():
        for mod in json.loads(modules.read_text()):
            if mod.get("type", "").endswith("Transformer"):
                return path / mod.get("path", "")
    return path


def _hub_error(name: str, arg: str, err: Exception) -> OSError:
    from huggingface_hub import constants
    why = ("the Hugging Face hub is offline here (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE
           else "it could not be fetched from the Hugging Face hub (no connection, or no such model)")
    return OSError(f"{arg}: cannot load {name!r}: it is not a local folder and {why}. "
                   f"Pass a local path to a folder with config.json, the weights and the tokenizer "
                   f"files (as written by save_pretrained). ({type(err).__name__}: {err})")


def load_backbone(name_or_path: str, *, arg: str = "model"):
    """``(AutoModel, AutoTokenizer)`` from a local folder or a hub name.

    A sentence-transformers folder whose model lives in a subfolder (``0_Transformer/``) works.
    A hub name that cannot be fetched raises an OSError asking for a local path.
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ValueError(f"{arg} must be a model name or a folder, got {name_or_path!r}")
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        path = _transformer_folder(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{arg}: {path} has no config.json; is it a Hugging Face "
                                    "model folder?")
        source = str(path)
    elif path.exists() or _looks_like_path(name):
        raise FileNotFoundError(f"{arg}: no such model folder: {name}")
    else:
        source = name
    try:
        config = AutoConfig.from_pretrained(source)
    except OSError as err:
        if source == name and not path.exists():
            raise _hub_error(name, arg, err) from err
        raise
    backbone = AutoModel.from_pretrained(source, config=config)
    tokenizer = AutoTokenizer.from_pretrained(source)
    return backbone, tokenizer


def load_head(path, dim: int | None = None) -> MLPHead | None:
    """The ``cls`` pooler's MLP head saved by :func:`save_sentence_encoder`, or None."""
    folder = Path(path) / HEAD_DIR
    if not (folder / "config.json").is_file():
        return None
    from safetensors.torch import load_file
    config = json.loads((folder / "config.json").read_text())
    if config.get("in_features") != config.get("out_features") or "Tanh" not in config.get(
            "activation_function", ""):
        raise ValueError(f"{folder} is not a square Linear + Tanh head")
    if dim is not None and config["in_features"] != dim:
        raise ValueError(f"{folder} maps width {config['in_features']}, the encoder has {dim}")
    head = MLPHead(config["in_features"])
    state = load_file(str(folder / "model.safetensors"))
    head.dense.load_state_dict({"weight": state["linear.weight"], "bias": state["linear.bias"]})
    return head


def model_pooler_head(backbone) -> MLPHead | None:
    """The model's own Linear + Tanh pooler as a head, if it has one.

    SimCSE's released checkpoints store their MLP there; :func:`save_sentence_encoder` does
    the same, so ``pooler_output`` of an exported ``cls`` model is its sentence embedding.
    """
    own = getattr(backbone, "pooler", None)
    dense = getattr(own, "dense", None)
    if not isinstance(dense, nn.Linear) or not isinstance(getattr(own, "activation", None), nn.Tanh):
        return None
    head = MLPHead(dense.in_features)
    head.dense.load_state_dict(dense.state_dict())
    return head.to(dense.weight.device)


def load_encoder(name_or_path: str, pooler: str, *, arg: str = "model", device=None):
    """``(SentenceEncoder, tokenizer)`` ready to :func:`encode`.

    For pooler ``cls`` the head is the one saved next to the model (``2_Dense/``), else the
    model's own Linear + Tanh pooler (SimCSE's convention); a model with neither is an error.
    """
    check_pooler(pooler)
    backbone, tokenizer = load_backbone(name_or_path, arg=arg)
    head = None
    if pooler == "cls":
        head = load_head(name_or_path, backbone.config.hidden_size) or model_pooler_head(backbone)
        if head is None:
            raise ValueError(f"pooler 'cls' needs an MLP head: {name_or_path} has neither "
                             f"{HEAD_DIR}/ nor a Linear + Tanh pooler; use cls_before_pooler")
    encoder = SentenceEncoder(backbone, pooler, head)
    return encoder.to(device or "cpu").eval(), tokenizer


# ---------------------------------------------------------------------------------------
# Export

def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")


def _layer_weights(pooler: str, num_layers: int):
    """(layer_start, weights) of sentence-transformers' WeightedLayerPooling for the pooler.

    ``all_layer_embeddings[layer_start:]`` are averaged with the weights; zero weights pick
    the first and last layers out of the range.
    """
    if pooler == "avg_first_last":
        return 1, [1.0] + [0.0] * (num_layers - 2) + [1.0]
    return num_layers - 1, [1.0, 1.0]


def _sentence_transformers_modules(stage: Path, pooler: str, dim: int, num_layers: int,
                                   head: MLPHead | None) -> list:
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooler in ("avg_first_last", "avg_top2"):
        start, weights = _layer_weights(pooler, num_layers)
        folder = stage / "1_WeightedLayerPooling"
        _write_json(folder / "config.json", {"word_embedding_dimension": dim, "layer_start": start,
                                             "num_hidden_layers": num_layers})
        save_file({"layer_weights": torch.tensor(weights)}, str(folder / "model.safetensors"))
        modules.append({"idx": 1, "name": "1", "path": folder.name,
                        "type": "sentence_transformers.models.WeightedLayerPooling"})
    cls = pooler in ("cls", "cls_before_pooler")
    pooling = f"{len(modules)}_Pooling"
    _write_json(stage / pooling / "config.json", {
        "word_embedding_dimension": dim, "pooling_mode_cls_token": cls,
        "pooling_mode_mean_tokens": not cls, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False})
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": pooling,
                    "type": "sentence_transformers.models.Pooling"})
    if pooler == "cls":
        folder = stage / HEAD_DIR
        _write_json(folder / "config.json", {"in_features": dim, "out_features": dim, "bias": True,
                                             "activation_function": "torch.nn.modules.activation.Tanh"})
        save_file({"linear.weight": head.dense.weight.detach().float().cpu().contiguous(),
                   "linear.bias": head.dense.bias.detach().float().cpu().contiguous()},
                  str(folder / "model.safetensors"))
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": HEAD_DIR,
                        "type": "sentence_transformers.models.Dense"})
    return modules


def sentence_transformers_config() -> dict:
    """``config_sentence_transformers.json`` as sentence-transformers writes it: the versions
    the export was written with, no prompts, cosine similarity."""
    from importlib import metadata

    versions = {}
    for key, package in (("sentence_transformers", "sentence-transformers"),
                         ("transformers", "transformers"), ("pytorch", "torch")):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[key] = torch.__version__ if package == "torch" else metadata.version(package)
    return {"model_type": "SentenceTransformer", "__version__": versions, "prompts": {},
            "default_prompt_name": None, "similarity_fn_name": "cosine"}


# ---------------------------------------------------------------------------------------
# Model card

# How the embedding is read off ``AutoModel``'s output ``out`` for each pooler.
_MASKED_MEAN = ('mask = batch["attention_mask"].unsqueeze(-1).float()\n'
                'embeddings = (states * mask).sum(1) / mask.sum(1)')
_TRANSFORMERS_POOLING = {
    "cls_before_pooler": "embeddings = out.last_hidden_state[:, 0]  # the raw CLS state",
    "avg": "states = out.last_hidden_state\n" + _MASKED_MEAN,
    "avg_first_last": "states = (out.hidden_states[1] + out.hidden_states[-1]) / 2\n" + _MASKED_MEAN,
    "avg_top2": "states = (out.hidden_states[-2] + out.hidden_states[-1]) / 2\n" + _MASKED_MEAN,
}
_CLS_POOLER_OUTPUT = "embeddings = out.pooler_output  # the CLS state through the trained MLP (Linear + Tanh)"
_CLS_DENSE = ('from safetensors.torch import load_file\n'
              f'head = load_file(f"{{path}}/{HEAD_DIR}/model.safetensors")  # the trained MLP\n'
              'embeddings = torch.tanh(out.last_hidden_state[:, 0] @ head["linear.weight"].T\n'
              '                        + head["linear.bias"])')


def _number(value) -> str:
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    return "n/a" if value != value else format(value, "g")


@dataclass
class ModelCard:
    """What a model card (the export's ``README.md``) says beyond what the export itself
    knows; every field is optional and a section without its facts is left out.

    ``method`` is a key of :data:`fastcl.citations.METHODS` (its paper is cited);
    ``hyperparameters`` the objective's and ``training`` the run's settings (name → value);
    ``data`` the training data (a path or a dataset name) and ``examples`` how many examples
    it gave; ``step`` the exported step of ``total_steps``, chosen as ``selection`` says;
    ``dev_scores`` / ``test_scores`` Spearman ×100 per task, ``dev_metrics`` other dev
    numbers (alignment, uniformity); ``citations`` more BibTeX entries to cite.
    """

    base_model: str | None = None
    method: str | None = None
    hyperparameters: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    data: str | None = None
    examples: int | None = None
    step: int | None = None
    total_steps: int | None = None
    selection: str | None = None
    dev_scores: dict = field(default_factory=dict)
    dev_metrics: dict = field(default_factory=dict)
    test_scores: dict = field(default_factory=dict)
    citations: tuple = ()

    def hub_base_model(self) -> str | None:
        """The base model as a Hugging Face hub name; None for a local folder."""
        name = self.base_model
        if not name or Path(name).expanduser().exists() or _looks_like_path(name):
            return None
        return name

    def render(self, path, pooler: str, dim: int, max_seq_length: int, *,
               pooler_output: bool = False) -> str:
        """The card of the export in ``path`` (its pooler, width and input limit);
        ``pooler_output``: the model's own pooler holds the ``cls`` MLP head."""
        from .citations import METHODS

        path = str(path)
        name, paper, bibtex = METHODS[self.method] if self.method else (None, None, None)
        tags = ["sentence-transformers", "sentence-similarity", "feature-extraction", "fastcl"]
        tags += [self.method] if self.method else []
        front = ["---", "library_name: sentence-transformers", "pipeline_tag: sentence-similarity",
                 "tags:", *(f"- {t}" for t in tags)]
        if self.hub_base_model():
            front.append(f"base_model: {json.dumps(self.hub_base_model())}")
        lines = [*front, "---", ""]
        base = Path(self.base_model).name if self.base_model else None
        lines.append(f"# {name or 'Sentence'} encoder" + (f" from {base}" if base else ""))
        lines += ["", "A sentence encoder trained with fastcl"
                      + (f" with the {name} objective ({paper})" if name else "")
                      + f". It maps a sentence to a {dim}-dimensional vector (pooler `{pooler}`, "
                      f"inputs up to {max_seq_length} tokens); compare vectors by cosine similarity.",
                  ""]
        lines += self._training(pooler) + self._evaluation(path)
        lines += self._usage(path, pooler, pooler_output)
        cited = ([bibtex] if bibtex else []) + list(self.citations)
        if cited:
            lines += ["## Citation", "", "```bibtex", "\n\n".join(c.strip() for c in cited), "```", ""]
        return "\n".join(lines).rstrip("\n") + "\n"

    def _training(self, pooler: str) -> list:
        facts = []
        if self.base_model:
            facts.append(f"- **Base model:** `{self.base_model}`")
        if self.method:
            facts.append(f"- **Method:** `{self.method}`")
        if self.data:
            facts.append(f"- **Data:** `{self.data}`"
                         + (f", {self.examples} examples" if self.examples is not None else ""))
        if self.step is not None:
            facts.append(f"- **Steps:** the model of step {self.step}"
                         + (f" of {self.total_steps}" if self.total_steps else "")
                         + (f", {self.selection}" if self.selection else ""))
        facts.append(f"- **Pooler:** `{pooler}`")
        lines = ["## Training", "", *facts, ""]
        for title, table in (("Hyper-parameters of the method", self.hyperparameters),
                             ("Training settings", self.training)):
            if table:
                lines += [f"### {title}", "", "| name | value |", "| --- | --- |",
                          *(f"| `{k}` | {_number(v)} |" for k, v in table.items()), ""]
        return lines

    def _evaluation(self, path: str) -> list:
        lines = ["## Evaluation", ""]
        for title, scores, extra in (("Dev", self.dev_scores, self.dev_metrics),
                                     ("Test", self.test_scores, {})):
            lines += [f"### {title}", ""]
            if scores:
                lines += ["Spearman correlation ×100 of cosine similarities (SentEval's protocol)"
                          + (f", at step {self.step}" if title == "Dev" and self.step else "") + ":",
                          "", "| task | Spearman ×100 |", "| --- | --- |",
                          *(f"| {k} | {_number(v)} |" for k, v in scores.items()), ""]
                if extra:
                    lines += [", ".join(f"{k}: {_number(v)}" for k, v in extra.items())
                              + " (on STS-B dev; lower is better).", ""]
            elif title == "Dev":
                lines += ["No dev evaluation was run (the trainer's `--sts-dir` scores STS-B "
                          "dev during training).", ""]
            else:
                lines += ["Not computed during training. The seven STS tasks (STS12-16, STS-B, "
                          "SICK-R), with the data in DIR:", "", "```bash",
                          f"python -m fastcl.evaluate {path} --sts-dir DIR", "```", ""]
        return lines

    @staticmethod
    def _usage(path: str, pooler: str, pooler_output: bool) -> list:
        if pooler == "cls":
            pooling = _CLS_POOLER_OUTPUT if pooler_output else _CLS_DENSE
        else:
            pooling = _TRANSFORMERS_POOLING[pooler]
        hidden = ", output_hidden_states=True" if pooler in ("avg_first_last", "avg_top2") else ""
        sentences = '["A man is playing a guitar.", "Someone plays an instrument."]'
        return [
            "## Usage", "", "### Sentence Transformers", "", "```python",
            "from sentence_transformers import SentenceTransformer", "",
            f'model = SentenceTransformer("{path}")',
            f"embeddings = model.encode({sentences})",
            "print(model.similarity(embeddings, embeddings))", "```", "",
            "### Transformers", "", "```python", "import torch",
            "from transformers import AutoModel, AutoTokenizer", "",
            f'path = "{path}"',
            "tokenizer = AutoTokenizer.from_pretrained(path)",
            "model = AutoModel.from_pretrained(path).eval()",
            f"batch = tokenizer({sentences}, padding=True, truncation=True, return_tensors=\"pt\")",
            "with torch.no_grad():",
            f"    out = model(**batch{hidden})",
            pooling,
            "print(torch.nn.functional.cosine_similarity(embeddings[0], embeddings[1], dim=0))",
            "```", "", "### fastcl", "", "```python",
            "from fastcl.encoders import encode, load_encoder", "",
            f'encoder, tokenizer = load_encoder("{path}", "{pooler}")',
            f"embeddings = encode(encoder, tokenizer, {sentences})", "```", ""]


# Exports live in versions under VERSIONS_DIR; ``VERSIONS_DIR/current`` is a symbolic link to
# the complete one, and every top-level entry of the export (config.json, model.safetensors,
# 2_Dense, ...) is a link through it. Switching ``current`` with one rename switches them all.
VERSIONS_DIR = ".model"
SELECTION_FILE = "fastcl_selection.json"   # the trainer's {"step", "metric"} of an export
CURRENT = "current"


def crash_point(name: str) -> None:
    """Test hook: ``FASTCL_CRASH_AT=NAME[:N]`` makes the process SIGKILL itself the N-th time
    (default the first) it reaches the write point ``NAME`` (``checkpoint-write``,
    ``export-stage``, ``export-publish``, ``export-links``). For fault-injection tests only."""
    spec = os.environ.get("FASTCL_CRASH_AT")
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    counts = crash_point.__dict__.setdefault("counts", {})
    counts[name] = counts.get(name, 0) + 1
    if counts[name] == int(nth or 1):
        import signal
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` (and the folders themselves) to disk."""
    for root, _dirs, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable (best effort: not every file system
    lets a folder be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def clean_export_leftovers(out_dir) -> list:
    """Remove what an interrupted :func:`save_sentence_encoder` left in ``out_dir`` (staging
    folders, temporary links, versions that are not the current one). Returns their paths."""
    out_dir = Path(out_dir)
    removed = []
    for entry in out_dir.glob(".*"):
        # the staging folder of older fastcl versions, temporary links of _link
        stale_link = ".link-" in entry.name and entry.name.rpartition("-")[2].isdigit()
        if entry.name == ".export.tmp" or (stale_link and entry.is_symlink()):
            _remove(entry)
            removed.append(entry)
    versions = out_dir / VERSIONS_DIR
    if not versions.is_dir():
        return removed
    current = versions / CURRENT
    keep = os.readlink(current) if current.is_symlink() else None
    for entry in versions.iterdir():
        if entry.name == CURRENT or entry.name == keep:
            continue
        _remove(entry)
        removed.append(entry)
    return removed


def read_selection(out_dir) -> dict | None:
    """The ``selection`` published with the export in ``out_dir``, None if it has none."""
    path = Path(out_dir) / SELECTION_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def remove_export(out_dir) -> bool:
    """Remove the export :func:`save_sentence_encoder` published in ``out_dir`` (its links and
    versions; other files stay). Returns whether there was one."""
    out_dir = Path(out_dir)
    versions = out_dir / VERSIONS_DIR
    if not versions.is_dir():
        return False
    for entry in _export_links(out_dir, f"{VERSIONS_DIR}/"):
        entry.unlink()
    shutil.rmtree(versions)
    fsync_dir(out_dir)
    return True


def _export_links(out_dir: Path, prefix: str) -> list:
    """The entries of ``out_dir`` that are links into the export's versions under ``prefix``."""
    return [entry for entry in out_dir.iterdir()
            if entry.is_symlink() and os.readlink(entry).startswith(prefix)]


def _link(path: Path, target: str) -> None:
    """Make ``path`` a symbolic link to ``target`` with one rename (replacing what is there)."""
    if path.is_symlink() and os.readlink(path) == target:
        return
    tmp = path.with_name(f".{path.name}.link-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        _remove(tmp)
    os.symlink(target, tmp)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # an export written by an older fastcl: a real folder
    os.replace(tmp, path)


def _publish(stage: Path, out_dir: Path) -> None:
    """Make the complete export in ``stage`` (a folder under ``out_dir/VERSIONS_DIR``) the one
    ``out_dir`` shows, all at once: a reader sees the previous export or this one, never a mix.

    1. ``stage`` becomes version ``vN``; the previous version is kept.
    2. Each top-level entry of the export is (made) a link to ``VERSIONS_DIR/current/<entry>``.
       Names new to this export point at nothing until step 3.
    3. ``current`` is switched to ``vN`` with one rename: every entry changes together.
    4. Links to names this export lacks and the previous version are removed.
    """
    versions = out_dir / VERSIONS_DIR
    numbers = [int(p.name[1:]) for p in versions.iterdir()
               if p.name[:1] == "v" and p.name[1:].isdigit()]
    version = versions / f"v{max(numbers, default=0) + 1}"
    _fsync_tree(stage)
    os.rename(stage, version)
    fsync_dir(versions)
    crash_point("export-publish")
    names = sorted(p.name for p in version.iterdir())
    for name in names:
        _link(out_dir / name, f"{VERSIONS_DIR}/{CURRENT}/{name}")
    crash_point("export-links")
    _link(versions / CURRENT, version.name)  # the switch
    fsync_dir(versions)
    for entry in _export_links(out_dir, f"{VERSIONS_DIR}/{CURRENT}/"):
        if entry.name not in names:
            entry.unlink()
    clean_export_leftovers(out_dir)
    fsync_dir(out_dir)


def save_sentence_encoder(out_dir, backbone, tokenizer, pooler: str, head: MLPHead | None = None,
                          *, max_seq_length: int | None = None, card: ModelCard | None = None,
                          selection: dict | None = None) -> Path:
    """Write ``backbone`` + ``tokenizer`` (``save_pretrained``) and sentence-transformers config.

    Modules: Transformer → [WeightedLayerPooling for avg_first_last / avg_top2] → Pooling
    (CLS token or masked mean) → [Dense(d, d, Tanh) holding ``head`` for ``cls``]. For ``cls``
    the head is also written into the model's own Linear + Tanh pooler when it has one, so
    ``AutoModel(...)(...).pooler_output`` is the embedding too (SimCSE's convention).
    ``config_sentence_transformers.json`` holds sentence-transformers' model settings
    (cosine similarity, no prompts) and ``README.md`` the model card: ``card`` (a
    :class:`ModelCard`, as the trainer fills it) or, without it, a card with what the export
    itself knows (pooler, width, how to load it). ``selection`` (the trainer's step and dev
    metric of this model) goes to ``SELECTION_FILE``, published with the model so the two never
    disagree. The whole export is staged in ``OUT_DIR/.model/`` and published at once (see
    :func:`_publish`): the top-level entries are links into the current version, so a reader
    (or a crash) never sees files of two exports side by side.
    """
    check_pooler(pooler)
    if pooler == "cls" and head is None:
        raise ValueError("pooler 'cls' is exported with its MLP head: pass head=")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_export_leftovers(out_dir)
    stage = out_dir / VERSIONS_DIR / f"stage-{os.getpid()}"
    stage.mkdir(parents=True)
    state = {k: v for k, v in backbone.state_dict().items()}
    if pooler == "cls" and model_pooler_head(backbone) is not None:
        state["pooler.dense.weight"] = head.dense.weight.detach().clone()
        state["pooler.dense.bias"] = head.dense.bias.detach().clone()
    backbone.save_pretrained(stage, state_dict=state)
    crash_point("export-stage")
    tokenizer.save_pretrained(stage)
    config = backbone.config
    modules = _sentence_transformers_modules(stage, pooler, config.hidden_size,
                                             config.num_hidden_layers, head)
    _write_json(stage / "modules.json", modules)
    st_config = {"max_seq_length": max_seq_length or default_max_length(tokenizer, backbone),
                 "do_lower_case": False}
    if pooler in ("avg_first_last", "avg_top2"):
        # WeightedLayerPooling reads every layer's states from the Transformer module.
        st_config["config_args"] = {"output_hidden_states": True}
    _write_json(stage / "sentence_bert_config.json", st_config)
    _write_json(stage / "fastcl_pooler.json", {"pooler": pooler})
    if selection is not None:
        _write_json(stage / SELECTION_FILE, selection)
    _write_json(stage / "config_sentence_transformers.json", sentence_transformers_config())
    (stage / "README.md").write_text((card or ModelCard()).render(
        out_dir, pooler, config.hidden_size, st_config["max_seq_length"],
        pooler_output=pooler == "cls" and model_pooler_head(backbone) is not None), encoding="utf-8")
    _publish(stage, out_dir)
    return out_dir
