"""Elementwise AdaLN kernels: gated residual add and modulation.

Both are memory bound: one pass reads the activation operands once (broadcast operands mostly
hit L2) and writes the result once. Each program handles a [BLOCK_R, BLOCK_D] tile of the
[outer, inner, D] views built by :mod:`exactdit.kernels.rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactdit.kernels.rows import ELEMENTWISE_TILE, elementwise_blocks, row_offsets, row_strides, rows_of
from exactdit.numerics import LAUNCH_OPTIONS, add_rn, dtype_add, dtype_mul, mul_rn, round_to


@triton.jit
def _tile(rows, cols, n_rows, width, inner, stride_outer, stride_inner):
    """Offsets and mask of a tile of an [outer, inner, D] view with unit stride along D."""
    offsets = row_offsets(rows, inner, stride_outer, stride_inner)[:, None] + cols[None, :]
    mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
    return offsets, mask


@triton.jit
def residual_gate_add_kernel(
    residual_ptr, update_ptr, gate_ptr, out_ptr,
    n_rows, inner, width,
    r_so, r_si, u_so, u_si, g_so, g_si, o_so, o_si,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out = residual + (gate.float() * update.float()).to(dtype)``.

    Rounds: the product once to the dtype, the sum once to the dtype, as two eager ops of the
    dtype (``dtype_mul``, ``dtype_add``; for bf16/fp16 the fp32 product of two half values is
    exact, so this also equals ``residual + gate * update``; for fp32 both are single fp32 ops,
    and the multiply is never fused into the add).
    Accepts bf16, fp16, fp32; all operands and the output share that dtype.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs, mask = _tile(rows, cols, n_rows, width, inner, r_so, r_si)
    r = tl.load(residual_ptr + offs, mask=mask)
    offs, _ = _tile(rows, cols, n_rows, width, inner, u_so, u_si)
    u = tl.load(update_ptr + offs, mask=mask)
    offs, _ = _tile(rows, cols, n_rows, width, inner, g_so, g_si)
    g = tl.load(gate_ptr + offs, mask=mask)
    out = dtype_add(r, dtype_mul(g, u))
    offs, _ = _tile(rows, cols, n_rows, width, inner, o_so, o_si)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def modulate_values(x, scale, shift, HAS_SHIFT: tl.constexpr, UPCAST: tl.constexpr):
    """The modulation chain on tensors of one dtype (bf16, fp16, fp32); returns that dtype.

    UPCAST (ERNIE-Image): ``x.float() * (1 + scale.float()) + shift.float()``, every op an fp32
    op, no FMA, then one rounding to the dtype.
    Native (Flux, SD3, Qwen-Image): ``x * (1 + scale) + shift``, every op an eager op of the
    dtype (``dtype_add`` / ``dtype_mul``: one rounding each, on packed pairs on the GPU).
    Shared with the norm + modulate kernels.
    """
    if UPCAST:
        y = mul_rn(x.to(tl.float32), 1.0 + scale.to(tl.float32))
        if HAS_SHIFT:
            y = add_rn(y, shift.to(tl.float32))
        return round_to(y, x.dtype)
    else:
        y = dtype_mul(x, dtype_add(tl.full(scale.shape, 1.0, scale.dtype), scale))
        if HAS_SHIFT:
            y = dtype_add(y, shift)
        return y


@triton.jit
def modulate_kernel(
    x_ptr, scale_ptr, shift_ptr, out_ptr,
    n_rows, inner, width,
    x_so, x_si, sc_so, sc_si, sh_so, sh_si, o_so, o_si,
    HAS_SHIFT: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``modulate_values`` over a tile, one rounding to the dtype at the end.

    Accepts bf16, fp16, fp32 with x, scale, shift and out of one dtype.
    """
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs, mask = _tile(rows, cols, n_rows, width, inner, x_so, x_si)
    x = tl.load(x_ptr + offs, mask=mask)
    offs, _ = _tile(rows, cols, n_rows, width, inner, sc_so, sc_si)
    scale = tl.load(scale_ptr + offs, mask=mask)
    shift = scale
    if HAS_SHIFT:
        offs, _ = _tile(rows, cols, n_rows, width, inner, sh_so, sh_si)
        shift = tl.load(shift_ptr + offs, mask=mask)
    y = modulate_values(x, scale, shift, HAS_SHIFT, UPCAST)
    offs, _ = _tile(rows, cols, n_rows, width, inner, o_so, o_si)
    tl.store(out_ptr + offs, y, mask=mask)


def _launch(kernel, out: torch.Tensor, operands: list[torch.Tensor], **constexprs) -> torch.Tensor:
    """Launch an elementwise kernel over ``out``'s shape; operands broadcast to it."""
    shape = tuple(out.shape)
    tensors = operands + [out]
    n_rows, inner, width = rows_of(shape)
    block_r, block_d, grid = elementwise_blocks(n_rows, width)
    strides = [s for t in tensors for s in row_strides(t, shape)]
    kernel[grid](
        *tensors, n_rows, inner, width, *strides,
        **constexprs, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=ELEMENTWISE_TILE["num_warps"], **LAUNCH_OPTIONS,
    )
    return out


def residual_gate_add(residual, update, gate, out):
    """Write ``residual + gate * update`` (see the kernel) into ``out``."""
    return _launch(residual_gate_add_kernel, out, [residual, update, gate])


def modulate(x, scale, shift, upcast, out):
    """Write the modulation of ``x`` (see ``modulate_values``) into ``out``."""
    operands = [x, scale, scale if shift is None else shift]
    return _launch(modulate_kernel, out, operands, HAS_SHIFT=shift is not None, UPCAST=upcast)
