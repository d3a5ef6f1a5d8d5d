"""What a benchmark run measures: the built-in sweeps (most important first, so that a time
budget cuts from the end) and a custom sweep from ``--objective``, ``--impl``, ``--n``,
``--d``, ``--dtype`` and ``--e2e-n``. A plan is a list of specs: ``kind`` "case" (one
objective, implementation, N, d and dtype of ``_cases.py``) or "e2e" (one batch size of
the end-to-end step of ``_e2e.py``, every implementation)."""

from __future__ import annotations

from _cases import IMPLS, NOT_COMPILED, ONLY_FOR, OBJECTIVES, num_candidates
from _e2e import IMPLS as E2E_IMPLS

DTYPES = ("float32", "bfloat16", "float16", "float64")


def sweep(objectives, impls, ns, ds, dtypes, **extra):
    """Specs ordered by N so that an interrupted sweep has every implementation at small N."""
    out = []
    for dtype in dtypes:
        for d in ds:
            for objective in objectives:
                for n in ns:
                    for impl in impls:
                        if impl in ONLY_FOR and objective not in ONLY_FOR[impl]:
                            continue
                        if impl == "compiled" and objective in NOT_COMPILED:
                            continue
                        out.append({"kind": "case", "objective": objective, "impl": impl, "n": n,
                                    "m": num_candidates(objective, n), "d": d, "dtype": dtype,
                                    **extra})
    return out


def e2e_steps(encoder, ns, seq, dtype, impls):
    return [{"kind": "e2e", "encoder": encoder, "n": n, "seq": seq, "dtype": dtype,
             "impls": impls} for n in ns]


def default_plan(device: str, mode: str) -> list[dict]:
    """The built-in sweeps, most important first (a time budget cuts from the end)."""
    others = ["infonce-hard", "focal", "dclr", "escl"]
    if device == "cpu":
        cpu = ["fastcl", "reference"]
        if mode == "quick":
            return (sweep(["infonce"], cpu, [256, 1024], [384], ["float32"])
                    + sweep(["infonce"], ["mnrl"], [1024], [384], ["float32"])
                    + sweep(others + ["noise"], cpu, [512], [384], ["float32"])
                    + e2e_steps("tiny", [16], 32, "float32", cpu))
        return (sweep(["infonce"], cpu + ["mnrl"], [256, 1024, 4096, 8192], [768], ["float32"])
                + sweep(["infonce"], ["compiled"], [1024, 4096], [768], ["float32"])
                + sweep(others + ["noise"], cpu, [1024, 4096], [768], ["float32"])
                + sweep(["infonce-hard"], ["mnrl"], [1024, 4096], [768], ["float32"])
                + sweep(["infonce"], cpu, [4096], [384, 1024], ["float32"])
                + e2e_steps("small", [16, 64], 32, "float32", cpu))
    gpu = ["fastcl", "tiled", "reference"]
    if mode == "quick":
        return (sweep(["infonce"], gpu + ["mnrl", "compiled"], [1024, 4096, 16384], [768], ["bfloat16"])
                + sweep(others + ["noise"], gpu, [4096], [768], ["bfloat16"])
                + e2e_steps("base", [256], 32, "bfloat16", ["fastcl", "reference"]))
    if mode == "default":
        return (sweep(["infonce"], gpu + ["mnrl", "compiled"], [256, 1024, 4096, 16384, 32768],
                       [768], ["bfloat16"])
                + sweep(others + ["noise"], gpu, [1024, 4096, 16384], [768], ["bfloat16"])
                + e2e_steps("base", [128, 512], 32, "bfloat16", ["fastcl", "reference"]))
    big = [256, 1024, 4096, 16384, 32768, 65536, 131072]
    # torch.compile last among the bf16 cases: its compile time must not starve the rest
    return (sweep(["infonce"], gpu + ["mnrl"], big, [768], ["bfloat16"])
            + sweep(["noise"], gpu, [1024, 4096, 16384, 65536], [768], ["bfloat16"])
            + sweep(others, gpu + ["mnrl"], [1024, 4096, 16384, 65536], [768], ["bfloat16"])
            + e2e_steps("base", [256, 1024, 4096], 32, "bfloat16", ["fastcl", "reference"])
            + sweep(["infonce"], ["compiled"], big, [768], ["bfloat16"])
            + sweep(["infonce"], gpu, [1024, 4096, 16384, 65536], [768], ["float32"])
            + sweep(["infonce"], ["fastcl", "reference"], [4096, 32768], [384, 1024], ["bfloat16"]))


def custom_plan(args, device) -> list[dict]:
    objectives = split_list(args.objective or ["infonce"], OBJECTIVES, "--objective")
    impls = split_list(args.impl or ["fastcl,reference" + (",tiled" if device == "cuda" else "")],
                       IMPLS, "--impl")
    ns = [int(x) for x in split_list(args.n or ["1024"], None, "--n")]
    ds = [int(x) for x in split_list(args.d or ["768"], None, "--d")]
    dtypes = split_list(args.dtype or ["bfloat16" if device == "cuda" else "float32"], DTYPES, "--dtype")
    plan = sweep(objectives, impls, ns, ds, dtypes)
    if args.e2e_n:
        plan += e2e_steps(args.e2e_encoder or ("base" if device == "cuda" else "small"),
                          [int(x) for x in split_list(args.e2e_n, None, "--e2e-n")], args.e2e_seq,
                          dtypes[0], [i for i in impls if i in E2E_IMPLS])
    return plan


def split_list(values, allowed, flag):
    """Repeated and comma-separated values as one list without repeats; ``allowed`` (unless
    None) are the accepted values, anything else exits naming ``flag``."""
    items = [v.strip() for value in values for v in str(value).split(",") if v.strip()]
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise SystemExit(f"{flag}: unknown {', '.join(bad)} (choose from {', '.join(allowed)})")
    return list(dict.fromkeys(items))

