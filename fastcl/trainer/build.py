""":func:`build_trainer`, the Python API the command line calls too: the model (:func:`build_model`),
the losses' columns (:func:`fastcl.data.loss_columns`), the method's loss (:func:`build_loss`) with
its options (:class:`ObjectiveArguments`: :func:`check_objective` checks which apply, the loss their
values where it is built), the trainer and its callbacks."""

from __future__ import annotations

import copy
import inspect
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers.trainer_utils import rotate_checkpoints

from .. import common, files
from ..data import SUPERVISED, loss_columns
from ..integrations.sentence_transformers.callbacks import KeepBase
from ..integrations.sentence_transformers.models import is_sentence_transformers_model, load_model, model_path

from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers import SentenceTransformerTrainingArguments as Arguments

METHODS = ("simcse", "simcse-sup", "dclr", "focal", "escl")
LOSSES = {"simcse": "FastInfoNCELoss", "simcse-sup": "FastInfoNCELoss", "dclr": "FastDCLRLoss",
          "focal": "FastFocalInfoNCELoss", "escl": "FastESCLLoss"}   # Cached<name>: --mini_batch_size
LOSS_NAMES = {"rd_weight": "weight", "dclr_formulation": "formulation",
              "premise_labels": "class_labels"}   # where a loss says otherwise
GENERAL = ("mini_batch_size", "augment", "temperature_learning_rate")   # not options of the loss class
GUIDE = ("complementary", "complementary_pooler", "complementary_mode")   # DCLR's guide model
FAMILY_DEFAULTS = {"phi": (common.PHI, common.PHI_ROBERTA),   # DCLR's, by the model's family
                   "noise_ratio": (common.NOISE_RATIO, common.NOISE_RATIO_ROBERTA)}
DEV = "dev"   # the dev evaluator's metrics: eval_dev_<task>, eval_dev_avg
SELECT = {"stsb": "stsb-dev", "avg": "avg"}   # --select: the metric that picks the best step
CHECKPOINT_PREFIX = "checkpoint-"


