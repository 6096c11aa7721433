"""GPU-only: the GeGLU kernel against live CUDA eager ``up * F.gelu(gate)``.

Run on the device: ``python -m pytest -m gpu tests/test_gpu_geglu.py``. Every bf16 and fp16
gate value (NaN and Inf included, compared bit for bit) against random up values, random fp32,
ERNIE-Image's F = 12288 at S = 4224 and odd widths, separate and fused projections; bf16 on both
the table path and the erf path. Kernels are called directly with poisoned outputs (conftest);
the public op is checked to run fused.
"""

import sys

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.ops.geglu import GEGLU
from tests.helpers import assert_bits_equal

pytestmark = pytest.mark.gpu

geglu_op = sys.modules["exactdit.ops.geglu"]

PATHS = [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, False)]


@pytest.fixture(params=[True, False], ids=["table", "erf"])
def bf16_path(request, monkeypatch):
    """Run a bf16 test on the table path and on the erf path."""
    monkeypatch.setattr(geglu_op, "USE_TABLE", request.param)
    return request.param


def all_values(dtype, rows):
    """Every 16-bit pattern of ``dtype``, repeated over ``rows`` rows: [rows, 65536]."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16)
    return bits.view(dtype).expand(rows, -1).contiguous()


def randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)


def test_the_bf16_table_passes_its_check_on_this_gpu():
    table = geglu_op.gelu_table(torch.device("cuda", torch.cuda.current_device()))
    assert table is not None, geglu_op.table_status()
    assert set(geglu_op.table_status().values()) == {"table"}


@pytest.mark.parametrize("dtype,table", PATHS, ids=["bf16-table", "bf16-erf", "fp16-erf"])
def test_every_gate_value(dtype, table, monkeypatch):
    monkeypatch.setattr(geglu_op, "USE_TABLE", table)
    assert GEGLU.signature(all_values(dtype, 1), all_values(dtype, 1))[0].startswith("table" if table else "erf")
    gate = all_values(dtype, 16)
    up = randn(gate.shape, dtype, 0, scale=4.0)
    assert_bits_equal(GEGLU.fused(gate, up), references.geglu(gate, up), str(dtype))
    ones = torch.ones_like(gate)  # the GELU alone, rounded to the dtype
    assert_bits_equal(GEGLU.fused(gate, ones), references.geglu(gate, ones), f"{dtype} gelu")


def test_fp32_random_gates():
    for seed, scale in [(1, 1.0), (2, 8.0), (3, 1e-3), (4, 1e-38)]:
        gate = randn((1024, 4096), torch.float32, seed, scale)
        up = randn((1024, 4096), torch.float32, seed + 10)
        assert_bits_equal(GEGLU.fused(gate, up), references.geglu(gate, up), f"scale {scale}")


@pytest.mark.parametrize("B,S,F", [(1, 4224, 12288), (2, 4224, 12288), (2, 77, 12288), (1, 4225, 5001), (2, 3, 12289)], ids=str)
def test_production_and_odd_shapes(B, S, F, bf16_path):
    gate, up = randn((B, S, F), torch.bfloat16, S, 2.0), randn((B, S, F), torch.bfloat16, F)
    ref = references.geglu(gate, up)
    assert_bits_equal(GEGLU.fused(gate, up), ref, "separate")
    fused = torch.cat([gate, up], dim=-1)
    assert_bits_equal(GEGLU.fused(fused, None), ref, "fused [..., 2F]")
    sbf = gate.transpose(0, 1).contiguous().transpose(0, 1)  # [S, B, F] storage seen as [B, S, F]
    assert_bits_equal(GEGLU.fused(sbf, up), references.geglu(sbf, up), "permuted gate")


def test_fp16_and_fp32_production_width():
    for dtype in (torch.float16, torch.float32):
        gate, up = randn((4224, 12288), dtype, 5, 2.0), randn((4224, 12288), dtype, 6)
        assert_bits_equal(GEGLU.fused(gate, up), references.geglu(gate, up), str(dtype))


def test_public_op_takes_the_fused_path(bf16_path):
    gate, up = randn((2, 4224, 12288), torch.bfloat16, 7, 2.0), randn((2, 4224, 12288), torch.bfloat16, 8)
    fused = torch.cat([gate, up], dim=-1)
    for _ in range(2):
        assert_bits_equal(ops.geglu(gate, up), references.geglu(gate, up))
        assert_bits_equal(ops.geglu(fused), references.geglu(fused))
    rep = exactdit.report(show=False)["geglu"]
    assert rep["fused"] == 4 and rep["eager"] == 0 and not rep["disabled"]
