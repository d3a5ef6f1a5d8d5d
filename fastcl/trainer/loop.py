"""The training run: set-up, the loop, checkpoints, resume, evaluation and export.

Loop: AdamW, linear decay to 0, gradient-norm clipping, bf16 autocast on GPU. Every
``--eval-steps`` steps the model is scored on STS-B dev (``--select avg``: the mean of STS-B
dev and SICK-R dev) and the best one is exported to ``--output-dir`` (with its model card,
:func:`model_card`), together with ``train_log.jsonl`` (one JSON object per step and per
evaluation, mirrored to the ``--report-to`` trackers, :mod:`.report`), ``loss_curve.png``,
``dev_curve.png`` and ``align_uniform.png``. A checkpoint (``checkpoint.pt``: model,
optimizer, scheduler, random states, data position, with the SHA-256 of its content) is
written atomically every ``--checkpoint-steps`` steps, on SIGINT/SIGTERM and, when an error
stops the loop, as an emergency checkpoint of the last consistent state; ``--resume``
verifies it and continues with the same subsequent losses as an uninterrupted run. A
finished run removes it unless ``--keep-checkpoint``. The export is published as a whole
(the previous one stays until the new one is complete), and the dev files are parsed before
step 1. ``FASTCL_CRASH_AT=POINT[:N]`` (a test hook) kills the process at a write point.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import distributed, training
from ..checkpoint import clean_checkpoint_temps, read_checkpoint, write_checkpoint
from ..data import batch_examples, epoch_order, read_training_data
from ..encoders import (MLPHead, ModelCard, SentenceEncoder, clean_export_leftovers, load_backbone,
                        load_encoder, read_selection, remove_export, save_sentence_encoder)
from ..evaluate import evaluate, load_task
from ..objectives import Objective
from . import report
from .cli import (CHECKPOINT, CONFIG_FILE, FAMILY_DEFAULTS, RUN_DEFINING, build_parser,
                  export_pooler, objective_options, parse_args, resolve_args, write_config)
from .logs import (LOG, TEMPORARY, append_log, json_safe, replace_text, truncate_log,
                   write_plots)

PROG = "fastcl-train"
RESULTS = "train_results.json"  # written when a run has finished


# ---------------------------------------------------------------------------------------
# Set-up

@dataclass
class Run:
    """Everything one training run holds; built by :func:`setup`."""

    args: object
    out: Path
    world: int
    rank: int
    device: torch.device
    data: object                      # fastcl.data.TrainingData
    steps_per_epoch: int
    total_steps: int
    dev_cache: dict
    tokenizer: object
    encoder: SentenceEncoder          # the trained pooler (with the MLP head)
    eval_pooler: str
    eval_encoder: SentenceEncoder     # the same modules, evaluation/export pooler
    objective: Objective
    optimizer: torch.optim.Optimizer
    scheduler: object
    autocast: object                  # a torch.autocast context, or None
    state: dict = field(default_factory=lambda: {
        "step": 0, "epoch": 0, "batch_in_epoch": 0, "best_metric": None, "best_step": None,
        "evaluated": None})
    checkpoint_step: int | None = None
    # set by the loop
    bar: object = None
    phase: str = "after"              # "step": inside a step; "log": its record pending; "after"
    updating: bool = False            # the optimizer update of the step has begun
    before: tuple | None = None       # (state, random states) at the start of the step
    record: dict | None = None        # the step's log record
    prog: str = PROG                  # the program name errors are reported under
    order: tuple | None = None        # (epoch, example order of that epoch)
    reporter: object = None           # the --report-to trackers (report.Reporters), rank 0
    exporting: dict | None = None     # the evaluation record of the model being exported
    records: list = field(default_factory=list)  # the log's records (rank 0), for the plots


def setup(args) -> Run:
    out = Path(args.output_dir)
    world, rank = distributed.world_and_rank()
    device = torch.device(args.device or distributed.default_device())
    if world > 1 and args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the number of "
                         f"processes ({world}): each takes an equal share of the batch")
    data = read_training_data(args.data, args.method, args.snli_splits, text_column=args.text_column,
                              columns=args.columns, split=args.data_split)
    if args.method == "simcse-sup" and data.kind == "pairs" and args.hard_negative_weight:
        raise ValueError(f"--hard-negative-weight {args.hard_negative_weight:g} weighs each "
                         f"anchor's hard negative, but --data {args.data} has pairs (no hard "
                         f"negative column)")
    steps_per_epoch = len(data) // args.batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"--data: {len(data)} examples, fewer than --batch-size {args.batch_size}")
    dev_cache = {}
    if args.sts_dir:
        # parsed now: a missing or malformed dev file is an error before step 1, naming it
        for task in ("stsb-dev",) + (("sickr-dev",) if args.select == "avg" else ()):
            dev_cache[task] = load_task(args.sts_dir, task)
    training.set_seed(args.seed)
    backbone, tokenizer = load_backbone(args.model, arg="--model")
    head = MLPHead(backbone.config.hidden_size, getattr(backbone.config, "initializer_range", 0.02)) \
        if args.pooler == "cls" else None
    encoder = SentenceEncoder(backbone, args.pooler, head).to(device)
    if world > 1:
        distributed.broadcast_parameters(encoder)  # one model, whatever each process drew
        distributed.seed_dropout(args.seed, rank)
    eval_pooler = export_pooler(args)
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    optimizer = training.make_optimizer(encoder, args.lr, args.weight_decay)
    return Run(args=args, out=out, world=world, rank=rank, device=device, data=data,
               steps_per_epoch=steps_per_epoch, total_steps=total_steps, dev_cache=dev_cache,
               tokenizer=tokenizer, encoder=encoder, eval_pooler=eval_pooler,
               eval_encoder=SentenceEncoder(backbone, eval_pooler, head),  # shares the modules
               objective=make_objective(args, backbone, device), optimizer=optimizer,
               scheduler=training.linear_schedule(optimizer, total_steps, args.warmup_steps),
               autocast=_autocast(args.precision, device))


def make_objective(args, backbone, device) -> Objective:
    """The objective of ``args``. DCLR's phi and noise ratio default by model family
    (:data:`fastcl.trainer.cli.FAMILY_DEFAULTS`) and are written back into ``args``."""
    roberta = "roberta" in backbone.config.model_type
    for name, (bert_value, roberta_value) in FAMILY_DEFAULTS.items():
        if args.method == "dclr" and getattr(args, name) is None:
            setattr(args, name, roberta_value if roberta else bert_value)
    obj = Objective(args.method, **objective_options(args))
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
    return obj


def _autocast(precision: str, device: torch.device):
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda"
                                   and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else None


# ---------------------------------------------------------------------------------------
# Checkpoint, resume, export

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
        state.update(world_size=run.world, rng_ranks=distributed.gather_objects(rng))
    return state


def save_run_checkpoint(run: Run) -> None:
    """Write the run's checkpoint (every process takes part; rank 0 writes the file)."""
    state = checkpoint_state(run)
    if run.rank == 0:
        write_checkpoint(run.out / CHECKPOINT, state)
    run.checkpoint_step = run.state["step"]


