#!/usr/bin/env python
"""Train a sentence encoder with one of fastcl's contrastive objectives.

    python train.py --method simcse --model bert-base-uncased --data wiki1m_for_simcse.txt \\
        --output-dir out/simcse --sts-dir data

Loop: AdamW, linear decay to 0, gradient-norm clipping, bf16 autocast on GPU. Every
``--eval-steps`` steps the model is scored on STS-B dev (``--select avg``: the mean of STS-B
dev and SICK-R dev) and the best one is exported to ``--output-dir``, together with
``train_log.jsonl`` (one JSON object per step and per evaluation), ``dev_curve.png`` and
``align_uniform.png``. A checkpoint (``checkpoint.pt``: model, optimizer, scheduler, random
states, data position, with the SHA-256 of its content) is written atomically every
``--checkpoint-steps`` steps, on SIGINT/SIGTERM and, when an error stops the loop, as an
emergency checkpoint of the last consistent state; ``--resume`` verifies it and continues
with the same subsequent losses as an uninterrupted run. The export is published as a whole
(the previous one stays until the new one is complete), and the dev files are parsed before
step 1. ``FASTCL_CRASH_AT=POINT[:N]`` (a test hook) kills the process at a write point.

Large batches: ``--chunk-size C`` encodes in chunks of at most C inputs (cached two-pass
encoding with exact dropout replay: the gradients of one pass, the activation memory of C
inputs). ``torchrun --nproc_per_node W train.py ...`` splits each batch over W processes whose
losses use the candidates of all of them (global in-batch negatives), with the gradients of
single-process training on the whole batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from fastcl import training
from fastcl.encoders import (POOLERS, MLPHead, SentenceEncoder, clean_export_leftovers,
                             load_backbone, load_encoder, save_sentence_encoder)
from fastcl.evaluate import evaluate, load_task

CHECKPOINT = "checkpoint.pt"
LOG = "train_log.jsonl"

# The papers' recipes (BERT-base). phi and noise_ratio depend on the model family.
METHOD_DEFAULTS = {
    "simcse": dict(batch_size=64, lr=3e-5, epochs=1, mlp_only_train=True, select="stsb"),
    "simcse-sup": dict(batch_size=512, lr=5e-5, epochs=3, mlp_only_train=False, select="stsb"),
    "dclr": dict(batch_size=128, lr=3e-5, epochs=3, mlp_only_train=True, select="avg"),
    "focal": dict(batch_size=64, lr=3e-5, epochs=1, mlp_only_train=True, select="stsb"),
    "escl": dict(batch_size=64, lr=3e-5, epochs=1, mlp_only_train=True, select="stsb"),
}
# Options that only one method reads, with their defaults.
METHOD_OPTIONS = {
    "hard_negative_weight": ("simcse-sup", 0.0),
    "phi": ("dclr", None), "noise_ratio": ("dclr", None), "noise_steps": ("dclr", 4),
    "noise_lr": ("dclr", 1e-3), "noise_std": ("dclr", 1.0), "dclr_formulation": ("dclr", "paper"),
    "complementary": ("dclr", None), "complementary_pooler": ("dclr", None),
    "complementary_mode": ("dclr", "frozen"),
    "m": ("focal", 0.3),
    "rd_weight": ("escl", 2.5e-3), "rd": ("escl", "softplus"), "sensitive_dropout": ("escl", 0.45),
}
# Options whose value must be the same when resuming (they define the run's steps).
RUN_DEFINING = ("method", "model", "data", "snli_splits", "sts_dir", "batch_size", "lr", "epochs",
                "max_steps", "max_seq_len", "chunk_size", "pooler", "mlp_only_train", "seed", "temperature",
                "warmup_steps", "weight_decay", "max_grad_norm", "precision", "select",
                *METHOD_OPTIONS)

EPILOG = """\
defaults per method (BERT-base recipes of the papers):
  method      batch  lr     epochs  pooler (train -> eval/export)     select
  simcse        64   3e-5     1     cls + MLP -> cls_before_pooler     stsb
  simcse-sup   512   5e-5     3     cls + MLP -> cls (MLP kept)        stsb
  dclr         128   3e-5     3     cls + MLP -> cls_before_pooler     avg
  focal         64   3e-5     1     cls + MLP -> cls_before_pooler     stsb
  escl          64   3e-5     1     cls + MLP -> cls_before_pooler     stsb
  all: temperature 0.05, max length 32, AdamW without weight decay, linear decay, clip 1.0.
  dclr: phi 0.9 (BERT) / 0.85 (RoBERTa), noise ratio 1 (BERT) / 2.5 (RoBERTa), 4 noise
  steps of lr 1e-3 from N(0, 1). focal: m 0.3. escl: rd weight 2.5e-3, sensitive dropout 0.45.

