"""Callbacks for sentence-transformers' (transformers') trainer that fastcl's trainer uses and any
run can: :class:`KeepBase`, the base model (step 0, ``eval_on_start``) competing for the best
checkpoint; :class:`GracefulStop`, a first SIGINT/SIGTERM ending the run with a checkpoint of its step."""

from __future__ import annotations

import contextlib
import signal

import torch
from transformers import TrainerCallback


class KeepBase(TrainerCallback):
    """Step 0 (the base model) competes for the best: where it scored at least as high as the best
    trained step, its weights (a CPU copy) come back and ``state.best_global_step`` says 0."""

    def __init__(self, model):
        self.base = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def on_train_end(self, args, state, control, model=None, **kwargs):
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        start = [r[key] for r in state.log_history if r.get("step") == 0 and key in r]
        if start and (state.best_metric is None or state.best_metric <= start[0]):
            model.load_state_dict(self.base)
            state.best_metric, state.best_global_step, state.best_model_checkpoint = start[0], 0, None


class GracefulStop(TrainerCallback):
    """The first SIGINT/SIGTERM ends training after the step in progress with its checkpoint (all
    processes at the same step); a second one acts as usual."""

    signum = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.signum or 0
        if args.world_size > 1:
            flag = torch.tensor([signum], device=args.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            signum = int(flag.item())
        if signum:
            self.signum, control.should_save, control.should_training_stop = signum, True, True

    def on_train_end(self, args, state, control, **kwargs):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
