"""One ``fastcl-train`` run: the run folder (one run each, written through no link), resume from the
newest verified checkpoint on the same data, a first SIGINT/SIGTERM that checkpoints its step, the
log (a JSON record per step and evaluation) and ``OUT/model``, the best evaluation (step 0 included)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

from transformers import TrainerCallback, TrainerState

from .. import files
from ..files import MANIFEST, DamagedError, LockedError, OutputLock
from ..integrations.sentence_transformers.callbacks import GracefulStop, KeepBase
from . import build
from .build import CHECKPOINT_PREFIX, FAMILY_DEFAULTS
from .cli import (CONFIG_FILE, FREE_ON_RESUME, build_parser, effective_config,
                  objective_options, parse_args, resolve_args, training_arguments, write_config)

PROG = "fastcl-train"
MODEL_DIR = "model"
RESULTS = "train_results.json"   # written last: a finished run
LOG = "train_log.jsonl"
DATA_RECORD = "fastcl_data.json"  # the training data's fingerprint (files.data_fingerprint)
STATE = "trainer_state.json"
# What transformers reads of a checkpoint's training state when it resumes (and STATE).
TRAINING_STATE = {"optimizer.pt": ("state", "param_groups"), "rng_state*.pth": ("python", "numpy", "cpu")}
# What a run writes at the top of its folder, besides checkpoint-N/ ("runs": TensorBoard's).
OWN = (MODEL_DIR, RESULTS, CONFIG_FILE, LOG, DATA_RECORD, "runs", "eval")


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# The log, JSON lines: {"type": "start" | "step" | "eval" | "summary", "step", "epoch", ...}

def read_log(out: Path) -> list:
    """The records of the log (:func:`fastcl.files.read_jsonl`)."""
    return files.read_jsonl(Path(out) / LOG)


class TrainLog(TrainerCallback):
    """Each record transformers logs, as a line of the log (main process); dev scores printed."""

    def __init__(self, out: Path):
        self.out = out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        kind = "eval" if any(k.startswith("eval_") for k in logs) else \
            "step" if "loss" in logs else "summary"
        record = files.append_jsonl(self.out / LOG, {"type": kind, "step": state.global_step, "epoch": state.epoch,
                                       **{k.removeprefix(f"eval_{build.DEV}_"): v for k, v in logs.items()}})
        if kind == "eval":
            scores = [f"{k} {record[k]:.2f}" for k in ("stsb-dev", "sickr-dev", "avg")
                      if record.get(k) is not None]
            print(f"dev at step {state.global_step}: {', '.join(scores)}", flush=True)


# The output folder

def step_of(checkpoint) -> int:
    return int(Path(checkpoint).name[len(CHECKPOINT_PREFIX):])


def checkpoints(out: Path) -> list:
    """``(step, folder)`` of every ``checkpoint-N`` folder in ``out`` (not links), by step."""
    return sorted((step_of(p), p) for p in out.glob(f"{CHECKPOINT_PREFIX}*")
                  if p.name[len(CHECKPOINT_PREFIX):].isdigit() and p.is_dir() and not p.is_symlink())


def writes(name: str) -> bool:
    """Whether a run writes the entry ``name`` of its folder: its own entries, checkpoints, the
    lock, and the temporary and staged files of its atomic writes."""
    return name in OWN or name.startswith((CHECKPOINT_PREFIX, files._STAGE, files._OLD)) \
        or name == files.LOCK or name.startswith(".") and name.endswith(".tmp")


def guard_links(out: Path, remove: bool = False) -> None:
    """A link among the entries the run writes in ``out`` (or under them) is an error naming it,
    or with ``remove`` (``--overwrite_output_dir``) is unlinked, its target untouched."""
    hint = "remove it, or pass --overwrite_output_dir to have it removed (its target is kept)"
    for message in files.refuse_links(out, lambda name: writes(name) and name != files.LOCK, remove, hint):
        _say(message)


def prepare_output(args, out: Path) -> OutputLock:
    """Check and lock ``out`` for this run (main process); returns the held lock."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--output_dir {out} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    entries = sorted(p.name for p in out.iterdir() if p.name != files.LOCK)
    ours = (out / CONFIG_FILE).is_file()
    if args.resume and not ours:
        raise FileNotFoundError(f"--resume: {out} holds no fastcl run ({CONFIG_FILE} is missing)")
    if entries and not ours:
        raise ValueError(f"--output_dir {out} is not empty and holds no fastcl run "
                         f"({', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}): "
                         "choose an empty or new folder")
    lock = OutputLock(out).acquire()
    try:
        if lock.previous:
            _say(f"took over the lock of a run that is no longer running ({lock.previous})")
        for message in files.recover_swaps(out):
            _say(message)
        finished, saved = (out / RESULTS).is_file(), checkpoints(out)
        if args.resume and finished:
            raise ValueError(f"--resume: the run in {out} has finished ({RESULTS}); "
                             "--overwrite_output_dir trains there again")
        if args.resume:
            _check_same_run(args, out)
        elif ours and (finished or saved) and not args.overwrite_output_dir:
            what = f"a finished run ({RESULTS})" if finished else f"an unfinished run ({saved[-1][1].name})"
            raise ValueError(f"--output_dir {out} holds {what}: choose another folder, "
                             + ("" if finished else "pass --resume to continue it, ")
                             + "or pass --overwrite_output_dir to train there again")
        elif ours:   # a fresh run: nothing of the earlier one stays; a link is unlinked, never followed
            for entry in sorted(out.iterdir()):
                if writes(entry.name) and entry.name != files.LOCK:
                    files.remove_inside(entry, out)
        guard_links(out, remove=args.overwrite_output_dir)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_same_run(args, out: Path) -> None:
    """A resume repeats every option but :data:`.cli.FREE_ON_RESUME`, compared as
    :func:`.cli.effective_config` saves them."""
    saved, now, default = files.read_mapping(out / CONFIG_FILE), effective_config(args), \
        build_parser().get_default
    diff = [f"--{k.replace('_', '-')} {now.get(k)!r} (checkpoint: {saved.get(k, default(k))!r})"
            for k in sorted(set(now) | set(saved)) if k not in FREE_ON_RESUME
            and now.get(k) != saved.get(k, default(k))
            # a family default (DCLR's phi, noise ratio) is resolved once the model is loaded
            and not (k in FAMILY_DEFAULTS and now.get(k) is None)]
    if diff:
        raise ValueError("--resume needs the options of the interrupted run: " + "; ".join(diff))


