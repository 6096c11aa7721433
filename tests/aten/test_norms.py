"""CPU tests of exactdit.aten.norms (order models of ATen CUDA kernels).

On CPU the models cannot be bit-equal to torch's CPU kernels (different
reduction trees, CPU rsqrt/erf), so these tests check closeness to float64
references with tolerances of a few fp32 ulps, exact properties that do hold
on CPU (the FMA emulation, the composite RMSNorm chain, determinism, path
selection), and that the contraction options really change bits.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from exactdit.aten.gelu import GELU_K_ALPHA, gelu_candidates, gelu_order_model
from exactdit.aten.norms import (
    fma_f32,
    layer_norm_order_model,
    rms_norm_composite_model,
    rms_norm_order_model,
    vectorized_path_ok,
)

F32 = torch.float32


# ---------------------------------------------------------------- helpers

def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def _next32(v: float, up: bool) -> float:
    return float(torch.nextafter(torch.tensor(v, dtype=F32),
                                 torch.tensor(math.inf if up else -math.inf, dtype=F32)))


def _round_f32_exact(q: Fraction) -> float:
    """Correctly rounded (nearest, ties to even) fp32 value of a rational."""
    cand = _f32(float(q))  # float(Fraction) is correctly rounded to binary64
    best = None
    for c in (_next32(cand, False), cand, _next32(cand, True)):
        if math.isinf(c):
            continue
        err = abs(Fraction(c) - q)
        if best is None or err < best[0]:
            best = (err, c)
        elif err == best[0]:
            bits = struct.unpack("I", struct.pack("f", c))[0]
            if bits % 2 == 0:
                best = (err, c)
    return best[1]


def _rows(m, n, dtype, seed, scale=3.0, shift=0.5):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, n, generator=g) * scale + shift).to(dtype)


def _ulp32(t: torch.Tensor) -> torch.Tensor:
    t = t.to(F32).abs()
    return torch.nextafter(t, torch.full_like(t, math.inf)) - t


def _ulp_lowp(t: torch.Tensor, dtype) -> torch.Tensor:
    """Spacing of ``dtype`` (bf16/fp16) numbers at |t| (normal range)."""
    mbits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    _, e = torch.frexp(t.double().abs())
    return torch.exp2((e - 1 - mbits).double()).float()


# ---------------------------------------------------------------- FMA

def test_fma_double_rounding_case():
    # a*b = 2**-24 - 2**-70 exactly; c = 1 + 2**-23 (odd last bit).
    # exact a*b + c lies just below the fp32 midpoint 1 + 2**-23 + 2**-24, so
    # the correct result is 1 + 2**-23; rounding through binary64 first lands
    # on the midpoint and ties to the even neighbour 1 + 2**-22.
    a = torch.tensor([2.0 ** -24 * (1 + 2.0 ** -23)], dtype=F32)
    b = torch.tensor([1 - 2.0 ** -23], dtype=F32)
    c = torch.tensor([1 + 2.0 ** -23], dtype=F32)
    naive = (a.double() * b.double() + c.double()).float()
    assert naive.item() == 1 + 2.0 ** -22
    assert fma_f32(a, b, c).item() == 1 + 2.0 ** -23
    assert fma_f32(-a, b, -c).item() == -(1 + 2.0 ** -23)


def test_fma_matches_exact_rational_rounding():
    g = torch.Generator().manual_seed(1)
    n = 3000
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    b = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    # make c comparable to a*b so that cancellation and midpoints occur
    c = -(a * b) * (1 + torch.randn(n, generator=g) * 2.0 ** -20)
    c[: n // 3] = torch.randn(n // 3, generator=g)
    got = fma_f32(a.float(), b.float(), c.float())
    for i in range(n):
        q = Fraction(a[i].item()) * Fraction(b[i].item()) + Fraction(c[i].item())
        assert got[i].item() == _round_f32_exact(q), i


# ---------------------------------------------------------------- RMSNorm

def _rms_ref64(x, w, eps):
    x64 = x.double()
    rstd = torch.rsqrt((x64 * x64).mean(-1, keepdim=True) + _f32(eps))
    y = x64 * rstd
    if w is not None:
        y = y * w.double()
    return y, rstd


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [64, 128, 256, 1000, 1536, 4095, 30])
def test_rms_model_close_to_reference(dtype, n):
    x = _rows(64, n, dtype, seed=n)
    w = _rows(1, n, dtype, seed=n + 1, scale=0.5, shift=1.0)[0]
    y, rstd = rms_norm_order_model(x, w, 1e-6, return_rstd=True)
    assert y.dtype == dtype and y.shape == x.shape
    yref, rref = _rms_ref64(x, w, 1e-6)
    assert ((rstd.double() - rref).abs() / rref).max().item() < 4e-7
    if dtype == F32:
        # each output a few fp32 ulps from the float64 value
        assert ((y.double() - yref).abs() <= 4 * _ulp32(yref.float()).double()).all()
    else:
        # at most one unit in the output dtype, and mostly exact
        yr = yref.to(dtype)
        assert ((y.float() - yr.float()).abs() <= _ulp_lowp(yref, dtype)).all()
        assert (y == yr).float().mean().item() > 0.995
    # torch's own CPU kernel agrees closely as well
    ycpu = F.rms_norm(x, (n,), w, 1e-6)
    tol = 1e-5 if dtype == F32 else 2e-2
    torch.testing.assert_close(y.float(), ycpu.float(), rtol=tol, atol=tol)


def test_rms_model_no_weight_and_default_eps():
    x = _rows(16, 256, torch.bfloat16, seed=5)
    y = rms_norm_order_model(x, None, None)
    yref, _ = _rms_ref64(x, None, torch.finfo(F32).eps)
    assert (y.float() - yref.float()).abs().max().item() <= 2.0 ** -5
    torch.testing.assert_close(y, F.rms_norm(x, (256,)), rtol=1e-2, atol=1e-2)


def test_rms_paths_differ_only_by_rounding():
    x = _rows(128, 1024, F32, seed=7)
    yv, rv = rms_norm_order_model(x, None, 1e-6, vectorized=True, return_rstd=True)
    yf, rf = rms_norm_order_model(x, None, 1e-6, vectorized=False, return_rstd=True)
    assert ((rv - rf).abs() / rv).max().item() < 4e-7
    assert not torch.equal(rv, rf)  # different trees -> some rstd bits differ


def test_rms_square_fma_option_changes_bits_for_fp32():
    x = _rows(256, 512, F32, seed=8)
    _, r1 = rms_norm_order_model(x, None, 1e-6, return_rstd=True, square_fma=True)
    _, r2 = rms_norm_order_model(x, None, 1e-6, return_rstd=True, square_fma=False)
    assert not torch.equal(r1, r2)
    # for bf16 inputs the square is exact, so the option cannot matter
    xb = x.to(torch.bfloat16)
    _, b1 = rms_norm_order_model(xb, None, 1e-6, return_rstd=True, square_fma=True)
    _, b2 = rms_norm_order_model(xb, None, 1e-6, return_rstd=True, square_fma=False)
    assert torch.equal(b1, b2)


def test_rms_composite_is_bit_exact_on_cpu():
    # bf16 input + fp32 weight: torch dispatches to rms_norm_composite on every
    # device, so with CPU mean/rsqrt the model must give the same bits.
    x = _rows(33, 384, torch.bfloat16, seed=9)
    w = _rows(1, 384, F32, seed=10, scale=0.3, shift=1.0)[0]
    ref = F.rms_norm(x, (384,), w, 1e-6)
    assert torch.equal(rms_norm_composite_model(x, w, 1e-6), ref)
    x32 = _rows(9, 100, F32, seed=11)
    wb = _rows(1, 100, torch.bfloat16, seed=12)[0]
    assert torch.equal(rms_norm_composite_model(x32, wb, 1e-5), F.rms_norm(x32, (100,), wb, 1e-5))


def test_rms_model_accepts_leading_dims():
    x = _rows(2 * 7 * 3, 64, torch.bfloat16, seed=13).reshape(2, 7, 3, 64)
    w = torch.ones(64, dtype=torch.bfloat16)
    y = rms_norm_order_model(x, w, 1e-6)
    assert y.shape == x.shape
    assert torch.equal(y.reshape(-1, 64), rms_norm_order_model(x.reshape(-1, 64), w, 1e-6))


# ---------------------------------------------------------------- LayerNorm

def _ln_ref64(x, w, b, eps):
    x64 = x.double()
    mean = x64.mean(-1, keepdim=True)
    var = ((x64 - mean) ** 2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + _f32(eps))
    y = (x64 - mean) * rstd
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, mean, rstd


@pytest.mark.parametrize("dtype", [torch.bfloat16, F32])
@pytest.mark.parametrize("n", [64, 1536, 1000, 4095, 3])
@pytest.mark.parametrize("affine", ["none", "w", "b", "wb"])
def test_layer_norm_model_close_to_reference(dtype, n, affine):
    x = _rows(48, n, dtype, seed=n, shift=2.0)
    w = _rows(1, n, dtype, seed=n + 1, scale=0.5, shift=1.0)[0] if "w" in affine else None
    b = _rows(1, n, dtype, seed=n + 2, scale=0.5, shift=0.0)[0] if "b" in affine else None
    y, mean, rstd = layer_norm_order_model(x, w, b, 1e-6, return_stats=True)
    yref, mref, rref = _ln_ref64(x, w, b, 1e-6)
    assert ((mean.double() - mref).abs() * rref).max().item() < 2e-6
    assert ((rstd.double() - rref).abs() / rref).max().item() < 2e-6
    if dtype == F32:
        assert ((y.double() - yref).abs() <= 2e-6 * (1 + yref.abs())).all()
    else:
        assert ((y.float() - yref.float()).abs() <= 2.0 ** -7 * (yref.float().abs() + 2.0 ** -6)).all()
        assert (y == yref.to(dtype)).float().mean().item() > 0.99
    ycpu = F.layer_norm(x, (n,), w, b, 1e-6)
    tol = 2e-5 if dtype == F32 else 3e-2
    torch.testing.assert_close(y.float(), ycpu.float(), rtol=tol, atol=tol)


def test_layer_norm_combine_variants_change_bits():
    # N = 1000: threads hold 8 or 4 elements, so combine weights are inexact
    x = _rows(512, 1000, F32, seed=21, shift=3.0)
    outs = {mf: layer_norm_order_model(x, None, None, 1e-6, mean_fma=mf, return_stats=True)[1]
            for mf in ("first", "second", "none")}
    assert not torch.equal(outs["first"], outs["second"])
    assert not torch.equal(outs["first"], outs["none"])
    _, _, r1 = layer_norm_order_model(x, None, None, 1e-6, return_stats=True, sigma_fma=True)
    _, _, r2 = layer_norm_order_model(x, None, None, 1e-6, return_stats=True, sigma_fma=False)
    assert not torch.equal(r1, r2)


def test_layer_norm_fallback_zero_sign():
    # Rows whose modelled mean is exactly 0 and whose first element is -0.
    # Fallback output is fma(t, 1, 0): the -0 becomes +0; the vectorised path
    # without affine stores t = rstd * (-0 - 0) = -0.
    x = torch.tensor([[-0.0, 1.0, 0.0, -1.0, 0.0]], dtype=F32)
    y, mean, _ = layer_norm_order_model(x, None, None, 1e-5, return_stats=True)
    assert mean.item() == 0.0
    assert torch.signbit(y).tolist() == [[False, False, False, True, False]]
    x4 = torch.tensor([[-0.0, 0.0, 3.0, -3.0]], dtype=F32)
    yv, mean4, _ = layer_norm_order_model(x4, None, None, 1e-5, return_stats=True)
    assert mean4.item() == 0.0
    assert torch.signbit(yv).tolist() == [[True, False, False, True]]


# ---------------------------------------------------------------- path selection

def test_vectorized_path_conditions():
    buf = torch.zeros(4 * 65, dtype=torch.bfloat16)
    x = buf[: 4 * 64].view(4, 64)
    assert vectorized_path_ok(x)
    mis = buf[1: 1 + 4 * 64].view(4, 64)  # 2-byte offset: not 8-byte aligned
    assert not vectorized_path_ok(mis)
    assert not vectorized_path_ok(torch.zeros(4, 66, dtype=torch.bfloat16))
    assert not vectorized_path_ok(torch.zeros(4, 64, dtype=torch.float64))
    w = torch.zeros(65, dtype=torch.bfloat16)[1:]
    assert not vectorized_path_ok(x, w)


# ---------------------------------------------------------------- GELU

def test_gelu_constant():
    assert GELU_K_ALPHA == _f32(math.sqrt(0.5))
    assert GELU_K_ALPHA != math.sqrt(0.5)


def test_gelu_candidates_close_fp32():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200000, generator=g) * 4
    ref64 = x.double() * 0.5 * (1 + torch.erf(x.double() / math.sqrt(2)))
    cands = gelu_candidates()
    assert {"src", "cdf_first", "fma_h_e_h", "erf_f64", "all_f64"} <= set(cands)
    for name, fn in cands.items():
        y = fn(x)
        assert y.dtype == F32
        err = (y.double() - ref64).abs()
        assert (err <= 4e-7 * ref64.abs() + 1e-37 + 2e-7 * x.double().abs()).all(), name
    # the models are not all the same function: some candidates differ in bits
    assert not torch.equal(cands["src"](x), cands["u_f64"](x)) or \
        not torch.equal(cands["src"](x), cands["all_f64"](x))


def test_gelu_order_model_bf16_exhaustive_vs_cpu():
    # all bf16 values with 2**-100 < |x| < 2**100 (torch's CPU GELU flushes
    # subnormals and handles huge values differently, so those are left out)
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    ax = x.float().abs()
    x = x[(ax > 2.0 ** -100) & (ax < 2.0 ** 100)]
    assert x.numel() > 50000
    y = gelu_order_model(x)
    ref = F.gelu(x)
    assert y.dtype == torch.bfloat16
    assert (y == ref).float().mean().item() > 0.999
    # near x < -4, 1 + erf(x/sqrt2) cancels, so the error is relative to |x|
    diff = (y.float() - ref.float()).abs()
    assert (diff <= 2.0 ** -7 * ref.float().abs() + 2.0 ** -22 * x.float().abs()).all()


def test_gelu_src_structure():
    # with an erf that returns 0 the source order gives exactly fl(x*0.5)*1
    x = torch.tensor([3.0, -5.0, 1e-30], dtype=F32)
    y = gelu_candidates(lambda u: torch.zeros_like(u))["src"](x)
    assert torch.equal(y, x * 0.5)


# ---------------------------------------------------------------- determinism

def test_models_deterministic():
    x = _rows(40, 1536, torch.bfloat16, seed=31)
    w = _rows(1, 1536, torch.bfloat16, seed=32)[0]
    b = _rows(1, 1536, torch.bfloat16, seed=33)[0]
    assert torch.equal(rms_norm_order_model(x, w, 1e-6), rms_norm_order_model(x.clone(), w.clone(), 1e-6))
    assert torch.equal(layer_norm_order_model(x, w, b, 1e-6), layer_norm_order_model(x.clone(), w, b, 1e-6))
    # a row's result does not depend on the other rows (one block per row)
    y_all = layer_norm_order_model(x, None, None, 1e-6)
    y_one = layer_norm_order_model(x[5:6], None, None, 1e-6)
    assert torch.equal(y_all[5:6], y_one)
    g = torch.randn(1000)
    assert torch.equal(gelu_order_model(g), gelu_order_model(g.clone()))