def clean_leftovers(out: Path) -> list:
    """Remove the temporary files of writes a crash interrupted (checkpoint, export, log,
    plots). Run at start, before anything is written."""
    removed = clean_checkpoint_temps(out, CHECKPOINT) + clean_export_leftovers(out)
    for name in (*TEMPORARY, f".{CONFIG_FILE}.tmp", f".{RESULTS}.tmp"):
        if (out / name).is_file():
            (out / name).unlink()
            removed.append(out / name)
    return removed


def resume(run: Run) -> None:
    path = run.out / CHECKPOINT
    if not path.is_file():
        if (run.out / RESULTS).is_file():
            raise FileNotFoundError(f"--resume: the run in {run.out} has finished and its "
                                    f"checkpoint was removed ({path}; --keep-checkpoint keeps it)")
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    ckpt = read_checkpoint(path)
    sig = run_signature(run.args)
    # an option newer than the checkpoint had its default then
    parser = build_parser()
    old = {k: ckpt["args"][k] if k in ckpt["args"] else parser.get_default(k) for k in sig}
    diff = [f"--{k.replace('_', '-')} {sig[k]!r} (checkpoint: {old[k]!r})"
            for k in sig if old[k] != sig[k]]
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
    exported = read_selection(run.out)
    if exported is not None and exported["step"] > run.state["step"]:
        # A best model exported after this checkpoint by the run that stopped: the state names
        # it, as the export on disk does, and its evaluation is redone as the best when the
        # replay reaches its step (best_step == step), re-exporting the model of this run.
        run.state["best_step"], run.state["best_metric"] = exported["step"], exported["metric"]
    pending = run.state.pop("log_record", None)  # an emergency checkpoint's unwritten record
    if run.rank == 0:
        run.records = truncate_log(run.out, run.state["step"])
        done = any(r.get("type") == "step" and r["step"] == run.state["step"] for r in run.records)
        if pending is not None and not done:
            run.records.append(append_log(run.out, pending))


