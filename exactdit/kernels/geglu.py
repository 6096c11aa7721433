"""GeGLU ``up * F.gelu(gate)`` (exact erf GELU), one memory-bound pass.

Each program handles a [BLOCK_R, BLOCK_D] tile of [outer, inner, F] views (unit stride along F),
built by :mod:`exactdit.kernels.rows`; gate and up may be the two halves of one fused
``[..., 2F]`` projection (chunk views read through their strides, no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactdit.kernels.rows import ELEMENTWISE_TILE, elementwise_blocks, row_offsets, row_strides, rows_of
from exactdit.numerics import INTERPRET, LAUNCH_OPTIONS, add_rn, cuda_libdevice, mul_rn, round_to, rounded

#: fp32(1 / sqrt(2)) = 0.70710677f, ATen's ``kAlpha``.
K_ALPHA = tl.constexpr(0.7071067690849304)

#: Which fp32 evaluation order of ATen's GELU the kernel uses (see ``gelu_values``); the GPU
#: probe decides. 0 = source order, 1 = cdf first, 2 = distributed FMA.
GELU_FORM = 0


@triton.jit
def gelu_values(x, FORM: tl.constexpr):
    """ATen's exact GELU ``x * 0.5 * (1 + erf(x * kAlpha))`` on fp32 values; returns fp32.

    erf is ``tl.math.erf`` from the CUDA toolkit's libdevice (``numerics.cuda_libdevice``: the
    one ATen's erff came from); every other op rounds once, never contracted.
    FORM 0 (source order, ``aten_norms.gelu_candidates()["src"]``):
    ``fl(fl(x * 0.5) * fl(1 + erf(fl(x * kAlpha))))``; FORM 1 (``cdf_first``):
    ``fl(x * fl(0.5 * fl(1 + erf(u))))``; FORM 2 (``fma_h_e_h``): ``fma(h, erf(u), h)`` with
    ``h = fl(x * 0.5)``.
    """
    half = tl.full(x.shape, 0.5, tl.float32)
    one = tl.full(x.shape, 1.0, tl.float32)
    u = mul_rn(x, tl.full(x.shape, K_ALPHA, tl.float32))
    e = tl.math.erf(u)
    if FORM == 0:
        return mul_rn(mul_rn(x, half), add_rn(one, e))
    elif FORM == 1:
        return mul_rn(x, mul_rn(half, add_rn(one, e)))
    else:
        h = mul_rn(x, half)
        return tl.fma(h, e, h)


# Row counts only feed index arithmetic: not specialising them saves compilations.
@triton.jit(do_not_specialize=["n_rows", "inner"])
def geglu_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_rows, inner, width,
    g_so, g_si, u_so, u_si, o_so, o_si,
    FORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out = up * F.gelu(gate)`` as eager runs it: GELU in fp32 (``gelu_values``) rounded
    once to the dtype (GELU's own kernel), then the product rounded to the dtype (the multiply
    kernel; for bf16/fp16 the fp32 product of two dtype values is exact before that rounding).
    gate, up and out share one dtype: bf16, fp16 or fp32.
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    g = tl.load(gate_ptr + row_offsets(rows, inner, g_so, g_si)[:, None] + cols[None, :], mask=mask).to(tl.float32)
    u = tl.load(up_ptr + row_offsets(rows, inner, u_so, u_si)[:, None] + cols[None, :], mask=mask).to(tl.float32)
    y = mul_rn(u, rounded(gelu_values(g, FORM), DTYPE))
    tl.store(out_ptr + row_offsets(rows, inner, o_so, o_si)[:, None] + cols[None, :], round_to(y, DTYPE), mask=mask)


def geglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``up * gelu(gate)`` into ``out`` (all of one shape, 1 to 3 dims)."""
    shape = tuple(out.shape)
    n_rows, inner, width = rows_of(shape)
    block_r, block_d, grid = elementwise_blocks(n_rows, width)
    strides = [s for t in (gate, up, out) for s in row_strides(t, shape)]
    geglu_kernel[grid](
        gate, up, out, n_rows, inner, width, *strides,
        FORM=GELU_FORM, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=ELEMENTWISE_TILE["num_warps"], **LAUNCH_OPTIONS,
        **({} if INTERPRET else {"extern_libs": {"libdevice": cuda_libdevice()}}),
    )
    return out
