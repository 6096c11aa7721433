"""GeGLU ``up * F.gelu(gate)`` (exact erf GELU), one memory-bound pass.

Each program handles TILES consecutive [BLOCK_R, BLOCK_D] tiles of [outer, inner, F] views (unit
stride along F), built by :mod:`exactdit.kernels.rows`; gate and up may be the two halves of one
fused ``[..., 2F]`` projection (chunk views read through their strides, no copy).

Two ways to get eager's GELU bits:

* erf path (any dtype): ATen's formula in fp32 with the CUDA toolkit's ``erff``, every op rounded
  as ATen's kernel rounds. About 30 of its 45 instructions per element are erf, which makes the
  kernel issue-bound rather than memory-bound.
* table path (bf16): a bf16 gate has only 2^16 values, so GELU's bf16 output is a lookup. The
  table holds eager's own ``F.gelu`` of every bf16 value in a window of magnitudes
  ``[2^-12, 2^4)`` (``gelu_table``). Outside it GELU saturates: for |x| >= 16 ``1 + erf`` is
  exactly 2 or 0 in fp32, and for |x| < 2^-12 GELU lies within half a bf16 ulp of x / 2, so
  eager's bits are ``bf16(fl(x * 0.5) * f)`` with f = 2, 0 or 1. The op layer checks the
  kernel against eager on all 2^16 gates before it uses a table, so these rules are verified,
  not assumed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactdit.kernels.rows import ELEMENTWISE_TILE, elementwise_blocks, row_offsets, row_strides, rows_of
from exactdit.numerics import INTERPRET, LAUNCH_OPTIONS, add_rn, cuda_libdevice, dtype_mul, mul_rn, round_to, widen_bf16

#: fp32(1 / sqrt(2)) = 0.70710677f, ATen's ``kAlpha``.
K_ALPHA = tl.constexpr(0.7071067690849304)

#: Which fp32 evaluation order of ATen's GELU the kernel uses (see ``gelu_values``); the GPU
#: probe decides. 0 = source order, 1 = cdf first, 2 = distributed FMA.
GELU_FORM = 0

#: The table path's window: bf16 magnitudes (bit patterns without the sign) in
#: [TABLE_LO, TABLE_LO + TABLE_WINDOW), i.e. |x| in [2^-12, 2^4): 16 binades of 128 values.
TABLE_LO = (127 - 12) << 7
TABLE_WINDOW = 2048
#: Row tiles per program on the table path: each program loads the 8 KB table once.
TABLE_TILES = 4


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


@triton.jit
def gelu_from_table(gate, table, LO: tl.constexpr, WINDOW: tl.constexpr):
    """Eager's bf16 ``F.gelu`` of bf16 ``gate``, as int16 bits, from ``table`` (int16 bits
    [2 * WINDOW]: eager's GELU of the magnitudes LO + i, positive then negative) inside the
    window and the saturated forms ``bf16(fl(x * 0.5) * f)`` outside it (module docstring)."""
    bits = gate.to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    magnitude = bits & 0x7FFF
    negative = bits < 0
    i = magnitude - LO
    inside = i.to(tl.uint32, bitcast=True) < WINDOW
    # out-of-window lanes read some entry and discard it: cheaper than clamping the index
    index = (i & (WINDOW - 1)) + tl.where(negative, WINDOW, 0)
    looked_up = tl.reshape(tl.gather(table, tl.reshape(index, [index.numel]), 0), index.shape)
    x = widen_bf16(gate)
    factor = tl.where(magnitude < LO, 1.0, tl.where(negative, 0.0, 2.0))
    saturated = round_to(mul_rn(mul_rn(x, tl.full(x.shape, 0.5, tl.float32)), factor), tl.bfloat16)
    return tl.where(inside, looked_up, saturated.to(tl.int16, bitcast=True))


# Row counts only feed index arithmetic: not specialising them saves compilations.
@triton.jit(do_not_specialize=["n_rows", "inner"])
def geglu_kernel(
    gate_ptr, up_ptr, out_ptr, table_ptr,
    n_rows, inner, width,
    g_so, g_si, u_so, u_si, o_so, o_si,
    FORM: tl.constexpr, TABLE: tl.constexpr, LO: tl.constexpr, WINDOW: tl.constexpr,
    TILES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out = up * F.gelu(gate)`` as eager runs it: GELU rounded once to the dtype (GELU's own
    kernel), then the product as the dtype's eager multiply (``dtype_mul``).
    gate, up and out share one dtype: bf16, fp16 or fp32. The GELU comes from ``gelu_values``
    (erf path) or, with TABLE (bf16 only), from ``gelu_from_table`` and the table at
    ``table_ptr`` ([2 * WINDOW] bf16), which never widens a value through the interpreter's
    conversion (wrong for subnormal bf16), so CPU tests see the GPU's bits.
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if TABLE:
        table = tl.load(table_ptr.to(tl.pointer_type(tl.int16)) + tl.arange(0, 2 * WINDOW))
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    for tile in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + tile) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < n_rows)[:, None] & (cols < width)[None, :]
        g = tl.load(gate_ptr + row_offsets(rows, inner, g_so, g_si)[:, None] + cols[None, :], mask=mask)
        u = tl.load(up_ptr + row_offsets(rows, inner, u_so, u_si)[:, None] + cols[None, :], mask=mask)
        if TABLE:
            gelu = gelu_from_table(g, table, LO, WINDOW).to(tl.bfloat16, bitcast=True)
        else:
            gelu = round_to(gelu_values(g.to(tl.float32), FORM), DTYPE)
        out = dtype_mul(u, gelu)
        tl.store(out_ptr + row_offsets(rows, inner, o_so, o_si)[:, None] + cols[None, :], out, mask=mask)


def gelu_table(gelu_of_every_bf16: torch.Tensor) -> torch.Tensor:
    """The table path's [2 * TABLE_WINDOW] table from eager's GELU of all 2^16 bf16 values
    (indexed by bit pattern 0x0000..0xFFFF): the window's positive magnitudes, then its negative
    ones."""
    window = torch.arange(TABLE_LO, TABLE_LO + TABLE_WINDOW, device=gelu_of_every_bf16.device)
    return torch.cat([gelu_of_every_bf16[window], gelu_of_every_bf16[window + 0x8000]]).contiguous()


def geglu(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``up * gelu(gate)`` into ``out`` (all of one shape, 1 to 3 dims); with ``table``
    (from ``gelu_table``; bf16 only) the GELU is looked up, otherwise computed with erf."""
    shape = tuple(out.shape)
    n_rows, inner, width = rows_of(shape)
    block_r, block_d, (rows_grid, cols_grid) = elementwise_blocks(n_rows, width)
    tiles = TABLE_TILES if table is not None else 1
    strides = [s for t in (gate, up, out) for s in row_strides(t, shape)]
    geglu_kernel[(-(-rows_grid // tiles), cols_grid)](
        gate, up, out, gate if table is None else table, n_rows, inner, width, *strides,
        FORM=GELU_FORM, TABLE=table is not None, LO=TABLE_LO, WINDOW=TABLE_WINDOW, TILES=tiles,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=ELEMENTWISE_TILE["num_warps"], **LAUNCH_OPTIONS,
        **({} if INTERPRET or table is not None else {"extern_libs": {"libdevice": cuda_libdevice()}}),
    )
    return out
