"""What a run is built from, on sentence-transformers: the model, the dataset, the loss and
the training arguments. Each function reads the resolved options (:func:`.cli.resolve_args`).

- :func:`build_model`: a sentence-transformers model keeps its own modules (its pooling,
  Normalize, ...) unless ``--pooler`` is given; a plain Hugging Face encoder gets the method's
  pooler (:func:`.heads.pooling_modules`). Training inputs are cut at ``--max-seq-len``; the
  model's own limit comes back for evaluation and the saved model.
- :func:`build_dataset`: the columns the losses take: ``anchor``, ``positive`` (the sentence
  twice for the unsupervised methods, SimCSE's duplicated batch; dropout makes the two views)
  and ``negative`` (supervised hard negatives).
- :func:`build_loss`: the fastcl sentence-transformers loss of the method, cached with
  ``--mini-batch-size``, gathering across processes when there are several, with DCLR's
  guide and the positive-view augmentation.
- :func:`build_arguments`: ``SentenceTransformerTrainingArguments`` from the options.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data import read_training_data
from ..encoders import _hub_error, _looks_like_path
from .cli import FAMILY_DEFAULTS

# The name the dev evaluator's metrics carry: eval_<DEV>_<task>, eval_<DEV>_avg.
DEV = "dev"
SELECT_METRIC = {"stsb": f"eval_{DEV}_stsb-dev", "avg": f"eval_{DEV}_avg"}


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_cpu(args) -> bool:
    """Whether the run trains on the CPU by the trainer's arguments: ``--device cpu``, or
    several processes and no CUDA (told nothing, accelerate leaves each process to train on
    its own there: no gradient averaging, every process writing the log)."""
    return args.device == "cpu" or (args.device == "auto" and world_size() > 1
                                    and not torch.cuda.is_available())


def _is_sentence_transformers_folder(name: str) -> bool:
    path = Path(name).expanduser()
    if path.is_dir():
        return (path / "modules.json").is_file()
    from sentence_transformers.util import is_sentence_transformer_model
    try:
        return is_sentence_transformer_model(name)
    except Exception:  # offline, or no such repository: the load below says which
        return False


def _transformer(name: str, arg: str):
    """sentence-transformers' Transformer module of the Hugging Face encoder ``name``; a
    missing folder or a hub name that cannot be fetched is an error naming ``arg``."""
    from .heads import Transformer

    path = Path(name).expanduser()
    if not path.is_dir():
        if path.exists() or _looks_like_path(name):
            raise FileNotFoundError(f"{arg}: no such model folder: {name}")
    elif not (path / "config.json").is_file():
        raise FileNotFoundError(f"{arg}: {path} has no config.json; is it a Hugging Face model folder?")
    try:
        return Transformer(str(path) if path.is_dir() else name)
    except OSError as err:
        if path.is_dir():
            raise
        raise _hub_error(name, arg, err) from err


def load_model(name: str, pooler: str | None, *, mlp_only_train: bool = False,
               device: str | None = None, arg: str = "--model"):
    """A ``SentenceTransformer`` of ``name``: its own modules for a sentence-transformers model
    when ``pooler`` is None; else its Transformer followed by the modules of ``pooler``."""
    from fastcl.integrations.sentence_transformers._base import SentenceTransformer

    from .heads import pooling_modules

    if pooler is None:
        if not _is_sentence_transformers_folder(name):
            raise ValueError(f"{arg} {name} is not a sentence-transformers model: choose its "
                             "pooler (--pooler)")
        return SentenceTransformer(name, device=device)
    if Path(name).expanduser().is_dir() and (Path(name).expanduser() / "modules.json").is_file():
        base = SentenceTransformer(name, device="cpu")
        transformer = base[0]
    else:
        transformer = _transformer(name, arg)
    hf = transformer.auto_model
    if pooler in ("avg_first_last", "avg_top2"):
        hf.config.output_hidden_states = True  # saved with the model's config.json
    modules = pooling_modules(pooler, hf.config.hidden_size, hf.config.num_hidden_layers,
                              mlp_only_train=mlp_only_train,
                              init_std=getattr(hf.config, "initializer_range", 0.02))
    return SentenceTransformer(modules=[transformer, *modules], device=device)


def build_model(args, device: str | None = None):
    """The model to train (see the module docstring). Sets ``args.pooler_used``: the pooler
    chosen, or None when the base model's own modules are kept."""
    keep = args.pooler is None and _is_sentence_transformers_folder(args.model)
    pooler = None if keep else (args.pooler or args.recipe_pooler)
    mlp = bool(args.mlp_only_train) and pooler == "cls"
    model = load_model(args.model, pooler, mlp_only_train=mlp, device=device)
    args.pooler_used = pooler
    args.model_max_seq_length = model.max_seq_length
    model.max_seq_length = args.max_seq_len
    return model


def family(model) -> str:
    """``roberta`` for a RoBERTa-family encoder (DCLR's other defaults), else ``bert``."""
    return "roberta" if "roberta" in model[0].auto_model.config.model_type else "bert"


def build_dataset(args):
    """``(dataset, skipped, source)``: the training examples with the losses' columns."""
    data = read_training_data(args.data, args.method, args.snli_splits, text_column=args.text_column,
                              columns=args.columns, split=args.data_split)
    ds = data.dataset
    if data.kind == "sentences":
        text = ds["text"]
        import datasets
        ds = datasets.Dataset.from_dict({"anchor": text, "positive": list(text)})
    else:
        ds = ds.rename_columns({"sent0": "anchor", "sent1": "positive",
                                **({"hard_neg": "negative"} if "hard_neg" in ds.column_names else {})})
        if args.hard_negative_weight and "negative" not in ds.column_names:
            raise ValueError(f"--hard-negative-weight {args.hard_negative_weight:g} weighs each "
                             f"anchor's hard negative, but --data {args.data} has pairs (no hard "
                             "negative column)")
    if len(ds) < args.batch_size:
        raise ValueError(f"--data: {len(ds)} examples, fewer than --batch-size {args.batch_size}")
    return ds, data.skipped, data.source


