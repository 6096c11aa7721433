"""diffusers' decomposed RMSNorm, optionally with AdaLN modulation and the gated residual before it.

The eager chain (``exactdit.references.rms_norm``) is

    variance = x.to(float32).pow(2).mean(-1, keepdim=True)   # ATen generic reduce (Reduce.cuh)
    h = x * torch.rsqrt(variance + eps)                       # fp32
    [h = h.to(weight.dtype)]                                  # only for a half-precision weight
    out = h * weight                  (or h.to(x.dtype) without a weight)

The only hard part is the variance: its bits depend on the order of ATen's additions, which
depends on the launch shape ATen picks for the *real* (M, D) (see :mod:`exactdit.aten.reduce`).
The kernel below reproduces that order for a given emulated configuration:

* ``T = BW * WY`` threads reduce one row (``BW`` lanes, ``WY`` warps when warps split the row);
* vectorized path (D >= 128, D % 4 == 0): float4 vector ``k`` of the row goes to thread
  ``k mod T``, component ``i`` into its accumulator ``i`` -- so chunk ``j`` of ``4 T`` consecutive
  elements is added elementwise into a ``[4 T]`` accumulator (element ``4 p + i`` is thread
  ``p``'s accumulator ``i``), in chunk order, starting from 0;
* scalar path (D < 128): chunk ``j`` of ``T`` consecutive elements goes into accumulator
  ``j % 4`` of the threads;
* each thread combines ``((a0 + a1) + a2) + a3``;
* threads are combined by halving trees, first over the ``BW`` lanes (lane ``t`` += lane
  ``t + off``, off = BW/2 .. 1), then over the ``WY`` warps the same way;
* the total is multiplied by ATen's fp32 factor ``fl(M) / fl(M * D)``.

Then ``var + fl32(eps)``, ``rsqrt.approx``, and the elementwise tail with eager's roundings.
Each program owns ``ROWS`` rows: pass 1 reads the rows chunk by chunk (the reduction's chunks, in
ATen's order) and reduces; pass 2 reads them again (L2 hits) in wider ``[ROWS, TAIL]`` tiles --
any tiling of the elementwise tail is exact -- and writes the output. The launch shape (ROWS,
num_warps, unrolling, TAIL, L2 hints) never changes the arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exactdit.device.rows import next_power_of_2
from exactdit.device.numerics import add_rn


@triton.jit
def halving_tree(v, ROWS: tl.constexpr, OUTER: tl.constexpr, N: tl.constexpr):
    """ATen's shuffle-down tree, the one every generated reduction uses: ``[ROWS, OUTER, N]`` ->
    ``[ROWS, OUTER]`` (``N`` a power of two, at most 1024): element ``t`` adds element ``t + off``
    for off = N/2, N/4, ..., 1 (one fp32 add per pair: the sum over a size-2 axis is exactly that
    add). Lane 0's value is the result."""
    for k in tl.static_range(10):
        if (N >> k) > 1:
            v = tl.sum(tl.reshape(v, (ROWS, OUTER, 2, N >> (k + 1))), axis=2)
    return tl.reshape(v, (ROWS, OUTER))


@triton.jit
def row_total(acc, a1, a2, a3, ROWS: tl.constexpr, BW: tl.constexpr, WY: tl.constexpr, VECTORIZED: tl.constexpr):
    """Per-thread combine ``((a0 + a1) + a2) + a3``, then the lane tree, then the warp tree.

    Vectorized: ``acc`` is ``[ROWS, 4 T]`` with thread ``p``'s accumulator ``i`` at ``4 p + i``.
    Scalar: ``acc``, ``a1``, ``a2``, ``a3`` are the four ``[ROWS, T]`` accumulators."""
    T: tl.constexpr = BW * WY
    if VECTORIZED:
        parts = tl.reshape(acc, (ROWS, T, 2, 2))
        even, odd = tl.split(parts)  # accumulators (0, 2) and (1, 3)
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
    else:
        s0 = acc
        s1 = a1
        s2 = a2
        s3 = a3
    per_thread = add_rn(add_rn(add_rn(s0, s1), s2), s3)
    # thread p = lane + warp * BW
    lanes = halving_tree(tl.reshape(per_thread, (ROWS, WY, BW)), ROWS, WY, BW)
    return tl.reshape(halving_tree(tl.reshape(lanes, (ROWS, 1, WY)), ROWS, 1, WY), (ROWS,))


@triton.jit
def block_sum(acc, ROWS: tl.constexpr, LANES: tl.constexpr):
    """The block reduction of ATen's vectorized norm kernel over per-thread sums ``acc``
    [ROWS, LANES] (``F.rms_norm``): the tree per 32-lane warp, then the warp sums folded in
    halves, ``(w0 + w2) + (w1 + w3)``. Returns [ROWS]."""
    if LANES > 32:
        per_warp = halving_tree(tl.reshape(acc, (ROWS * (LANES // 32), 1, 32)), ROWS * (LANES // 32), 1, 32)
        return tl.reshape(halving_tree(tl.reshape(per_warp, (ROWS, 1, LANES // 32)), ROWS, 1, LANES // 32), (ROWS,))
    else:
        return tl.reshape(halving_tree(tl.reshape(acc, (ROWS, 1, LANES)), ROWS, 1, LANES), (ROWS,))


def tail_block(chunk: int, width: int, rows: int) -> int:
    """Width of pass 2's tiles: ~2048 elements per tile of ``rows`` rows, at least one chunk,
    at most the row (rounded up to a power of two)."""
    return min(next_power_of_2(width), max(chunk, 2048 // rows))


