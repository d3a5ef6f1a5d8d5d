#!/usr/bin/env python
"""End to end, cached: one training step of a BERT-base-sized encoder with GradCache, fastcl's
``CachedFastInfoNCELoss`` against sentence-transformers' ``CachedMultipleNegativesRankingLoss``.

    python bench/e2e_cached.py --out /tmp/e2e-cached.json                  # GPU: batch 4096
    python bench/e2e_cached.py --dry-run --out /tmp/e2e-cached-dry.json    # CPU, tiny, ~10 s

The encoder: a ``BertModel`` with random weights (``BertConfig``: hidden 768, 12 layers, 12
heads, FFN 3072, vocabulary 30522; nothing is downloaded), saved with a tokenizer built
offline (a small generated WordPiece vocabulary) to a temporary folder and loaded as a
``SentenceTransformer`` (``Transformer`` + mean ``Pooling``) — the same model object for both
losses. The batch: ``--batch`` (anchor, positive) pairs of ``--seq`` random token ids (no
padding; the positive is the anchor with a quarter of its tokens replaced), tokenized columns
as the trainer's collator gives them.

Each loss is called the way ``SentenceTransformerTrainer`` calls it — ``loss(features,
labels=None)`` then ``.backward()`` — with ``scale=20`` (1/τ = 1/0.05), cosine similarity and
``mini_batch_size=--mini-batch``: pass 1 embeds each column in mini-batches without a graph,
the loss of the whole batch gives the embeddings' gradients, pass 2 (in the backward)
embeds each mini-batch again under its saved random state and back-propagates. Both losses
share that machinery (sentence-transformers' ``CachedLossMixin``) and differ in the loss:
the full N×N similarity matrix (sentence-transformers) or fastcl's fused, chunked loss. On
GPU the model's forward runs under ``torch.autocast`` (``--autocast``, default bfloat16) with
its outputs cast to float32, as accelerate does for ``SentenceTransformerTrainer(bf16=True)``.
The encoder is in train mode (dropout on); there is no optimizer update.

Steps: one untimed warm-up step per implementation, then ``--steps`` timed steps each, the two
implementations alternating (which goes first alternates too). Step k runs under
``torch.manual_seed(seed + k)`` for both, so both see the same dropout masks and the same
embeddings: their losses (and parameter-gradient norms) must agree — on CPU in float32 to
``1e-4`` relative, on GPU to ``1e-3`` (``--loss-rtol``; both losses see the same float32
embeddings there, autocast covering only the encoder).

Per implementation: the median step time (CUDA events on GPU, ``time.perf_counter`` on CPU)
and examples/s (``batch`` pairs / median step), the peak GPU memory
(``torch.cuda.max_memory_allocated``, reset before each step: ``peak_allocated_mib`` the
absolute peak — weights, gradients, activations, everything — and ``peak_beyond_start_mib``
beyond what was allocated as the step began: weights and token ids), each step's loss and
gradient norm, and an estimate of the encoder FLOPs of a step (4 forwards' worth: pass 1,
the replay and a backward of twice a forward).

``--time-budget SECONDS`` (from the start of the script): no step starts that would end
after it (each step estimated by the fastest step so far); the rows say how many steps ran.
The JSON (``--out``) is rewritten after every step, and on SIGTERM, so a run cut short keeps
what it measured. Keys: ``environment``, ``settings``, ``rows`` (one per implementation),
``agreement`` (per-step relative differences, the tolerance, ``ok``), ``elapsed_s``,
``interrupted``. Exit status 1 if a step failed other than by running out of memory, or the
losses disagree.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import _checkout  # noqa: F401,E402  (fastcl importable from a bare checkout)
from _e2e import ENCODERS, bert_config_sized  # noqa: E402
from _env import environment  # noqa: E402
from _measure import MIB, cuda_peak, default_threads, select_device, timed_call  # noqa: E402

IMPLS = ("fastcl", "sentence-transformers")
LOSS_CLASSES = {"fastcl": "fastcl.integrations.sentence_transformers.CachedFastInfoNCELoss",
                "sentence-transformers": "sentence_transformers CachedMultipleNegativesRankingLoss"}
SCALE = 20.0
BASE = ENCODERS["base"]
GPU_DEFAULTS = dict(batch=4096, mini_batch=512, layers=BASE["num_hidden_layers"],
                    hidden=BASE["hidden_size"], seq=32, steps=3)
DRY_DEFAULTS = dict(batch=32, mini_batch=8, layers=2, hidden=64, seq=16, steps=2)
LOSS_RTOL = {"cpu": 1e-4, "cuda": 1e-3}


class Interrupted(BaseException):
    """SIGTERM (``timeout``'s first signal): not an ``Exception``, so no per-step handler eats it."""


class BudgetSpent(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(f"received {signal.Signals(signum).name}")


def _quiet():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        import transformers
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except (ImportError, AttributeError):
        pass


def _st_classes():
    """SentenceTransformer, its Transformer and Pooling modules and CachedMNRL, for
    sentence-transformers 6 (``sentence_transformer.*``) and older (``models``, ``losses``)."""
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Pooling, Transformer
    try:
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    except ImportError:
        from sentence_transformers.losses import CachedMultipleNegativesRankingLoss
    return SentenceTransformer, Transformer, Pooling, CachedMultipleNegativesRankingLoss


def build_model(config, seq: int, device: str, folder: Path):
    """The random BertModel and an offline WordPiece tokenizer saved to ``folder``, loaded as a
    SentenceTransformer (Transformer + mean Pooling) on ``device``."""
    import torch
    from transformers import BertModel
    try:
        from transformers import BertTokenizerFast as Tokenizer
    except ImportError:  # pragma: no cover - releases without the alias
        from transformers import BertTokenizer as Tokenizer

    SentenceTransformer, Transformer, Pooling, _ = _st_classes()
    vocab = folder / "vocab.txt"
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"tok{i}" for i in range(995)]
    vocab.write_text("\n".join(words) + "\n")
    tokenizer = Tokenizer(vocab_file=str(vocab))
    with torch.device("cpu"):
        BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    transformer = Transformer(str(folder), max_seq_length=seq)
    return SentenceTransformer(modules=[transformer, Pooling(config.hidden_size)], device=device)


def make_columns(batch: int, seq: int, vocab_size: int, device: str, seed: int) -> list[dict]:
    """Tokenized (anchor, positive) columns: random ids, no padding; the positive is the anchor
    with a quarter of its tokens (never [CLS] / [SEP]) replaced."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1000, vocab_size, (batch, seq), generator=gen)
    anchors[:, 0], anchors[:, -1] = 101, 102                        # [CLS] … [SEP] of BERT's vocabulary
    positives = anchors.clone()
    swap = torch.rand(batch, seq, generator=gen) < 0.25
    swap[:, 0] = swap[:, -1] = False
    positives[swap] = torch.randint(1000, vocab_size, (int(swap.sum()),), generator=gen)
    return [{"input_ids": ids.to(device), "token_type_ids": torch.zeros_like(ids).to(device),
             "attention_mask": torch.ones_like(ids).to(device)} for ids in (anchors, positives)]


def autocast_forward(model, dtype, device_type: str = "cuda") -> None:
    """What accelerate does to a model for mixed precision: ``forward`` under ``torch.autocast``,
    its floating outputs cast to float32 (also in the replay forwards of pass 2)."""
    import torch

    inner = model.forward

    def forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            out = inner(*args, **kwargs)
        return {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in out.items()}

    model.forward = forward


def step_flops(config, batch: int, seq: int) -> float:
    """Encoder FLOPs of one cached step (estimate): 4 forwards of both columns (pass 1, the
    replay, and a backward of twice a forward); per token and layer 2·(4h² + 2h·f) for the
    weights and 4·seq·h for attention; embeddings, norms and the loss left out."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = layers * (2 * (4 * h * h + 2 * h * f) + 4 * seq * h)
    return 4.0 * per_token * 2 * batch * seq


def grad_norm(model) -> float:
    import torch

    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def rel_diff(a, b):
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny: --device cpu --batch 32 --mini-batch 8 --layers 2 --hidden 64 "
                        "--seq 16 --steps 2 (flags given as well override these)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="default: cuda when there is one (cpu with --dry-run)")
    p.add_argument("--batch", type=int, default=None, help="pairs per step (GPU default 4096)")
    p.add_argument("--mini-batch", type=int, default=None,
                   help="mini_batch_size of both losses (GPU default 512)")
    p.add_argument("--layers", type=int, default=None, help="encoder layers (default 12)")
    p.add_argument("--hidden", type=int, default=None,
                   help="encoder width (default 768; heads hidden/64, FFN 4·hidden)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sentence (default 32)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per implementation (default 3)")
    p.add_argument("--autocast", choices=("bfloat16", "float16", "none"), default=None,
                   help="the model's forward under autocast in this dtype (default bfloat16 on "
                        "GPU, none on CPU)")
    p.add_argument("--impl", default=",".join(IMPLS), help=f"comma list of {', '.join(IMPLS)}")
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="relative tolerance of the loss agreement (default 1e-4 CPU, 1e-3 GPU)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds from the start: no step starts that would end after it")
    p.add_argument("--threads", type=int, default=default_threads(), help="torch threads on CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    defaults = DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device is None:
        args.device = "cpu" if args.dry_run else "auto"
    impls = [i for i in args.impl.split(",") if i]
    if not impls or any(i not in IMPLS for i in impls):
        raise SystemExit(f"--impl: a comma list of {', '.join(IMPLS)}")
    if min(args.batch, args.mini_batch, args.layers, args.hidden, args.seq) < 1 or args.steps < 0:
        raise SystemExit("--batch, --mini-batch, --layers, --hidden and --seq must be positive")

    _quiet()
    import torch

    device, on_gpu = select_device(args.device, args.threads)
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    import fastcl

    deadline = None if args.time_budget is None else T0 + args.time_budget
    if args.autocast is None:
        args.autocast = "bfloat16" if on_gpu else "none"
    autocast = None if args.autocast == "none" else getattr(torch, args.autocast)
    rtol = args.loss_rtol if args.loss_rtol is not None else LOSS_RTOL["cuda" if on_gpu else "cpu"]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    config = bert_config_sized(args.hidden, args.layers)
    report = {
        "benchmark": "end-to-end cached (GradCache) training step: fastcl CachedFastInfoNCELoss vs "
                     "sentence-transformers CachedMultipleNegativesRankingLoss on the same encoder",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": device,
        "environment": environment(device, args.threads),
        "settings": {**vars(args), "device": device, "impls": impls, "scale": SCALE,
                     "temperature": 1.0 / SCALE, "similarity": "cosine", "pooling": "mean",
                     "encoder": {"hidden": config.hidden_size, "layers": config.num_hidden_layers,
                                 "heads": config.num_attention_heads,
                                 "intermediate": config.intermediate_size,
                                 "vocab": config.vocab_size},
                     "autocast": None if autocast is None else args.autocast,
                     "autocast_method": None if autocast is None else
                     "model.forward under torch.autocast, outputs cast to float32 (as accelerate)",
                     "loss_rtol": rtol, "warmup_steps": 1,
                     "step_flops_estimate": step_flops(config, args.batch, args.seq),
                     "fastcl_switches": {k: v for k, v in os.environ.items()
                                         if k.startswith(("FASTCL_", "TRITON_INTERPRET"))}},
        "rows": [], "agreement": None, "interrupted": False,
    }

    def save():
        report["elapsed_s"] = time.perf_counter() - T0
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
        tmp.replace(out_path)

    signal.signal(signal.SIGTERM, _on_signal)
    rec = {impl: {"impl": impl, "loss_class": LOSS_CLASSES[impl], "ok": True, "warmup_s": None,
                  "step_times_s": [], "losses": [], "grad_norms": [], "peaks_allocated_mib": [],
                  "peaks_beyond_start_mib": []} for impl in impls}
    report["rows"] = list(rec.values())
    code = 0
    stop = None
    tmp = tempfile.TemporaryDirectory(prefix="fastcl-e2e-cached-")
    try:
        if deadline is not None and time.perf_counter() >= deadline:
            raise BudgetSpent(f"time budget of {args.time_budget:g} s spent before the model was built")
        from fastcl.integrations.sentence_transformers import CachedFastInfoNCELoss
        *_, CachedMNRL = _st_classes()
        t_build = time.perf_counter()
        torch.manual_seed(args.seed)
        model = build_model(config, args.seq, device, Path(tmp.name))
        model.train()
        report["settings"]["model_build_s"] = time.perf_counter() - t_build
        report["settings"]["encoder_params"] = sum(p.numel() for p in model.parameters())
        if autocast is not None:
            autocast_forward(model, autocast, "cuda" if on_gpu else "cpu")
        columns = make_columns(args.batch, args.seq, config.vocab_size, device, args.seed)
        losses = {"fastcl": CachedFastInfoNCELoss(model, scale=SCALE, mini_batch_size=args.mini_batch),
                  "sentence-transformers": CachedMNRL(model, scale=SCALE, mini_batch_size=args.mini_batch)}
        for impl in impls:
            rec[impl]["backend"] = (fastcl.resolve_backend("auto", columns[0]["attention_mask"].float())
                                    if impl == "fastcl" else "full N×N matrix (cos_sim)")
        save()

        def one_step(impl, k):
            model.zero_grad(set_to_none=True)
            gc.collect()
            torch.manual_seed(args.seed + k)                     # the same dropout for both

            def run():
                loss = losses[impl]([dict(c) for c in columns], None)
                loss.backward()
                return float(loss.detach())

            if on_gpu:
                peak, (secs, loss) = cuda_peak(lambda: timed_call(run, device))
                absolute = torch.cuda.max_memory_allocated()
            else:
                (secs, loss), peak, absolute = timed_call(run, device), None, None
            return secs, loss, grad_norm(model), peak, absolute

        fastest = None
        for k in range(1 + args.steps):                            # step 0: the warm-up
            order = impls if k % 2 == 0 else impls[::-1]
            for impl in order:
                r = rec[impl]
                if not r["ok"]:
                    continue
                if deadline is not None and time.perf_counter() + (fastest or 0.0) > deadline:
                    stop = f"time budget of {args.time_budget:g} s spent before step {k}"
                    break
                try:
                    secs, loss, gnorm, peak, absolute = one_step(impl, k)
                except Exception as exc:  # an out-of-memory is a result; anything else an error
                    oom = (isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError))
                           or any(t in str(exc) for t in ("out of memory", "can't allocate memory")))
                    r.update(ok=False, error=("out of memory: " if oom else "")
                             + f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                    code = code or (0 if oom else 1)
                    if on_gpu:
                        torch.cuda.empty_cache()
                    continue
                fastest = secs if fastest is None else min(fastest, secs)
                r["losses"].append(loss)
                r["grad_norms"].append(gnorm)
                if k == 0:
                    r["warmup_s"] = secs
                else:
                    r["step_times_s"].append(secs)
                    if peak is not None:
                        r["peaks_allocated_mib"].append(absolute / MIB)
                        r["peaks_beyond_start_mib"].append(peak / MIB)
                save()
            if stop:
                break
    except BudgetSpent as exc:
        stop = str(exc)
    except (Interrupted, KeyboardInterrupt) as exc:
        report["interrupted"] = str(exc) or "KeyboardInterrupt"
        print(f"interrupted ({report['interrupted']}): writing what was measured", flush=True)
        code = 130
        stop = report["interrupted"]
    finally:
        tmp.cleanup()

    for r in rec.values():
        times = r["step_times_s"]
        r["steps_timed"] = len(times)
        r["median_step_s"] = statistics.median(times) if times else None
        r["examples_per_s"] = args.batch / r["median_step_s"] if times else None
        r["tflops_estimate"] = (report["settings"]["step_flops_estimate"] / r["median_step_s"] / 1e12
                                if times else None)
        r["loss"] = r["losses"][-1] if r["losses"] else None
        r["peak_allocated_mib"] = max(r["peaks_allocated_mib"], default=None)
        r["peak_beyond_start_mib"] = max(r["peaks_beyond_start_mib"], default=None)
        r["memory_method"] = ("torch.cuda.max_memory_allocated, reset before each step (max over the "
                              "timed steps)" if on_gpu else "not measured on CPU")
        if stop and r["ok"] and len(times) < args.steps:
            r["note"] = f"{len(times)} of {args.steps} timed steps ({stop})"
    if len(impls) == 2 and all(rec[i]["losses"] for i in impls):
        a, b = rec["fastcl"], rec["sentence-transformers"]
        pairs = list(zip(a["losses"], b["losses"]))
        loss_diffs = [rel_diff(x, y) for x, y in pairs]
        grad_diffs = [rel_diff(x, y) for x, y in zip(a["grad_norms"], b["grad_norms"])]
        report["agreement"] = {
            "what": "per step (warm-up first), the same seed for both: |fastcl − ST| / |ST|",
            "loss_rel_diff": loss_diffs, "grad_norm_rel_diff": grad_diffs,
            "max_loss_rel_diff": max(loss_diffs), "max_grad_norm_rel_diff": max(grad_diffs),
            "loss_rtol": rtol, "ok": max(loss_diffs) <= rtol}
        if not report["agreement"]["ok"]:
            code = code or 1
        a["loss_rel_diff_vs_st"] = max(loss_diffs)
        if a["median_step_s"] and b["median_step_s"]:
            a["speedup_vs_st"] = b["median_step_s"] / a["median_step_s"]
    save()

    s = report["settings"]
    print(f"e2e cached | {device}: {report['environment'].get('gpu_model') or report['environment']['cpu_model']}"
          f" | batch {args.batch}, mini-batch {args.mini_batch}, {args.layers} layers × {args.hidden}, "
          f"seq {args.seq}, autocast {s['autocast']}")
    print(f"{'impl':<22} {'steps':>5} {'warm-up s':>9} {'step s':>8} {'ex/s':>9} {'peak MiB':>9} "
          f"{'loss':>10} {'grad norm':>10}")
    for r in rec.values():
        fmt = lambda v, f: "-" if v is None else format(v, f)
        print(f"{r['impl']:<22} {r['steps_timed']:>5} {fmt(r['warmup_s'], '9.3f')} "
              f"{fmt(r['median_step_s'], '8.3f')} {fmt(r['examples_per_s'], '9.1f')} "
              f"{fmt(r['peak_allocated_mib'], '9.0f')} {fmt(r['loss'], '10.6f')} "
              f"{fmt(r['grad_norms'][-1] if r['grad_norms'] else None, '10.4g')}"
              + ("" if r["ok"] else f"  ERROR {r.get('error')}") + (f"  ({r['note']})" if r.get("note") else ""))
    ag = report["agreement"]
    if ag:
        print(f"loss agreement: max rel diff {ag['max_loss_rel_diff']:.2e} (tolerance {rtol:g}): "
              f"{'OK' if ag['ok'] else 'MISMATCH'}; grad norm max rel diff {ag['max_grad_norm_rel_diff']:.2e}")
    print(f"{report['elapsed_s']:.1f} s; wrote {out_path}")
    return code


if __name__ == "__main__":
    sys.exit(main())
