#!/usr/bin/env python
"""How many positives premise labels add to supervised SimCSE's batches.

With ``--premise_labels``, each triplet's label is the id of its premise (its anchor text), and
every candidate of the positives block whose row has the anchor's label is a positive (SupCon's
targets). Beyond each anchor's own entailment, a batch therefore gains

    E = Σ_i #{j ≠ i : y_j = y_i}

extra positives (``y`` the batch's premise ids): none where each premise appears once in the
batch, in which case the labels leave the loss as supervised SimCSE's.

This script counts E over the batches train.py would train on: the trainer is built as train.py
builds it (``--method simcse-sup --premise_labels true``, the seed, the batch size, its batch
sampler: ``no_duplicates`` by default for simcse-sup) and its own training dataloader is read
for ``--steps`` steps, epoch after epoch as the trainer reads it. Nothing is trained.

    python experiments/premise_positives.py --json experiments/results/premise_positives.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXPERIMENTS = Path(__file__).resolve().parent
if str(EXPERIMENTS) not in sys.path:
    sys.path.insert(0, str(EXPERIMENTS))

import compare  # noqa: E402


def extra_positives(labels) -> int:
    """E = Σ_i #{j ≠ i : y_j = y_i}: the positives a batch's labels add to each row's own."""
    return sum(n * (n - 1) for n in Counter(int(y) for y in labels).values())


def batch_labels(model: str, data: str, seed: int, batch_size: int, steps: int,
                 batch_sampler: str | None = None):
    """The premise ids of each of the first ``steps`` training batches of train.py's run
    ``--method simcse-sup --premise_labels true --seed SEED`` on ``data`` (a list per batch)."""
    from fastcl.data import read_training_data
    from fastcl.trainer import build
    from fastcl.trainer.cli import build_parser, objective_options, parse_args, resolve_args, training_arguments

    with tempfile.TemporaryDirectory() as out:
        argv = ["--method", "simcse-sup", "--premise_labels", "true", "--model", model, "--data", data,
                "--output_dir", out, "--seed", str(seed), "--per_device_train_batch_size", str(batch_size),
                "--max_steps", str(steps), "--sts_dir", "none", "--use_cpu"]
        if batch_sampler:
            argv += ["--batch_sampler", batch_sampler]
        parser = build_parser("train.py")
        args = resolve_args(parser, parse_args(parser, argv))
        import transformers

        transformers.set_seed(args.seed)   # as train.py does before it builds the trainer
        rows = read_training_data(args.data, args.method, args.snli_splits, text_column=args.text_column,
                                  columns=args.columns, split=args.data_split)
        model = build.build_model(args, device="cpu")
        trainer = build.build_trainer(args.method, model, rows.dataset, training_arguments(args),
                                      **objective_options(args))
        loader = trainer.get_train_dataloader()
        batches, epoch = [], 0
        while len(batches) < steps:   # each epoch re-seeded as the trainer's loop does it
            for sampler in (loader, getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)):
                if hasattr(sampler, "set_epoch"):
                    sampler.set_epoch(epoch)
            before = len(batches)
            for batch in loader:
                batches.append(batch["label"].tolist())
                if len(batches) == steps:
                    break
            if len(batches) == before:
                raise ValueError(f"--data {data}: the trainer's dataloader gave no batch")
            epoch += 1
        return batches


def count(model: str, data: str, seeds, batch_size: int, steps: int, batch_sampler: str | None = None) -> dict:
    """Per seed: E of every batch, their sum, the batches with E > 0, and the largest label group."""
    per_seed = {}
    for seed in seeds:
        batches = batch_labels(model, data, seed, batch_size, steps, batch_sampler)
        extra = [extra_positives(b) for b in batches]
        per_seed[str(seed)] = {"batches": len(batches), "rows": sum(map(len, batches)),
                               "extra_positives": sum(extra),
                               "batches_with_extra": sum(e > 0 for e in extra),
                               "largest_group": max(max(Counter(b).values()) for b in batches),
                               "per_batch": extra}
    return per_seed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python experiments/premise_positives.py",
                                description="Count the positives premise labels add to supervised "
                                            "SimCSE's training batches (train.py's own, nothing trained).")
    p.add_argument("--model", default=None, help="start encoder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--nli-dir", default=str(compare.SHARED / "nli" / "snli_senteval"),
                   help="the SentEval SNLI folder supervised SimCSE trains on (compare.py's --nli-dir)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--steps", type=int, default=120, help="batches per seed (default 120, compare.py's)")
    p.add_argument("--batch-size", type=int, default=64, help="rows per batch (default 64, compare.py's)")
    p.add_argument("--batch-sampler", default=None,
                   help="train.py's --batch_sampler (default: train.py's for simcse-sup, no_duplicates)")
    p.add_argument("--json", default=None, help="write the counts here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 2:
        p.error("--steps must be >= 1 and --batch-size >= 2")
    model = args.model or compare.default_model()
    per_seed = count(model, args.nli_dir, args.seeds, args.batch_size, args.steps, args.batch_sampler)
    for seed, c in per_seed.items():
        print(f"seed {seed}: {c['batches']} batches of {args.batch_size} ({c['rows']} rows), "
              f"{c['extra_positives']} extra positives, {c['batches_with_extra']} batches with any, "
              f"largest premise group in a batch {c['largest_group']}", flush=True)
    if args.json:
        command = ["python", "experiments/premise_positives.py", *(argv if argv is not None else sys.argv[1:])]
        compare.write_json(Path(args.json), {
            "command": " ".join(command), "model": compare.model_record(model),
            "nli_dir": str(Path(args.nli_dir).resolve()), "batch_size": args.batch_size, "steps": args.steps,
            "batch_sampler": args.batch_sampler or "train.py's default (no_duplicates)", "seeds": per_seed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
