"""GeGLU kernel in Triton's interpreter (CPU).

The kernel reproduces ATen's CUDA GELU (``aten_norms.gelu_order_model``, source order, confirmed
on an H200 over all bf16 and fp16 inputs) followed by the dtype multiply. ATen's CPU GELU rounds
differently, so on CPU the kernel is held to that order model with the erf the interpreter
uses for ``tl.math.erf``: Python's double ``math.erf`` rounded to fp32. With the same erf on both
sides the comparison is exact and checks everything around erf: the constants, the order and
rounding of each op, the rounding to the dtype before the multiply. (Whether libdevice ``erff``
equals CUDA's ``erff`` is a GPU question: tests/test_gpu_geglu.py.)
"""

import itertools
import sys
import math

import numpy as np
import pytest
import torch

import exactdit
from exactdit import aten_norms, ops, references
from exactdit.kernels import geglu as kernels
from exactdit.ops.geglu import GEGLU
from tests.conftest import DEVICE, ON_GPU
from tests.helpers import assert_bits_equal, rand

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU order-model tests (GPU runs test_gpu_geglu.py)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_erf = np.vectorize(math.erf, otypes=[np.float64])


def erf_interp(u: torch.Tensor) -> torch.Tensor:
    """The interpreter's ``tl.math.erf`` on fp32: ``math.erf`` in double, rounded to fp32."""
    return torch.from_numpy(_erf(u.double().numpy()).astype(np.float32))


def model(gate, up, form="src"):
    gelu = aten_norms.gelu_candidates(erf_interp)[form](gate.float()).to(gate.dtype)
    return up * gelu


def assert_same(out, ref, what=""):
    """Bits equal, except that any NaN matches any NaN: the CPU model's NaN payloads come from
    torch's CPU conversions, not the GPU's canonical ones (GPU tests compare NaNs bit for bit)."""
    both_nan = torch.isnan(out) & torch.isnan(ref)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"{what}: NaN positions differ"
    assert_bits_equal(torch.where(both_nan, 0, out), torch.where(both_nan, 0, ref), what)


def all_values(dtype):
    """Every bit pattern of a 16-bit dtype as a [256, 256] tensor."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).reshape(256, 256)


def interpreter_subnormal_bf16(gate):
    """Gates whose bf16 GELU is subnormal. The interpreter widens subnormal bf16 values to fp32
    wrongly (its generic float conversion, triton 3.9), the GPU exactly; these are left to the
    GPU's exhaustive test."""
    return (gate.float().abs() < 2.0**-124) & (gate != 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_gate_value(dtype):
    g = torch.Generator().manual_seed(0)
    gate = all_values(dtype).to(DEVICE)
    up = rand(gate.shape, dtype, DEVICE, g)
    out, ref = GEGLU.fused(gate, up), model(gate, up)
    if dtype == torch.bfloat16:
        skip = interpreter_subnormal_bf16(gate)
        assert int(skip.sum()) < 1200
        out, ref = torch.where(skip, 0, out), torch.where(skip, 0, ref)
    assert_same(out, ref, str(dtype))


def test_fp32_random_and_extreme_gates():
    g = torch.Generator().manual_seed(1)
    gate = rand((64, 1000), torch.float32, DEVICE, g, scale=2.0)
    gate[0, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 5.0, -5.5])
    up = rand(gate.shape, torch.float32, DEVICE, g)
    assert_same(GEGLU.fused(gate, up), model(gate, up))


SHAPES = [(1, 1, 16), (3, 2, 37), (5, 7, 1000), (2, 3, 1536)]


