"""The trainer's command line: options, the papers' recipes, and their checks.

The papers' training recipes live in one place, the YAML files of ``recipes/``
(``--config recipe:NAME``); without ``--config`` a method takes the training defaults of its
BERT-base recipe (:func:`method_defaults`). The objectives' hyper-parameters default to
:mod:`fastcl.common`; which options a method reads comes from :data:`METHOD_OPTIONS`. Every
rule between options is checked here, once, in :func:`resolve_args`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

from .. import augment, common
from ..data import parse_columns
from ..files import replace_text
from ..encoders import POOLERS

DESCRIPTION = ("Train a sentence encoder with one of fastcl's contrastive objectives, on "
               "sentence-transformers' trainer.")
CONFIG_FILE = "fastcl_config.yaml"   # the run's options, written into --output-dir
RECIPE = "recipe:"                   # --config recipe:NAME: a recipe shipped with fastcl
# Options naming local files or folders: saved as absolute paths when they exist.
PATH_OPTIONS = ("model", "data", "output_dir", "sts_dir", "complementary")

METHODS = ("simcse", "simcse-sup", "dclr", "focal", "escl")
SUPERVISED = ("simcse-sup",)
# The method-specific options: flag dest -> (the methods that read it, its default). None:
# the loss's own default (DCLR's phi and noise ratio: by model family, FAMILY_DEFAULTS).
METHOD_OPTIONS = {
    "hard_negative_weight": (("simcse-sup",), 0.0),
    "focal_m": (("simcse", "simcse-sup", "dclr"), None),
    "mask_duplicates": (METHODS, None),   # see resolve_args
    "phi": (("dclr",), None),
    "noise_ratio": (("dclr",), None),
    "noise_steps": (("dclr",), common.NOISE_STEPS),
    "noise_lr": (("dclr",), common.NOISE_LR),
    "noise_std": (("dclr",), common.NOISE_STD),
    "dclr_formulation": (("dclr",), "paper"),
    "complementary": (("dclr",), None),
    "complementary_pooler": (("dclr",), None),
    "complementary_mode": (("dclr",), "frozen"),
    "m": (("focal",), common.FOCAL_M),
    "rd_weight": (("escl",), common.ESCL_WEIGHT),
    "rd": (("escl",), common.ESCL_RD),
    "sensitive_dropout": (("escl",), common.SENSITIVE_DROPOUT),
}
FAMILY_DEFAULTS = {"phi": (common.PHI, common.PHI_ROBERTA),
                   "noise_ratio": (common.NOISE_RATIO, common.NOISE_RATIO_ROBERTA)}
# What a method's BERT-base recipe sets when no --config gives it.
RECIPE_DEFAULTS = ("batch_size", "lr", "epochs", "select", "pooler", "mlp_only_train")
# Options whose value must be the same when resuming (they define the run's steps).
RUN_DEFINING = ("method", "model", "data", "snli_splits", "text_column", "columns", "data_split",
                "sts_dir", "batch_size", "lr", "epochs", "max_steps", "max_seq_len",
                "mini_batch_size", "pooler", "mlp_only_train", "seed", "temperature",
                "warmup_steps", "warmup_ratio", "lr_scheduler_type", "weight_decay",
                "max_grad_norm", "precision", "select", "augment", "batch_sampler",
                "gradient_accumulation_steps", "eval_steps", "save_steps", *METHOD_OPTIONS)


def _methods_phrase(methods) -> str:
    return methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} or {methods[-1]}"


def method_defaults(method: str) -> dict:
    """The training defaults of ``method``: the :data:`RECIPE_DEFAULTS` keys of its BERT-base
    recipe (``recipes/<method>-bert.yaml``)."""
    values = load_config(f"{RECIPE}{method}-bert")
    return {k: values[k] for k in RECIPE_DEFAULTS if k in values}


def epilog() -> str:
    """The --help text after the options: every method's recipe and defaults."""
    rows = []
    for method in METHODS:
        r = method_defaults(method)
        pooler = ("cls + MLP -> cls_before_pooler" if r.get("mlp_only_train")
                  else "cls + MLP -> cls (MLP kept)")
        rows.append(f"  {method:<11}{r['batch_size']:>5}   {r['lr']:<6g} {r['epochs']:>3}     "
                    f"{pooler:<34}{r['select']}")
    return "\n".join([
        "defaults per method (the BERT-base recipes of the papers, recipes/<method>-bert.yaml):",
        "  method      batch  lr     epochs  pooler (train -> eval/export)     select",
        *rows,
        "  the pooler applies to a plain Hugging Face encoder; a sentence-transformers model keeps",
        "  its own modules (pooling, Normalize ...) unless --pooler is given.",
        f"  all: temperature {common.TEMPERATURE}, max length 32, AdamW without weight decay, "
        "linear decay, clip 1.0.",
        f"  dclr: phi {common.PHI} (BERT) / {common.PHI_ROBERTA} (RoBERTa), noise ratio "
        f"{common.NOISE_RATIO:g} (BERT) / {common.NOISE_RATIO_ROBERTA:g} (RoBERTa), "
        f"{common.NOISE_STEPS} noise",
        f"  steps of lr {common.NOISE_LR:g} from N(0, {common.NOISE_STD:g}). focal: m "
        f"{common.FOCAL_M}. escl: rd weight {common.ESCL_WEIGHT:g}, sensitive dropout "
        f"{common.SENSITIVE_DROPOUT}.",
        "",
        "data formats (--data):",
        "  .txt: UTF-8, one sentence a line (blank lines are skipped); unsupervised methods.",
        "  .csv, .tsv (a header row, standard quoting), .json, .jsonl, .parquet: unsupervised methods",
        "  read --text-column (default: text or sentence, else the only text column); simcse-sup",
        "  reads --columns anchor,positive[,hard_negative] (default sent0,sent1[,hard_neg]).",
        "  a folder of such files (one format), or a dataset name for datasets.load_dataset",
        "  (--data-split; offline it loads from the local cache). simcse-sup also reads a folder in",
        "  SentEval's SNLI layout (s1.<split>, s2.<split>, labels.<split>) made into (premise,",
        "  entailment, contradiction) triplets. Rows with an empty field are skipped and counted.",
        "",
        "output (--output-dir OUT): OUT/model/ the trained model (a plain sentence-transformers",
        "  folder, also loadable with transformers' AutoModel), OUT/checkpoint-N/ the resumable",
        f"  checkpoints, OUT/train_log.jsonl, plots, OUT/{CONFIG_FILE} (the run's options).",
        "",
        "configuration files (--config FILE, YAML or JSON): keys are the options above (batch_size",
        "  or batch-size), flags on the command line override them, and every run saves its",
        f"  options as OUTPUT_DIR/{CONFIG_FILE}. The papers' recipes: --config recipe:NAME, NAME:",
        textwrap.fill(", ".join(recipe_names()) or "(none installed)", 94,
                      initial_indent="  ", subsequent_indent="  "),
        "",
        "large batches: --mini-batch-size for cached encoding; torchrun --nproc_per_node W for",
        "global negatives over W processes.",
    ])