def export(run: Run) -> None:
    enc = run.eval_encoder
    selection = None
    if run.exporting is not None:  # a new best: its step and metric travel with the model
        selection = {"step": run.state["step"], "metric": run.exporting["metric"]}
    save_sentence_encoder(run.out, enc.backbone, run.tokenizer, run.eval_pooler, enc.head,
                          card=model_card(run, run.exporting), selection=selection)



# Run settings the model card lists besides the objective's.
_CARD_SETTINGS = ("batch_size", "lr", "epochs", "max_steps", "max_seq_len", "warmup_steps",
                  "weight_decay", "max_grad_norm", "pooler", "mlp_only_train", "mini_batch_size",
                  "precision", "seed", "augment")


def model_card(run: Run, evaluation: dict | None) -> ModelCard:
    """The card of the model of step ``run.state["step"]``; ``evaluation``: its dev record."""
    from ..citations import GRADCACHE

    args, obj = run.args, run.objective
    method_options = {"temperature": obj.temperature}
    for name in obj.spec.options:
        value = args.complementary if name == "complementary" else getattr(obj, name)
        if name == "complementary_mode" and not args.complementary or name == "focal_m" and value is None:
            continue
        method_options[name] = value
    training = {k: getattr(args, k) for k in _CARD_SETTINGS if getattr(args, k, None) is not None}
    training.update(precision="bf16" if run.autocast is not None else "fp32", processes=run.world,
                    export_pooler=run.eval_pooler)
    data = str(args.data) + (f" (splits {', '.join(args.snli_splits)})" if args.snli_splits else "")
    tasks = ("stsb-dev", "sickr-dev")
    if evaluation is not None:
        how = "STS-B dev" if args.select == "stsb" else "the mean of STS-B dev and SICK-R dev"
        selection = (f"the best by {how} (Spearman) of the evaluations every "
                     f"{args.eval_steps} steps up to then")
    else:
        selection = "the last step (no dev evaluation)"
    return ModelCard(
        base_model=str(args.model), method=args.method, hyperparameters=method_options,
        training=training, data=data, examples=len(run.data), step=run.state["step"],
        total_steps=run.total_steps, selection=selection,
        dev_scores={t: evaluation[t] for t in tasks if evaluation and t in evaluation},
        dev_metrics={k: evaluation[k] for k in ("alignment", "uniformity")} if evaluation else {},
        citations=(GRADCACHE,) if args.mini_batch_size else ())


def log(run: Run, record: dict) -> None:
    """Append ``record`` to the log (rank 0) and hand it to the --report-to trackers."""
    written = append_log(run.out, record, run.rank)
    if written is not None:
        run.records.append(written)             # as read back from the log
    if run.reporter is not None:
        run.reporter.write(record)


# ---------------------------------------------------------------------------------------
# Evaluation

