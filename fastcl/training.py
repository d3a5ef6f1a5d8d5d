"""Training pieces shared by ``train.py``: data, views, objectives, one step, checkpoints.

One training step is: a batch of examples → embeddings of every view → a fastcl loss →
backward and an optimizer step. :func:`embed_views` and :func:`objective_loss` are separate
so other step drivers (cached two-pass encoding, data parallelism) can reuse them.

Views per method (the SimCSE conventions the papers share):

- unsupervised (simcse, dclr, focal, escl): one forward of the duplicated batch
  ``[x1, x1, x2, x2, …]`` in train mode; the two dropout masks give anchors ``h`` and
  positives ``h⁺``.
- escl: a third view ``h⁻`` of the same sentences from a separate forward with every dropout
  rate set to ``sensitive_dropout`` (0.45); the two main views keep the model's own rate.
- dclr: a frozen complementary encoder embeds the batch in eval mode under no_grad. Without
  dropout its two views coincide, so ``c = c⁺`` and the instance weights are
  ``α_ij = 1[cos(c_i, c_j) < φ]``.
- simcse-sup: one forward of ``[p1, e1, c1, p2, e2, c2, …]`` (premise, entailment,
  contradiction) gives ``h``, ``h⁺`` and hard negatives ``h⁻``.
"""

from __future__ import annotations

import contextlib
import csv
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

import fastcl

from .encoders import SentenceEncoder, dropout_rate, tokenize

UNSUPERVISED = ("simcse", "dclr", "focal", "escl")
SUPERVISED = ("simcse-sup",)
METHODS = ("simcse", "simcse-sup", "dclr", "focal", "escl")


# ---------------------------------------------------------------------------------------
# Data

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
    lines = _plain_lines(path)
    sentences = [line for line in lines if line.strip()]
    return TrainingData(_dataset({"text": sentences}), "sentences", len(lines) - len(sentences),
                        str(path))


def read_csv_triplets(path) -> TrainingData:
    """A csv with a header holding ``sent0, sent1`` and optionally ``hard_neg`` (standard
    csv quoting, as SimCSE's ``nli_for_simcse.csv``). Rows with an empty needed field are
    skipped and counted. Malformed quoting (a quote never closed, text after a closing quote)
    and rows with more fields than the header are errors naming the file and line: they are
    what an unbalanced quote that merges rows leaves."""
    path = Path(path)
    with _utf8(path), open(path, encoding="utf-8-sig", newline="") as f:
        # strict: a quote that is never closed, or text after a closing quote, is an error
        # instead of rows merged into one field
        reader = csv.DictReader(f, strict=True)
        try:
            header = reader.fieldnames or []
        except csv.Error as err:
            raise ValueError(f"--data: {path}:{reader.line_num}: malformed csv ({err})") from None
        missing = [c for c in ("sent0", "sent1") if c not in header]
        if missing:
            raise ValueError(f"--data: {path} needs columns sent0,sent1[,hard_neg]; "
                             f"its header {header} lacks {', '.join(missing)}")
        cols = ["sent0", "sent1"] + (["hard_neg"] if "hard_neg" in header else [])
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
    kind = "triplets" if "hard_neg" in cols else "pairs"
    return TrainingData(_dataset(data), kind, skipped, str(path))


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
        raise ValueError(f"--snli-splits: {folder} lacks split(s) {', '.join(absent)} "
                         f"(found: {', '.join(available) or 'none'})")
    groups: dict = {}
    for split in splits:
        files = [folder / f"{name}.{split}" for name in ("s1", "s2", "labels")]
        s1, s2, labels = (_plain_lines(f) for f in files)
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
def _utf8(path: Path):
    """Turn a UnicodeDecodeError while reading ``path`` into a ValueError naming it."""
    try:
        yield
    except UnicodeDecodeError as err:
        raise ValueError(f"--data: {path} is not UTF-8 text (byte {err.start}: "
                         f"{err.object[err.start:err.start + 4]!r}); convert it to UTF-8") from None


