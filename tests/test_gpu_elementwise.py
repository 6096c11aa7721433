"""GPU-only: elementwise kernels against CUDA eager over many random shapes and layouts.

Run on the device: ``python -m pytest -m gpu``. Outputs are poisoned (conftest) and the kernels
are called directly, so neither unwritten elements nor the gate's fallback can hide an error.
"""

import random

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.ops.elementwise import MODULATE, RESIDUAL_GATE_ADD
from tests.helpers import MODULATION_KINDS, activation, assert_bits_equal, modulation

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
KINDS = ["bsd", "sbd", "sbd_as_bsd", "rows", "row_slice"]


def _random_cases(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        S = rng.choice([1, 2, 3, 17, 255, 256, 511, 512, 1024, 4224]) + rng.choice([0, 0, 1])
        D = rng.choice([64, 96, 100, 127, 1000, 1536, 3072, 4095, 4096, 5120, 6144, 8191, 12288])
        yield S, rng.choice([1, 2]), D, rng.choice(DTYPES), rng.choice(KINDS), rng.choice(MODULATION_KINDS), rng.random() < 0.5


@pytest.mark.parametrize("case", list(_random_cases(150, 0)), ids=str)
def test_random_shapes_and_layouts(case):
    S, B, D, dtype, kind, mk, upcast = case
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    x = activation(kind, S, B, D, dtype, "cuda", g)
    other = activation(kind, S, B, D, dtype, "cuda", g)
    vec, vec2 = (modulation(mk, x.shape, dtype, "cuda", g) for _ in range(2))
    assert_bits_equal(RESIDUAL_GATE_ADD.fused(x, other, vec), references.residual_gate_add(x, other, vec), "residual_gate_add")
    for shift in (vec2, None):
        out = MODULATE.fused(x, vec, shift, upcast)
        assert_bits_equal(out, references.modulate(x, vec, shift, upcast=upcast), f"modulate shift={shift is not None}")


def test_production_shapes_through_the_public_ops():
    g = torch.Generator().manual_seed(0)
    for B in (1, 2):
        x = activation("sbd", 4224, B, 4096, torch.bfloat16, "cuda", g)
        attn = activation("sbd", 4224, B, 4096, torch.bfloat16, "cuda", g)
        mods = torch.randn(B, 6 * 4096, generator=g).to("cuda", torch.bfloat16).chunk(6, dim=-1)
        shift, scale, gate = (m.unsqueeze(0) for m in mods[:3])  # [1, B, D] views of chunks
        assert_bits_equal(ops.modulate(x, scale, shift, upcast=True), references.modulate(x, scale, shift, upcast=True))
        assert_bits_equal(ops.residual_gate_add(x, attn, gate), references.residual_gate_add(x, attn, gate))
    rep = exactdit.report(show=False)
    assert rep["modulate"]["eager"] == 0 and rep["residual_gate_add"]["eager"] == 0
    assert rep["modulate"]["fused"] == 2 and rep["residual_gate_add"]["fused"] == 2


def test_fp32_has_no_fma():
    """fp32 chains where an FMA would round differently in most elements."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 1024, generator=g).cuda() * 3
    u = torch.randn(4096, 1024, generator=g).cuda() / 7
    gate = torch.randn(1024, generator=g).cuda() * 1.3
    assert_bits_equal(RESIDUAL_GATE_ADD.fused(x, u, gate), x + gate * u)
    assert not torch.equal(torch.addcmul(x, gate, u), x + gate * u)  # an FMA-like op does differ
    assert_bits_equal(MODULATE.fused(x, u, gate, False), x * (1 + u) + gate)
