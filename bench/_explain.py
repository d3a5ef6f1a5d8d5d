#!/usr/bin/env python
"""Explain: an analytic per-chunk cost model of fastcl's GPU infonce forward+backward, for
the design as built.

    python bench/_explain.py 32768 --device h200
    python bench/_explain.py 8192 --dtype float32 --device a100
    python bench/_explain.py 32768 --device custom --peak-tflops 500 --bandwidth-tbs 3
    python bench/run.py --explain 32768                   # the same text from the bench

This is a MODEL, not a measurement: every figure is predicted from peak rates (device
presets below); ``bench/gpu_check.sh`` measures the real thing. It shows where the time of a
call goes. A design change is measured between commits (``bench/ab.py --base``), and this
model follows the code it is run with: chunk rows come from ``fastcl.tiled.rows_per_chunk``.

Notation: N anchors, M candidates (M = N for infonce), d width, b bytes per element of the
GEMM dtype (2 for bfloat16/float16, 4 for float32), R rows per chunk, C = ceil(N/R) chunks,
T = ceil(M/128) column tiles (BLOCK_M = 128). Useful FLOPs of forward+backward: 6·N·M·d
(similarity 2NMd forward, two gradient GEMMs 2NMd each backward).

Time of a stage = max(FLOPs / (peak · eff), bytes / bandwidth) + launches · launch_us.
GEMM-like stages run at efficiency eff = 1.0 of the preset peak (which is already a practical,
measured-style ceiling) unless ``--sim-efficiency`` (the Triton similarity kernel) or
``--gemm-efficiency`` (the cuBLAS gradient GEMMs) say otherwise; for a preset with a GPU
profile on record (``MEASURED_TFLOPS``: H200) the text adds the prediction with the
efficiencies that profile measured. Elementwise FLOPs are not counted, they are far below
the memory time. A call = (C − 1) full chunks + the last chunk (its remaining rows) + the
per-call stages.

Chunk rows: fastcl's CUDA sizing, ``fastcl.tiled.rows_per_chunk`` for the Triton engine's
one R×M buffer in the GEMM dtype (the default budget, at least ``MIN_CHUNK_ROWS`` where a
quarter of the preset's memory holds them; ``memory_budget_mib`` replaces both).

Per chunk, the bounded design (the default where every logit has a bound: τ ≥ 0.025 for
InfoNCE, 16-bit buffers in bf16, not the released DCLR):
  similarity kernel       1 launch, 2RMd; reads R·d·b + M·d·b + M·4; writes
                          E = exp(l − B)·slope·ginv_k R·M·b, row sums R·T·4
  row finish              1 launch; reads R·T·4; writes loss, 1/Z, positive coefficient R·12
  GEMM E K → fp32         1 launch, 2RMd; reads R·M·b + M·d·b; writes R·d·4
  tangent kernel          1 launch: u/Z − c·k_pos, dq = w⊙(u − q̂(q̂·u)), q̂/Z and the
                          positive's dk row; reads R·d·(4 + 2b + 4); writes R·d·(2b + 4)
  GEMM dk += Eᵀ(q̂/Z)      1 launch (addmm, beta=1, in place, fp32 accumulator), 2RMd;
                          reads R·M·b + R·d·b + M·d·4; writes M·d·4
The two-pass design (``two_pass=True``: fp16 buffers, τ < 0.025, the released DCLR) has
instead of the row finish a row kernel (one program per row): it reads the partials R·T·8
and e R·M·b and writes the gradient H in place R·M·b and the row loss R·4; its tangent
kernel reads R·d·(4 + b) and writes 2·R·d·b.
Per call (``per_call_stages``: each launch the code makes, which tests/test_explain.py
counts in Triton's interpreter): the input scan (each input's largest |entry|, in float32,
all read back at once: read N·d·b + M·d·b), norms of Q and K (read N·d·b + M·d·b), dk zero
(write M·d·4), the row and column factors and the loss (small vectors), the tangent on dk
in one launch that writes the input dtype (read M·d·(4+b), write M·d·b), and backward's
scaling of dq and dk by the incoming gradient (read and write N·d·b + M·d·b).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

from fastcl.tiled import DEFAULT_MEMORY_BUDGET, Epilogue, rows_per_chunk

BLOCK_M = 128                      # column tile of the Triton kernels
MIB = 1 << 20
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Practical ceilings, not datasheet peaks (TFLOP/s, TB/s). fp32 is the non-tensor-core rate:
# fastcl computes fp32 products exactly ("ieee"), so TF32 is listed for reference only.
DEVICES = {
    # bf16: measured torch.mm 8192³ on an H200; HBM: measured device-to-device copy.
    "h200": dict(name="H200", bf16=790.0, tf32=395.0, fp32=60.0, hbm=4.3, sms=132, launch_us=4.0,
                 memory_gib=139),
    # H100 SXM: ≈ 0.76 of the 989 (bf16) / 494 (tf32) datasheet; 0.85 of 3.35 TB/s.
    "h100": dict(name="H100 SXM", bf16=750.0, tf32=375.0, fp32=60.0, hbm=3.35 * 0.85, sms=132,
                 launch_us=4.0, memory_gib=80),
    # A100 SXM 80GB: 0.9 of the 312 (bf16) / 156 (tf32) datasheet; 0.85 of 2.0 TB/s.
    "a100": dict(name="A100 SXM 80GB", bf16=280.0, tf32=140.0, fp32=19.5, hbm=2.0 * 0.85,
                 sms=108, launch_us=4.0, memory_gib=80),
}
GEMM_EFF = 1.0                     # GEMM-like stages reach the (already practical) preset peak

#: The TFLOP/s a GPU profile measured (FLOPs over kernel time of the similarity kernel and
#: of the two cuBLAS gradient GEMMs); the text's calibrated line divides them by the preset's
#: peak. H200, the current design, N = M = 32768, d = 768, bf16, 8 chunks of 4096 rows,
#: the similarity tile 128×128×32 chosen then: similarity 3.995 ms for 2·N·M·d = 1.649 TFLOP
#: (412.8 TFLOP/s), GEMMs 2.227 + 2.015 ms for twice that (777.6 TFLOP/s);
#: bench/results/nvidia-h200-2026-11-30-profile.log.
MEASURED_TFLOPS = {
    "h200": dict(sim=412.8, gemm=777.6, source="bench/results/nvidia-h200-2026-11-30-profile.log"),
}


def measured_efficiency(preset: str) -> dict | None:
    """``MEASURED_TFLOPS`` of a preset as fractions of its bf16 peak (None if none measured)."""
    m = MEASURED_TFLOPS.get(preset)
    if m is None:
        return None
    peak = DEVICES[preset]["bf16"]
    return dict(sim=m["sim"] / peak, gemm=m["gemm"] / peak, source=m["source"])

MODEL_NOTE = "predicted from peak rates; bench/gpu_check.sh measures the real thing"


def _stage(key, name, launches, flops=0, read=0, written=0):
    return dict(key=key, name=name, launches=launches, flops=flops, bytes_read=read,
                bytes_written=written)


def _efficiency(st, eff):
    """The fraction of the peak a GEMM-like stage runs at: the similarity kernel's own, the
    other GEMMs'."""
    return eff["sim"] if st["key"] == "sim" else eff["gemm"]