def dev_evaluation(run: Run) -> dict:
    """Dev scores, alignment and uniformity (STS-B dev) and the selection metric."""
    tasks = ["stsb-dev"] + (["sickr-dev"] if run.args.select == "avg" else [])
    res = evaluate(run.eval_encoder, run.tokenizer, None, run.args.sts_dir, tasks,
                   batch_size=run.args.eval_batch_size, metrics=True, data=run.dev_cache)
    metric = sum(res["scores"][t] for t in tasks) / len(tasks)
    return {**res["scores"], **res["metrics"]["stsb-dev"], "metric": metric}


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
    if run.order is None or run.order[0] != st["epoch"]:
        run.order = (st["epoch"], epoch_order(len(run.data), run.args.seed, st["epoch"]))
    start = st["batch_in_epoch"] * bs
    rows = run.data.dataset[run.order[1][start:start + bs].tolist()]
    st["batch_in_epoch"] += 1
    batch = batch_examples(run.data, rows)
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
        run.exporting = record  # for the model card
        try:
            export(run)  # the state names the new best only once its export is complete
        finally:
            run.exporting = None
        run.state["best_metric"], run.state["best_step"] = record["metric"], step
    log(run, record)
    run.state["evaluated"] = step
    write_plots(run.out, run.records)
    run.bar.write(f"step {step}: " + ", ".join(
        f"{k} {_num(record[k], '.2f')}" for k in ("stsb-dev", "sickr-dev") if k in record)
        + f", alignment {_num(record['alignment'])}, uniformity {_num(record['uniformity'])}"
        + (" (best)" if record["best"] else ""))


def _num(value, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def train(run: Run) -> int:
    """The loop; returns 0 when done (1 when no dev evaluation scored), 128 + signal number
    when stopped by a signal.

    Any exception inside it first writes an emergency checkpoint of the last consistent
    state when it can (:func:`emergency_checkpoint`), then propagates.
    """
    from tqdm.auto import tqdm

    args, st = run.args, run.state
    log(run, {"type": "start", "step": st["step"], "resumed": bool(args.resume),
              "examples": len(run.data), "skipped": run.data.skipped,
              "total_steps": run.total_steps, "processes": run.world, "args": vars(args)})
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
                                          mini_batch_size=args.mini_batch_size,
                                          distributed=run.world > 1)
                st["step"] += 1
                rate = len(batch) * run.world / (time.perf_counter() - tic)
                run.record = {"type": "step", "step": st["step"], "epoch": st["epoch"], **out,
                              "examples_per_s": rate}
                run.phase = "log"
                log(run, run.record)
                run.phase = "after"
                if run.world > 1:
                    stop.signum = distributed.agreed_signal(stop.signum, run.device)
                run.bar.set_postfix(loss=f"{out['loss']:.4f}", ex_s=f"{rate:.1f}", refresh=False)
                run.bar.update(1)
                maybe_evaluate(run)
                if st["step"] % args.checkpoint_steps == 0 or stop.signum or st["step"] == run.total_steps:
                    save_run_checkpoint(run)
                if stop.signum:
                    if run.rank == 0:
                        write_plots(run.out, run.records)
                        run.bar.write(f"stopped by signal {stop.signum} after step {st['step']}; "
                                      f"checkpoint written, continue with --resume")
                    return 128 + stop.signum
        except Exception as err:
            emergency_checkpoint(run, err)
            if isinstance(err, OSError):  # disk full, permissions...: no traceback needed
                raise SystemExit(f"{run.prog}: error: {err}") from err
            raise
        finally:
            hook.remove()
    return finish(run)


def emergency_checkpoint(run: Run, err: Exception) -> bool:
    """After ``err`` in the loop, write the checkpoint of the last consistent state: the end
    of the step in progress when the error came after it, the start of the step when it came
    before the optimizer update (the step is then redone after ``--resume``). Not possible
    during the update itself, nor with several processes. Returns whether one was written."""
    def say(message):
        print(f"{run.prog}: {message}", file=sys.stderr, flush=True)

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
        save_run_checkpoint(run)
    except Exception as again:
        say(f"error after step {st['step']}; the emergency checkpoint could not be written "
            f"({again}); {keep}")
        return False
    finally:
        st.pop("log_record", None)
    say(f"error after step {st['step']} ({type(err).__name__}): emergency checkpoint written "
        f"to {run.out / CHECKPOINT} at step {st['step']}; fix the cause and continue with --resume")
    return True


