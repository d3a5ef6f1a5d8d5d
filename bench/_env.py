"""The environment of a benchmark run: versions, the machine, where fastcl came from, and
whether 16-bit GEMMs can write float32 (``run.py --env`` prints it; every report holds it)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import _checkout
from _measure import cpu_model, default_threads


def environment(device: str, threads: int) -> dict:
    import torch

    env = {"device": device, "torch": torch.__version__, "python": sys.version.split()[0],
           "platform": platform.platform(), "cpu_model": cpu_model(), "cpu_threads": threads,
           "usable_cores": default_threads(), "load_average_at_start": loadavg(),
           "fastcl_from": _checkout.HOW}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    from importlib import metadata
    for pkg in ("fastcl", "sentence-transformers", "transformers", "numpy", "matplotlib"):
        try:
            env[pkg.replace("-", "_")] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg.replace("-", "_")] = None
    from _alternatives import versions
    env["alternatives"] = versions()     # the packages a user would pick instead (None: absent)
    import fastcl
    env["fastcl"] = env["fastcl"] or getattr(fastcl, "__version__", None)
    try:
        root = _checkout.ROOT
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "fastcl", "kernels"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        env["git_commit"] = (commit + (" (fastcl/ or kernels/ modified)" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu_model=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   gpu_sms=p.multi_processor_count, cuda=torch.version.cuda,
                   tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        try:
            env["gpu_driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["gpu_driver"] = None
    env["mixed_gemm"] = mixed_gemm_support(device)
    return env


def mixed_gemm_support(device: str) -> dict:
    """Whether 16-bit GEMMs can write float32 directly on ``device`` (what the chunk driver
    uses when it can): "ok", or the error, per form."""
    import torch

    a = torch.randn(64, 32, device=device).bfloat16()
    b = torch.randn(32, 48, device=device).bfloat16()
    want = a.float() @ b.float()
    forms = {
        "mm(bf16, bf16, out_dtype=float32)": lambda: torch.mm(a, b, out_dtype=torch.float32),
        "addmm(float32, bf16, bf16, out_dtype=float32)":
            lambda: torch.addmm(torch.zeros_like(want), a, b, out_dtype=torch.float32),
        "addmm(..., out_dtype=float32, out=input) (in place)":
            lambda: (lambda c: torch.addmm(c, a, b, out_dtype=torch.float32, out=c))(
                torch.zeros_like(want)),
    }
    out = {}
    for name, fn in forms.items():
        try:
            got = fn()
            err = (got.float() - want).abs().max().item()
            out[name] = ("ok" if got.dtype == torch.float32 and err < 1e-2
                         else f"wrong result: dtype {got.dtype}, max error {err:.3g}")
        except Exception as exc:  # unsupported here: say why
            out[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    return out


def loadavg():
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def busy_warning(env: dict) -> str | None:
    """CPU timings with other work running are not reliable (threads wait for each other)."""
    load = env.get("load_average_at_start")
    if env.get("device") == "cpu" and load and load[0] > 0.5 * env["usable_cores"]:
        return (f"WARNING: load average {load[0]:.2f} on {env['usable_cores']} cores at the start: "
                "other work is running, CPU timings will be slow and noisy")
    return None


def device_slug(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(0).lower()).strip("-") or "cuda"