def build_parser(prog: str = "fastcl-train") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--method", required=True, choices=METHODS, help="training objective")
    g.add_argument("--model", required=True, metavar="NAME_OR_PATH",
                   help="a sentence-transformers model or any Hugging Face AutoModel encoder: a "
                        "local folder, or a hub name when online")
    g.add_argument("--data", required=True, metavar="PATH", help="training data (formats below)")
    g.add_argument("--snli-splits", nargs="+", default=None, metavar="SPLIT",
                   help="with an SNLI folder: the splits to use (default: every split found)")
    g.add_argument("--text-column", default=None, metavar="NAME",
                   help="unsupervised methods, with a table (csv, tsv, json, parquet, dataset): the "
                        "sentence column (default: text or sentence, else the only text column)")
    g.add_argument("--columns", default=None, metavar="A,P[,N]",
                   help="simcse-sup, with a table: the anchor, positive and optional hard-negative "
                        "columns (default: sent0,sent1[,hard_neg])")
    g.add_argument("--data-split", default="train", metavar="SPLIT",
                   help="with a dataset name: the split to train on (default train)")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or JSON file of options (keys: the option names); flags given on the "
                        "command line override it. recipe:NAME is a shipped recipe (see below)")
    g.add_argument("--output-dir", required=True, metavar="DIR",
                   help="where the model (DIR/model), checkpoints and logs go")
    g.add_argument("--overwrite-output-dir", action="store_true",
                   help="train into an --output-dir that holds a fastcl run (its model, checkpoints "
                        "and log are replaced); without it such a folder is refused")
    g.add_argument("--allow-nonempty-output-dir", action="store_true",
                   help="train into a non-empty --output-dir that is not a fastcl run; fastcl then "
                        "writes its own entries only and removes nothing of what is there")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint OUTPUT_DIR/checkpoint-N "
                        "(same options as the first run)")
    g.add_argument("--allow-changed-data", action="store_true",
                   help="with --resume: continue although the training data changed since the run "
                        "started (a file's size, time, first or last bytes; a dataset's "
                        "fingerprint); without it such a resume is refused, naming the file")
    g.add_argument("--seed", type=int, default=42, help="seed of dropout, data order, head and noise (default 42)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto (default): CUDA when available (pick GPUs with CUDA_VISIBLE_DEVICES), "
                        "else the CPU for several processes")
    g.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"), default="auto",
                   help="mixed precision of the encoder: auto (default): bf16 on a GPU that "
                        "supports it, fp32 otherwise; the loss always runs in float32")

    g = p.add_argument_group("optimization")
    g.add_argument("--batch-size", type=int, default=None,
                   help="examples per step over all processes (default: per method)")
    g.add_argument("--lr", type=float, default=None, help="peak learning rate (default: per method)")
    g.add_argument("--epochs", type=int, default=None, help="passes over the data (default: per method)")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many steps; overrides --epochs")
    g.add_argument("--max-seq-len", type=int, default=32,
                   help="truncate training inputs to this many tokens (default 32; evaluation "
                        "and the saved model keep the model's own limit)")
    g.add_argument("--lr-scheduler-type", default="linear", metavar="TYPE",
                   help="transformers' scheduler: linear (default), cosine, constant, "
                        "constant_with_warmup, polynomial, ...")
    g.add_argument("--warmup-steps", type=int, default=0, help="warmup steps (default 0)")
    g.add_argument("--warmup-ratio", type=float, default=None,
                   help="warmup as a share of the steps, instead of --warmup-steps")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, not on biases and norms (default 0)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient-norm clipping (default 1.0)")
    g.add_argument("--gradient-accumulation-steps", type=int, default=1, metavar="K",
                   help="split each batch into K parts with one update (default 1); each part "
                        "contrasts with its own in-batch negatives only: --mini-batch-size keeps "
                        "every negative")
    g.add_argument("--mini-batch-size", type=int, default=None, metavar="B",
                   help="cached two-pass encoding (GradCache): run the encoder on at most B inputs "
                        "at a time with the same gradients and dropout masks replayed exactly; "
                        "activation memory then follows B instead of the batch (default: one pass)")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute the encoder's activations in the backward (less memory)")
    g.add_argument("--torch-compile", action="store_true", help="torch.compile the encoder")
    g.add_argument("--batch-sampler", choices=("batch_sampler", "no_duplicates", "no_duplicates_hashed"),
                   default=None,
                   help="sentence-transformers' batch sampler: no_duplicates keeps a text out of "
                        "a batch that holds it already (no false negatives from duplicates; "
                        "default for simcse-sup), batch_sampler (default otherwise) does not")

    g = p.add_argument_group("pooling")
    g.add_argument("--pooler", choices=POOLERS, default=None,
                   help="default: a sentence-transformers model keeps its own pooling; a plain "
                        "encoder gets the method's (cls). cls: CLS through an MLP head (Linear+"
                        "Tanh); cls_before_pooler: raw CLS; avg: mean of the last layer; "
                        "avg_first_last, avg_top2")
    g.add_argument("--mlp-only-train", action=argparse.BooleanOptionalAction, default=None,
                   help="with --pooler cls: train with the MLP but evaluate and save "
                        "cls_before_pooler (default: on for unsupervised methods, off for simcse-sup)")

    g = p.add_argument_group("evaluation and checkpoints")
    g.add_argument("--sts-dir", default=None, metavar="DIR",
                   help="STS data folder (stsb/sts-dev.csv, sick/SICK_trial.txt): STS-B and SICK-R "
                        "dev at step 0 and every --eval-steps, the best step is saved; without it "
                        "the last model is saved")
    g.add_argument("--eval-steps", type=int, default=125, help="evaluate every N steps (default 125)")
    g.add_argument("--select", choices=("stsb", "avg"), default=None,
                   help="keep the best model by STS-B dev Spearman, or by the mean of STS-B dev and "
                        "SICK-R dev (default: avg for dclr, stsb otherwise)")
    g.add_argument("--early-stopping-patience", type=int, default=None, metavar="N",
                   help="stop when N evaluations in a row do not improve the selection metric")
    g.add_argument("--eval-batch-size", type=int, default=64, help="sentences per evaluation forward (default 64)")
    g.add_argument("--save-steps", type=int, default=None,
                   help="write a resumable checkpoint-N every N steps (default: --eval-steps with "
                        "--sts-dir, else 250; a multiple of --eval-steps with --sts-dir)")
    g.add_argument("--save-total-limit", type=int, default=2,
                   help="checkpoints kept (the newest and the best; default 2)")

    g = p.add_argument_group("tracking and sharing")
    g.add_argument("--logging-steps", type=int, default=1, help="log the loss every N steps (default 1)")
    g.add_argument("--report-to", nargs="+", default=["none"], metavar="TRACKER",
                   help="transformers' integrations: tensorboard, wandb, mlflow, ... or none "
                        "(default)")
    g.add_argument("--push-to-hub", action="store_true", help="upload the saved model to the Hugging Face hub")
    g.add_argument("--hub-model-id", default=None, metavar="NAME", help="the hub repository of --push-to-hub")

    g = p.add_argument_group("objective")
    g.add_argument("--temperature", type=float, default=common.TEMPERATURE,
                   help=f"softmax temperature (default {common.TEMPERATURE})")
    g.add_argument("--mask-duplicates", action=argparse.BooleanOptionalAction, default=None,
                   help="drop every candidate whose text equals that of the anchor's positive (a "
                        "duplicate sentence is no negative; default: on for simcse-sup with "
                        "--batch-sampler batch_sampler, whose batches may repeat a text; off where "
                        "a no_duplicates sampler keeps repeats out, and for the unsupervised methods)")
    g.add_argument("--hard-negative-weight", type=float, default=None,
                   help="simcse-sup: log-weight added to each anchor's hard-negative logit (default 0)")
    g.add_argument("--phi", type=float, default=None,
                   help="dclr: drop in-batch negatives whose complementary cosine is >= phi "
                        f"(default {common.PHI}, RoBERTa {common.PHI_ROBERTA})")
    g.add_argument("--noise-ratio", type=float, default=None,
                   help=f"dclr: noise negatives per anchor (default {common.NOISE_RATIO:g}, "
                        f"RoBERTa {common.NOISE_RATIO_ROBERTA:g})")
    g.add_argument("--noise-steps", type=int, default=None, help=f"dclr: gradient-ascent steps on the noise (default {common.NOISE_STEPS})")
    g.add_argument("--noise-lr", type=float, default=None, help=f"dclr: noise step size beta (default {common.NOISE_LR:g})")
    g.add_argument("--noise-std", type=float, default=None, help=f"dclr: initial noise std sigma (default {common.NOISE_STD:g})")
    g.add_argument("--dclr-formulation", choices=("paper", "released"), default=None,
                   help="dclr: the paper's loss or the authors' released code (default paper)")
    g.add_argument("--complementary", default=None, metavar="PATH",
                   help="dclr: frozen complementary encoder (e.g. a trained SimCSE) for instance "
                        "weighting; without it no negative is dropped")
    g.add_argument("--complementary-pooler", choices=POOLERS, default=None,
                   help="dclr: pooler of a plain complementary encoder (default cls_before_pooler); "
                        "a sentence-transformers model keeps its own")
    g.add_argument("--complementary-mode", choices=("frozen", "released"), default=None,
                   help="dclr: 'frozen' (default) embeds the batch in eval mode, c = c+; 'released' "
                        "does as the authors' code: dropout on, each column its own view (c and "
                        "c+ two dropout views), still without gradients")
    g.add_argument("--m", type=float, default=None, help=f"focal: margin m of the negative logits s(s+m)/t (default {common.FOCAL_M})")
    g.add_argument("--focal-m", type=float, default=None, metavar="M",
                   help="simcse, simcse-sup, dclr: add Focal-InfoNCE's modulation with margin M "
                        "(positive logit s^2/t, every negative s(s+M)/t, hard and noise negatives "
                        "included); default off. --method focal takes its margin as --m")
    g.add_argument("--rd-weight", type=float, default=None, help=f"escl: weight of the relative-difference term (default {common.ESCL_WEIGHT:g})")
    g.add_argument("--rd", choices=("softplus", "margin"), default=None,
                   help=f"escl: relative-difference form (default {common.ESCL_RD})")
    g.add_argument("--sensitive-dropout", type=float, default=None,
                   help=f"escl: dropout rate of the third, sensitive view (default {common.SENSITIVE_DROPOUT})")
    rates = ", ".join(f"{name.replace('_', '-')} {rate:g}" for name, rate in common.AUGMENT_RATES.items())
    g.add_argument("--augment", default=None, metavar="NAME[:RATE]",
                   help="unsupervised methods: also augment the positive (second) copy of each "
                        "sentence, dropout still on: token-cutoff, span-cutoff, feature-cutoff (on "
                        "the embedding layer's output), word-shuffle, word-deletion; RATE is the "
                        f"share of content tokens (of dimensions for feature-cutoff) changed, default "
                        f"{rates}; special tokens and padding are never touched (default: none)")
    return p


