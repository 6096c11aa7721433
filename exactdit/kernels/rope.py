"""Per-head RMSNorm (``F.rms_norm``) and ERNIE-Image's rotary embedding, fused.

One program handles BLOCK_R rows (one row = one head of one token, ``head_dim`` elements) of a
[d0, d1, d2, N] strided view with unit stride along N. q and k are done in one launch: grid
axis 1 picks the tensor.

The norm reproduces ATen's ``vectorized_layer_norm_kernel`` with the rms flag (see
:mod:`exactdit.aten_norms`, ``rms_norm_order_model``): a 128-thread block per row, thread t
owns the 4-element vectors t, t + 128, ...; ``acc = fma(v, v, acc)`` per element in read order;
a warp shuffle-down tree 16, 8, 4, 2, 1; warps combined ``(w0 + w2) + (w1 + w3)``;
``var = s / N`` (div.rn); ``rstd = rsqrt.approx(var + eps)``; ``y = w * (rstd * x)`` rounded
once to the dtype. Threads that own no vector contribute +0, which changes no sum, so a row of
``NV = N / 4`` vectors is reduced over ``LANES = next_pow2(NV)`` (at most 128) lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from exactdit.kernels.rows import next_power_of_2
from exactdit.numerics import LAUNCH_OPTIONS, add_rn, as_fp32, div_rn, mul_rn, round_to, rounded, rsqrt_approx

#: threads per row of ATen's vectorized norm kernel, and elements per vector.
THREADS = 128
VEC = 4
WARP = 32
#: ``acc = fma(v, v, acc)`` (nvcc contracts the source's ``acc + v * v``); False: mul then add.
#: Only fp32 inputs (or squares below the fp32 normal range) can tell the two apart.
SQUARE_FMA = True
#: elements per program (BLOCK_R rows of BLOCK_N): a memory-bound tile size.
ROW_BLOCK_ELEMENTS = 4096


@triton.jit
def _halving_tree(a, ROWS: tl.constexpr, L: tl.constexpr):
    """Shuffle-down tree over the last axis of ``a`` [ROWS, L] (L a power of two): lane l adds
    lane l + L/2, then l + L/4, ... Returns [ROWS], lane 0's value."""
    for level in tl.static_range(8):
        if (L >> level) > 1:
            a = tl.sum(tl.reshape(a, [ROWS, 2, L >> (level + 1)]), axis=1)
    return tl.reshape(a, [ROWS])