def resume_point(out: Path, main_process: bool) -> Path:
    """The newest complete checkpoint of ``out``: verified by the main process (which removes newer
    incomplete ones; a damaged file is an error naming it), the newest with a manifest for others."""
    for _, path in reversed(checkpoints(out)):
        if not main_process:
            if (path / MANIFEST).is_file():
                return path
        elif files.verify_manifest(path):
            files.check_loadable(path, TRAINING_STATE)   # a manifest rewritten to match too
            trainer_state(path)
            return path
        else:
            _say(f"removed {path}: a checkpoint whose writing was interrupted")
            files.remove_inside(path, out)
    raise FileNotFoundError(f"--resume: no complete checkpoint in {out}")


def trainer_state(checkpoint: Path) -> TrainerState:
    """The trainer state saved in ``checkpoint``, checked to be the state of its step."""
    path, step = Path(checkpoint) / STATE, step_of(checkpoint)
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        state = TrainerState(**(state if isinstance(state, dict) else {}))   # as transformers reads it
    except (OSError, ValueError, TypeError) as err:
        raise DamagedError(f"{path} is damaged: {type(err).__name__}: {err}") from None
    if state.global_step != step or type(state.max_steps) is not int:
        raise DamagedError(f"{path} is damaged: not the trainer state of step {step} (global_step: "
                           f"{state.global_step!r}, max_steps: {state.max_steps!r})")
    return state


def check_data(args, out: Path, dataset, resumed: bool) -> None:
    """Record the training data's fingerprint in ``out/DATA_RECORD``; on a resume, changed data
    (against the record) is an error naming the file, unless ``--allow_changed_data``."""
    now, record = files.data_fingerprint(args.data, dataset), out / DATA_RECORD
    if resumed and not record.is_file():
        _say(f"warning: {record} is missing (a run of an earlier fastcl): the training data "
             "cannot be compared with the run's")
    elif resumed and (changes := files.fingerprint_changes(args.data, files.read_mapping(record), now)):
        if not args.allow_changed_data:
            raise ValueError("--resume: the training data changed since the run started: "
                             + "; ".join(changes) + ". Resumed on other data, the run would not "
                             "be the one it continues; restore the data, or pass "
                             "--allow_changed_data to continue on it anyway")
        _say("warning: --allow_changed_data: continuing on changed data: " + "; ".join(changes))
    files.replace_text(record, json.dumps({"data": str(args.data), **now}, indent=1) + "\n")