def _require(parser, ok: bool, message: str) -> None:
    if not ok:
        parser.error(message)


def resolve_args(parser, args) -> argparse.Namespace:
    """Fill method defaults and check every value and every rule between options, once;
    errors name the option."""
    for name, (methods, default) in METHOD_OPTIONS.items():
        given = getattr(args, name)
        hint = "; --method focal takes its margin as --m" if name == "focal_m" else ""
        _require(parser, given is None or args.method in methods,
                 f"--{name.replace('_', '-')} applies to --method {_methods_phrase(methods)} only{hint}")
        if given is None:
            setattr(args, name, default)
    supervised = args.method in SUPERVISED
    if args.augment is not None:
        _require(parser, not supervised,
                 f"--augment applies to the unsupervised methods (it augments the second copy of "
                 f"each sentence); {args.method} takes its positives from the data")
        try:
            args.augment = augment.parse(args.augment).spec  # canonical: NAME:rate
        except ValueError as err:
            parser.error(f"--{err}")
    if args.complementary and (Path(args.complementary) / CONFIG_FILE).is_file():
        args.complementary = str(Path(args.complementary) / "model")  # a fastcl-train output folder
    if args.method == "dclr" and args.complementary is None:
        # options of the complementary model do nothing without one: an error, not a no-op
        _require(parser, args.complementary_pooler is None,
                 "--complementary-pooler needs --complementary (the model it pools)")
        _require(parser, args.complementary_mode != "released",
                 "--complementary-mode released needs --complementary (the model it runs)")
    _require(parser, args.focal_m is None or args.dclr_formulation != "released",
             "--focal-m combines with --dclr-formulation paper only (the released code's loss has "
             "no focal modulation)")
    _require(parser, args.text_column is None or not supervised,
             f"--text-column applies to unsupervised methods; {args.method} reads --columns")
    _require(parser, args.columns is None or supervised,
             f"--columns applies to --method simcse-sup; {args.method} reads --text-column")
    if args.columns is not None:
        try:
            parse_columns(args.columns)
        except ValueError as err:
            parser.error(str(err))
    recipe = method_defaults(args.method)
    args.recipe_pooler = recipe["pooler"]
    _require(parser, args.mlp_only_train is None or args.pooler in (None, "cls"),
             "--mlp-only-train/--no-mlp-only-train apply to --pooler cls only")
    for name in ("batch_size", "lr", "epochs", "select", "mlp_only_train"):
        if getattr(args, name) is None:
            setattr(args, name, recipe[name])
    if args.batch_sampler is None:
        args.batch_sampler = "no_duplicates" if supervised else "batch_sampler"
    if args.mask_duplicates is None and args.method in METHOD_OPTIONS["mask_duplicates"][0]:
        # a no_duplicates sampler already keeps a text from appearing twice in a batch (and
        # the ids cost a comparison per entry; with DCLR's guide mask they take the tiled path)
        args.mask_duplicates = supervised and args.batch_sampler == "batch_sampler"
    if args.save_steps is None:
        args.save_steps = args.eval_steps if args.sts_dir else 250
    pos = lambda v: v is not None and v > 0 and math.isfinite(v)  # noqa: E731
    checks = [
        (args.batch_size >= 2, f"--batch-size must be >= 2 (in-batch negatives), got {args.batch_size}"),
        (pos(args.lr), f"--lr must be > 0, got {args.lr}"),
        (args.epochs >= 1, f"--epochs must be >= 1, got {args.epochs}"),
        (args.max_steps is None or args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}"),
        (args.max_seq_len >= 2, f"--max-seq-len must be >= 2, got {args.max_seq_len}"),
        (args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}"),
        (args.warmup_ratio is None or 0 <= args.warmup_ratio < 1,
         f"--warmup-ratio must be in [0, 1), got {args.warmup_ratio}"),
        (args.warmup_ratio is None or args.warmup_steps == 0,
         "--warmup-ratio and --warmup-steps both set the warmup; give one"),
        (args.weight_decay >= 0, f"--weight-decay must be >= 0, got {args.weight_decay}"),
        (pos(args.max_grad_norm), f"--max-grad-norm must be > 0, got {args.max_grad_norm}"),
        (args.gradient_accumulation_steps >= 1,
         f"--gradient-accumulation-steps must be >= 1, got {args.gradient_accumulation_steps}"),
        (args.batch_size % args.gradient_accumulation_steps == 0,
         f"--batch-size {args.batch_size} must be a multiple of --gradient-accumulation-steps "
         f"{args.gradient_accumulation_steps}"),
        (args.mini_batch_size is None or args.mini_batch_size >= 1,
         f"--mini-batch-size must be >= 1, got {args.mini_batch_size}"),
        (args.eval_steps >= 1, f"--eval-steps must be >= 1, got {args.eval_steps}"),
        (args.eval_batch_size >= 1, f"--eval-batch-size must be >= 1, got {args.eval_batch_size}"),
        (args.save_steps >= 1, f"--save-steps must be >= 1, got {args.save_steps}"),
        (not args.sts_dir or args.save_steps % args.eval_steps == 0,
         f"--save-steps {args.save_steps} must be a multiple of --eval-steps {args.eval_steps} "
         "(the best evaluated step must have a checkpoint to be kept)"),
        (args.save_total_limit >= 1, f"--save-total-limit must be >= 1, got {args.save_total_limit}"),
        (args.logging_steps >= 1, f"--logging-steps must be >= 1, got {args.logging_steps}"),
        (args.early_stopping_patience is None or args.early_stopping_patience >= 1,
         f"--early-stopping-patience must be >= 1, got {args.early_stopping_patience}"),
        (args.early_stopping_patience is None or args.sts_dir,
         "--early-stopping-patience needs --sts-dir (the evaluations it watches)"),
        ("none" not in args.report_to or set(args.report_to) == {"none"},
         f"--report-to none cannot be combined with a tracker, got {' '.join(args.report_to)}"),
        (args.hub_model_id is None or args.push_to_hub, "--hub-model-id needs --push-to-hub"),
        (not args.allow_changed_data or args.resume, "--allow-changed-data applies to --resume only"),
        (pos(args.temperature), f"--temperature must be > 0, got {args.temperature}"),
        (args.phi is None or -1 <= args.phi <= 1, f"--phi must be in [-1, 1], got {args.phi}"),
        (args.noise_ratio is None or args.noise_ratio >= 0, f"--noise-ratio must be >= 0, got {args.noise_ratio}"),
        (args.noise_steps >= 0, f"--noise-steps must be >= 0, got {args.noise_steps}"),
        (pos(args.noise_std), f"--noise-std must be > 0, got {args.noise_std}"),
        (0 <= args.sensitive_dropout < 1, f"--sensitive-dropout must be in [0, 1), got {args.sensitive_dropout}"),
        (args.sts_dir is None or Path(args.sts_dir).is_dir(), f"--sts-dir: no such folder: {args.sts_dir}"),
    ]
    for ok, message in checks:
        _require(parser, ok, message)
    return args


