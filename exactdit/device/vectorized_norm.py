"""Per-head RMSNorm (``F.rms_norm``) and ERNIE-Image's rotary embedding, fused.

One program handles BLOCK_R rows (one row = one head of one token, ``head_dim`` elements) of a
[d0, d1, d2, N] strided view with unit stride along N. q and k are done in one launch: grid
axis 1 picks the tensor.

The norm reproduces ATen's ``vectorized_layer_norm_kernel`` with the rms flag (see
:mod:`exactdit.aten.norms`, ``rms_norm_order_model``): a 128-thread block per row, thread t
owns the 4-element vectors t, t + 128, ...; ``acc = fma(v, v, acc)`` per element in read order;
a warp shuffle-down tree 16, 8, 4, 2, 1; warps combined ``(w0 + w2) + (w1 + w3)``;
``var = s / N`` (div.rn); ``rstd = rsqrt.approx(var + eps)``; ``y = w * (rstd * x)`` rounded
once to the dtype. Threads that own no vector contribute +0, which changes no sum, so a row of
``NV = N / 4`` vectors is reduced over ``LANES = next_pow2(NV)`` (at most 128) lanes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exactdit.aten.norms import VEC_THREADS
from exactdit.device.rows import vector_elements
from exactdit.device.numerics import add_rn, mul_rn, round_to

#: threads per row of ATen's vectorized norm kernel
THREADS = VEC_THREADS
#: ``acc = fma(v, v, acc)`` (nvcc contracts the source's ``acc + v * v``); False: mul then add.
#: Only fp32 inputs (or squares below the fp32 normal range) can tell the two apart.
SQUARE_FMA = True
#: elements per program (BLOCK_R rows of BLOCK_N) and warps: a memory-bound tile
#: (``bench_rope_geglu.py --tune`` on an H200).
ROW_BLOCK_ELEMENTS = 2048  # 53.7 us at 1 x 4224 x 32 x 128 against 57.7 us for 4096 (same run)
NUM_WARPS = 4


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
def rms_normed(x, w, rstd, DTYPE: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """``F.rms_norm`` output ``round(w * (rstd * x))`` in DTYPE; x, w, rstd fp32 tensors that
    broadcast to the output tile."""
    y = mul_rn(rstd, x)
    if HAS_WEIGHT:
        y = mul_rn(w, y)
    return round_to(y, DTYPE)