# The run

def main(argv=None, prog: str = PROG) -> int:
    """The trainer's command line (``fastcl-train``, ``python -m fastcl.trainer``,
    ``train.py``); returns the exit status."""
    parser = build_parser(prog)
    args = resolve_args(parser, parse_args(parser, argv))
    out = Path(args.output_dir)
    main_process = int(os.environ.get("RANK", "0")) == 0
    lock = None
    try:
        if main_process:
            lock = prepare_output(args, out)
        checkpoint = resume_point(out, main_process) if args.resume else None
        return _train(args, out, checkpoint, main_process)
    except (ValueError, OSError, LockedError) as err:
        raise SystemExit(f"{prog}: error: {err}") from err
    finally:
        if lock is not None:
            lock.release()


def _evaluator(args, main_process: bool):
    """The dev evaluator of ``--sts_dir`` (STS-B dev and SICK-R dev, those it holds), its
    files parsed now: a malformed one is an error before step 1."""
    from ..evaluate import DEV, task_source
    from ..integrations.sentence_transformers.evaluation import SentEvalSTSEvaluator

    tasks = []
    for task in DEV:
        with contextlib.suppress(FileNotFoundError):
            tasks.append(task_source(args.sts_dir, task) and task)
    if not tasks:
        raise FileNotFoundError(f"--sts_dir {args.sts_dir} holds neither stsb/sts-dev.csv nor "
                                "sick/SICK_trial.txt (SentEval's data/downstream layout)")
    return SentEvalSTSEvaluator(args.sts_dir, tasks, name=build.DEV, metrics=True,
                                batch_size=args.per_device_eval_batch_size,
                                show_progress_bar=main_process, max_seq_length=args.model_max_seq_length)


def _train(args, out: Path, checkpoint: Path | None, main_process: bool) -> int:
    import transformers

    from ..data import read_training_data

    transformers.set_seed(args.seed)  # the head's initialization
    data = read_training_data(args.data, args.method, args.snli_splits, text_column=args.text_column,
                              columns=args.columns, split=args.data_split)
    batch = args.per_device_train_batch_size * build.world_size() * args.gradient_accumulation_steps
    if len(data.dataset) < batch:
        raise ValueError(f"--data: {len(data.dataset)} examples, fewer than one batch ({batch})")
    model = build.build_model(args, device="cpu" if args.use_cpu else None)
    stop = GracefulStop()
    trainer = build.build_trainer(args.method, model, data.dataset, training_arguments(args),
                                  evaluator=_evaluator(args, main_process) if args.sts_dir else None,
                                  callbacks=[TrainLog(out), stop], **objective_options(args))
    for name in FAMILY_DEFAULTS:   # DCLR's, resolved by the model's family
        setattr(args, name, trainer.objective_options.get(name))
    step = step_of(checkpoint) if checkpoint else 0
    if main_process:
        check_data(args, out, data.dataset, resumed=bool(checkpoint))
        if checkpoint:   # the records of the steps after it are redone
            kept = [r for r in read_log(out) if r.get("step", 0) <= step]
            files.replace_text(out / LOG, "".join(json.dumps(r) + "\n" for r in kept))
        write_config(out, args)
        files.append_jsonl(out / LOG, {"type": "start", "step": step, "resumed": bool(checkpoint),
                         "examples": len(data.dataset), "skipped": data.skipped,
                         "processes": build.world_size(),
                         "args": {k: getattr(v, "value", v) for k, v in vars(args).items() if k != "config"}})
        print(f"{args.method}: {len(data.dataset)} examples from {data.source}"
              + (f" ({data.skipped} skipped)" if data.skipped else "")
              + f", {batch} a step, pooling: {args.pooler_used or 'the base model own modules'}"
              + ("" if args.sts_dir else "; no --sts_dir: no dev evaluation, the last step is saved "
                 "(STS-B and SICK-R dev: --sts_dir SentEval/data/downstream, from SimCSE's "
                 "data/download_senteval.sh)"),
              flush=True)
    trainer.guard = lambda: guard_links(out)
    trainer.export_max_seq_length = args.model_max_seq_length
    # a training that had ended (killed while exporting): resumed, the trainer would run a step more
    if checkpoint and (state := trainer_state(checkpoint)).global_step >= state.max_steps:
        _finish_without_training(trainer, args, out, checkpoint, state)
    else:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    if stop.signum:
        if main_process:
            _say(f"stopped by signal {stop.signum} after step {trainer.state.global_step}: "
                 f"{out / (CHECKPOINT_PREFIX + str(trainer.state.global_step))} written, continue "
                 "with --resume")
        return 128 + stop.signum
    return _finish(trainer, args, out) if main_process else 0