# ---------------------------------------------------------------------------------------
# Configuration files: --config FILE (YAML or JSON), the shipped recipes, the saved config

def recipe_names() -> list:
    """The recipes shipped with fastcl (``fastcl/trainer/recipes/NAME.yaml``)."""
    folder = Path(__file__).resolve().parent / "recipes"
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def recipe_path(name: str) -> Path:
    """The file of the shipped recipe ``name``."""
    if name not in recipe_names():
        raise ValueError(f"--config: no recipe {name!r}; the recipes are "
                         f"{', '.join(recipe_names()) or '(none installed)'}")
    return Path(__file__).resolve().parent / "recipes" / f"{name}.yaml"


def load_config(spec: str) -> dict:
    """The mapping of options in the config file ``spec`` (``.yaml``, ``.yml`` or ``.json``;
    ``recipe:NAME``: a shipped recipe). An empty file is an empty mapping."""
    path = recipe_path(spec[len(RECIPE):]) if spec.startswith(RECIPE) else Path(spec)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--config: {spec}: a config file is YAML (.yaml, .yml) or JSON (.json)")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--config: no such file: {spec}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config: {spec} is not UTF-8 text") from None
    if suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--config: {spec} is not valid JSON ({err})") from None
    else:
        import yaml
        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"--config: {spec} is not valid YAML ({err})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"--config: {spec} must hold a mapping of option names to values, "
                         f"not a {type(values).__name__}")
    return values


