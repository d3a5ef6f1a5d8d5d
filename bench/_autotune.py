"""What the similarity kernel's autotuning chose, and what it measured, in this process.

Triton's autotuner keeps only its last tuning's times (``configs_timings``); a benchmark
wants every key's, to report each tile it tried. :func:`record` wraps fastcl's choice of
the kernel (``fastcl.kernels.contrastive._similarity``) so that each autotuner it hands out
is kept, and after each launch that tuned a new key, that tuning's times.
"""

from __future__ import annotations

#: Each autotuner handed out, by its config list; every config's median time (ms) where a
#: launch tuned a new key, by (config list, key).
_TUNERS: dict = {}
_TIMINGS: dict = {}


def _kernels():
    from fastcl.kernels import contrastive
    return contrastive


def record() -> bool:
    """Start recording (once a process; before the first launch). False where this fastcl
    has no autotuner to wrap (an older commit reports its own ``chosen_configs()``)."""
    kc = _kernels()
    if hasattr(kc, "chosen_configs") or not hasattr(kc, "_similarity"):
        return False
    if getattr(kc._similarity, "recorded", False):
        return True
    choose = kc._similarity

    def similarity(*args, **kwargs):
        kernel = choose(*args, **kwargs)
        if not hasattr(kernel, "cache") or not hasattr(kernel, "configs"):
            return kernel                      # the interpreter's bare kernel
        name = _name(kernel)
        _TUNERS[name] = kernel
        return _Noting(kernel, name)
    similarity.recorded = True
    kc._similarity = similarity
    return True


def _name(tuner) -> str:
    configs = [(c.kwargs.get("BLOCK_R"), c.kwargs.get("BLOCK_D"), c.num_warps, c.num_stages)
               for c in tuner.configs]
    return f"_similarity_kernel{configs}"


class _Noting:
    """An autotuner whose launches note their tuning's times (``tuner[grid](...)``)."""

    def __init__(self, tuner, name):
        self.tuner, self.name = tuner, name

    def __getitem__(self, grid):
        launch = self.tuner[grid]

        def run(*args, **kwargs):
            before = len(self.tuner.cache)
            out = launch(*args, **kwargs)
            note_timings(self.tuner, self.name, before)
            return out
        return run


def note_timings(tuner, name: str, tuned_before: int) -> None:
    """After a launch through ``tuner``: if it tuned a new key, keep the median time (ms) of
    every config it measured (nothing when there was one config to try)."""
    if len(tuner.cache) <= tuned_before:
        return
    key = next(reversed(tuner.cache))
    timings = getattr(tuner, "configs_timings", None) or {}
    if tuner.cache[key] not in timings:
        return
    _TIMINGS[(name, key)] = {
        str(config): float(t[0] if isinstance(t, (list, tuple)) else t)
        for config, t in timings.items()}


def chosen_configs() -> dict:
    """What autotuning picked so far in this process: {config list: {key: config}}."""
    kc = _kernels()
    if hasattr(kc, "chosen_configs"):
        return kc.chosen_configs()
    return {name: {str(k): str(v) for k, v in tuner.cache.items()}
            for name, tuner in _TUNERS.items()}


def autotune_timings() -> dict:
    """What autotuning measured so far in this process: {config list: {key: {config: ms}}}."""
    kc = _kernels()
    if hasattr(kc, "autotune_timings"):
        return kc.autotune_timings()
    out = {}
    for (name, key), times in _TIMINGS.items():
        tuner = _TUNERS.get(name)
        names = getattr(tuner, "keys", None) or []
        # the key by name (the argument dtypes that follow it left out)
        label = (", ".join(f"{n}={v}" for n, v in zip(names, key))
                 if isinstance(key, tuple) and names else str(key))
        out.setdefault(name, {})[label] = times
    return out