def _opt(default=None, help="", **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ObjectiveArguments:
    """The objective's options (``None``: the loss's default). A new loss option is one field: the
    method's loss class takes it by its name (or :data:`LOSS_NAMES`'), a method whose class lacks
    it refuses it, and the loss checks its value where it is built (:func:`fastcl.spec.build_spec`)."""

    temperature: float = _opt(common.TEMPERATURE, "softmax temperature")
    learnable_temperature: bool = _opt(False, "learn the temperature from --temperature (logged)")
    temperature_learning_rate: float | None = _opt(help="the learned τ's (default: --learning_rate)")
    hard_negative_weight: float | None = _opt(help="simcse-sup: log-weight of the hard negative")
    focal_m: float | None = _opt(help="simcse, simcse-sup, dclr: Focal-InfoNCE's modulation")
    mask_duplicates: bool | None = _opt(help="drop candidates equal to the positive (true/false)")
    phi: float | None = _opt(help=f"dclr: drop negatives whose guide cosine >= phi ({common.PHI})")
    noise_ratio: float | None = _opt(help=f"dclr: noise negatives per anchor ({common.NOISE_RATIO:g})")
    noise_steps: int | None = _opt(help=f"dclr: ascent steps on the noise ({common.NOISE_STEPS})")
    noise_lr: float | None = _opt(help=f"dclr: noise step size ({common.NOISE_LR:g})")
    noise_std: float | None = _opt(help=f"dclr: initial noise std ({common.NOISE_STD:g})")
    dclr_formulation: str | None = _opt(help="dclr: the paper's or the code's", choices=("paper", "released"))
    m: float | None = _opt(help=f"focal: margin of the negative logits ({common.FOCAL_M})")
    rd_weight: float | None = _opt(help=f"escl: weight of the relative difference ({common.ESCL_WEIGHT:g})")
    rd: str | None = _opt(help="escl: the relative difference's form", choices=("softplus", "margin"))
    sensitive_dropout: float | None = _opt(help=f"escl: third view's dropout ({common.SENSITIVE_DROPOUT})")
    false_negative_margin: float | None = _opt(help="drop candidates beating the positive's cosine by more")
    positive_prior: float | None = _opt(help="the debiased loss's class prior tau+ in [0, 1)")
    label_smoothing: float | None = _opt(help="the uniform share of each row's target, in [0, 1) (0)")
    premise_labels: bool | None = _opt(help="simcse-sup, --batch_sampler group_by_label: premise targets")
    teacher: str | None = _opt(help="a frozen teacher (sentence-transformers model) the loss distils")
    teacher_temperature: float | None = _opt(help="the teacher's temperature (default: --temperature)")
    distill_weight: float | None = _opt(help="the teacher's share of each row's target, in [0, 1] (0.5)")


OBJECTIVE = tuple(f.name for f in fields(ObjectiveArguments))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def on_cpu(args) -> bool:
    """Whether the run trains on the CPU: ``--use_cpu``, or several processes and no CUDA
    (told nothing, accelerate leaves each process to train on its own there)."""
    return bool(args.use_cpu) or (world_size() > 1 and not torch.cuda.is_available())


def loss_class(method: str, cached: bool = False):
    from fastcl.integrations import sentence_transformers as st
    return getattr(st, ("Cached" if cached else "") + LOSSES[method])


def check_objective(method: str, options: dict) -> None:
    """``options`` (those that have a value) apply to ``method``: its loss class takes each; their
    values are the loss's to check, where :func:`build_loss` builds it."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    known = (*OBJECTIVE, *GENERAL, *GUIDE)
    for name in options:
        if name not in known:
            raise ValueError(f"{name!r} is no objective option; they are {', '.join(known)}")
        keywords = {LOSS_NAMES.get(name, name), "scale" if name == "temperature" else ""}
        methods = [m for m in METHODS if keywords & set(inspect.signature(loss_class(m)).parameters)
                   or name in GUIDE and m == "dclr"]
        if name not in GENERAL and method not in methods:
            hint = "; --method focal takes its margin as --m" if name == "focal_m" else ""
            raise ValueError(f"--{name} applies to --method {', '.join(methods[:-1])}"
                             f"{' or ' if len(methods) > 1 else ''}{methods[-1]} only{hint}")
    if "augment" in options and method in SUPERVISED:
        raise ValueError(f"--augment applies to the unsupervised methods; {method} has its positives")
    if "premise_labels" in options and method not in SUPERVISED:
        raise ValueError(f"--premise_labels applies to --method {', '.join(SUPERVISED)} only")
    rate = options.get("temperature_learning_rate")
    if rate is not None and not (options.get("learnable_temperature") and 0 < rate < math.inf):
        raise ValueError(f"--temperature_learning_rate {rate:g}: a learning rate > 0 of "
                         "--learnable_temperature's temperature")


def build_model(args, device: str | None = None):
    """The model of the options: its own modules, or ``--pooler`` (a plain encoder: the
    method's). Sets ``args.pooler_used`` (None: the base model's own modules kept)."""
    keep = args.pooler is None and is_sentence_transformers_model(model_path(args.model))
    pooler = None if keep else (args.pooler or args.recipe_pooler)
    model = load_model(args.model, pooler, mlp_only_train=bool(args.mlp_only_train) and pooler == "cls",
                       device=device)
    args.pooler_used, args.model_max_seq_length = pooler, model.max_seq_length
    model.max_seq_length = args.max_seq_len   # training inputs; the saved model keeps its own
    return model


def build_loss(method: str, model, options: dict, device: str | None = None):
    """The fastcl loss of ``method`` for ``model`` with the objective ``options`` (those that
    have a value; DCLR's phi and noise ratio by model family, written back into ``options``).
    A value the loss refuses is its error with the options' names (``--rd_weight``, not ``weight``)."""
    from fastcl.integrations import sentence_transformers as st

    kw = {LOSS_NAMES.get(k, k): v for k, v in options.items() if k not in (*GENERAL, *GUIDE)}
    guide = []
    if method in ("simcse", "simcse-sup"):   # InfoNCE's scale is 1/τ
        if not (temperature := kw.pop("temperature", common.TEMPERATURE)) > 0:
            raise ValueError(f"--temperature must be > 0, got {temperature:g}")
        kw["scale"] = 1.0 / temperature
        if options.get("teacher"):   # frozen, its own modules (a plain encoder: mean pooling)
            own = is_sentence_transformers_model(model_path(options["teacher"]))
            kw["teacher"] = load_model(options["teacher"], None if own else "avg", device=device,
                                       arg="--teacher").requires_grad_(False)
    if method == "dclr":
        roberta = "roberta" in model[0].auto_model.config.model_type
        for name, values in FAMILY_DEFAULTS.items():
            kw[name] = options[name] = kw.get(name, values[roberta])
        path, pooler = options.get("complementary"), options.get("complementary_pooler")
        if path:
            pooler = pooler or (None if is_sentence_transformers_model(path) else "cls_before_pooler")
        guide = [load_model(path, pooler, device=device, arg="--complementary").requires_grad_(False)
                 if path else None]
        kw["guide_dropout"] = options.get("complementary_mode") == "released"
    cached = {"mini_batch_size": options["mini_batch_size"]} if "mini_batch_size" in options else {}
    try:
        loss = loss_class(method, bool(cached))(model, *guide, gather_across_devices=world_size() > 1,
                                                **kw, **cached)
        return st.AugmentedPositives(loss, options["augment"]) if options.get("augment") else loss
    except (ValueError, TypeError) as err:
        message = str(err)
        for name in options:
            message = re.sub(rf"(?<![-\w]){LOSS_NAMES.get(name, name)}\b", f"--{name}", message)
        raise ValueError(message) from None


def own_parameters(loss) -> dict:
    """The parameters of fastcl's loss itself (a learnable temperature), by name, and the loss
    (inside ``AugmentedPositives`` too)."""
    loss = loss if hasattr(loss, "_own_parameters") else loss.loss
    return loss, {f"own.{i}": p for i, p in enumerate(loss._own_parameters())}


def own_names(module, loss) -> set:
    """The names in ``module`` of ``loss``'s own parameters (:func:`own_parameters`)."""
    own = own_parameters(loss)[1].values()
    return {n for n, p in module.named_parameters() if any(p is q for q in own)}


class Trainer(SentenceTransformerTrainer):
    """sentence-transformers' trainer whose checkpoints carry the loss's own parameters and a
    manifest, written before the rotation removes older ones; ``guard()`` refuses links first; the
    model is saved with its own input limit ``export_max_seq_length``; a failed write names it."""

    guard = None
    export_max_seq_length = None
    LOSS_PARAMETERS = "loss_parameters.pt"

    def get_decay_parameter_names(self, model) -> list:
        """Those of transformers but the loss's own (a decayed log-scale would pull τ to 1)."""
        own = own_names(model, self.loss)
        return [n for n in super().get_decay_parameter_names(model) if n not in own]

    def log(self, logs, *args, **kwargs):
        loss, own = own_parameters(self.loss)
        if own and "loss" in logs:   # a learnable temperature's value beside each step's loss
            logs["temperature"] = loss.current_temperature
        super().log(logs, *args, **kwargs)

    def _load_from_checkpoint(self, checkpoint_path: str) -> None:
        super()._load_from_checkpoint(checkpoint_path)
        own, path = own_parameters(self.loss)[1], Path(checkpoint_path) / self.LOSS_PARAMETERS
        if own and path.is_file():
            with torch.no_grad():
                for name, value in files.load_tensors(path).items():   # weights_only
                    own[name].copy_(value)

    def _save_checkpoint(self, model, trial):
        folder = Path(self._get_output_dir(trial=trial)) / f"{CHECKPOINT_PREFIX}{self.state.global_step}"
        if self.args.should_save and self.guard is not None:
            self.guard()
        own = getattr(self.model, "_orig_mod", self.model)
        limit, cut = self.args.save_total_limit, own.max_seq_length
        self.args.save_total_limit, own.max_seq_length = None, self.export_max_seq_length or cut
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
        if self.args.should_save:
            if params := own_parameters(self.loss)[1]:
                torch.save({k: v.detach().cpu() for k, v in params.items()}, folder / self.LOSS_PARAMETERS)
            files.crash_point("checkpoint-manifest")
            files.write_manifest(folder)
        if self.args.world_size > 1:
            torch.distributed.barrier()
        if self.args.should_save:
            rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)


def build_trainer(method: str, model, train_dataset, args=None, *, evaluator=None, callbacks=None,
                  **objective_options):
    """A trainer of ``model`` on ``train_dataset`` (:func:`~fastcl.data.loss_columns`) with the fastcl loss of
    ``method`` and ``objective_options`` (:class:`ObjectiveArguments`, :data:`GENERAL`, :data:`GUIDE`).
    With an ``evaluator`` and ``load_best_model_at_end``, step 0 competes (``eval_on_start``) with
    every evaluated step (transformers evaluates the last one too): a run that never beats its base
    model ends with its weights."""
    options = {k: v for k, v in objective_options.items() if v is not None}
    check_objective(method, options)
    args = args or Arguments(output_dir="fastcl-output")
    dataset = loss_columns(train_dataset, method, options.get("hard_negative_weight") or 0.0,
                           bool(options.get("premise_labels")))
    loss = build_loss(method, model, options, device=str(model.device))
    if (rate := options.get("temperature_learning_rate")) is not None:   # its own group at that rate
        args = copy.copy(args)   # (sentence-transformers' learning_rate_mapping; the caller's args kept)
        names = "|".join(map(re.escape, sorted(own_names(loss, loss))))
        args.learning_rate_mapping = {**args.learning_rate_mapping, f"^({names})$": rate}
    callbacks = list(callbacks or [])
    if evaluator is not None and args.load_best_model_at_end and not (args.deepspeed or args.fsdp):
        callbacks.append(KeepBase(model))
    trainer = Trainer(model=model, args=args, train_dataset=dataset, loss=loss, evaluator=evaluator,
                      callbacks=callbacks)
    trainer.objective_options = options   # as the loss took them (DCLR's family defaults filled)
    return trainer