@pytest.mark.parametrize("shape,dtype", list(itertools.product(SHAPES, DTYPES)), ids=str)
def test_separate_and_fused_projections(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    gate, up = rand(shape, dtype, DEVICE, g, scale=2.0), rand(shape, dtype, DEVICE, g)
    ref = model(gate, up)
    assert_same(GEGLU.fused(gate, up), ref, "separate")
    fused = torch.cat([gate, up], dim=-1)  # one [..., 2F] projection: chunk views, strided rows
    assert_same(GEGLU.fused(fused, None), ref, "fused")
    g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])  # 2-d and 1-d
    assert_same(GEGLU.fused(g2, u2), model(g2, u2), "2-d")
    assert_same(GEGLU.fused(g2[0], u2[0]), model(g2[0], u2[0]), "1-d")


def test_strided_and_permuted_inputs():
    g = torch.Generator().manual_seed(2)
    gate = rand((9, 2, 96), torch.bfloat16, DEVICE, g).permute(1, 0, 2)  # [S, B, F] seen as [B, S, F]
    up = rand((2, 18, 96), torch.bfloat16, DEVICE, g)[:, ::2]  # every other row
    out = GEGLU.fused(gate, up)
    assert_same(out, model(gate, up))
    assert out.stride() == references.geglu(gate, up).stride()


def test_output_is_rounded_before_the_multiply():
    """``up * bf16(gelu)``, not one rounding of the fp32 product: the two differ, and the kernel
    is the first."""
    gate = all_values(torch.bfloat16).to(DEVICE)
    finite = torch.isfinite(gate)
    gate = torch.where(finite & ~interpreter_subnormal_bf16(gate), gate, 0)
    up = torch.full_like(gate, 1.3359375)
    one_rounding = (up.float() * aten_norms.gelu_candidates(erf_interp)["src"](gate.float())).to(torch.bfloat16)
    out = GEGLU.fused(gate, up)
    assert_same(out, model(gate, up))
    assert not torch.equal(out, one_rounding)


def test_gelu_form_switch(monkeypatch):
    """The constexpr that selects the GELU evaluation order reaches the kernel (the GPU probe
    picked form 0, the source order; form 2, a distributed FMA, differs in many values)."""
    gate = all_values(torch.float16).to(DEVICE)
    gate = torch.where(torch.isfinite(gate), gate, 0)
    up = torch.ones_like(gate)
    monkeypatch.setattr(kernels, "GELU_FORM", 2)
    fma_form = GEGLU.fused(gate, up)
    monkeypatch.setattr(kernels, "GELU_FORM", 0)
    src = GEGLU.fused(gate, up)
    assert_same(src, model(gate, up))
    assert not torch.equal(src.view(torch.int16), fma_form.view(torch.int16))


def test_public_op_runs_eager_on_cpu_and_validates():
    """ATen's CPU GELU is not the CUDA kernel this reproduces: on CPU the public op is eager."""
    g = torch.Generator().manual_seed(3)
    gate, up = rand((4, 64), torch.bfloat16, DEVICE, g), rand((4, 64), torch.bfloat16, DEVICE, g)
    assert_bits_equal(ops.geglu(gate, up), references.geglu(gate, up))
    fused = torch.cat([gate, up], -1)
    assert_bits_equal(ops.geglu(fused), references.geglu(fused))
    rep = exactdit.report(show=False)["geglu"]
    assert rep["fused"] == 0 and rep["eager"] == 2
    with pytest.raises(ValueError):
        ops.geglu(rand((4, 63), torch.bfloat16, DEVICE, g))


# --- the bf16 table path ---------------------------------------------------------------------

geglu_op = sys.modules["exactdit.ops.geglu"]  # the module (``exactdit.ops.geglu`` is the function)


def model_gelu(x):
    """The order model's bf16 GELU with the GPU's canonical NaN (0x7FFF), as a table source."""
    y = aten_norms.gelu_candidates(erf_interp)["src"](x.float()).to(x.dtype)
    return torch.where(torch.isnan(y), torch.tensor(0x7FFF, dtype=torch.int16).view(x.dtype), y)


@pytest.fixture
def fresh_tables(monkeypatch):
    monkeypatch.setattr(geglu_op, "_tables", {})
    monkeypatch.setattr(geglu_op, "_refused", {})


