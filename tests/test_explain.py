"""The analytic cost model of bench/_explain.py: consistency of its numbers (CPU, fast)."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _explain  # noqa: E402

N, D = 32768, 768


@pytest.fixture(scope="module")
def h200():
    return _explain.explain(N, d=D, dtype="bfloat16", device="h200")


def test_chunk_and_call_totals(h200):
    assert h200["per_chunk"]["launches"] == 5
    assert 0 < h200["fraction_of_matmul"] <= 1.0
    assert h200["total"]["ms"] > 0


def test_rows_are_a_multiple_of_the_tile(h200):
    assert h200["rows"] % 128 == 0
    assert h200["rows"] == 4096       # 128 MiB / (32768 · 2 B) = 2048, raised to the 4096 floor
    assert _explain.explain(16384)["rows"] == 4096                 # 128 MiB / (16384 · 2 B)
    assert _explain.explain(100)["rows"] == 100
    assert _explain.explain(N, memory_budget_mib=64)["rows"] == 1024   # a budget: no floor


def test_useful_flops_and_stage_flops_sum(h200):
    assert h200["useful_flops"] == 6 * N * N * D
    assert h200["total"]["flops"] == 6 * N * N * D
    # also with a short last chunk and M ≠ N
    e = _explain.explain(5000, m=7000, d=384, dtype="float16", device="h100")
    assert e["chunks"] > 1 or e["last_rows"] == 5000
    assert e["total"]["flops"] == 6 * 5000 * 7000 * 384


def test_fp32_uses_fp32_peak():
    e = _explain.explain(4096, dtype="float32", device="h200")
    assert e["device"]["peak_tflops"] == _explain.DEVICES["h200"]["fp32"]
    assert e["bytes_per_element"] == 4
    assert _explain.explain(4096, device="a100", dtype="float32")["device"]["peak_tflops"] == 19.5


def test_json_and_custom_device():
    json.dumps(_explain.explain(4096))
    with pytest.raises(ValueError):
        _explain.explain(4096, device="custom")
    c = _explain.explain(4096, device="custom", peak_tflops=100, bandwidth_tbs=1)
    assert c["device"]["peak_tflops"] == 100 and c["device"]["bandwidth_tbs"] == 1


def test_text_says_it_is_a_model():
    t = _explain.explain_text(N, d=D, device="h200")
    assert "MODEL" in t and "predicted from peak rates" in t and "bench/gpu_check.sh" in t


def test_main(capsys):
    assert _explain.main(["4096", "--device", "a100"]) == 0
    out = capsys.readouterr().out
    assert "A100" in out and "predicted ms per call" in out


@pytest.mark.parametrize("n", [16384, 32768, 65536])
def test_rows_are_the_drivers(n):
    """The model's chunk rows are the ones fastcl's driver picks for the Triton engine on a
    device with the preset's free memory."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fastcl.tiled import Epilogue, engine_for, rows_per_chunk
    ep = Epilogue(0.05)
    rows = rows_per_chunk(n, n, ep, engine_for("triton").row_bytes(ep, torch.bfloat16, n, n), "cuda",
                          128, lambda: 139 * 2**30)
    assert _explain.explain(n)["rows"] == rows


def test_efficiencies_slow_their_own_stages():
    """A similarity kernel below the peak slows the similarity stage alone; the GEMM
    efficiency the gradient GEMMs alone."""
    ideal = _explain.explain(N, d=D)
    slow_sim = _explain.explain(N, d=D, sim_efficiency=0.5)
    slow_mm = _explain.explain(N, d=D, gemm_efficiency=0.5)
    us = lambda x: {s["key"]: s["us"] for s in x["chunk_stages"]}
    assert us(slow_sim)["sim"] == pytest.approx(2 * us(ideal)["sim"], rel=0.05)
    assert us(slow_sim)["gemm_dq"] == us(ideal)["gemm_dq"]
    assert us(slow_mm)["gemm_dk"] > 1.9 * us(ideal)["gemm_dk"]
    assert us(slow_mm)["sim"] == us(ideal)["sim"]
    assert slow_sim["fraction_of_matmul"] < ideal["fraction_of_matmul"]
    with pytest.raises(ValueError, match="sim_efficiency"):
        _explain.explain(N, sim_efficiency=0)
    with pytest.raises(ValueError, match="gemm_efficiency"):
        _explain.explain(N, gemm_efficiency=1.5)


