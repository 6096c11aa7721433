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

from exactdit.kernels.rows import next_power_of_2, vector_elements
from exactdit.numerics import (
    LAUNCH_OPTIONS, add_rn, as_fp32, div_rn, dtype_add, dtype_mul, dtype_sub, mul_rn, round_to, rounded, rsqrt_approx,
)

#: threads per row of ATen's vectorized norm kernel, and elements per vector.
THREADS = 128
VEC = 4
#: ``acc = fma(v, v, acc)`` (nvcc contracts the source's ``acc + v * v``); False: mul then add.
#: Only fp32 inputs (or squares below the fp32 normal range) can tell the two apart.
SQUARE_FMA = True
#: Use ``_norm_rope_halves`` where it applies (False: always the general path; tests use both).
HALVES = True
#: elements per program (BLOCK_R rows of BLOCK_N) and warps: a memory-bound tile
#: (``bench_rope_geglu.py --tune`` on an H200).
ROW_BLOCK_ELEMENTS = 2048  # 53.7 us at 1 x 4224 x 32 x 128 against 57.7 us for 4096 (same run)
NUM_WARPS = 4


@triton.jit
def _halving_tree(a, ROWS: tl.constexpr, L: tl.constexpr):
    """Shuffle-down tree over the last axis of ``a`` [ROWS, L] (L a power of two): lane l adds
    lane l + L/2, then l + L/4, ... Returns [ROWS], lane 0's value."""
    for level in tl.static_range(8):
        if (L >> level) > 1:
            a = tl.sum(tl.reshape(a, [ROWS, 2, L >> (level + 1)]), axis=1)
    return tl.reshape(a, [ROWS])


