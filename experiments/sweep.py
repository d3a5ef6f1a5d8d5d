"""Sensitivity of DCLR's φ and Focal-InfoNCE's m, DCLR + Focal, and an augmentation against
dropout alone, at compare.py's CPU scale (same start, data and budget; 2 seeds by default).

Runs, per seed (each one ``train.py`` subprocess through compare.py's ``do_run``, trained and
scored as compare.py's: the start model's own pooling by default):

1. ``simcse`` — the baseline, and DCLR's complementary model (the same run compare.py makes:
   with the same ``--work-dir`` a finished compare.py run is reused, only scored).
2. ``dclr-phi{φ}`` for each ``--phis`` (default 0.5 0.6 0.7), with the share of in-batch
   negatives the mask drops at each φ measured by experiments/dclr_diagnostics.py on the
   training data with that seed's SimCSE as the complementary model.
3. ``focal-m{m}`` for each ``--ms`` (default 0.1 0.5; compare.py's m = 0.3 run, ``focal-seedS``,
   is added to the m plot when its model is in the work dir).
4. ``simcse-aug-{NAME}`` — SimCSE with ``--augment`` (default ``feature_cutoff:0.2``, fixed up
   front); with several ``--augments``, a screening on the first seed at ``--screen-steps``
   picks the best by STS-B dev first.
5. ``dclr-phi{φ*}-focal{m}`` — DCLR + Focal (``--focal-m``, default 0.3) at the φ with the best
   mean STS-B dev Spearman over the seeds (dev, not test: the test sets are only reported).

Outputs in ``--results-dir`` (default experiments/results/sweep): one JSON per run in runs/,
``sweep.json``, ``sweep.md`` (mean ± std over seeds, and the paired difference to SimCSE of
the same seed) and the plots ``phi.png`` and ``m.png``. Resumable as compare.py. ``--dry-run``
prints the plan, the train.py commands and the time estimate without running anything.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import compare  # noqa: E402
from compare import do_run, mean_std, publish, run_totals, verdict, write_json  # noqa: E402
from fastcl.augment import parse as parse_augment  # noqa: E402
from fastcl.common import FOCAL_M  # noqa: E402

# Seconds per step measured for compare.py (2-core CPU, MiniLM, batch 64, max length 32) and the
# per-run overhead (start, 6 dev evaluations and checkpoints, scoring), from its README: measured
# with fastcl's earlier training loop, an estimate for the sentence-transformers trainer.
STEP_S = {"simcse": 2.11, "dclr": 2.23, "focal": 2.11}
RUN_OVERHEAD_S = 90.0
SCORE_S = 30.0
DIAGNOSTICS_S = 75.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python experiments/sweep.py",
        description="DCLR's phi, Focal-InfoNCE's m, DCLR + Focal and an augmentation against "
                    "dropout alone, at compare.py's scale (resumable).")
    compare.add_shared_options(p, seeds=[0, 1], results_dir=compare.REPO / "experiments" / "results" / "sweep")
    g = p.add_argument_group("sweep")
    g.add_argument("--phis", nargs="+", type=float, default=[0.5, 0.6, 0.7], help="DCLR phi values")
    g.add_argument("--ms", nargs="+", type=float, default=[0.1, 0.5], help="Focal-InfoNCE m values")
    g.add_argument("--combo-focal-m", type=float, default=FOCAL_M,
                   help=f"--focal-m of DCLR + Focal, at the best phi (default {FOCAL_M:g}, Focal-InfoNCE's m)")
    g.add_argument("--augments", nargs="+", default=["feature_cutoff:0.2"], metavar="NAME[:RATE]",
                   help="augmentation(s) against dropout alone (default feature_cutoff:0.2, fixed); "
                        "with several, a screening on the first seed picks one by STS-B dev")
    g.add_argument("--screen-steps", type=int, default=40,
                   help="steps of each screening run when --augments has several (default 40)")
    g.add_argument("--diag-batches", type=int, default=20,
                   help="batches dclr_diagnostics.py averages the masked share over (default 20)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the plan, the commands and the time estimate; run nothing")
    return p


def slug(x: float) -> str:
    return f"{x:g}"


def aug_name(spec: str) -> str:
    return spec.split(":")[0].replace("-", "_")


def best_dev(result: dict):
    """The best STS-B dev Spearman a run logged (its model selection's score)."""
    values = [c["stsb-dev"] for c in result.get("dev_curve", []) if c.get("stsb-dev") is not None]
    return max(values) if values else None


def estimate_s(args) -> dict:
    """Wall-time estimate of the default plan on an idle 2-core CPU (compare.py's timings)."""
    def run(method, steps=None):
        return (steps or args.steps) * STEP_S[method] + RUN_OVERHEAD_S
    seeds = len(args.seeds)
    parts = {"simcse (trained; scored only if compare.py's runs are in --work-dir)": seeds * run("simcse"),
             "dclr phi runs": seeds * len(args.phis) * run("dclr"),
             "focal m runs": seeds * len(args.ms) * run("focal"),
             "augmentation runs": seeds * run("simcse"),
             "dclr + focal at the best phi": seeds * run("dclr"),
             "masked share (dclr_diagnostics)": seeds * DIAGNOSTICS_S * args.diag_batches / 20,
             "start model scored": SCORE_S}
    if len(args.augments) > 1:
        parts["augmentation screening"] = len(args.augments) * run("simcse", args.screen_steps)
    parts["total"] = sum(parts.values())
    return parts


def masked_share(args, seed: int, data: Path) -> dict:
    """dclr_diagnostics.py's masked share at each φ, on the training data, with the seed's
    SimCSE run as the complementary model (cached in the results, reused while its command
    is the same)."""
    import dclr_diagnostics as diag
    path = Path(args.results_dir) / "runs" / f"masked-seed{seed}.json"
    phis = [float(p) for p in args.phis]
    # the training pooler and the complementary model's pooler: those the folders are saved
    # with, as train.py's (dclr_diagnostics.py's defaults), unless --pooler is given
    argv = ["--model", args.model,
            "--complementary", str(compare.run_dir(args, f"simcse-seed{seed}") / compare.MODEL_DIR),
            "--data", str(data), "--batches", str(args.diag_batches), "--batch-size", str(args.batch_size),
            "--max-seq-len", str(args.max_seq_len), "--seed", str(seed), "--phi", *map(str, phis)]
    if args.pooler:
        argv[2:2] = ["--pooler", args.pooler]
    command = "python experiments/dclr_diagnostics.py " + shlex.join(argv)
    if path.is_file():
        res = json.loads(path.read_text())
        if res.get("command") == command:
            return res
    parser = diag.build_parser()
    diag_args = parser.parse_args(argv)
    diag.check_args(parser, diag_args)
    print(f"[masked-seed{seed}] dclr_diagnostics.py {shlex.join(argv)}", flush=True)
    tic = time.perf_counter()
    out = diag.diagnose(diag_args)
    res = {"seed": seed, "phis": phis, "batches": args.diag_batches,
           "masked": {slug(p): out["mean"]["masked"][str(p)] for p in phis},
           "comp_cos_mean": out["mean"]["comp_cos_mean"], "comp_cos_max": out["mean"]["comp_cos_max"],
           "command": command, "wall_s": time.perf_counter() - tic}
    write_json(path, res)
    return res


def plan(args) -> list:
    """(group, label, method, name-without-seed, extra flags) of every run but the combination."""
    runs = [("baseline", "SimCSE (dropout only)", "simcse", "simcse", [])]
    runs += [("phi", f"DCLR φ={slug(p)}", "dclr", f"dclr-phi{slug(p)}", ["--phi", slug(p)]) for p in args.phis]
    runs += [("m", f"Focal m={slug(m)}", "focal", f"focal-m{slug(m)}", ["--m", slug(m)]) for m in args.ms]
    return runs


def augment_run(spec: str) -> tuple:
    return ("augment", f"SimCSE + {spec}", "simcse", f"simcse-aug-{aug_name(spec)}", ["--augment", spec])


def combo_run(args, phi: float) -> tuple:
    m = slug(args.combo_focal_m)
    return ("combo", f"DCLR φ={slug(phi)} + Focal m={m}", "dclr", f"dclr-phi{slug(phi)}-focal{m}",
            ["--phi", slug(phi), "--focal_m", m])


def screen(args, data, config, cache) -> str:
    """The augmentation with the best STS-B dev on the first seed at --screen-steps."""
    if len(args.augments) == 1:
        return args.augments[0]
    short = argparse.Namespace(**vars(args))
    short.steps, short.eval_steps = args.screen_steps, max(1, args.screen_steps // 2)
    short_config = dict(config, steps=short.steps, eval_steps=short.eval_steps)
    seed = args.seeds[0]
    scores = {}
    for spec in args.augments:
        _, _, method, name, extra = augment_run(spec)
        r = do_run(short, method, seed, data, short_config, cache, name=f"screen-{name}-seed{seed}", extra=extra)
        scores[spec] = best_dev(r)
    best = max(scores, key=lambda s: scores[s] if scores[s] is not None else float("-inf"))
    print(f"[screening] STS-B dev: {scores}; picked {best}", flush=True)
    write_json(Path(args.results_dir) / "screening.json", {"steps": args.screen_steps, "seed": seed,
                                                           "stsb_dev": scores, "picked": best})
    return best


def row(label, group, runs, baseline, extra=None) -> dict:
    """Mean ± std over seeds and the paired difference to SimCSE of the same seed."""
    by_seed = {r["seed"]: r for r in runs}
    out = {"label": label, "group": group, "runs": [r["name"] for r in runs], "seeds": sorted(by_seed)}
    out["avg"] = dict(zip(("mean", "std"), mean_std([r["avg"] for r in runs])))
    for task in ("stsb", "sickr"):
        out[task] = dict(zip(("mean", "std"), mean_std([r["scores"].get(task) for r in runs])))
    out["stsb_dev"] = dict(zip(("mean", "std"), mean_std([best_dev(r) for r in runs])))
    out["diff_to_simcse"] = {str(s): (by_seed[s]["avg"] - baseline[s]["avg"])
                             if s in baseline and by_seed[s]["avg"] is not None else None for s in sorted(by_seed)}
    diffs = list(out["diff_to_simcse"].values())
    out["mean_diff"] = mean_std(diffs)[0]
    out["spread"] = max(out["avg"]["std"] or 0.0,
                        mean_std([r["avg"] for r in baseline.values()])[1] or 0.0)
    out["vs_simcse"] = verdict(diffs, out["spread"])
    out.update(extra or {})
    return out


def cell(ms, d=2) -> str:
    if ms["mean"] is None:
        return "n/a"
    return f"{ms['mean']:.{d}f}" + (f" ± {ms['std']:.{d}f}" if ms["std"] else "")


def write_markdown(path: Path, summary: dict) -> None:
    cfg = summary["config"]
    lines = ["# Sensitivity sweep at CPU scale", "",
             f"Start: {compare.start_label(cfg['model'])}; data, budget ({cfg['steps']} steps of batch "
             f"{cfg['batch_size']}, lr {cfg['lr']}) and selection (STS-B dev) as experiments/compare.py. "
             f"Seeds: {' '.join(map(str, summary['seeds']))}. DCLR's complementary model: the SimCSE run "
             f"of the same seed. Best φ (by mean STS-B dev): {slug(summary['best_phi'])}. Augmentation: "
             f"{summary['augment']}{' (screened)' if summary.get('screening') else ' (fixed up front)'}.", "",
             "Test Spearman ×100, mean ± std over seeds; `avg − SimCSE` is per seed, against the "
             "SimCSE run of the same seed (same data order and dropout). vs SimCSE: **better** or "
             "**worse** when every seed's difference has one sign and their mean exceeds the seed "
             "spread (the larger std over seeds of the two runs' avg), else within. Masked: the "
             "share of in-batch negatives DCLR's mask drops at that φ (dclr_diagnostics.py, mean "
             "over seeds).", "",
             "| run | seeds | STS-B | SICK-R | avg | STS-B dev | avg − SimCSE, per seed | vs SimCSE | masked |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        diffs = ", ".join("n/a" if v is None else f"{v:+.2f}" for v in r["diff_to_simcse"].values())
        masked = f"{100 * r['masked']:.3f}%" if r.get("masked") is not None else ""
        baseline = r["group"] == "baseline"
        versus = "" if baseline else (f"**{r['vs_simcse']}**" if r["vs_simcse"] != "within" else "within")
        if not baseline and r["mean_diff"] is not None:
            versus += f" ({r['mean_diff']:+.2f} vs ±{r['spread']:.2f})"
        lines.append(f"| {r['label']} | {len(r['seeds'])} | {cell(r['stsb'])} | {cell(r['sickr'])} | "
                     f"{cell(r['avg'])} | {cell(r['stsb_dev'])} | {diffs if not baseline else ''} | "
                     f"{versus} | {masked} |")
    lines += ["", f"Command: `{summary['command']}`", "",
              f"Wall time of this invocation: {summary['wall_s'] / 60:.1f} min; training and scoring "
              f"summed over the runs (those of earlier, resumed invocations included): "
              f"{summary['runs_s'] / 60:.1f} min; estimate for the plan: "
              f"{summary['estimate_s']['total'] / 60:.0f} min.", "",
              "![score vs phi](phi.png)", "", "![score vs m](m.png)", ""]
    path.write_text("\n".join(lines))


def plot(summary: dict, results_dir: Path) -> list:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next(r for r in summary["rows"] if r["group"] == "baseline")
    written = []
    for group, key, xlabel, name in (("phi", "phi", "DCLR φ", "phi.png"), ("m", "m", "Focal-InfoNCE m", "m.png")):
        rows = sorted((r for r in summary["rows"] if r["group"] == group), key=lambda r: r[key])
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        xs = [r[key] for r in rows]
        ax.errorbar(xs, [r["avg"]["mean"] for r in rows], yerr=[r["avg"]["std"] or 0 for r in rows],
                    marker="o", capsize=4, label="test avg (STS-B, SICK-R)")
        ax.axhline(base["avg"]["mean"], color="grey", ls="--", label="SimCSE")
        if group == "phi":
            for r in rows:
                if r.get("masked") is not None:
                    ax.annotate(f"{100 * r['masked']:.2g}% masked", (r[key], r["avg"]["mean"]),
                                xytext=(0, 8), textcoords="offset points", ha="center", fontsize=8)
        ax.set(xlabel=xlabel, ylabel="Spearman x100", xticks=xs,
               title=f"{xlabel}: mean ± std over {len(summary['seeds'])} seed(s)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(results_dir / name, dpi=100)
        plt.close(fig)
        written.append(name)
    return written


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tic = time.perf_counter()
    if args.screen_steps < 1 or args.diag_batches < 1:
        parser.error("--screen-steps and --diag-batches must be >= 1")
    for spec in args.augments:  # a bad value fails now, not after an hour of runs
        try:
            parse_augment(spec)
        except ValueError as err:
            parser.error(f"--augments: {err}")
    estimate = estimate_s(args)
    if args.dry_run:
        args.model = args.model or compare.default_model()
        args.eval_steps = args.eval_steps or max(1, args.steps // 5)
        data = Path(args.work_dir) / "data" / "train.txt"
        print(f"seeds {' '.join(map(str, args.seeds))}, {args.steps} steps of batch {args.batch_size}")
        for seed in args.seeds:
            for _, label, method, name, extra in plan(args) + [augment_run(a) for a in args.augments[:1]]:
                out = Path(args.work_dir) / "runs" / f"{name}-seed{seed}"
                print(f"[{name}-seed{seed}] {label}: "
                      f"{shlex.join(compare.train_command(args, method, seed, data, out, False, extra))}")
        print(f"then DCLR φ=<best by STS-B dev> + Focal m={slug(args.combo_focal_m)} per seed")
        for part, s in estimate.items():
            print(f"estimate: {part}: {s / 60:.1f} min")
        return 0
    work, results_dir, data_info, config = compare.prepare(parser, args)
    data = work / "data" / "train.txt"
    cache: dict = {}
    start = compare.do_start(args, config, cache)
    results: dict = {}
    masked: dict = {}
    runs = plan(args)
    augment = screen(args, data, config, cache)
    runs.append(augment_run(augment))
    for seed in args.seeds:  # simcse first: DCLR's complementary model
        for group, label, method, name, extra in runs:
            r = do_run(args, method, seed, data, config, cache, name=f"{name}-seed{seed}", extra=extra)
            results.setdefault(name, []).append(r)
        masked[seed] = masked_share(args, seed, data)
    phi_dev = {p: mean_std([best_dev(r) for r in results[f"dclr-phi{slug(p)}"]])[0] for p in args.phis}
    best_phi = max(args.phis, key=lambda p: phi_dev[p] if phi_dev[p] is not None else float("-inf"))
    combo = combo_run(args, best_phi)
    runs.append(combo)
    for seed in args.seeds:
        results.setdefault(combo[3], []).append(
            do_run(args, combo[2], seed, data, config, cache, name=f"{combo[3]}-seed{seed}", extra=combo[4]))
    # compare.py's focal runs (train.py's default m), where their models are in the work dir:
    # one more m point
    if FOCAL_M not in args.ms and all((compare.run_dir(args, f"focal-seed{s}") / compare.RESULTS).is_file()
                                      for s in args.seeds):
        runs.append(("m", f"Focal m={slug(FOCAL_M)} (compare.py's runs)", "focal", "focal", []))
        results["focal"] = [do_run(args, "focal", s, data, config, cache) for s in args.seeds]
    baseline = {r["seed"]: r for r in results["simcse"]}
    rows = []
    for group, label, method, name, extra in runs:
        info = {}
        if group == "phi":
            phi = float(extra[1])
            info = {"phi": phi, "masked": mean_std([masked[s]["masked"][slug(phi)] for s in args.seeds])[0]}
        elif group == "m":
            info = {"m": float(extra[1]) if extra else FOCAL_M}
        elif group == "combo":
            info = {"phi": best_phi, "focal_m": args.combo_focal_m}
        rows.append(row(label, group, results[name], baseline, info))
    summary = {"command": shlex.join(["python", "experiments/sweep.py",
                                      *(argv if argv is not None else sys.argv[1:])]),
               "config": config, "seeds": args.seeds, "data": data_info, "start": {"avg": start["avg"]},
               "best_phi": best_phi, "phi_stsb_dev": {slug(p): v for p, v in phi_dev.items()},
               "augment": augment, "screening": len(args.augments) > 1, "masked": masked, "rows": rows,
               "estimate_s": estimate, **run_totals(results)}
    summary["plots"] = plot(summary, results_dir)
    return publish(summary, tic, results_dir / "sweep.json", results_dir / "sweep.md", write_markdown)


if __name__ == "__main__":
    sys.exit(main())