@triton.jit
def _block_sum(acc, ROWS: tl.constexpr, LANES: tl.constexpr):
    """ATen's block reduction of per-thread sums ``acc`` [ROWS, LANES]: a shuffle-down tree per
    32-lane warp, then the warp sums folded in halves, ``(w0 + w2) + (w1 + w3)``."""
    if LANES > 32:
        per_warp = _halving_tree(tl.reshape(acc, [ROWS * (LANES // 32), 32]), ROWS * (LANES // 32), 32)
        return _halving_tree(tl.reshape(per_warp, [ROWS, LANES // 32]), ROWS, LANES // 32)
    else:
        return _halving_tree(acc, ROWS, LANES)


@triton.jit
def _row_starts(rows, d1, d2, s0, s1, s2):
    """Element offset of each flat row index of a [d0, d1, d2, N] view."""
    rows = rows.to(tl.int64)
    i2 = rows % d2
    rest = rows // d2
    return (rest // d1) * s0 + (rest % d1) * s1 + i2 * s2


@triton.jit
def _rms_rstd(x_ptr, starts, row_mask, eps,
              N: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr, BLOCK_R: tl.constexpr,
              SQUARE_FMA: tl.constexpr):
    """``rsqrt.approx(s / N + eps)`` per row, with the sum of squares s in ATen's order."""
    lanes = tl.arange(0, LANES)
    acc = tl.zeros([BLOCK_R, LANES], dtype=tl.float32)
    for j in tl.static_range(ITERS):
        vec = j * 128 + lanes
        mask = row_mask[:, None] & (vec < N // 4)[None, :]
        for e in tl.static_range(4):
            v = tl.load(x_ptr + starts[:, None] + (vec * 4 + e)[None, :], mask=mask, other=0.0).to(tl.float32)
            if SQUARE_FMA:
                acc = tl.fma(v, v, acc)
            else:
                acc = add_rn(acc, mul_rn(v, v))
    s = _block_sum(acc, BLOCK_R, LANES)
    var = div_rn(s, tl.full((), N, tl.float32))
    return rsqrt_approx(add_rn(var, eps))


@triton.jit
def _normed(x, w, rstd, DTYPE: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """``F.rms_norm`` output ``round(w * (rstd * x))`` as fp32, or x itself without NORM."""
    if NORM:
        y = mul_rn(rstd[:, None], x)
        if HAS_WEIGHT:
            y = mul_rn(w[None, :], y)
        return rounded(y, DTYPE)
    else:
        return x


@triton.jit
def _norm_rope_rows(
    x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, pid,
    n_rows, d1, d2, x_s0, x_s1, x_s2, t_s0, t_s1, t_s2, o_s0, o_s1, o_s2, w_s, eps,
    N: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SQUARE_FMA: tl.constexpr,
):
    """Norm and/or rotate BLOCK_R rows of one tensor (see the public kernel)."""
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    starts = _row_starts(rows, d1, d2, x_s0, x_s1, x_s2)
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < N)[None, :]

    rstd = tl.zeros([BLOCK_R], dtype=tl.float32)
    w = tl.zeros([BLOCK_N], dtype=tl.float32)
    if NORM:
        rstd = _rms_rstd(x_ptr, starts, row_mask, as_fp32(eps), N, LANES, ITERS, BLOCK_R, SQUARE_FMA)
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols * w_s, mask=cols < N, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, w, rstd, DTYPE, NORM, HAS_WEIGHT)

    if ROPE:
        HALF: tl.constexpr = ROT // 2
        first = cols < HALF
        in_rot = cols < ROT
        # rotate_half partner: column c + HALF for the first half, c - HALF for the second
        partner = tl.where(first, cols + HALF, cols - HALF)
        partner = tl.where(in_rot, partner, cols)
        wp = w
        if NORM and HAS_WEIGHT:
            wp = tl.load(w_ptr + partner * w_s, mask=cols < N, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + starts[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        yp = _normed(xp, wp, rstd, DTYPE, NORM, HAS_WEIGHT)
        rotated = tl.where(first[None, :], -yp, yp)
        t_starts = _row_starts(rows, d1, d2, t_s0, t_s1, t_s2)
        t_mask = row_mask[:, None] & in_rot[None, :]
        cos = tl.load(cos_ptr + t_starts[:, None] + cols[None, :], mask=t_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t_starts[:, None] + cols[None, :], mask=t_mask, other=0.0).to(tl.float32)
        # x * cos + rotated * sin, each op rounded to the dtype as eager does
        r = add_rn(rounded(mul_rn(y, cos), DTYPE), rounded(mul_rn(rotated, sin), DTYPE))
        y = tl.where(in_rot[None, :], r, y)

    o_starts = _row_starts(rows, d1, d2, o_s0, o_s1, o_s2)
    tl.store(out_ptr + o_starts[:, None] + cols[None, :], round_to(y, DTYPE), mask=mask)


@triton.jit
def norm_rope_kernel(
    a_ptr, a_w_ptr, a_out_ptr, a_rows, a_d1, a_d2, a_s0, a_s1, a_s2, a_o0, a_o1, a_o2, a_ws,
    b_ptr, b_w_ptr, b_out_ptr, b_rows, b_d1, b_d2, b_s0, b_s1, b_s2, b_o0, b_o1, b_o2, b_ws,
    cos_ptr, sin_ptr, t_s0, t_s1, t_s2, eps,
    N: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SQUARE_FMA: tl.constexpr,
):
    """ERNIE-Image's ``rope(F.rms_norm(x, (N,), w, eps), cos, sin)`` for two tensors a (grid
    axis 1 = 0) and b (= 1), e.g. q and k; either half can be switched off (NORM, ROPE).

    Inputs: [d0, d1, d2, N] strided views (unit stride along N) of one dtype (bf16, fp16,
    fp32); weights [N] strided, same dtype; cos/sin tables of that dtype indexed per row
    through (t_s0, t_s1, t_s2) (0 for broadcast dims), ROT = their width (even, <= N).
    Norm: ATen's vectorized RMSNorm order (module docstring), output rounded once.
    RoPE (non-interleaved rotate-half on the first ROT channels, the rest passed through):
    ``round(round(y * cos) + round(rotate_half(y) * sin))``, as eager rounds each op.
    """
    pid = tl.program_id(0)
    if tl.program_id(1) == 0:
        if pid * BLOCK_R < a_rows:
            _norm_rope_rows(a_ptr, a_w_ptr, cos_ptr, sin_ptr, a_out_ptr, pid,
                            a_rows, a_d1, a_d2, a_s0, a_s1, a_s2, t_s0, t_s1, t_s2, a_o0, a_o1, a_o2, a_ws, eps,
                            N, ROT, NORM, ROPE, HAS_WEIGHT, LANES, ITERS, BLOCK_R, BLOCK_N, SQUARE_FMA)
    else:
        if pid * BLOCK_R < b_rows:
            _norm_rope_rows(b_ptr, b_w_ptr, cos_ptr, sin_ptr, b_out_ptr, pid,
                            b_rows, b_d1, b_d2, b_s0, b_s1, b_s2, t_s0, t_s1, t_s2, b_o0, b_o1, b_o2, b_ws, eps,
                            N, ROT, NORM, ROPE, HAS_WEIGHT, LANES, ITERS, BLOCK_R, BLOCK_N, SQUARE_FMA)


def strides_4d(t: torch.Tensor, shape: tuple) -> list[int]:
    """Row strides (d0, d1, d2) of ``t`` broadcast to ``shape`` (1 to 4 dims) and viewed as
    [d0, d1, d2, N]; 0 along broadcast or size-1 dims. Integer arithmetic only (no views)."""
    pad = len(shape) - t.dim()
    sizes = (1,) * pad + tuple(t.shape)
    strides = (0,) * pad + t.stride()
    lead = [0 if sizes[i] == 1 else strides[i] for i in range(len(shape) - 1)]
    return [0] * (3 - len(lead)) + lead


def dims_4d(shape: tuple) -> tuple[int, int, int]:
    """(rows, d1, d2) of the [d0, d1, d2, N] view of ``shape``."""
    lead = (1, 1, 1) + tuple(shape[:-1])
    d0, d1, d2 = lead[-3:]
    return d0 * d1 * d2, d1, d2


def _operand(x, weight, out):
    shape = tuple(x.shape)
    n_rows, d1, d2 = dims_4d(shape)
    w = weight if weight is not None else x
    w_s = weight.stride(0) if weight is not None else 0
    return [x, w, out, n_rows, d1, d2, *strides_4d(x, shape), *strides_4d(out, shape), w_s]


def norm_rope(pairs, eps, tables, *, norm: bool, rope: bool):
    """Launch the kernel over one or two ``(x, weight, out)`` triples (x: [..., N], 1-4 dims;
    weight [N] or None; out: x's shape) sharing eps and the ``(cos, sin)`` tables (broadcast
    to x's shape[:-1] + (rot_dim,), unit stride along the last dim; or None without rope).
    Returns the outs."""
    x0 = pairs[0][0]
    n = x0.shape[-1]
    ops = [_operand(*p) for p in pairs]
    if len(ops) == 1:
        ops.append(list(ops[0]))
        ops[1][3] = 0  # no rows: a second tensor that is never touched
    if rope:
        cos, sin = tables
        rot = cos.shape[-1]
        tshape = tuple(x0.shape[:-1]) + (rot,)
        t_strides = strides_4d(cos, tshape)
    else:
        cos = sin = x0
        rot = 0
        t_strides = [0, 0, 0]
    has_weight = pairs[0][1] is not None
    n_vec = n // VEC
    lanes = min(THREADS, next_power_of_2(n_vec))
    iters = -(-n_vec // THREADS)
    block_n = next_power_of_2(n)
    max_rows = max(o[3] for o in ops)
    block_r = max(1, min(ROW_BLOCK_ELEMENTS // block_n, next_power_of_2(max_rows)))
    grid = (-(-max_rows // block_r), len(pairs))
    norm_rope_kernel[grid](
        *ops[0], *ops[1], cos, sin, *t_strides, float(eps),
        N=n, ROT=rot, NORM=norm, ROPE=rope, HAS_WEIGHT=has_weight, LANES=lanes, ITERS=iters,
        BLOCK_R=block_r, BLOCK_N=block_n, SQUARE_FMA=SQUARE_FMA, num_warps=4, **LAUNCH_OPTIONS,
    )
    return tuple(p[2] for p in pairs)