data formats:
  unsupervised methods: a UTF-8 text file, one sentence a line (blank lines are skipped).
  simcse-sup: a csv with a header holding sent0,sent1[,hard_neg], or a folder in SentEval's
  SNLI layout (s1.<split>, s2.<split>, labels.<split>) made into (premise, entailment,
  contradiction) triplets.
"""


# ---------------------------------------------------------------------------------------
# Command line

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0],
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--method", required=True, choices=training.METHODS, help="training objective")
    g.add_argument("--model", required=True, metavar="NAME_OR_PATH",
                   help="any Hugging Face AutoModel encoder: a local folder, or a hub name when online")
    g.add_argument("--data", required=True, metavar="PATH",
                   help="training data (formats below)")
    g.add_argument("--snli-splits", nargs="+", default=None, metavar="SPLIT",
                   help="with an SNLI folder: the splits to use (default: every split found)")
    g.add_argument("--output-dir", required=True, metavar="DIR", help="where the model, log, plots and checkpoint go")
    g.add_argument("--resume", action="store_true",
                   help=f"continue from OUTPUT_DIR/{CHECKPOINT} (same options as the first run)")
    g.add_argument("--seed", type=int, default=42, help="seed of dropout, data order, head and noise (default 42)")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 autocast on a GPU that supports it, fp32 otherwise")

    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=None, help="examples per step (default: per method)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per method)")
    g.add_argument("--epochs", type=int, default=None, help="passes over the data (default: per method)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps; overrides --epochs")
    g.add_argument("--max-seq-len", type=int, default=32, help="truncate training inputs to this many tokens (default 32)")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps before the decay (default 0)")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, not on biases and norms (default 0)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient-norm clipping (default 1.0)")
    g.add_argument("--chunk-size", type=int, default=None, metavar="C",
                   help="cached two-pass encoding: run the encoder on at most C inputs at a time "
                        "(unsupervised methods encode 2 inputs per example, escl 3, simcse-sup 2 or "
                        "3) with the same gradients and dropout masks replayed exactly; activation "
                        "memory then follows C instead of the batch (default: one pass, no chunks)")

    g = p.add_argument_group("pooling")
    g.add_argument("--pooler", choices=POOLERS, default="cls",
                   help="cls: CLS through an MLP head (Linear+Tanh); cls_before_pooler: raw CLS; "
                        "avg: mean of the last layer; avg_first_last, avg_top2 (default cls)")
    g.add_argument("--mlp-only-train", action=argparse.BooleanOptionalAction, default=None,
                   help="with --pooler cls: train with the MLP but evaluate and export "
                        "cls_before_pooler (default: on for unsupervised methods, off for simcse-sup)")

    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--sts-dir", default=None, metavar="DIR",
                   help="STS data folder (stsb/sts-dev.csv, sick/SICK_trial.txt); without it there "
                        "is no dev evaluation and the last model is saved")
    g.add_argument("--eval-steps", type=int, default=125, help="evaluate every N steps (default 125)")
    g.add_argument("--select", choices=("stsb", "avg"), default=None,
                   help="keep the best model by STS-B dev Spearman, or by the mean of STS-B dev and "
                        "SICK-R dev (default: avg for dclr, stsb otherwise)")
    g.add_argument("--eval-batch-size", type=int, default=64, help="sentences per evaluation forward (default 64)")
    g.add_argument("--checkpoint-steps", type=int, default=250,
                   help="write the resumable checkpoint every N steps (default 250; also on SIGINT/SIGTERM)")

    g = p.add_argument_group("objective")
    g.add_argument("--temperature", type=float, default=0.05, help="softmax temperature (default 0.05)")
    g.add_argument("--hard-negative-weight", type=float, default=None,
                   help="simcse-sup: log-weight added to each anchor's hard-negative logit (default 0)")
    g.add_argument("--phi", type=float, default=None,
                   help="dclr: drop in-batch negatives whose complementary cosine is >= phi "
                        "(default 0.9, RoBERTa 0.85)")
    g.add_argument("--noise-ratio", type=float, default=None,
                   help="dclr: noise negatives per anchor (default 1, RoBERTa 2.5)")
    g.add_argument("--noise-steps", type=int, default=None, help="dclr: gradient-ascent steps on the noise (default 4)")
    g.add_argument("--noise-lr", type=float, default=None, help="dclr: noise step size beta (default 1e-3)")
    g.add_argument("--noise-std", type=float, default=None, help="dclr: initial noise std sigma (default 1)")
    g.add_argument("--dclr-formulation", choices=("paper", "released"), default=None,
                   help="dclr: the paper's loss or the authors' released code (default paper)")
    g.add_argument("--complementary", default=None, metavar="PATH",
                   help="dclr: frozen complementary encoder (e.g. a trained SimCSE) for instance "
                        "weighting; without it no negative is dropped")
    g.add_argument("--complementary-pooler", choices=POOLERS, default=None,
                   help="dclr: pooler of the complementary encoder (default cls_before_pooler; "
                        "cls, the checkpoint's own pooler output, with --complementary-mode released)")
    g.add_argument("--complementary-mode", choices=("frozen", "released"), default=None,
                   help="dclr: 'frozen' (default) embeds the batch once in eval mode, c = c+; "
                        "'released' does as the authors' code: dropout on, the duplicated batch "
                        "(c and c+ are two dropout views), still without gradients")
    g.add_argument("--m", type=float, default=None, help="focal: margin m of the negative logits s(s+m)/t (default 0.3)")
    g.add_argument("--rd-weight", type=float, default=None, help="escl: weight of the relative-difference term (default 2.5e-3)")
    g.add_argument("--rd", choices=("softplus", "margin"), default=None,
                   help="escl: relative-difference form (default softplus)")
    g.add_argument("--sensitive-dropout", type=float, default=None,
                   help="escl: dropout rate of the third, sensitive view (default 0.45)")
    return p


def _require(parser, ok: bool, message: str) -> None:
    if not ok:
        parser.error(message)


def resolve_args(parser, args) -> argparse.Namespace:
    """Fill method defaults and check every value; errors name the option."""
    for name, (method, default) in METHOD_OPTIONS.items():
        given = getattr(args, name)
        _require(parser, given is None or args.method == method,
                 f"--{name.replace('_', '-')} applies to --method {method} only")
        if given is None:
            setattr(args, name, default)
    defaults = METHOD_DEFAULTS[args.method]
    _require(parser, args.mlp_only_train is None or args.pooler == "cls",
             "--mlp-only-train/--no-mlp-only-train apply to --pooler cls only")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value if name != "mlp_only_train" or args.pooler == "cls" else False)
    checks = [
        (args.batch_size >= 2, f"--batch-size must be >= 2 (in-batch negatives), got {args.batch_size}"),
        (args.lr > 0 and math.isfinite(args.lr), f"--lr must be > 0, got {args.lr}"),
        (args.epochs >= 1, f"--epochs must be >= 1, got {args.epochs}"),
        (args.max_steps is None or args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}"),
        (args.max_seq_len >= 2, f"--max-seq-len must be >= 2, got {args.max_seq_len}"),
        (args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}"),
        (args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
        (args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm}"),
        (args.chunk_size is None or args.chunk_size >= 1, f"--chunk-size must be >= 1, got {args.chunk_size}"),
        (args.eval_steps >= 1, f"--eval-steps must be >= 1, got {args.eval_steps}"),
        (args.eval_batch_size >= 1, f"--eval-batch-size must be >= 1, got {args.eval_batch_size}"),
        (args.checkpoint_steps >= 1, f"--checkpoint-steps must be >= 1, got {args.checkpoint_steps}"),
        (args.temperature > 0 and math.isfinite(args.temperature), f"--temperature must be > 0, got {args.temperature}"),
        (args.phi is None or -1 <= args.phi <= 1, f"--phi must be in [-1, 1], got {args.phi}"),
        (args.noise_ratio is None or args.noise_ratio >= 0, f"--noise-ratio must be >= 0, got {args.noise_ratio}"),
        (args.noise_steps >= 0, f"--noise-steps must be >= 0, got {args.noise_steps}"),
        (args.noise_std > 0, f"--noise-std must be > 0, got {args.noise_std}"),
        (0 <= args.sensitive_dropout < 1, f"--sensitive-dropout must be in [0, 1), got {args.sensitive_dropout}"),
        (args.sts_dir is None or Path(args.sts_dir).is_dir(), f"--sts-dir: no such folder: {args.sts_dir}"),
    ]
    for ok, message in checks:
        _require(parser, ok, message)
    return args


def export_pooler(args) -> str:
    """The pooler of evaluation and export: the MLP goes away with --mlp-only-train."""
    return "cls_before_pooler" if args.pooler == "cls" and args.mlp_only_train else args.pooler


def _family_default(backbone, bert: float, roberta: float) -> float:
    return roberta if "roberta" in backbone.config.model_type else bert


# ---------------------------------------------------------------------------------------
# Set-up

class Run:
    """Everything one training run holds; built by :func:`setup`."""


def setup(args) -> Run:
    run = Run()
    run.args = args
    run.out = Path(args.output_dir)
    run.world, run.rank = world_and_rank()
    run.device = torch.device(args.device or default_device(run))
    if run.world > 1 and args.batch_size % run.world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"processes ({run.world}): each takes an equal share of the batch")
    run.data = training.read_training_data(args.data, args.method, args.snli_splits)
    run.steps_per_epoch = len(run.data) // args.batch_size
    if run.steps_per_epoch == 0:
        raise ValueError(f"--data: {len(run.data)} examples, fewer than --batch-size {args.batch_size}")
    run.total_steps = args.max_steps or args.epochs * run.steps_per_epoch
    run.dev_cache = {}
    if args.sts_dir:
        # parsed now: a missing or malformed dev file is an error before step 1, naming it
        for task in ("stsb-dev",) + (("sickr-dev",) if args.select == "avg" else ()):
            run.dev_cache[task] = load_task(args.sts_dir, task)
    training.set_seed(args.seed)
    backbone, run.tokenizer = load_backbone(args.model, arg="--model")
    head = MLPHead(backbone.config.hidden_size, getattr(backbone.config, "initializer_range", 0.02)) \
        if args.pooler == "cls" else None
    run.encoder = SentenceEncoder(backbone, args.pooler, head).to(run.device)
    if run.world > 1:
        from fastcl import distributed
        distributed.broadcast_parameters(run.encoder)  # one model, whatever each process drew
        # each process its own dropout masks (same seed on all would repeat them)
        torch.manual_seed(args.seed * 1_000_003 + run.rank)
    run.eval_pooler = export_pooler(args)
    run.eval_encoder = SentenceEncoder(backbone, run.eval_pooler, head)  # shares the modules
    run.objective = make_objective(args, backbone, run.device)
    run.optimizer = training.make_optimizer(run.encoder, args.lr, args.weight_decay)
    run.scheduler = training.linear_schedule(run.optimizer, run.total_steps, args.warmup_steps)
    run.autocast = _autocast(args.precision, run.device)
    run.state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "best_metric": None, "best_step": None,
                 "evaluated": None}
    run.checkpoint_step = None
    return run


def world_and_rank() -> tuple:
    """(number of processes, this process's rank); (1, 0) outside ``torch.distributed``."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def default_device(run) -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if run.world > 1 else "cuda"


def init_distributed(device_arg) -> None:
    """Join the process group that ``torchrun`` describes (WORLD_SIZE > 1 in the environment):
    NCCL on GPUs, gloo on CPU."""
    import torch.distributed as dist
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    cuda = torch.cuda.is_available() and (device_arg is None or device_arg.startswith("cuda"))
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")


def make_objective(args, backbone, device) -> training.Objective:
    """The objective of ``args``; DCLR's phi and noise ratio default by model family
    (BERT 0.9 and 1, RoBERTa 0.85 and 2.5) and are written back into ``args``."""
    if args.method == "dclr":
        args.phi = _family_default(backbone, 0.9, 0.85) if args.phi is None else args.phi
        args.noise_ratio = _family_default(backbone, 1.0, 2.5) if args.noise_ratio is None else args.noise_ratio
    options = dict(temperature=args.temperature, hard_negative_weight=args.hard_negative_weight,
                   phi=args.phi, noise_ratio=args.noise_ratio, noise_steps=args.noise_steps,
                   noise_lr=args.noise_lr, noise_std=args.noise_std, formulation=args.dclr_formulation,
                   m=args.m, rd_weight=args.rd_weight, rd=args.rd,
                   sensitive_dropout=args.sensitive_dropout)
    obj = training.Objective(args.method, **{k: v for k, v in options.items() if v is not None})
    if args.method == "dclr":
        # DCLR's noise comes from its own generator so the run is reproducible and resumable.
        obj.generator = torch.Generator(device=device).manual_seed(args.seed)
        if args.complementary:
            released = args.complementary_mode == "released"
            pooler = args.complementary_pooler or ("cls" if released else "cls_before_pooler")
            comp, comp_tok = load_encoder(args.complementary, pooler, arg="--complementary",
                                          device=device)
            obj.complementary = comp.requires_grad_(False).eval()
            obj.complementary_tokenizer = comp_tok
            obj.complementary_mode = args.complementary_mode or "frozen"
    return obj


def _autocast(precision: str, device: torch.device):
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda"
                                   and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None


# ---------------------------------------------------------------------------------------
# Log, checkpoint, export

def json_safe(value):
    """``value`` with every NaN or infinity replaced by None (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def append_log(out: Path, record: dict, rank: int = 0) -> None:
    if rank:
        return
    with open(out / LOG, "a", encoding="utf-8") as f:
        f.write(json.dumps(json_safe(record), allow_nan=False) + "\n")


def read_log(out: Path) -> list:
    """The records of the log; a last line cut short by a crash is ignored."""
    path = out / LOG
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON") from None
    return records


def truncate_log(out: Path, step: int) -> None:
    """Drop records of steps after ``step`` (they are redone after a resume), atomically."""
    kept = [r for r in read_log(out) if r.get("step", 0) <= step]
    tmp = out / f".{LOG}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, out / LOG)


def run_signature(args) -> dict:
    """The options a resume must repeat, with local paths made absolute."""
    sig = {}
    for name in RUN_DEFINING:
        value = getattr(args, name)
        if name in ("model", "data", "complementary", "sts_dir") and value and Path(value).exists():
            value = str(Path(value).resolve())
        sig[name] = value
    return sig


def checkpoint_state(run: Run) -> dict:
    """The checkpoint's content (every process must call it: it gathers their random states)."""
    rng = training.rng_state(run.objective.generator)
    state = {"format": 1, "state": dict(run.state), "args": run_signature(run.args),
             "examples": len(run.data), "model": run.encoder.state_dict(),
             "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
             "rng": rng}
    if run.world > 1:
        import torch.distributed as dist
        ranks = [None] * run.world
        dist.all_gather_object(ranks, rng)
        state.update(world_size=run.world, rng_ranks=ranks)
    return state


def save_checkpoint(run: Run) -> None:
    state = checkpoint_state(run)
    if run.rank == 0:
        training.save_checkpoint(run.out / CHECKPOINT, state)
    run.checkpoint_step = run.state["step"]


def clean_leftovers(out: Path) -> list:
    """Remove the temporary files of writes a crash interrupted (checkpoint, export, log,
    plots). Run at start, before anything is written."""
    removed = training.clean_checkpoint_temps(out, CHECKPOINT) + clean_export_leftovers(out)
    for name in (f".{LOG}.tmp", ".dev_curve.tmp.png", ".align_uniform.tmp.png"):
        if (out / name).is_file():
            (out / name).unlink()
            removed.append(out / name)
    return removed


def resume(run: Run) -> None:
    path = run.out / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ckpt = training.load_checkpoint(path)
    sig = run_signature(run.args)
    diff = [f"--{k.replace('_', '-')} {sig[k]!r} (checkpoint: {ckpt['args'].get(k)!r})"
            for k in sig if ckpt["args"].get(k) != sig[k]]
    if diff:
        raise ValueError("--resume needs the options of the interrupted run: " + "; ".join(diff))
    if ckpt.get("world_size", 1) != run.world:
        raise ValueError(f"--resume: the checkpoint was written by {ckpt.get('world_size', 1)} "
                         f"process(es), this run has {run.world}")
    if ckpt["examples"] != len(run.data):
        raise ValueError(f"--resume: --data now has {len(run.data)} examples, the checkpoint "
                         f"was trained on {ckpt['examples']}")
    run.encoder.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    training.set_rng_state(ckpt["rng_ranks"][run.rank] if run.world > 1 else ckpt["rng"],
                           run.objective.generator)
    run.state = dict(ckpt["state"])
    run.checkpoint_step = run.state["step"]
    pending = run.state.pop("log_record", None)  # an emergency checkpoint's unwritten record
    if run.rank == 0:
        truncate_log(run.out, run.state["step"])
        done = any(r.get("type") == "step" and r["step"] == run.state["step"] for r in read_log(run.out))
        if pending is not None and not done:
            append_log(run.out, pending)


def export(run: Run) -> None:
    enc = run.eval_encoder
    save_sentence_encoder(run.out, enc.backbone, run.tokenizer, run.eval_pooler, enc.head)


# ---------------------------------------------------------------------------------------
# Evaluation and plots

def dev_evaluation(run: Run) -> dict:
    """Dev scores, alignment and uniformity (STS-B dev) and the selection metric."""
    tasks = ["stsb-dev"] + (["sickr-dev"] if run.args.select == "avg" else [])
    res = evaluate(run.eval_encoder, run.tokenizer, None, run.args.sts_dir, tasks,
                   batch_size=run.args.eval_batch_size, metrics=True, data=run.dev_cache)
    metric = sum(res["scores"][t] for t in tasks) / len(tasks)
    return {**res["scores"], **res["metrics"]["stsb-dev"], "metric": metric}


def write_plots(out: Path, records: list) -> None:
    """dev_curve.png (dev Spearman over steps) and align_uniform.png (Wang & Isola's metrics)."""
    evals = [r for r in records if r.get("type") == "eval"]
    if not evals:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in evals]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("stsb-dev", "sickr-dev"):
        if key in evals[0]:
            ax.plot(steps, [_nan(r.get(key)) for r in evals], marker="o", label=key)
    if "sickr-dev" in evals[0]:
        ax.plot(steps, [_nan(r["metric"]) for r in evals], linestyle="--", label="mean (selects)")
    scored = [r for r in evals if r["metric"] is not None]
    if scored:
        best = max(scored, key=lambda r: r["metric"])
        ax.axvline(best["step"], color="grey", linestyle=":", label=f"best (step {best['step']})")
    ax.set(xlabel="step", ylabel="Spearman x100", title="dev STS")
    ax.legend()
    _save_figure(fig, out / "dev_curve.png")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key in zip(axes, ("alignment", "uniformity")):
        ax.plot(steps, [_nan(r[key]) for r in evals], marker="o")
        ax.set(xlabel="step", ylabel=key, title=f"{key} on STS-B dev (lower is better)")
    _save_figure(fig, out / "align_uniform.png")