def test_table_path_every_gate_value():
    """Every bf16 gate, subnormals included (the table path widens by bits), against the model,
    with the table taken from the model: checks the window, the index arithmetic and the
    saturated forms outside the window."""
    table, why = geglu_op.build_gelu_table(DEVICE, model_gelu)
    assert why is None and table.shape == (2 * kernels.TABLE_WINDOW,)
    g = torch.Generator().manual_seed(4)
    gate = all_values(torch.bfloat16).to(DEVICE)
    up = rand(gate.shape, torch.bfloat16, DEVICE, g)
    out = kernels.geglu(gate, up, torch.empty_like(gate), table)
    assert_same(out, model(gate, up))
    fused = torch.cat([gate, up], dim=-1)  # [..., 2F] projection, odd tile counts per program
    assert_same(kernels.geglu(*fused[:37].chunk(2, -1), torch.empty_like(gate[:37]), table), model(gate[:37], up[:37]))


def test_table_check_refuses_wrong_tables():
    """The check compares the kernel with eager over all 2^16 gates: an eager GELU that breaks
    one of the kernel's saturation rules outside the window in one value (above it, below it),
    or ATen's CPU GELU (which flushes subnormal results and gives NaN for +Inf), and the table
    is refused."""
    for bits, value in [(0x41A0, 19.0), (0xC1A0, -1e-30), (0x3000, 0.0)]:  # gelu(20), gelu(-20), gelu(2^-31)
        def one_value_off(x):
            y = model_gelu(x).clone()
            y[bits] = value
            return y

        table, why = geglu_op.build_gelu_table(DEVICE, one_value_off)
        assert table is None and f"1 of 65536 elements differ, first at index ({bits},)" in why
    table, why = geglu_op.build_gelu_table(DEVICE)  # ATen's CPU GELU
    assert table is None and "elements differ" in why


def test_op_takes_the_table_path_when_checked(fresh_tables, monkeypatch):
    real_build = geglu_op.build_gelu_table
    monkeypatch.setattr(geglu_op, "build_gelu_table", lambda device: real_build(device, model_gelu))
    gate = rand((3, 40), torch.bfloat16, DEVICE, torch.Generator().manual_seed(5))
    assert GEGLU.signature(gate, gate)[0] == "table"
    assert_same(GEGLU.fused(gate, gate), model(gate, gate))
    monkeypatch.setattr(geglu_op, "USE_TABLE", False)
    assert GEGLU.signature(gate, gate)[0] == f"erf form {kernels.GELU_FORM}"
    assert GEGLU.signature(gate.half(), gate.half())[0] == f"erf form {kernels.GELU_FORM}"


def test_refused_table_falls_back_to_erf(fresh_tables, caplog):
    gate = rand((3, 40), torch.bfloat16, DEVICE, torch.Generator().manual_seed(6))
    with caplog.at_level("WARNING", logger="exactdit"):
        assert geglu_op.gelu_table(gate.device) is None  # ATen's CPU GELU fails the check
    assert "computes bf16 GELU with erf" in caplog.text
    assert "elements differ" in geglu_op.table_status()[str(gate.device)]
    assert GEGLU.signature(gate, gate)[0] == f"erf form {kernels.GELU_FORM}"


def test_no_table_is_built_during_capture(fresh_tables, monkeypatch):
    """Building and checking a table needs a host sync: during graph capture or compilation
    the device is settled on erf for good (a path never changes under a verified signature)."""
    monkeypatch.setattr(geglu_op, "cannot_sync", lambda: True)
    monkeypatch.setattr(geglu_op, "build_gelu_table", lambda *a: pytest.fail("built during capture"))
    assert geglu_op.gelu_table(torch.device(DEVICE)) is None
    assert "graph capture" in geglu_op.table_status()[str(torch.device(DEVICE))]