def test_calibrated_line_uses_the_measured_efficiencies():
    t = _explain.explain_text(N, d=D, device="h200")
    measured = _explain.measured_efficiency("h200")
    cal = _explain.explain(N, d=D, device="h200", sim_efficiency=measured["sim"],
                           gemm_efficiency=measured["gemm"])
    assert "calibrated" in t and measured["source"] in t
    assert f"predicted ms per call:   {cal['total']['ms']:.2f}" in t
    assert "calibrated" not in _explain.explain_text(4096, device="a100")
    # given efficiencies replace the calibrated line (they are the user's own)
    assert "calibrated" not in _explain.explain_text(N, device="h200", sim_efficiency=0.6)
    assert _explain.main(["4096", "--sim-efficiency", "0.5", "--gemm-efficiency", "0.9"]) == 0


# Ops that launch nothing on a GPU: views, metadata and allocations without a fill.
_NO_LAUNCH = {"view", "_unsafe_view", "slice", "select", "permute", "t", "transpose", "expand",
              "unsqueeze", "squeeze", "alias", "as_strided", "detach", "split_with_sizes",
              "empty", "empty_like", "new_empty", "empty_strided", "scalar_tensor", "lift_fresh"}


def _launches(chunk, dtype, warm, n=64, d=32):
    """The launches of ``fastcl.infonce`` forward + backward on the Triton backend in the
    interpreter: the torch ops that compute and the Triton kernels (the interpreter's own
    tensor traffic inside a kernel is not counted). Autograd's seed of ∂loss is not fastcl's."""
    import torch
    import triton.runtime.interpreter as interpreter
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    import fastcl
    from conftest import correlated, make
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_LAUNCH:
                seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    launch = interpreter.GridExecutor.__call__

    def kernel(self, *args, **kwargs):
        seen.append("triton")
        with _disable_current_modes():
            return launch(self, *args, **kwargs)
    a, p = make(n, d, dtype=dtype), correlated(make(n, d, dtype=dtype))
    if warm:
        fastcl.infonce(a, p, backend="triton", chunk_size=chunk).backward()  # (probes, caches: once a dtype)
        a.grad = p.grad = None                  # (else backward adds into them: not fastcl's)
    interpreter.GridExecutor.__call__ = kernel
    try:
        with Ops():
            loss = fastcl.infonce(a, p, backend="triton", chunk_size=chunk)
        grad = torch.ones_like(loss)
        with Ops():
            loss.backward(grad)
    finally:
        interpreter.GridExecutor.__call__ = launch
    return len(seen)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_model_counts_the_launches_the_code_makes(dtype, request):
    """The model's launches, per chunk and once a call, are those of the code as built (the
    Triton backend in the interpreter; 16-bit with a GPU's 16-bit buffers). On a CPU a
    16-bit GEMM into a float32 accumulator takes a cast of each operand (and a separate add
    for dk) where cuBLAS takes one launch, so there the chunk's count is the model's for
    float32 only, and the call's is measured apart from the chunks'."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from fastcl.kernels import contrastive as kc
    if not kc.INTERPRET:
        pytest.skip("counts launches in Triton's interpreter")
    if dtype != "float32":
        request.getfixturevalue("gpu_buffers")
    one, four = (_launches(chunk, getattr(torch, dtype), warm=chunk == 64) for chunk in (64, 16))
    per_chunk = (four - one) / 3
    model = _explain.explain(64, d=32, dtype=dtype)
    if dtype == "float32":
        assert per_chunk == model["per_chunk"]["launches"]
    assert one - per_chunk == sum(s["launches"] for s in model["per_call_stages"])