def _time(st, dev, eff):
    """Predicted seconds of one stage, and what bounds it."""
    t_compute = st["flops"] / (dev["peak_tflops"] * 1e12 * _efficiency(st, eff))
    t_memory = (st["bytes_read"] + st["bytes_written"]) / (dev["bandwidth_tbs"] * 1e12)
    t_launch = st["launches"] * dev["launch_us"] * 1e-6
    bound = "compute" if t_compute >= t_memory else "memory"
    if t_launch > max(t_compute, t_memory):   # tiny stages: the launches are the cost
        bound = "launch"
    return max(t_compute, t_memory) + t_launch, bound


def chunk_rows(n, m, b, memory_gib, memory_budget_mib=None):
    """R: the driver's CUDA sizing for the Triton engine's one R×M buffer in the GEMM dtype."""
    ep = Epilogue(0.05, memory_budget=None if memory_budget_mib is None
                  else int(memory_budget_mib * MIB))
    return rows_per_chunk(n, m, ep, m * b, "cuda", BLOCK_M, lambda: memory_gib * 2**30)


def chunk_stages(r, m, d, b, two_pass=False):
    """Stages of one chunk of r rows."""
    t = math.ceil(m / BLOCK_M)
    g = 2 * r * m * d
    if two_pass:
        head = [
            _stage("sim", "similarity kernel → e", 1, g, r * d * b + m * d * b,
                   r * m * b + r * t * 8),
            # LSE, gradient (in place over e) and row loss fused in one kernel
            _stage("grad", "row kernel (LSE+grad+loss)", 1, 0, r * t * 8 + r * m * b,
                   r * m * b + r * 4),
            _stage("gemm_dq", "GEMM HK → fp32", 1, g, r * m * b + m * d * b, r * d * 4),
            _stage("tan_dq", "tangent kernel (dq, q̂)", 1, 0, r * d * 4 + r * d * b,
                   2 * r * d * b)]
    else:
        head = [
            _stage("sim", "similarity kernel → E", 1, g, r * d * b + m * d * b + m * 4,
                   r * m * b + r * t * 4),
            # the rows from the tiles' sums: no pass over the R×M buffer
            _stage("grad", "row finish (loss, 1/Z)", 1, 0, r * t * 4, r * 12),
            _stage("gemm_dq", "GEMM EK → fp32", 1, g, r * m * b + m * d * b, r * d * 4),
            _stage("tan_dq", "tangent kernel (dq, q̂/Z)", 1, 0, r * d * (8 + 2 * b),
                   r * d * (2 * b + 4))]
    return head + [
        # accumulate straight into dk: no temporary, no extra pass
        _stage("gemm_dk", "GEMM dk += Hᵀq̂" if two_pass else "GEMM dk += Eᵀ(q̂/Z)", 1, g,
               r * m * b + r * d * b + m * d * 4, m * d * 4),
    ]