def _plain_lines(path: Path) -> list:
    """Lines of a UTF-8 file split on LF only, a CR before the LF dropped."""
    with _utf8(path), open(path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line does not start another
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_training_data(path, method: str, snli=None) -> TrainingData:
    """Read ``path`` in the format ``method`` needs (see :func:`read_sentences`,
    :func:`read_csv_triplets`, :func:`read_snli`)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--data: no such file or folder: {path}")
    supervised = method in SUPERVISED
    if snli and not path.is_dir():
        raise ValueError(f"--snli-splits applies to a SentEval SNLI folder, not to {path.name}")
    if path.is_dir():
        if not supervised:
            raise ValueError(f"--data: method {method} trains on a text file with one sentence "
                             f"a line, not a folder ({path})")
        data = read_snli(path, snli)
    elif path.suffix.lower() == ".csv":
        if not supervised:
            raise ValueError(f"--data: method {method} trains on a text file with one sentence "
                             f"a line; {path.name} is a csv (that is simcse-sup's format)")
        data = read_csv_triplets(path)
    else:
        if supervised:
            raise ValueError(f"--data: simcse-sup needs a csv with sent0,sent1,hard_neg columns "
                             f"or a SentEval SNLI folder, got {path.name}")
        data = read_sentences(path)
    if len(data) == 0:
        raise ValueError(f"--data: {path} holds no usable examples")
    return data


def batch_examples(data: TrainingData, rows: dict) -> list:
    """One batch as a list: sentences, or (sent0, sent1[, hard_neg]) tuples."""
    if data.kind == "sentences":
        return list(rows["text"])
    cols = [rows["sent0"], rows["sent1"]] + ([rows["hard_neg"]] if data.kind == "triplets" else [])
    return list(zip(*cols))


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The example order of ``epoch``: a permutation that depends on (seed, epoch) only,
    so a resumed run finds the same order."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)


# ---------------------------------------------------------------------------------------
# Objectives

@dataclass
class Objective:
    """A method and its hyper-parameters (defaults: the papers')."""

    method: str
    temperature: float = 0.05
    hard_negative_weight: float = 0.0      # simcse-sup
    phi: float = 0.9                       # dclr
    noise_ratio: float = 1.0
    noise_steps: int = 4
    noise_lr: float = 1e-3
    noise_std: float = 1.0
    formulation: str = "paper"
    m: float = 0.3                         # focal
    rd_weight: float = 2.5e-3              # escl
    rd: str = "softplus"
    sensitive_dropout: float = 0.45
    complementary: SentenceEncoder | None = None
    complementary_tokenizer: object = None
    complementary_mode: str = "frozen"     # or "released": dropout on, two views
    generator: torch.Generator | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")


def view_inputs(obj: Objective, tokenizer, batch: list, max_length: int, device) -> list:
    """The encoder forwards :func:`embed_views` makes for ``batch``, in order, as
    ``(name, features)`` pairs: ``grouped`` (simcse-sup: ``[p1, e1, c1, p2, …]``), ``doubled``
    (unsupervised: ``[x1, x1, x2, x2, …]``) and, for ESCL, ``sensitive`` (``[x1, x2, …]`` at
    ``obj.sensitive_dropout``). The batch is tokenized once, padded to its longest input."""
    if obj.method in SUPERVISED:
        if not batch or isinstance(batch[0], str):
            raise ValueError("simcse-sup takes (sent0, sent1[, hard_neg]) examples")
        feats = tokenize(tokenizer, [s for example in batch for s in example], max_length, device)
        return [("grouped", feats)]
    if not batch or not isinstance(batch[0], str):
        raise ValueError(f"{obj.method} takes a batch of sentences")
    feats = tokenize(tokenizer, batch, max_length, device)
    calls = [("doubled", {k: v.repeat_interleave(2, dim=0) for k, v in feats.items()})]
    if obj.method == "escl":
        calls.append(("sensitive", feats))
    return calls


def forward_mode(obj: Objective, encoder: SentenceEncoder, name: str):
    """The context a forward of :func:`view_inputs` runs in (the sensitive view's dropout)."""
    if name == "sensitive":
        return dropout_rate(encoder, obj.sensitive_dropout)
    return contextlib.nullcontext()


def assemble_views(obj: Objective, outputs: dict, n: int) -> dict:
    """The views of ``n`` examples from the embeddings of each forward of :func:`view_inputs`."""
    if "grouped" in outputs:
        z = outputs["grouped"]
        z = z.view(n, z.shape[0] // n, -1)
        out = {"anchors": z[:, 0], "positives": z[:, 1]}
        if z.shape[1] == 3:
            out["negatives"] = z[:, 2]
        return out
    z = outputs["doubled"].view(n, 2, -1)
    out = {"anchors": z[:, 0], "positives": z[:, 1]}
    if "sensitive" in outputs:
        out["sensitive"] = outputs["sensitive"]
    return out


def embed_views(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list,
                max_length: int) -> dict:
    """Embeddings of every view ``obj.method`` needs for one batch (see the module docstring).

    ``batch`` holds sentences (unsupervised) or (sent0, sent1[, hard_neg]) tuples
    (supervised). Returns a dict with ``anchors``, ``positives`` and, by method,
    ``negatives`` (hard negatives), ``sensitive`` (ESCL) or ``complementary`` (DCLR, a pair).
    """
    device = next(encoder.parameters()).device
    outputs = {}
    for name, feats in view_inputs(obj, tokenizer, batch, max_length, device):
        with forward_mode(obj, encoder, name):
            outputs[name] = encoder(**feats)
    out = assemble_views(obj, outputs, len(batch))
    if obj.method == "dclr" and obj.complementary is not None:
        out["complementary"] = complementary_views(obj, batch, max_length)
    return out


def complementary_views(obj: Objective, sentences: list, max_length: int,
                        chunk_size: int | None = None):
    """``(c, c⁺)`` of the frozen complementary encoder, no_grad, float32; with ``chunk_size``,
    in forwards of at most that many sentences. ``frozen``: eval mode, one view (c⁺ = c).
    ``released`` (the authors' code): dropout on, the duplicated batch, c and c⁺ its halves."""
    comp = obj.complementary
    released = obj.complementary_mode == "released"
    comp.train(released)
    device = next(comp.parameters()).device
    texts = list(sentences) * 2 if released else list(sentences)
    with torch.no_grad():
        feats = tokenize(obj.complementary_tokenizer, texts, max_length, device)
        step = chunk_size or len(texts)
        c = torch.cat([comp(**{k: v[i:i + step] for k, v in feats.items()}).float()
                       for i in range(0, len(texts), step)])
    comp.eval()
    n = len(sentences)
    return (c[:n], c[n:]) if released else (c, c)


def objective_loss(obj: Objective, views: dict) -> torch.Tensor:
    """The method's fastcl loss on the views of :func:`embed_views`."""
    h, h_pos = views["anchors"], views["positives"]
    if obj.method == "simcse":
        return fastcl.infonce(h, h_pos, temperature=obj.temperature)
    if obj.method == "simcse-sup":
        neg = views.get("negatives")
        return fastcl.infonce(h, h_pos, neg, temperature=obj.temperature,
                              hard_negative_weight=obj.hard_negative_weight if neg is not None else 0.0)
    if obj.method == "focal":
        return fastcl.focal_infonce(h, h_pos, temperature=obj.temperature, m=obj.m)
    if obj.method == "escl":
        return fastcl.escl_loss(h, h_pos, views["sensitive"], temperature=obj.temperature,
                                weight=obj.rd_weight, rd=obj.rd)
    comp = views.get("complementary")
    if comp is not None:
        comp = tuple(c.to(h.dtype) for c in comp)
    return fastcl.dclr_loss(h, h_pos, complementary=comp, phi=obj.phi,
                            noise_ratio=obj.noise_ratio, noise_steps=obj.noise_steps,
                            noise_lr=obj.noise_lr, noise_std=obj.noise_std,
                            temperature=obj.temperature, generator=obj.generator,
                            formulation=obj.formulation)


def train_step(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list, optimizer,
               scheduler, *, max_length: int, max_grad_norm: float = 1.0,
               autocast=None, chunk_size: int | None = None, distributed: bool = False) -> dict:
    """One optimizer step on one batch: views → loss → backward → clip → step.

    ``chunk_size``: cached two-pass encoding (:func:`cached_backward`), same gradients with
    the activations of at most ``chunk_size`` encoder inputs at a time. ``distributed``: this
    process holds its share of the global batch; the loss is computed against the candidates
    of all processes and gradients are averaged over them (:mod:`fastcl.distributed`).

    Returns ``{"loss": float, "grad_norm": float, "lr": float}`` (lr of this step; with
    ``distributed`` the loss is the global mean).
    """
    encoder.train()
    lr = optimizer.param_groups[0]["lr"]
    loss_fn = _global_loss if distributed else objective_loss
    if chunk_size is None:
        with autocast if autocast is not None else contextlib.nullcontext():
            views = embed_views(obj, encoder, tokenizer, batch, max_length)
            loss = loss_fn(obj, views)
        loss.backward()
    else:
        loss = cached_backward(obj, encoder, tokenizer, batch, max_length=max_length,
                               chunk_size=chunk_size, autocast=autocast, loss_fn=loss_fn)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    loss = float(loss.detach())
    if distributed:
        from . import distributed as dist_cl
        dist_cl.average_gradients(params)
        loss = dist_cl.mean(loss, device=params[0].device)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": float(grad_norm), "lr": lr}


def _global_loss(obj: Objective, views: dict) -> torch.Tensor:
    from . import distributed as dist_cl
    return dist_cl.global_loss(obj, views)


def _rng_snapshot(device: torch.device) -> tuple:
    """The random state an encoder forward on ``device`` draws its dropout from."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _rng_restore(state: tuple, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def cached_backward(obj: Objective, encoder: SentenceEncoder, tokenizer, batch: list, *,
                    max_length: int, chunk_size: int, autocast=None,
                    loss_fn=None) -> torch.Tensor:
    """Cached (two-pass, GradCache-style) encoding: accumulates into ``.grad`` the gradient
    of ``loss_fn(obj, views)`` (default :func:`objective_loss`) and returns the loss, detached.

    Pass 1 makes every forward of :func:`view_inputs` in chunks of ``chunk_size`` rows without
    a graph, saving the random state before each chunk. The embeddings become leaf tensors;
    the loss and its gradient with respect to them come from fastcl. Pass 2 restores each
    chunk's random state, so its dropout masks are those of pass 1, re-encodes the chunk with
    a graph and back-propagates the chunk's cached embedding gradient. Afterwards the random
    state is the one pass 1 left, so the following steps draw as after an ordinary step.
    DCLR's complementary encoder runs once, in pass 1.

    The gradient equals that of one backward through the same chunked forwards; with
    ``chunk_size`` at least the rows of each forward (2N unsupervised, 3N or 2N simcse-sup)
    the forwards are the unchunked ones and so is the gradient.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    loss_fn = loss_fn or objective_loss
    amp = (lambda: autocast) if autocast is not None else contextlib.nullcontext
    device = next(encoder.parameters()).device
    chunks = []  # (name, first row, features, random state)
    cached = {}
    with torch.no_grad():
        for name, feats in view_inputs(obj, tokenizer, batch, max_length, device):
            rows = next(iter(feats.values())).shape[0]
            parts = []
            for start in range(0, rows, chunk_size):
                part = {k: v[start:start + chunk_size] for k, v in feats.items()}
                chunks.append((name, start, part, _rng_snapshot(device)))
                with amp(), forward_mode(obj, encoder, name):
                    parts.append(encoder(**part))
            cached[name] = torch.cat(parts).requires_grad_(True)
    after = _rng_snapshot(device)
    views = assemble_views(obj, cached, len(batch))
    if obj.method == "dclr" and obj.complementary is not None:
        views["complementary"] = complementary_views(obj, batch, max_length, chunk_size)
    with amp():
        loss = loss_fn(obj, views)
    loss.backward()
    grads = {name: leaf.grad for name, leaf in cached.items()}
    del views, cached
    for name, start, part, state in chunks:
        _rng_restore(state, device)
        with amp(), forward_mode(obj, encoder, name):
            z = encoder(**part)
        if grads[name] is None:  # the loss does not depend on this view
            continue
        torch.autograd.backward(z, grads[name][start:start + z.shape[0]].to(z.dtype))
    _rng_restore(after, device)
    return loss.detach()


# ---------------------------------------------------------------------------------------
# Optimizer and schedule

def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float):
    """AdamW; biases and normalization weights are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def linear_schedule(optimizer, total_steps: int, warmup_steps: int = 0):
    """Linear warmup over ``warmup_steps``, then linear decay to 0 at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------
# Reproducibility and checkpoints

def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state(generator: torch.Generator | None = None) -> dict:
    """Every random state a step consumes (dropout, DCLR noise), in a form torch.load
    reads with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (name, keys.tolist(), pos, has_gauss, cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def set_rng_state(state: dict, generator: torch.Generator | None = None) -> None:
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])


def _tuples(x):
    """random.setstate needs tuples where a round trip may have produced lists."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


# A checkpoint file: MAGIC, the SHA-256 of the payload, the payload's length (8 bytes, little
# endian), then the payload (``torch.save`` of the state). load_checkpoint verifies all three.
MAGIC = b"FASTCL-CKPT\x00v2\n"
_HEADER = len(MAGIC) + 32 + 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or fails verification; the message names the file."""


def save_checkpoint(path, state: dict) -> None:
    """Write ``state`` to a temporary file in the same folder with its digest, fsync, then
    ``os.replace``: the checkpoint on disk is always a complete, verifiable one.

    A write killed half-way leaves ``.<name>.tmp-<pid>``; :func:`clean_checkpoint_temps`
    removes it at the next start.
    """
    import hashlib
    import io

    from .encoders import crash_point

    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            half = len(payload) // 2
            f.write(payload[:half])
            f.flush()
            crash_point("checkpoint-write")
            f.write(payload[half:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        del payload
        if tmp.exists():
            tmp.unlink()
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def clean_checkpoint_temps(folder, name: str = "checkpoint.pt") -> list:
    """Remove ``.<name>.tmp-<pid>`` files that a killed :func:`save_checkpoint` left behind
    (those of live processes other than this one are kept). Returns the paths removed."""
    removed = []
    for tmp in Path(folder).glob(f".{name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_checkpoint(path) -> dict:
    """The state saved by :func:`save_checkpoint`, after checking its length and SHA-256.

    Raises :class:`CheckpointError` (a ValueError naming the file) for an empty, truncated,
    damaged or foreign file.
    """
    import hashlib
    import io

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"checkpoint {path}: cannot be read ({err.strerror or err})") from err
    if not data:
        raise CheckpointError(f"checkpoint {path} is empty (zero bytes): it is not usable")
    if not data.startswith(MAGIC):
        what = ("it has no integrity digest (written by an older fastcl?)" if data[:2] == b"PK"
                else "it does not start with a fastcl checkpoint header")
        raise CheckpointError(f"checkpoint {path} is not a fastcl checkpoint: {what}")
    if len(data) < _HEADER:
        raise CheckpointError(f"checkpoint {path} is truncated ({len(data)} bytes, shorter "
                              "than its header)")
    digest = data[len(MAGIC):len(MAGIC) + 32]
    size = int.from_bytes(data[len(MAGIC) + 32:_HEADER], "little")
    payload = memoryview(data)[_HEADER:]
    if len(payload) != size:
        raise CheckpointError(f"checkpoint {path} is {'truncated' if len(payload) < size else 'too long'}: "
                              f"{len(payload)} payload bytes, the header says {size}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is damaged: its SHA-256 does not match the "
                              "digest written with it")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as err:  # verified bytes that still do not load: report, do not trace
        raise CheckpointError(f"checkpoint {path} cannot be loaded: {err}") from err