def _finish_without_training(trainer, args, out: Path, checkpoint: Path, state: TrainerState) -> None:
    """A resume of a run whose training had ended: the trainer takes the checkpoint's state
    and the model the uninterrupted run ended with (the best step's, step 0 included)."""
    trainer.state, best = state, state.best_model_checkpoint
    source = out / Path(best).name if args.sts_dir and best else checkpoint   # in this folder
    if source != checkpoint:
        if not files.verify_manifest(source):
            raise FileNotFoundError(f"--resume: {source}, the best step's checkpoint, is missing "
                                    "or incomplete")
        files.check_loadable(source)
    trainer._load_from_checkpoint(str(source))
    _say(f"the training had ended at step {state.global_step} ({checkpoint.name}): "
         f"exporting the model of {source.name}, no step is run")
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, KeepBase):
            callback.on_train_end(trainer.args, state, trainer.control, model=trainer.model)


def comparison(records: list, select: str, saved_step: int | None) -> dict | None:
    """Step 0 (the base model) against the saved step, by the selection metric; None when
    either has no finite score."""
    metric = build.SELECT[select]
    scores = {r["step"]: r[metric] for r in records
              if r.get("type") == "eval" and isinstance(r.get(metric), (int, float))}
    start, saved = scores.get(0), scores.get(saved_step)
    if start is None or saved is None or not math.isfinite(saved):
        return None
    trained = [v for s, v in scores.items() if s > 0 and math.isfinite(v)]
    return {"metric": metric, "step0": start, "best": saved, "best_step": saved_step,
            "best_trained": max(trained, default=None), "improved": saved > start}


def _finish(trainer, args, out: Path) -> int:
    """Save the best evaluated model (step 0 included), or the last step's, to ``OUT/model``
    (staged and swapped in whole) and say how it compares with step 0."""
    from ..integrations.sentence_transformers.models import without_training_heads

    best = trainer.state.best_global_step
    saved_step = best if args.load_best_model_at_end and best is not None else trainer.state.global_step
    cmp = comparison(read_log(out), args.select, saved_step) if args.sts_dir else None
    guard_links(out)
    final, target = without_training_heads(trainer.model), out / MODEL_DIR
    final.max_seq_length = args.model_max_seq_length
    stage = files.stage_dir(target)
    final.save_pretrained(str(stage))
    files.crash_point("model-stage")
    files.swap_in(stage, target)
    summary = {"method": args.method, "steps": trainer.state.global_step, "saved_step": saved_step,
               "select": args.select if args.sts_dir else None, "comparison": cmp, "model": str(target)}
    files.replace_text(out / RESULTS, json.dumps(files.json_safe(summary), indent=2, allow_nan=False) + "\n")
    print(f"model saved to {target} (step {saved_step})")
    if cmp is not None and not cmp["improved"]:
        _say(f"warning: training did not improve on the base model: {cmp['metric']} "
             f"{cmp['step0']:.2f} at step 0, at best {cmp['best_trained']:.2f}; "
             + ("the base model is saved (--keep_last saves the last step)" if saved_step == 0
                else "the saved step is the best trained one"))
    if args.push_to_hub:   # the saved model (transformers pushes the run's checkpoints)
        final.push_to_hub(args.hub_model_id or out.resolve().name)
    return 0