def per_call_stages(n, m, d, dtype):
    """Stages run once per call, with the launches the driver makes (fastcl/tiled.py's
    ``contrastive_forward`` and backward, fastcl/_validation.py's scan)."""
    b = DTYPE_BYTES[dtype]
    half = b == 2
    fp16 = dtype == "float16"
    # the scan: a reduction an input (+ its cast to float32 from 16 bits), one stack
    scan = 2 + 2 * half + 1
    # 1/‖q‖, 1/‖k‖; the smallest unclamped norm (4); the column ratio; the row weights (2);
    # float16 also caps the ratio, keeps the excess and lifts both by its gain (4)
    factors = 2 + 4 + 1 + 2 + 4 * fp16
    # the loss (sum in float64, mean, cast); the column scale (2; × the excess in float16)
    loss_and_scale = 3 + 2 + fp16
    # dq and dk times the incoming gradient (16 bits: its cast, or float16's cast back)
    backward = 2 + 2 * half
    return [
        _stage("nan_check", "input NaN/Inf scan", scan, 0, n * d * b + m * d * b, 8),
        _stage("norms", "norms of Q and K", 4, 0, n * d * b + m * d * b, (n + m) * 4),
        _stage("dk_zero", "dk zero", 1, 0, 0, m * d * 4),
        _stage("weights", "row, column factors; loss", factors + loss_and_scale, 0,
               2 * (n + m) * 4, (n + m) * 4),
        _stage("tan_dk", "tangent on dk", 1, 0, m * d * (4 + b), m * d * b),
        _stage("backward", "backward: dq, dk × ∂loss", backward, 0,
               n * d * b + m * d * b, n * d * b + m * d * b),
    ]


def _device(device, dtype, peak_tflops, bandwidth_tbs, launch_us):
    if device == "custom":
        if peak_tflops is None or bandwidth_tbs is None:
            raise ValueError("device 'custom' needs peak_tflops and bandwidth_tbs")
        base = dict(name="custom", bf16=peak_tflops, tf32=peak_tflops, fp32=peak_tflops,
                    hbm=bandwidth_tbs, sms=None, launch_us=4.0, memory_gib=80)
    elif device in DEVICES:
        base = DEVICES[device]
    else:
        raise ValueError(f"unknown device {device!r}; one of {sorted(DEVICES) + ['custom']}")
    peak = base["fp32"] if dtype == "float32" else base["bf16"]
    return dict(preset=device, name=base["name"], sms=base["sms"], memory_gib=base["memory_gib"],
                peak_tflops=float(peak_tflops if peak_tflops is not None else peak),
                peak_kind="fp32 (no TF32)" if dtype == "float32" else f"{dtype} tensor core",
                bandwidth_tbs=float(bandwidth_tbs if bandwidth_tbs is not None else base["hbm"]),
                launch_us=float(launch_us if launch_us is not None else base["launch_us"]))


def _timed(stages, dev, eff):
    out = []
    for st in stages:
        sec, bound = _time(st, dev, eff)
        out.append(dict(st, us=sec * 1e6, bound=bound))
    return out