def _nan(value) -> float:
    return math.nan if value is None else value


def _save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------
# Loop

class GracefulStop:
    """Turns the first SIGINT/SIGTERM into a flag checked between steps; a second one acts
    as usual. Handlers can only be installed from the main thread."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.signum = None
        self.saved = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self.saved[signum])

    def __exit__(self, *exc):
        for s, handler in self.saved.items():
            signal.signal(s, handler)


def next_batch(run: Run) -> list:
    """The next batch in the seeded per-epoch order; advances the data position."""
    st, bs = run.state, run.args.batch_size
    if st["batch_in_epoch"] == run.steps_per_epoch:
        st["epoch"], st["batch_in_epoch"] = st["epoch"] + 1, 0
    if getattr(run, "_order_epoch", None) != st["epoch"]:
        run._order = training.epoch_order(len(run.data), run.args.seed, st["epoch"])
        run._order_epoch = st["epoch"]
    start = st["batch_in_epoch"] * bs
    rows = run.data.dataset[run._order[start:start + bs].tolist()]
    st["batch_in_epoch"] += 1
    batch = training.batch_examples(run.data, rows)
    share = len(batch) // run.world
    return batch[run.rank * share:(run.rank + 1) * share]


def maybe_evaluate(run: Run) -> None:
    step = run.state["step"]
    if run.rank or not run.args.sts_dir or (step % run.args.eval_steps and step != run.total_steps):
        return
    record = {"type": "eval", "step": step, **dev_evaluation(run)}
    best = run.state["best_metric"]
    # A NaN metric (e.g. constant embeddings) is never the best: it would also block every
    # later comparison. best_step == step: this evaluation is redone after a resume.
    record["best"] = math.isfinite(record["metric"]) and (
        best is None or record["metric"] > best or run.state["best_step"] == step)
    if record["best"]:
        export(run)  # the state names the new best only once its export is complete
        run.state["best_metric"], run.state["best_step"] = record["metric"], step
    append_log(run.out, record)
    run.state["evaluated"] = step
    write_plots(run.out, read_log(run.out))
    run.bar.write(f"step {step}: " + ", ".join(
        f"{k} {_num(record[k], '.2f')}" for k in ("stsb-dev", "sickr-dev") if k in record)
        + f", alignment {_num(record['alignment'])}, uniformity {_num(record['uniformity'])}"
        + (" (best)" if record["best"] else ""))


def _num(value, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def train(run: Run) -> int:
    """The loop; returns 0 when done, 128 + signal number when stopped by a signal.

    Any exception inside it first writes an emergency checkpoint of the last consistent
    state when it can (:func:`emergency_checkpoint`), then propagates.
    """
    from tqdm.auto import tqdm

    args, st = run.args, run.state
    append_log(run.out, {"type": "start", "step": st["step"], "resumed": bool(args.resume),
                         "examples": len(run.data), "skipped": run.data.skipped,
                         "total_steps": run.total_steps, "processes": run.world, "args": vars(args)},
               run.rank)
    run.bar = tqdm(total=run.total_steps, initial=st["step"], desc=args.method, mininterval=1.0,
                   dynamic_ncols=True, disable=run.rank != 0)
    run.phase = "after"  # "step": inside a step; "log": its record pending; "after": done
    hook = run.optimizer.register_step_pre_hook(lambda *_: setattr(run, "updating", True))
    with GracefulStop() as stop, contextlib.closing(run.bar):
        try:
            if st["step"] and st.get("evaluated") != st["step"]:
                maybe_evaluate(run)  # an evaluation an error interrupted before the resume
            while st["step"] < run.total_steps:
                tic = time.perf_counter()
                run.before = (dict(st), training.rng_state(run.objective.generator))
                run.phase, run.updating = "step", False
                batch = next_batch(run)
                out = training.train_step(run.objective, run.encoder, run.tokenizer, batch,
                                          run.optimizer, run.scheduler, max_length=args.max_seq_len,
                                          max_grad_norm=args.max_grad_norm, autocast=run.autocast,
                                          chunk_size=args.chunk_size, distributed=run.world > 1)
                st["step"] += 1
                rate = len(batch) * run.world / (time.perf_counter() - tic)
                run.record = {"type": "step", "step": st["step"], "epoch": st["epoch"], **out,
                              "examples_per_s": rate}
                run.phase = "log"
                append_log(run.out, run.record, run.rank)
                run.phase = "after"
                if run.world > 1:
                    stop.signum = agreed_signal(stop.signum, run.device)
                run.bar.set_postfix(loss=f"{out['loss']:.4f}", ex_s=f"{rate:.1f}", refresh=False)
                run.bar.update(1)
                maybe_evaluate(run)
                if st["step"] % args.checkpoint_steps == 0 or stop.signum or st["step"] == run.total_steps:
                    save_checkpoint(run)
                if stop.signum:
                    if run.rank == 0:
                        run.bar.write(f"stopped by signal {stop.signum} after step {st['step']}; "
                                      f"checkpoint written, continue with --resume")
                    return 128 + stop.signum
        except Exception as err:
            emergency_checkpoint(run, err)
            if isinstance(err, OSError):  # disk full, permissions...: no traceback needed
                raise SystemExit(f"train.py: error: {err}") from err
            raise
        finally:
            hook.remove()
    finish(run)
    return 0


def emergency_checkpoint(run: Run, err: Exception) -> bool:
    """After ``err`` in the loop, write the checkpoint of the last consistent state: the end
    of the step in progress when the error came after it, the start of the step when it came
    before the optimizer update (the step is then redone after ``--resume``). Not possible
    during the update itself, nor with several processes. Returns whether one was written."""
    def say(message):
        print(f"train.py: {message}", file=sys.stderr, flush=True)

    last = run.checkpoint_step
    keep = f"the last checkpoint ({CHECKPOINT}, step {last}) is kept" if last is not None \
        else "there is no checkpoint yet"
    if run.world > 1:
        say(f"error with {run.world} processes: no emergency checkpoint; {keep}")
        return False
    st = run.state
    if run.phase == "step":
        if run.updating:
            say(f"error during the optimizer update of step {st['step'] + 1}: the model is "
                f"half-updated, no emergency checkpoint; {keep}")
            return False
        state, rng = run.before  # the step had not changed the model: undo its data and draws
        st.clear()
        st.update(state)
        training.set_rng_state(rng, run.objective.generator)
        run.optimizer.zero_grad(set_to_none=True)
    elif run.phase == "log":
        st["log_record"] = run.record
    try:
        save_checkpoint(run)
    except Exception as again:
        say(f"error after step {st['step']}; the emergency checkpoint could not be written "
            f"({again}); {keep}")
        return False
    finally:
        st.pop("log_record", None)
    say(f"error after step {st['step']} ({type(err).__name__}): emergency checkpoint written "
        f"to {run.out / CHECKPOINT} at step {st['step']}; fix the cause and continue with --resume")
    return True


def agreed_signal(signum, device):
    """The stop signal any process received (all stop after the same step), or None."""
    import torch.distributed as dist
    t = torch.tensor([signum or 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t) or None


def finish(run: Run) -> None:
    if run.rank:
        return
    if not run.args.sts_dir:
        export(run)
    summary = {"method": run.args.method, "steps": run.state["step"], "eval_pooler": run.eval_pooler,
               "select": run.args.select if run.args.sts_dir else None,
               "best_step": run.state["best_step"], "best_metric": run.state["best_metric"]}
    (run.out / "train_results.json").write_text(
        json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
    print(f"model saved to {run.out} ({'best' if run.args.sts_dir else 'last'} step "
          f"{run.state['best_step'] or run.state['step']}, pooler {run.eval_pooler})")


def main(argv=None) -> int:
    parser = build_parser()
    args = resolve_args(parser, parser.parse_args(argv))
    out = Path(args.output_dir)
    if not args.resume and (out / CHECKPOINT).exists():
        parser.error(f"--output-dir {out} holds a checkpoint: pass --resume to continue it, "
                     "or choose another folder")
    try:
        init_distributed(args.device)
        out.mkdir(parents=True, exist_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:
            for path in clean_leftovers(out):
                print(f"removed {path}, left by an interrupted write")
        run = setup(args)
        if args.resume:
            resume(run)
        elif (out / LOG).exists() and run.rank == 0:
            (out / LOG).unlink()
    except (ValueError, OSError) as err:
        raise SystemExit(f"train.py: error: {err}") from err
    if run.rank == 0:
        if not args.sts_dir:
            print("no --sts-dir: no dev evaluation during training; the last model will be saved")
        print(f"{args.method}: {len(run.data)} examples from {args.data}"
              + (f" ({run.data.skipped} skipped)" if run.data.skipped else "")
              + f", {run.total_steps} steps of {args.batch_size}, eval pooler {run.eval_pooler}"
              + (f", {run.world} processes of {args.batch_size // run.world}" if run.world > 1 else ""))
    try:
        return train(run)
    finally:
        if run.world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
