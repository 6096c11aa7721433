"""Addressing rows of [outer, inner, D] views through strides.

Ops view every operand as a 3-D strided tensor [outer, inner, D] with unit stride along D
(a [D] vector has outer and inner strides 0, a [B, 1, D] modulation vector under an [S, B, D]
activation has outer stride 0). Kernels read broadcast operands through these strides instead
of materialising copies.
"""

from __future__ import annotations

import triton
import triton.language as tl


#: Tile of the elementwise kernels: (elements per program, widest tile, warps). Chosen on an
#: H200 with benchmarks/tune_elementwise.py as the tile with the best worst case over the
#: production shapes (87.6% of copy bandwidth; see BENCHMARKS.md).
ELEMENTWISE_TILE = {"elements": 2048, "max_width": 2048, "num_warps": 4}


def elementwise_blocks(n_rows: int, width: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_R, BLOCK_D, grid) for a memory-bound elementwise kernel: tiles of a fixed number of
    elements, at most ``max_width`` wide so a non-power-of-two width wastes little of the last
    tile."""
    block_d = min(ELEMENTWISE_TILE["max_width"], next_power_of_2(width))
    block_r = min(max(1, ELEMENTWISE_TILE["elements"] // block_d), next_power_of_2(n_rows))
    return block_r, block_d, (-(-n_rows // block_r), -(-width // block_d))


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (plain Python: triton's helper is slow to call from the host)."""
    return 1 << max(0, (n - 1).bit_length())


@triton.jit
def vector_elements(x, ROWS: tl.constexpr, LANES: tl.constexpr):
    """The four elements of each thread's float4 vector in a row tile ``x`` [ROWS, 4 * LANES] of
    consecutive columns, where "thread" t owns columns 4t .. 4t + 3 (ATen's vectorised loads):
    four [ROWS, LANES] tensors, elements 4t, 4t + 1, 4t + 2, 4t + 3. Split out of the registers
    that hold them, so no data moves."""
    lo, hi = tl.split(tl.reshape(x, [ROWS, LANES, 2, 2]))  # 4t + {0, 2}, 4t + {1, 3}
    v0, v2 = tl.split(lo)
    v1, v3 = tl.split(hi)
    return v0, v1, v2, v3


@triton.jit
def pair_lane(x, LANE: tl.constexpr):
    """``x`` [R, C] (C even) with each element replaced by lane LANE (0: even, 1: odd) of its
    column pair (2i, 2i + 1): the element at column ``2 * (c // 2) + LANE``. Pairs sit in
    adjacent registers of one thread, so no data moves between threads (what ``tl.gather`` or a
    second load would cost for an interleaved rotary partner)."""
    even, odd = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    if LANE == 0:
        return tl.reshape(tl.join(even, even), [x.shape[0], x.shape[1]])
    else:
        return tl.reshape(tl.join(odd, odd), [x.shape[0], x.shape[1]])


@triton.jit
def lanes_exchanged(x, D: tl.constexpr):
    """``x`` [R, C] (C a multiple of 2 * D, D a power of two) with columns c and c ^ D exchanged:
    in each group of 2 * D columns the halves swap (D = 1: an interleaved rotary pair; D = half
    the row: rotate-half RoPE). ``a ^ (a ^ b)`` over the axis of the two halves: an exact move of
    16- or 32-bit float bits by a reduction over an axis of two (registers, or shuffles between
    the threads holding the halves) instead of ``tl.gather``'s round trip through shared memory."""
    if x.dtype.primitive_bitwidth == 32:
        bits = x.to(tl.int32, bitcast=True)
    else:
        bits = x.to(tl.int16, bitcast=True)
    halves = tl.reshape(bits, [x.shape[0], x.shape[1] // (2 * D), 2, D])
    swapped = halves ^ tl.xor_sum(halves, 2, keep_dims=True)
    return tl.reshape(swapped, [x.shape[0], x.shape[1]]).to(x.dtype, bitcast=True)