def _config_actions(parser) -> dict:
    """Config key → the parser's action: its dest (``batch_size``) or its flag without the
    dashes (``batch-size``, made ``batch_size``)."""
    actions = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config"):
            continue
        actions[action.dest] = action
        actions[action.option_strings[0].lstrip("-").replace("-", "_")] = action
    return actions


def config_tokens(parser, values: dict, spec: str) -> list:
    """The command-line tokens that set the options of the config ``values`` (from ``spec``).
    A null value leaves the option at its default."""
    actions = _config_actions(parser)
    tokens, seen = [], {}

    def bad(message):
        raise ValueError(f"--config {spec}: {message}")

    def scalar(key, value):
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            bad(f"{key}: expected a number or a string, got {value!r}")
        return str(value)

    for key, value in values.items():
        action = actions.get(str(key).replace("-", "_"))
        if action is None:
            bad(f"unknown key {key!r}: not an option of {parser.prog} (see {parser.prog} --help)")
        if action.dest in seen:
            bad(f"{key!r} and {seen[action.dest]!r} set the same option")
        seen[action.dest] = key
        if value is None:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false / --x/--no-x
            if not isinstance(value, bool):
                bad(f"{key}: expected true or false, got {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):
                tokens.append(flag if value else "--no-" + flag[2:])
            elif value == action.const:
                tokens.append(flag)
        elif isinstance(action, argparse._AppendAction):
            items = value if isinstance(value, list) else [value]
            tokens += [f"{flag}={scalar(key, v)}" for v in items]
        elif action.nargs in ("+", "*") or isinstance(action.nargs, int):
            items = value if isinstance(value, list) else [value]
            tokens += [flag, *(scalar(key, v) for v in items)]
        else:
            tokens.append(f"{flag}={scalar(key, value)}")
    return tokens


class _ParseError(Exception):
    pass


def _parse_leniently(parser, argv: list) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with no option required; errors raise :class:`_ParseError`
    instead of exiting."""
    required = [a for a in parser._actions if a.required]

    def fail(message):
        raise _ParseError(message)

    for action in required:
        action.required = False
    parser.error = fail  # shadows the method for this call
    try:
        return parser.parse_args(argv)
    finally:
        del parser.error
        for action in required:
            action.required = True


def parse_args(parser, argv=None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) with the options of its ``--config`` file
    placed before it: the file may give required options, flags on the command line override
    it. Errors in the file name the file and the key."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        spec = _parse_leniently(parser, argv).config
    except _ParseError:
        spec = None  # the parse below reports the error
    tokens = []
    if spec:
        try:
            tokens = config_tokens(parser, load_config(spec), spec)
            _parse_leniently(parser, tokens)  # values checked by the options' own types
        except ValueError as err:
            parser.error(str(err))
        except _ParseError as err:
            parser.error(f"--config {spec}: {err}")
    return parser.parse_args(tokens + argv)


def effective_config(args) -> dict:
    """The options of a run as a config file holds them, so that ``--config`` of it repeats the
    run: every option that has a value (local paths made absolute), except ``--resume`` and
    ``--allow-changed-data``, and the method options of other methods."""
    options = {a.dest for a in build_parser()._actions if a.option_strings}
    config = {}
    for key, value in vars(args).items():
        if key not in options or key in ("help", "config", "resume", "allow_changed_data") or value is None:
            continue
        if key in METHOD_OPTIONS and args.method not in METHOD_OPTIONS[key][0]:
            continue
        if key == "mlp_only_train" and args.pooler not in (None, "cls"):
            continue
        if key in PATH_OPTIONS and Path(value).exists():
            value = str(Path(value).resolve())
        config[key] = list(value) if isinstance(value, tuple) else value
    return config


def write_config(out, args) -> Path:
    """Write :func:`effective_config` as YAML to ``out/CONFIG_FILE`` (through a temporary file
    and a rename: a crash leaves the previous one whole)."""
    import yaml
    out = Path(out)
    text = (f"# The options of this fastcl-train run. Repeat it with: fastcl-train --config "
            f"{out.resolve() / CONFIG_FILE}\n# (flags given on the command line override these "
            "values)\n"
            + yaml.safe_dump(effective_config(args), sort_keys=False, allow_unicode=True))
    replace_text(out / CONFIG_FILE, text)
    return out / CONFIG_FILE