def _sum(stages, field):
    return sum(s[field] for s in stages)


def explain(n, m=None, d=768, dtype="bfloat16", device="h200", memory_budget_mib=None,
            peak_tflops=None, bandwidth_tbs=None, launch_us=None,
            sim_efficiency=GEMM_EFF, gemm_efficiency=GEMM_EFF, two_pass=False):
    """The cost model as a JSON-serialisable dict (see the module docstring for the formulas).
    ``sim_efficiency`` / ``gemm_efficiency``: the fractions of the peak the similarity kernel
    and the gradient GEMMs run at (1.0: the preset peak)."""
    for name, value in (("sim_efficiency", sim_efficiency), ("gemm_efficiency", gemm_efficiency)):
        if not 0 < value <= 1:
            raise ValueError(f"{name} must be in (0, 1], got {value}")
    eff = dict(sim=sim_efficiency, gemm=gemm_efficiency)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}")
    m = n if m is None else m
    b = DTYPE_BYTES[dtype]
    dev = _device(device, dtype, peak_tflops, bandwidth_tbs, launch_us)
    useful = 6 * n * m * d

    r = chunk_rows(n, m, b, dev["memory_gib"], memory_budget_mib)
    once = _timed(per_call_stages(n, m, d, dtype), dev, eff)
    c = math.ceil(n / r)
    last = n - (c - 1) * r                      # rows of the last (maybe short) chunk
    full = _timed(chunk_stages(r, m, d, b, two_pass), dev, eff)
    tail = _timed(chunk_stages(last, m, d, b, two_pass), dev, eff)
    total_us = (c - 1) * _sum(full, "us") + _sum(tail, "us") + _sum(once, "us")
    per_chunk = {f: _sum(full, f) for f in ("launches", "flops", "bytes_read", "bytes_written", "us")}
    budget = DEFAULT_MEMORY_BUDGET["cuda"] / MIB if memory_budget_mib is None else memory_budget_mib
    return dict(model=MODEL_NOTE, design="two-pass" if two_pass else "bounded",
                n=n, m=m, d=d, dtype=dtype, bytes_per_element=b,
                memory_budget_mib=budget, block_m=BLOCK_M, efficiency=eff,
                device=dev, useful_flops=useful, rows=r, chunks=c, last_rows=last,
                tiles=math.ceil(m / BLOCK_M), chunk_buffer_mib=r * m * b / MIB,
                chunk_stages=full, per_chunk=per_chunk, per_call_stages=once,
                total=dict(
                    launches=(c - 1) * per_chunk["launches"] + _sum(tail, "launches")
                    + _sum(once, "launches"),
                    flops=(c - 1) * per_chunk["flops"] + _sum(tail, "flops") + _sum(once, "flops"),
                    bytes=sum((c - 1) * _sum(full, f) + _sum(tail, f) + _sum(once, f)
                              for f in ("bytes_read", "bytes_written")),
                    us=total_us, ms=total_us / 1e3),
                fraction_of_matmul=useful / (total_us * 1e-6) / (dev["peak_tflops"] * 1e12))


