"""The rounding and arithmetic helpers against torch's own conversions and numpy's IEEE fp32."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from exactdit.numerics import LAUNCH_OPTIONS, add_rn, div_rn, mul_rn, round_to
from tests.conftest import DEVICE


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, round_to(x, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _arith_kernel(a_ptr, b_ptr, c_ptr, mul_ptr, add_ptr, div_ptr, chain_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    c = tl.load(c_ptr + offs, mask=mask)
    tl.store(mul_ptr + offs, mul_rn(a, b), mask=mask)
    tl.store(add_ptr + offs, add_rn(a, b), mask=mask)
    tl.store(div_ptr + offs, div_rn(a, b), mask=mask)
    tl.store(chain_ptr + offs, add_rn(mul_rn(a, b), c), mask=mask)


def _round(x32, dtype):
    x32 = x32.to(DEVICE)
    out = torch.empty(x32.shape, dtype=dtype, device=DEVICE)
    _round_kernel[(triton.cdiv(x32.numel(), 1024),)](x32, out, x32.numel(), BLOCK=1024, **LAUNCH_OPTIONS)
    return out.cpu()


def _from_bits(bits):
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.float32))


EDGE_BITS = [
    0x00000000, 0x80000000,  # +-0
    0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # bf16 ties to even (down, up), just above/below
    0x3F801000, 0x3F803000,  # fp16 ties (1 + 2^-11, 1 + 3 * 2^-11)
    0x00000001, 0x00400000, 0x007FFFFF, 0x00008000, 0x00018000,  # fp32 subnormals, bf16 subnormal ties
    0x33800000, 0x33000000, 0x33C00000, 0x387FC000, 0x38800000,  # fp16 subnormal range and its edges
    0x7F7F0000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF,  # bf16 max finite, just below/at/above overflow tie
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000,  # fp16 max finite, overflow tie, beyond
    0x7F800000, 0xFF800000,  # +-Inf
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_matches_torch_on_edge_values(dtype):
    x = _from_bits(EDGE_BITS)
    x = torch.cat([x, -x])
    got, want = _round(x, dtype), x.to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (x[got.view(torch.int16) != want.view(torch.int16)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rounding_matches_torch_on_random_bit_patterns(dtype):
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 2**32, (1 << 16,), generator=g, dtype=torch.int64).to(torch.uint32).numpy()
    x = torch.from_numpy(bits.view(np.float32).copy())
    x = x[~torch.isnan(x)]
    got, want = _round(x, dtype), x.to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_bf16_nan_is_kept_and_canonical():
    nans = _from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFF812345])
    got = _round(nans, torch.bfloat16)
    assert torch.isnan(got.float()).all()
    # CUDA's cvt.rn.bf16.f32 returns the canonical NaN, whatever the payload or sign.
    assert (got.view(torch.int16) == 0x7FFF).all()


def test_fp16_nan_is_kept():
    got = _round(_from_bits([0x7FC00000, 0xFFC00000, 0x7F800001]), torch.float16)
    assert torch.isnan(got.float()).all()


def test_arithmetic_is_ieee_fp32_without_contraction():
    g = torch.Generator().manual_seed(2)
    n = 4096
    a, b, c = (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float()) for _ in range(3))
    outs = [torch.empty(n, device=DEVICE) for _ in range(4)]
    _arith_kernel[(triton.cdiv(n, 1024),)](a.to(DEVICE), b.to(DEVICE), c.to(DEVICE), *outs, n, BLOCK=1024, **LAUNCH_OPTIONS)
    mul, add, div, chain = (o.cpu().numpy() for o in outs)
    an, bn, cn = a.numpy(), b.numpy(), c.numpy()
    assert np.array_equal(mul.view(np.int32), (an * bn).view(np.int32))
    assert np.array_equal(add.view(np.int32), (an + bn).view(np.int32))
    assert np.array_equal(div.view(np.int32), (an / bn).view(np.int32))
    two_roundings = (an * bn) + cn  # numpy rounds the product, then the sum
    assert np.array_equal(chain.view(np.int32), two_roundings.view(np.int32))
    fused = (an.astype(np.float64) * bn + cn).astype(np.float32)  # what an FMA would give
    assert (fused.view(np.int32) != two_roundings.view(np.int32)).any(), "inputs too tame to tell FMA apart"
