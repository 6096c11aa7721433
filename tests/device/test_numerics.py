"""The rounding and arithmetic helpers against torch's own conversions and numpy's IEEE fp32."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from exactdit.device.numerics import (LAUNCH_OPTIONS, add_rn, div_rn, dtype_add, dtype_mul, dtype_sub, mul_rn, neg_f32,
                               round_to)
from tests.conftest import DEVICE
from tests.helpers import with_special_values


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


@triton.jit
def _dtype_ops_kernel(a_ptr, b_ptr, mul_ptr, add_ptr, sub_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask)
    b = tl.load(b_ptr + offs, mask=mask)
    tl.store(mul_ptr + offs, dtype_mul(a, b), mask=mask)
    tl.store(add_ptr + offs, dtype_add(a, b), mask=mask)
    tl.store(sub_ptr + offs, dtype_sub(a, b), mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_dtype_ops_equal_eager_ops(dtype):
    """``dtype_mul/add/sub`` (packed half ops on the GPU) against eager ``a * b``, ``a + b``,
    ``a - b`` on the same device. Half dtypes: every bit pattern of a against random bit patterns
    of b and against specials (zeros, subnormals, Inf, NaN, 1, -1), so ties, exponent gaps over
    16 bits, subnormal results, overflow and cancellation to +-0 all occur. Bits must be equal;
    on the CPU NaN payloads may differ (torch's CPU conversion keeps them, the interpreter's
    rounding gives 0x7FFF) and are only required to be NaN."""
    g = torch.Generator().manual_seed(11)
    if dtype == torch.float32:
        a = torch.randn(1 << 20, generator=g) * torch.exp2(torch.randint(-40, 40, (1 << 20,), generator=g).float())
        b = torch.randn(1 << 20, generator=g)
    else:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        columns = 256 if DEVICE.type == "cuda" else 16
        specials = torch.tensor([0, -32768, 1, -32767, 0x3FF, 0x7FFF, -1, 0x7C00, -1024, 0x7F80, -128,
                                 0x3F80 if dtype == torch.bfloat16 else 0x3C00], dtype=torch.int16)
        random = torch.randint(-(2**15), 2**15, (2**16, columns), generator=g, dtype=torch.int32).to(torch.int16)
        b_bits = torch.cat([random, specials.expand(2**16, -1)], dim=1)
        a = every[:, None].expand_as(b_bits).reshape(-1).view(dtype)
        b = b_bits.reshape(-1).view(dtype)
    a, b = a.to(DEVICE).contiguous(), b.to(DEVICE).contiguous()
    outs = [torch.empty_like(a) for _ in range(3)]
    _dtype_ops_kernel[(triton.cdiv(a.numel(), 2048),)](a, b, *outs, a.numel(), BLOCK=2048, **LAUNCH_OPTIONS)
    for name, out, ref in zip(("mul", "add", "sub"), outs, (a * b, a + b, a - b)):
        if DEVICE.type != "cuda":
            both_nan = torch.isnan(out) & torch.isnan(ref)
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), name
            out, ref = torch.where(both_nan, 0, out), torch.where(both_nan, 0, ref)
        bits = {2: torch.int16, 4: torch.int32}[out.element_size()]
        differs = out.view(bits) != ref.view(bits)
        assert not differs.any(), f"{name}: {int(differs.sum())} differ, e.g. {a[differs][:4]} {b[differs][:4]}"


@triton.jit
def _neg_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, neg_f32(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_neg_equals_eager_neg_signed_zeros_included():
    """``neg_f32`` against eager ``-x`` bit for bit: +-0 (Triton 3.6's own ``-x`` is ``0 - x`` and
    turns +0 into +0), +-inf, subnormals and random values; NaNs only need to stay NaN on the CPU."""
    g = torch.Generator().manual_seed(5)
    x = with_special_values(torch.randn(4101, generator=g)).to(DEVICE)
    out = torch.empty_like(x)
    _neg_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, **LAUNCH_OPTIONS)
    ref = -x
    if DEVICE.type != "cuda":  # any NaN
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(out), nan)
        out[nan] = ref[nan] = 0.0
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))