def explain_text(n, m=None, d=768, dtype="bfloat16", device="h200", memory_budget_mib=None,
                 **kw):
    """The cost model as printable text: header, per-stage table, totals."""
    e = explain(n, m, d, dtype, device, memory_budget_mib, **kw)
    dev = e["device"]
    eff = e["efficiency"]
    lines = [
        f"fastcl explain: infonce forward+backward, a cost MODEL ({MODEL_NOTE})",
        f"device {dev['name']}: {dev['peak_tflops']:g} TFLOP/s {dev['peak_kind']}, "
        f"{dev['bandwidth_tbs']:.2f} TB/s, {dev['sms'] or '?'} SMs, {dev['launch_us']:g} µs/launch",
        f"N={e['n']} M={e['m']} d={e['d']} dtype={e['dtype']} (b={e['bytes_per_element']}) "
        f"useful FLOPs 6·N·M·d = {e['useful_flops'] / 1e9:,.1f} GFLOP",
        f"{e['design']} design; chunks: budget {e['memory_budget_mib']:g} MiB, R={e['rows']} rows/chunk, "
        f"C={e['chunks']} chunks (last {e['last_rows']} rows), T={e['tiles']} column tiles",
        "stage time = max(FLOPs/(peak·eff), bytes/bandwidth) + launches·launch_us; "
        f"eff {eff['sim']:.2f} similarity kernel, {eff['gemm']:.2f} GEMMs; "
        "bound: compute | memory | launch (launch overhead above both)",
        "",
        f"{'stage':<28s} {'launch':>6} {'GFLOP':>8} {'MB rd':>9} {'MB wr':>9} {'µs':>9} bound",
    ]

    def row(label, st):
        lines.append(f"{label:<28s} {st['launches']:>6} {st['flops'] / 1e9:>8.1f} "
                     f"{st['bytes_read'] / 1e6:>9.1f} {st['bytes_written'] / 1e6:>9.1f} "
                     f"{st['us']:>9.1f} {st.get('bound', '')}")
    lines.append("per chunk (full)")
    for st in e["chunk_stages"]:
        row("  " + st["name"], st)
    row("  chunk total", dict(e["per_chunk"], bound=""))
    lines.append("per call (once)")
    for st in e["per_call_stages"]:
        row("  " + st["name"], st)
    lines += [
        "",
        "totals",
        f"  launches per chunk:        {e['per_chunk']['launches']}",
        f"  launches per call:         {e['total']['launches']}",
        f"  predicted ms per call:     {e['total']['ms']:.2f}",
        f"  predicted fraction of {dtype} matmul peak: {e['fraction_of_matmul']:.3f}",
        f"  chunk buffer (MiB):        {e['chunk_buffer_mib']:.1f}   (R·M·b; MB = 1e6 bytes above)",
    ]
    measured = measured_efficiency(dev["preset"])
    if measured and dtype != "float32" and eff == dict(sim=GEMM_EFF, gemm=GEMM_EFF):
        rest = {k: v for k, v in kw.items() if k not in ("sim_efficiency", "gemm_efficiency")}
        cal = explain(n, m, d, dtype, device, memory_budget_mib, sim_efficiency=measured["sim"],
                      gemm_efficiency=measured["gemm"], **rest)
        lines += [
            f"  calibrated (similarity kernel at {measured['sim']:.2f}, GEMMs at "
            f"{measured['gemm']:.2f} of the peak, as a profile measured: {measured['source']}):",
            f"    predicted ms per call:   {cal['total']['ms']:.2f}",
            f"    predicted fraction:      {cal['fraction_of_matmul']:.3f}",
        ]
    lines += [
        "",
        "note: at N=M=32768, d=768, bfloat16 on H200 this fraction is the number the GPU run "
        "(bench/gpu_check.sh) checks.",
    ]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="fastcl: analytic cost model of GPU infonce "
                                "forward+backward (" + MODEL_NOTE + ")")
    p.add_argument("n", type=int, help="anchors N")
    p.add_argument("--m", type=int, default=None, help="candidates M (default N)")
    p.add_argument("--d", type=int, default=768, help="embedding width")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--device", default="h200", choices=sorted(DEVICES) + ["custom"])
    p.add_argument("--peak-tflops", type=float, default=None, help="GEMM peak for the dtype")
    p.add_argument("--bandwidth-tbs", type=float, default=None, help="memory bandwidth, TB/s")
    p.add_argument("--launch-us", type=float, default=None, help="launch overhead, µs")
    p.add_argument("--budget-mib", type=float, default=None, help="chunk memory budget, MiB")
    p.add_argument("--sim-efficiency", type=float, default=GEMM_EFF,
                   help="fraction of the peak the similarity kernel runs at (default 1.0)")
    p.add_argument("--gemm-efficiency", type=float, default=GEMM_EFF,
                   help="fraction of the peak the gradient GEMMs run at (default 1.0)")
    p.add_argument("--two-pass", action="store_true",
                   help="the two-pass design (fp16 buffers, τ < 0.025, the released DCLR)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    a = p.parse_args(argv)
    if a.device == "custom" and (a.peak_tflops is None or a.bandwidth_tbs is None):
        p.error("--device custom needs --peak-tflops and --bandwidth-tbs")
    kw = dict(m=a.m, d=a.d, dtype=a.dtype, device=a.device, memory_budget_mib=a.budget_mib,
              peak_tflops=a.peak_tflops, bandwidth_tbs=a.bandwidth_tbs,
              launch_us=a.launch_us, sim_efficiency=a.sim_efficiency,
              gemm_efficiency=a.gemm_efficiency, two_pass=a.two_pass)
    if a.json:
        print(json.dumps(explain(a.n, **kw), indent=1))
    else:
        print(explain_text(a.n, **kw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