@triton.jit
def block_sum(acc, ROWS: tl.constexpr, LANES: tl.constexpr):
    """ATen's block reduction of per-thread sums ``acc`` [ROWS, LANES]: a shuffle-down tree per
    32-lane warp, then the warp sums folded in halves, ``(w0 + w2) + (w1 + w3)``."""
    if LANES > 32:
        per_warp = _halving_tree(tl.reshape(acc, [ROWS * (LANES // 32), 32]), ROWS * (LANES // 32), 32)
        return _halving_tree(tl.reshape(per_warp, [ROWS, LANES // 32]), ROWS, LANES // 32)
    else:
        return _halving_tree(acc, ROWS, LANES)


@triton.jit
def _row_starts(rows, d1, d2, s0, s1, s2):
    """Element offset of each flat row index of a [d0, d1, d2, N] view. The index is split in
    32 bits (row counts stay below 2^31: a row has at least 8 elements and a tensor is far
    below 2^34 elements); only the offsets need 64."""
    i2 = rows % d2
    rest = rows // d2
    return (rest // d1).to(tl.int64) * s0 + (rest % d1).to(tl.int64) * s1 + i2.to(tl.int64) * s2


@triton.jit
def square_accumulate(acc, v, SQUARE_FMA: tl.constexpr):
    if SQUARE_FMA:
        return tl.fma(v, v, acc)
    else:
        return add_rn(acc, mul_rn(v, v))


@triton.jit
def accumulate_vectors(acc, x, BLOCK_R: tl.constexpr, LANES: tl.constexpr, SQUARE_FMA: tl.constexpr):
    """``acc`` [BLOCK_R, LANES] plus the squares of one vector per lane, taken from the tile
    ``x`` [BLOCK_R, 4 * LANES] of consecutive columns (zeros past the row end): lane t's elements
    4t, 4t+1, 4t+2, 4t+3 are split out of its registers and accumulated in that order."""
    v0, v1, v2, v3 = vector_elements(x, BLOCK_R, LANES)
    acc = square_accumulate(acc, v0, SQUARE_FMA)
    acc = square_accumulate(acc, v1, SQUARE_FMA)
    acc = square_accumulate(acc, v2, SQUARE_FMA)
    return square_accumulate(acc, v3, SQUARE_FMA)


@triton.jit
def thread_sums_from_tile(x, BLOCK_R: tl.constexpr, LANES: tl.constexpr, SQUARE_FMA: tl.constexpr):
    """Per-thread sums of squares when each thread owns at most one vector (N <= 512), from the
    row tile ``x`` [BLOCK_R, 4 * LANES] already in registers."""
    return accumulate_vectors(tl.zeros([BLOCK_R, LANES], dtype=tl.float32), x, BLOCK_R, LANES, SQUARE_FMA)


@triton.jit
def _thread_sums_from_memory(x_ptr, starts, row_mask, N: tl.constexpr, ITERS: tl.constexpr,
                             BLOCK_R: tl.constexpr, SQUARE_FMA: tl.constexpr):
    """Per-thread sums of squares for rows of several vectors per thread (N > 512): thread t
    reads vectors t, t + 128, ... (strided loads; the row is in L1 anyway)."""
    lanes = tl.arange(0, 128)
    acc = tl.zeros([BLOCK_R, 128], dtype=tl.float32)
    for j in tl.static_range(ITERS):
        vec = j * 128 + lanes
        mask = row_mask[:, None] & (vec < N // 4)[None, :]
        for e in tl.static_range(4):
            v = tl.load(x_ptr + starts[:, None] + (vec * 4 + e)[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = square_accumulate(acc, v, SQUARE_FMA)
    return acc


@triton.jit
def _block_sum_halves(acc_lo, acc_hi, BLOCK_R: tl.constexpr, LANES: tl.constexpr):
    """``block_sum`` of the lanes ``cat(acc_lo, acc_hi)`` (each [BLOCK_R, LANES // 2]) without
    joining them: within one warp the tree's first step adds lane l + LANES/2 to lane l; across
    warps the first step adds warp w + W/2 to warp w. Either way the halves add elementwise."""
    if LANES > 32:
        W: tl.constexpr = LANES // 32
        lo = _halving_tree(tl.reshape(acc_lo, [BLOCK_R * (W // 2), 32]), BLOCK_R * (W // 2), 32)
        hi = _halving_tree(tl.reshape(acc_hi, [BLOCK_R * (W // 2), 32]), BLOCK_R * (W // 2), 32)
        return _halving_tree(tl.reshape(lo + hi, [BLOCK_R, W // 2]), BLOCK_R, W // 2)
    else:
        return _halving_tree(acc_lo + acc_hi, BLOCK_R, LANES // 2)


@triton.jit
def rms_normed(x, w, rstd, DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """``F.rms_norm`` output ``round(w * (rstd * x))`` in DTYPE; x, w, rstd fp32 tensors that
    broadcast to the output tile."""
    y = mul_rn(rstd, x)
    if HAS_WEIGHT:
        y = mul_rn(w, y)
    return round_to(y, DTYPE)


@triton.jit
def _norm_rope_halves(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, row_mask, starts, d1, d2,
                      o_s0, o_s1, o_s2, t_s0, t_s1, t_s2, w_s, eps,
                      N: tl.constexpr, NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      BLOCK_R: tl.constexpr, SQUARE_FMA: tl.constexpr):
    """``norm_rope_kernel`` for ROT == N, N a power of two <= 512: the row is handled as its
    two halves lo = [0, N/2) and hi = [N/2, N) (contiguous, vectorised loads), so that
    rotate_half is ``(-hi, lo)`` without any reload. The norm's per-thread sums come from the
    halves (threads [0, N/8) own lo, the rest hi) and ``_block_sum_halves`` keeps ATen's tree."""
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    HALF: tl.constexpr = N // 2
    cols = tl.arange(0, HALF)
    mask = row_mask[:, None] & (cols < HALF)[None, :]
    y_lo = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0)
    y_hi = tl.load(x_ptr + starts[:, None] + (cols + HALF)[None, :], mask=mask, other=0.0)
    if NORM:
        x_lo = y_lo.to(tl.float32)
        x_hi = y_hi.to(tl.float32)
        acc_lo = thread_sums_from_tile(x_lo, BLOCK_R, HALF // 4, SQUARE_FMA)
        acc_hi = thread_sums_from_tile(x_hi, BLOCK_R, HALF // 4, SQUARE_FMA)
        var = div_rn(_block_sum_halves(acc_lo, acc_hi, BLOCK_R, N // 4), tl.full((), N, tl.float32))
        rstd = rsqrt_approx(add_rn(var, as_fp32(eps)))
        w_lo = tl.zeros([HALF], dtype=tl.float32)
        w_hi = w_lo
        if HAS_WEIGHT:
            w_lo = tl.load(w_ptr + cols * w_s).to(tl.float32)
            w_hi = tl.load(w_ptr + (cols + HALF) * w_s).to(tl.float32)
        y_lo = rms_normed(x_lo, w_lo[None, :], rstd[:, None], DTYPE, HAS_WEIGHT)
        y_hi = rms_normed(x_hi, w_hi[None, :], rstd[:, None], DTYPE, HAS_WEIGHT)
    t_starts = _row_starts(rows, d1, d2, t_s0, t_s1, t_s2)
    cos_lo = tl.load(cos_ptr + t_starts[:, None] + cols[None, :], mask=mask, other=0.0)
    cos_hi = tl.load(cos_ptr + t_starts[:, None] + (cols + HALF)[None, :], mask=mask, other=0.0)
    sin_lo = tl.load(sin_ptr + t_starts[:, None] + cols[None, :], mask=mask, other=0.0)
    sin_hi = tl.load(sin_ptr + t_starts[:, None] + (cols + HALF)[None, :], mask=mask, other=0.0)
    # y * cos + cat(-y_hi, y_lo) * sin, each op an eager op of the dtype; round(-a * b) is
    # -round(a * b), and c + (-d) is c - d
    out_lo = dtype_sub(dtype_mul(y_lo, cos_lo), dtype_mul(y_hi, sin_lo))
    out_hi = dtype_add(dtype_mul(y_hi, cos_hi), dtype_mul(y_lo, sin_hi))
    o_starts = _row_starts(rows, d1, d2, o_s0, o_s1, o_s2)
    tl.store(out_ptr + o_starts[:, None] + cols[None, :], out_lo, mask=mask)
    tl.store(out_ptr + o_starts[:, None] + (cols + HALF)[None, :], out_hi, mask=mask)


@triton.jit
def _norm_rope_general(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, row_mask, starts, d1, d2,
                       o_s0, o_s1, o_s2, t_s0, t_s1, t_s2, w_s, eps,
                       N: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                       HAS_WEIGHT: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SQUARE_FMA: tl.constexpr):
    """``norm_rope_kernel`` for any row: the whole row as one [BLOCK_R, BLOCK_N] tile, the
    rotate-half partner reloaded (scalar loads; the row is in L1)."""
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_N)
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)

    rstd = tl.zeros([BLOCK_R], dtype=tl.float32)
    w = tl.zeros([BLOCK_N], dtype=tl.float32)
    if NORM:
        if ITERS == 1:
            acc = thread_sums_from_tile(x, BLOCK_R, LANES, SQUARE_FMA)
        else:
            acc = _thread_sums_from_memory(x_ptr, starts, row_mask, N, ITERS, BLOCK_R, SQUARE_FMA)
        var = div_rn(block_sum(acc, BLOCK_R, LANES), tl.full((), N, tl.float32))
        rstd = rsqrt_approx(add_rn(var, as_fp32(eps)))
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols * w_s, mask=cols < N, other=0.0).to(tl.float32)
    y = x
    if NORM:
        y = rms_normed(x, w[None, :], rstd[:, None], DTYPE, HAS_WEIGHT).to(tl.float32)

    if ROPE:
        HALF: tl.constexpr = ROT // 2
        first = cols < HALF
        in_rot = cols < ROT
        # rotate_half partner: column c + HALF for the first half, c - HALF for the second
        # (reloaded: the row is in L1, and this keeps the tile's register layout simple)
        partner = tl.where(first, cols + HALF, cols - HALF)
        partner = tl.where(in_rot, partner, cols)
        wp = w
        if NORM and HAS_WEIGHT:
            wp = tl.load(w_ptr + partner * w_s, mask=cols < N, other=0.0).to(tl.float32)
        xp = tl.load(x_ptr + starts[:, None] + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        yp = xp
        if NORM:
            yp = rms_normed(xp, wp[None, :], rstd[:, None], DTYPE, HAS_WEIGHT).to(tl.float32)
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


# Row counts and sizes only feed index arithmetic: not specialising them saves compilations.
@triton.jit(do_not_specialize=["n_rows", "d1", "d2"])
def norm_rope_kernel(
    x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr,
    n_rows, d1, d2, x_s0, x_s1, x_s2, o_s0, o_s1, o_s2, t_s0, t_s1, t_s2, w_s,
    x_delta, w_delta, o_delta, eps,
    N: tl.constexpr, ROT: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, LANES: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SQUARE_FMA: tl.constexpr, HALVES: tl.constexpr,
):
    """ERNIE-Image's ``rope(F.rms_norm(x, (N,), w, eps), cos, sin)`` on BLOCK_R rows; either
    half can be switched off (NORM, ROPE).

    Grid axis 1 picks the tensor: program (i, 1) works on x, w, out shifted by x_delta,
    w_delta, o_delta elements (k relative to q), so q and k (same shape and strides) take one
    launch.
    Inputs: [d0, d1, d2, N] strided views (unit stride along N) of one dtype (bf16, fp16,
    fp32); weight [N] strided, same dtype; cos/sin tables of that dtype indexed per row
    through (t_s0, t_s1, t_s2) (0 for broadcast dims), ROT = their width (even, <= N).
    Norm: ATen's vectorized RMSNorm order (module docstring), output rounded once.
    RoPE (non-interleaved rotate-half on the first ROT channels, the rest passed through):
    ``round(round(y * cos) + round(rotate_half(y) * sin))``, as eager rounds each op.
    HALVES: the fast path for full rotation of a power-of-two row of at most 512 (see
    ``_norm_rope_halves``); otherwise the rotate-half partner is reloaded (scalar loads).
    """
    which = tl.program_id(1).to(tl.int64)
    x_ptr += which * x_delta
    w_ptr += which * w_delta
    out_ptr += which * o_delta

    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    starts = _row_starts(rows, d1, d2, x_s0, x_s1, x_s2)
    if HALVES:
        _norm_rope_halves(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, row_mask, starts, d1, d2,
                          o_s0, o_s1, o_s2, t_s0, t_s1, t_s2, w_s, eps,
                          N, NORM, HAS_WEIGHT, BLOCK_R, SQUARE_FMA)
    else:
        _norm_rope_general(x_ptr, w_ptr, out_ptr, cos_ptr, sin_ptr, rows, row_mask, starts, d1, d2,
                           o_s0, o_s1, o_s2, t_s0, t_s1, t_s2, w_s, eps,
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


def _delta(a: torch.Tensor | None, b: torch.Tensor | None) -> int | None:
    """Element offset of b's data from a's, or None when it is not a whole number of elements."""
    if a is None:
        return 0
    d = b.data_ptr() - a.data_ptr()
    return None if d % a.element_size() else d // a.element_size()


def norm_rope(pairs, eps, tables, *, norm: bool, rope: bool):
    """Launch the kernel over one or two ``(x, weight, out)`` triples (x: [..., N], 1-4 dims;
    weight [N] or None; out: x's shape) sharing eps and the ``(cos, sin)`` tables (broadcast
    to x's shape[:-1] + (rot_dim,), unit stride along the last dim; or None without rope).
    Two triples of one shape and strides take one launch (else one launch each). Returns the
    outs."""
    x, weight, out = pairs[0]
    shape = tuple(x.shape)
    n = shape[-1]
    n_rows, d1, d2 = dims_4d(shape)
    x_st, o_st = strides_4d(x, shape), strides_4d(out, shape)
    deltas = [0, 0, 0]
    if len(pairs) == 2:
        x2, w2, out2 = pairs[1]
        deltas = [_delta(x, x2), _delta(weight, w2), _delta(out, out2)]
        same = (
            tuple(x2.shape) == shape and strides_4d(x2, shape) == x_st and strides_4d(out2, shape) == o_st
            and (weight is None or w2.stride() == weight.stride()) and None not in deltas
        )
        if not same:
            return norm_rope(pairs[:1], eps, tables, norm=norm, rope=rope) + norm_rope(pairs[1:], eps, tables, norm=norm, rope=rope)
    if rope:
        cos, sin = tables
        rot = cos.shape[-1]
        t_st = strides_4d(cos, shape[:-1] + (rot,))
    else:
        cos = sin = x
        rot = 0
        t_st = [0, 0, 0]
    n_vec = n // VEC
    block_n = next_power_of_2(n)
    halves = bool(rope and rot == n and n == block_n and 8 <= n <= VEC * THREADS and HALVES)
    block_r = max(1, ROW_BLOCK_ELEMENTS // block_n)
    grid = (-(-n_rows // block_r), len(pairs))
    norm_rope_kernel[grid](
        x, x if weight is None else weight, out, cos, sin,
        n_rows, d1, d2, *x_st, *o_st, *t_st, 0 if weight is None else weight.stride(0),
        *deltas, float(eps),
        N=n, ROT=rot, NORM=norm, ROPE=rope, HAS_WEIGHT=weight is not None,
        LANES=min(THREADS, next_power_of_2(n_vec)), ITERS=-(-n_vec // THREADS),
        BLOCK_R=block_r, BLOCK_N=block_n, SQUARE_FMA=SQUARE_FMA, HALVES=halves, num_warps=NUM_WARPS, **LAUNCH_OPTIONS,
    )
    return tuple(p[2] for p in pairs)