def finish(run: Run) -> int:
    """Export (without --sts-dir), write the results, remove the checkpoint; the exit status."""
    if run.rank:
        return 0
    if not run.args.sts_dir:
        export(run)
    elif run.state["best_step"] is None:
        # every dev score was NaN (non-finite or constant embeddings): nothing worth exporting;
        # the checkpoint stays for a look at what went wrong
        print(f"{run.prog}: error: no dev evaluation gave a finite score (see the eval records "
              f"in {run.out / LOG}): no model exported", file=sys.stderr)
        return 1
    summary = {"method": run.args.method, "steps": run.state["step"], "eval_pooler": run.eval_pooler,
               "select": run.args.select if run.args.sts_dir else None,
               "best_step": run.state["best_step"], "best_metric": run.state["best_metric"]}
    # atomically: its presence marks a finished run (resume and --overwrite-output-dir read it)
    replace_text(run.out / RESULTS, json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n")
    write_plots(run.out, run.records)
    print(f"model saved to {run.out} ({'best' if run.args.sts_dir else 'last'} step "
          f"{run.state['best_step'] or run.state['step']}, pooler {run.eval_pooler})")
    if not run.args.keep_checkpoint and (run.out / CHECKPOINT).is_file():
        # the run is complete: the model, log and results are written; --resume has nothing left
        (run.out / CHECKPOINT).unlink()
        print(f"{CHECKPOINT} removed (--keep-checkpoint keeps it)")
    return 0


def main(argv=None, prog: str = PROG) -> int:
    """The trainer's command line (``fastcl-train``, ``python -m fastcl.trainer``,
    ``train.py``); returns the exit status."""
    parser = build_parser(prog)
    args = resolve_args(parser, parse_args(parser, argv))
    out = Path(args.output_dir)
    if not args.resume and (out / CHECKPOINT).exists():
        parser.error(f"--output-dir {out} holds a checkpoint: pass --resume to continue it, "
                     "or choose another folder")
    if not args.resume and (out / RESULTS).exists() and not args.overwrite_output_dir:
        parser.error(f"--output-dir {out} holds a finished run ({RESULTS}): choose another "
                     "folder, or pass --overwrite-output-dir to train there again")
    trackers = report.requested(args.report_to)
    try:
        report.check_available(trackers)
    except ImportError as err:
        parser.error(str(err))
    try:
        distributed.init_from_environment(args.device)
        out.mkdir(parents=True, exist_ok=True)
        if int(os.environ.get("RANK", "0")) == 0:
            for path in clean_leftovers(out):
                print(f"removed {path}, left by an interrupted write")
        run = setup(args)
        run.prog = prog
        if args.resume:
            resume(run)
        elif run.rank == 0:  # a fresh run: no record or model of an earlier one stays
            for name in (LOG, RESULTS):
                (out / name).unlink(missing_ok=True)
            if remove_export(out):
                print(f"removed the model an earlier run exported to {out}")
        if run.rank == 0:
            write_config(out, args)  # the run's options, phi / noise ratio resolved
    except (ValueError, OSError) as err:
        raise SystemExit(f"{prog}: error: {err}") from err
    if run.rank == 0:
        if not args.sts_dir:
            print("no --sts-dir: no dev evaluation during training; the last model will be saved")
        print(f"{args.method}: {len(run.data)} examples from {args.data}"
              + (f" ({run.data.skipped} skipped)" if run.data.skipped else "")
              + f", {run.total_steps} steps of {args.batch_size}, eval pooler {run.eval_pooler}"
              + (f", {run.world} processes of {args.batch_size // run.world}" if run.world > 1 else ""))
    failed = True
    try:
        if trackers and run.rank == 0:
            run.reporter = report.Reporters(out, trackers, args)
            run.reporter.replay(run.records)  # after --resume: the records kept in the log
        status = train(run)
        failed = False
        return status
    finally:
        if run.reporter is not None:
            run.reporter.close(failed)
        if run.world > 1:
            import torch.distributed as dist
            dist.destroy_process_group()