def build_loss(args, model, device: str | None = None):
    """The method's fastcl loss for ``model`` (see the module docstring). DCLR's phi and noise
    ratio default by model family (written back into ``args``)."""
    from fastcl.integrations import sentence_transformers as st

    cached = args.mini_batch_size is not None
    kw = dict(gather_across_devices=world_size() > 1)
    if cached:
        kw["mini_batch_size"] = args.mini_batch_size
    method = args.method
    kw["mask_duplicates"] = bool(args.mask_duplicates)
    if method in ("simcse", "simcse-sup"):
        cls = st.CachedFastInfoNCELoss if cached else st.FastInfoNCELoss
        loss = cls(model, scale=1.0 / args.temperature, hard_negative_weight=args.hard_negative_weight,
                   focal_m=args.focal_m, **kw)
    elif method == "focal":
        cls = st.CachedFastFocalInfoNCELoss if cached else st.FastFocalInfoNCELoss
        loss = cls(model, temperature=args.temperature, m=args.m, **kw)
    elif method == "escl":
        cls = st.CachedFastESCLLoss if cached else st.FastESCLLoss
        loss = cls(model, temperature=args.temperature, weight=args.rd_weight, rd=args.rd,
                   sensitive_dropout=args.sensitive_dropout, **kw)
    else:  # dclr
        roberta = family(model) == "roberta"
        for name, (bert_value, roberta_value) in FAMILY_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, roberta_value if roberta else bert_value)
        guide = None
        if args.complementary:
            guide = load_model(args.complementary, _guide_pooler(args), device=device,
                               arg="--complementary")
            guide.requires_grad_(False)
        cls = st.CachedFastDCLRLoss if cached else st.FastDCLRLoss
        loss = cls(model, guide, phi=args.phi, noise_ratio=args.noise_ratio,
                   noise_steps=args.noise_steps, noise_lr=args.noise_lr, noise_std=args.noise_std,
                   temperature=args.temperature, formulation=args.dclr_formulation,
                   focal_m=args.focal_m, guide_dropout=args.complementary_mode == "released", **kw)
    if args.augment:
        loss = st.AugmentedPositives(loss, args.augment)
    return loss


def _guide_pooler(args) -> str | None:
    if args.complementary_pooler:
        return args.complementary_pooler
    return None if _is_sentence_transformers_folder(args.complementary) else "cls_before_pooler"


def precision(args) -> str:
    """``fp32``, ``bf16`` or ``fp16``: ``auto`` is bf16 on a GPU that supports it."""
    if args.precision != "auto":
        return args.precision
    gpu = args.device != "cpu" and torch.cuda.is_available()
    return "bf16" if gpu and torch.cuda.is_bf16_supported() else "fp32"


def build_arguments(args):
    """``SentenceTransformerTrainingArguments`` of the run."""
    try:
        from sentence_transformers.sentence_transformer.training_args import (
            SentenceTransformerTrainingArguments as Arguments)
    except ImportError:  # pragma: no cover - older releases
        from sentence_transformers import SentenceTransformerTrainingArguments as Arguments

    world = world_size()
    per_device, rest = divmod(args.batch_size, world * args.gradient_accumulation_steps)
    if rest or per_device < 1:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"processes ({world}) times --gradient-accumulation-steps "
                         f"({args.gradient_accumulation_steps})")
    mixed = precision(args)
    evaluate = bool(args.sts_dir)
    kw = dict(
        output_dir=str(args.output_dir), seed=args.seed, data_seed=args.seed,
        per_device_train_batch_size=per_device, per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr, num_train_epochs=args.epochs, max_steps=args.max_steps or -1,
        lr_scheduler_type=args.lr_scheduler_type, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, bf16=mixed == "bf16", fp16=mixed == "fp16",
        use_cpu=on_cpu(args), torch_compile=args.torch_compile, batch_sampler=args.batch_sampler,
        dataloader_drop_last=True,  # every step a full batch of in-batch negatives
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        logging_strategy="steps", logging_steps=args.logging_steps, logging_first_step=True,
        report_to=[] if args.report_to == ["none"] else list(args.report_to),
        push_to_hub=args.push_to_hub, hub_model_id=args.hub_model_id,
        eval_strategy="steps" if evaluate else "no",
        disable_tqdm=int(os.environ.get("RANK", "0")) != 0,
    )
    # transformers 5 reads a warmup below 1 as a share of the steps; before, the share has a
    # field of its own and warmup_steps takes an int
    from transformers import TrainingArguments
    if args.warmup_ratio is not None and "warmup_ratio" in TrainingArguments.__dataclass_fields__:
        kw["warmup_ratio"] = args.warmup_ratio
    else:
        kw["warmup_steps"] = args.warmup_ratio if args.warmup_ratio is not None else args.warmup_steps
    if evaluate:
        # the base model scored before step 1 (not again on resume: its record is in the log)
        kw.update(eval_steps=args.eval_steps, eval_on_start=not args.resume, load_best_model_at_end=True,
                  metric_for_best_model=SELECT_METRIC[args.select], greater_is_better=True)
    if args.gradient_checkpointing:  # the field's name in transformers ≥ 5.x, and before
        fields = Arguments.__dataclass_fields__
        kw["activation_checkpointing" if "activation_checkpointing" in fields
           else "gradient_checkpointing"] = True
    return Arguments(**kw)
