"""``F.layer_norm`` over the last dim, alone or followed by AdaLN modulation, bit-identical to
ATen's ``vectorized_layer_norm_kernel`` (torch 2.11, CUDA).

One program per row, 4 warps. The program reproduces ATen's 128-thread block exactly as
:mod:`exactdit.aten.norms` models it (``layer_norm_order_model``, vectorised path):

* "thread" ``t`` (0..127, warp ``t // 32``, lane ``t % 32``) owns the 4-element vectors
  ``t, t + 128, t + 256, ...`` of the row and runs a Welford update over their elements in
  order; the program holds the 128 threads' states as [128] tensors;
* the states are combined by the warp shuffle-down tree (offsets 16..1 inside each warp) and
  then across warps ``(w0 + w2) + (w1 + w3)``, with ATen's count-weighted combine; lanes
  without data take part with count 0. Each step is a ``tl.gather`` of the partner's state
  (along a warp-local axis for the lane steps, so it lowers to shuffles);
* ``var = m2 / N`` (``div.rn``), ``rstd = rsqrt.approx(var + eps)``, and the output expression
  of the affine variant, rounded once to the dtype.

The row is read twice (statistics, then output); the second read mostly hits L2.

FMA placement: an FMA that eager's compiled code has is an explicit ``tl.fma``; every other
multiply/add goes through ``mul_rn``/``add_rn`` so nothing else is contracted. The placements
the GPU probe settles are constexpr switches (``MEAN_FMA``, ``SIGMA_FMA``, ``RCP_APPROX``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from exactdit.aten.norms import VEC_THREADS
from exactdit.device.rows import lanes_exchanged, vector_elements
from exactdit.device.numerics import INTERPRET, add_rn, div_rn, mul_rn, rsqrt_approx, sub_rn

#: ``MEAN_FMA`` values: which product of ``nA*A.mean + nB*B.mean`` nvcc fused into the add.
MEAN_FMA_NONE, MEAN_FMA_FIRST, MEAN_FMA_SECOND = 0, 1, 2
_MEAN_FMA = {"none": MEAN_FMA_NONE, "first": MEAN_FMA_FIRST, "second": MEAN_FMA_SECOND}

#: The contraction choices in use (same names as ``layer_norm_order_model``'s keyword
#: arguments). The H200 probe (torch 2.11) confirmed mean_fma="first", sigma_fma=True and a
#: correctly rounded ``1 / count``: mean, rstd and output matched eager on every row for bf16
#: and fp32, widths 64..6144.
CHOICES = {"mean_fma": "first", "sigma_fma": True, "rcp_approx": False}

THREADS = VEC_THREADS  # ATen's block: 4 warps of 32 threads
#: warps per program. The kernel's tensors model ATen's 128 threads whatever the warp count (a
#: layout choice that changes no bits), so fewer warps means each thread plays several of them.
NUM_WARPS = 4
#: widest row (in 512-element iterations per thread) whose loops are unrolled: D <= 8192
MAX_UNROLL = 16
#: largest count whose reciprocal the kernel takes as a constant (Python's ``1 / c`` rounded to
#: fp32 equals the correctly rounded fp32 ``1 / c`` for every c up to here: tested)
MAX_CONSTANT_COUNT = 2**20


if INTERPRET:

    @triton.jit
    def rcp_approx(x):
        """Interpreter stand-in for ``rcp.approx.f32``: the correctly rounded ``1 / x``."""
        return tl.div_rn(1.0, x)

else:

    @triton.jit
    def rcp_approx(x):
        """``rcp.approx.ftz.f32``: nvcc's fast reciprocal (only used if the probe finds ATen's
        ``1.f / count`` compiled to it)."""
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )


@triton.jit
def _reciprocal(x, RCP_APPROX: tl.constexpr):
    """ATen's ``1.f / count``: correctly rounded unless the probe says otherwise."""
    if RCP_APPROX:
        return rcp_approx(x)
    else:
        return div_rn(1.0, x)


@triton.jit
def _combine(bm, bs, bc, am, as_, ac, MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr, RCP_APPROX: tl.constexpr,
             TOTAL: tl.constexpr):
    """ATen's ``cuWelfordCombine(dataB=(bm, bs, bc), dataA=(am, as_, ac))`` (B is the lane or
    warp that keeps the result, A the one it receives):

    delta = B.mean - A.mean; count = A.count + B.count; coef = 1 / count;
    nA = A.count * coef; nB = B.count * coef; mean = nA * A.mean + nB * B.mean (FMA per
    MEAN_FMA); m2 = fma((delta * delta) * A.count, nB, A.m2 + B.m2) (SIGMA_FMA); count 0 gives
    mean = m2 = 0.
    TOTAL > 0: the states are known to hold TOTAL elements together, so ``count`` and ``coef``
    are constants (``coef`` is Python's ``1 / TOTAL`` rounded to fp32, which equals the correctly
    rounded fp32 reciprocal for every count the kernel meets: tested).
    """
    delta = sub_rn(bm, am)
    if TOTAL > 0:
        count = tl.full(bm.shape, TOTAL * 1.0, tl.float32)
        coef = tl.full(bm.shape, 1.0 / TOTAL, tl.float32)
    else:
        count = add_rn(ac, bc)
        coef = _reciprocal(tl.where(count > 0.0, count, 1.0), RCP_APPROX)
    na = mul_rn(ac, coef)
    nb = mul_rn(bc, coef)
    if MEAN_FMA == 1:
        mean = tl.fma(na, am, mul_rn(nb, bm))
    elif MEAN_FMA == 2:
        mean = tl.fma(nb, bm, mul_rn(na, am))
    else:
        mean = add_rn(mul_rn(na, am), mul_rn(nb, bm))
    t = mul_rn(mul_rn(delta, delta), ac)
    if SIGMA_FMA:
        m2 = tl.fma(t, nb, add_rn(as_, bs))
    else:
        m2 = add_rn(add_rn(as_, bs), mul_rn(t, nb))
    if TOTAL > 0:
        return mean, m2, count
    else:
        pos = count > 0.0
        return tl.where(pos, mean, 0.0), tl.where(pos, m2, 0.0), count


@triton.jit
def _shuffle_down(
    mean, m2, cnt, t, OFFSET: tl.constexpr,
    MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr, RCP_APPROX: tl.constexpr, COUNT: tl.constexpr,
):
    """One tree step over the 128 thread states: thread t keeps ``combine(own=t, other=t +
    OFFSET)``. Only threads whose partner is meaningful feed the final result (as with
    ATen's shuffle-down, lanes >= offset compute values nobody reads again). COUNT > 0: every
    state that matters holds COUNT elements (D % 512 == 0), so counts are constants."""
    AXIS: tl.constexpr = len(t.shape) - 1
    src = tl.minimum(t + OFFSET, t.shape[AXIS] - 1)
    am = tl.gather(mean, src, AXIS)
    as_ = tl.gather(m2, src, AXIS)
    if COUNT > 0:
        ac = cnt
    else:
        ac = tl.gather(cnt, src, AXIS)
    return _combine(mean, m2, cnt, am, as_, ac, MEAN_FMA, SIGMA_FMA, RCP_APPROX, 2 * COUNT)


@triton.jit
def _lane0(v, lane):
    """Element 0 along the last axis of an fp32 tensor, bit for bit (an integer sum of one
    nonzero bit pattern, so no sign of zero or NaN payload is lost)."""
    bits = tl.where(lane == 0, v.to(tl.int32, bitcast=True), 0)
    return tl.sum(bits, axis=len(v.shape) - 1).to(tl.float32, bitcast=True)


@triton.jit
def _welford_step(v, mean, m2, rcp):
    """``cuWelfordOnlineSum`` for one element ``v`` whose count has reciprocal ``rcp``:
    delta = v - mean; mean' = fma(delta, rcp, mean); m2' = fma(delta, v - mean', m2)."""
    delta = sub_rn(v, mean)
    new_mean = tl.fma(delta, rcp, mean)
    return new_mean, tl.fma(delta, sub_rn(v, new_mean), m2)


@triton.jit
def welford_update(tile, j, n_vec, mean, m2, cnt, RCP_APPROX: tl.constexpr, CONST_RCP: tl.constexpr,
                   FULL: tl.constexpr):
    """:func:`welford_elements` for one row's 128 threads, thread t's vector ``j * 128 + t`` the
    row ``tile[t]`` of a [128, 4] tile (fp32)."""
    even, odd = tl.split(tl.reshape(tile, (128, 2, 2)))  # elements (0, 2) and (1, 3)
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    return welford_elements(v0, v1, v2, v3, j, n_vec, mean, m2, cnt, RCP_APPROX, CONST_RCP, FULL, 128)


@triton.jit
def welford_elements(v0, v1, v2, v3, j, n_vec, mean, m2, cnt, RCP_APPROX: tl.constexpr, CONST_RCP: tl.constexpr,
                     FULL: tl.constexpr, LANES: tl.constexpr):
    """Iteration ``j`` of every thread's loop: thread t (the last axis of the states, LANES
    threads; leading axes are rows) folds the fp32 elements ``v0 .. v3`` of its vector
    ``j * LANES + t`` (if the row has it) into its Welford state (``cuWelfordOnlineSum``):
    delta = v - mean; cnt += 1; mean = fma(delta, 1 / cnt, mean); m2 = fma(delta, v - mean, m2).
    The count of an element is the same for every thread that has it (4 * j + i + 1). With
    CONST_RCP (j a constexpr) ``1 / count`` is a compile-time constant: the fp32 rounding of
    Python's float64 ``1 / c`` equals the correctly rounded fp32 ``1 / c`` for every c <= 4096
    (checked in the tests), so it equals ATen's ``div.rn`` result. FULL: every thread has
    vector j, so no masks."""
    valid = j * LANES + tl.arange(0, LANES) < n_vec
    base = tl.full((), j * 4, tl.float32)  # exact: counts stay far below 2**24
    for i in tl.static_range(4):
        if i == 0:
            v = v0
        elif i == 1:
            v = v1
        elif i == 2:
            v = v2
        else:
            v = v3
        if CONST_RCP:
            rcp = 1.0 / (j * 4 + i + 1)
        else:
            rcp = _reciprocal(base + (i + 1.0), RCP_APPROX)
        new_mean, new_m2 = _welford_step(v, mean, m2, rcp)
        if FULL:
            mean = new_mean
            m2 = new_m2
        else:
            mean = tl.where(valid, new_mean, mean)
            m2 = tl.where(valid, new_m2, m2)
    if FULL:
        cnt = tl.zeros_like(cnt) + (base + 4.0)
    else:
        cnt = tl.where(valid, base + 4.0, cnt)
    return mean, m2, cnt


@triton.jit
def vector_columns(j):
    """Columns of iteration ``j``'s [128, 4] tile: row t holds thread t's vector ``j * 128 + t``."""
    return ((j * 128 + tl.arange(0, 128)) * 4)[:, None] + tl.arange(0, 4)[None, :]


@triton.jit
def welford_finish(mean, m2, cnt, width, eps, MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr,
                   RCP_APPROX: tl.constexpr, TREE_COUNT: tl.constexpr):
    """(mean, rstd) of a row from its 128 thread states: ATen's warp trees and cross-warp
    combine, ``var = m2 / N`` (div.rn), ``rstd = rsqrt.approx(var + eps)``."""
    # warp trees (offsets 16..1 inside each warp of 32 threads), then across warps: thread 0
    # of warp 0 / 1 takes warp 2 / 3 (offset 64), then warp 0 takes warp 1 (offset 32)
    # ([warp, lane] view: the lane steps gather along a warp-local axis, i.e. by shuffles)
    lane = tl.broadcast_to(tl.arange(0, 32)[None, :], (4, 32))
    mean = tl.reshape(mean, (4, 32))
    m2 = tl.reshape(m2, (4, 32))
    cnt = tl.reshape(cnt, (4, 32))
    # TREE_COUNT: every thread's count when all hold the same number of elements, else 0
    C: tl.constexpr = TREE_COUNT
    for k in tl.static_range(5):
        mean, m2, cnt = _shuffle_down(mean, m2, cnt, lane, 16 >> k, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C << k)
    # lane 0 of each warp, as a [4] vector over warps
    mean = _lane0(mean, lane)
    m2 = _lane0(m2, lane)
    cnt = _lane0(cnt, lane)
    w = tl.arange(0, 4)
    mean, m2, cnt = _shuffle_down(mean, m2, cnt, w, 2, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C << 5)
    mean, m2, cnt = _shuffle_down(mean, m2, cnt, w, 1, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C << 6)
    return _lane0(mean, w), _rstd(_lane0(m2, w), width, eps)


@triton.jit
def _rstd(m2, width, eps):
    """``rsqrt.approx(m2 / N + eps)``, the division correctly rounded (ATen's var and rstd)."""
    return rsqrt_approx(add_rn(div_rn(m2, tl.full((), width, tl.float32)), eps))


# --- many narrow rows per program ------------------------------------------------------------------
# A row of D <= 512 gives each of ATen's 128 threads at most one vector, and only threads
# 0 .. D/4 - 1 hold data. Holding ROWS rows' states as [ROWS, LANES] tensors (LANES = the next
# power of two of D/4) and stepping the shuffle-down tree over the lanes computes the values
# ATen's thread 0 ends with: after the step of offset o, the next steps read only lanes below o; a step
# whose partners lie past LANES combines with ATen's empty (all zero) state, which is not a
# no-op (``nB = count * (1 / count)`` need not be 1, and an infinite ``delta * delta`` times a
# zero count is NaN), so it is computed, not skipped.


@triton.jit
def welford_lanes(x, ROWS: tl.constexpr, LANES: tl.constexpr, N_VEC: tl.constexpr):
    """Thread states (mean, m2, count), each [ROWS, LANES], after every thread t < N_VEC folded
    its one vector (columns 4t .. 4t + 3 of the row tile ``x`` [ROWS, 4 * LANES], fp32) into
    ATen's initial zero state; threads t >= N_VEC keep that state."""
    zero = tl.zeros([ROWS, LANES], tl.float32)
    v0, v1, v2, v3 = vector_elements(x, ROWS, LANES)
    return welford_elements(v0, v1, v2, v3, 0, N_VEC, zero, zero, zero, False, True, N_VEC == LANES, LANES)


@triton.jit
def _with_empty(mean, m2, cnt, MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr, RCP_APPROX: tl.constexpr,
                COUNT: tl.constexpr):
    """A tree step whose partner threads hold no data (COUNT > 0: every live lane holds COUNT
    elements)."""
    z = tl.zeros_like(mean)
    return _combine(mean, m2, cnt, z, z, z, MEAN_FMA, SIGMA_FMA, RCP_APPROX, COUNT)


@triton.jit
def _exchange_step(mean, m2, cnt, H: tl.constexpr, MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr,
                   RCP_APPROX: tl.constexpr, COUNT: tl.constexpr):
    """A tree step of offset H over the states [ROWS, LANES]: lane l (bit H clear) keeps
    ``combine(own l, received l + H)``. The partner's state arrives by ``lanes_exchanged`` (an
    exact move of the bits within the tensor's own layout: the states keep their shape, so no
    step goes through shared memory); lanes with bit H set compute values nobody reads, as in
    ATen's shuffle-down. COUNT > 0: every lane that matters holds COUNT elements."""
    am = lanes_exchanged(mean, H)
    as_ = lanes_exchanged(m2, H)
    if COUNT > 0:
        ac = cnt
    else:
        ac = lanes_exchanged(cnt, H)
    return _combine(mean, m2, cnt, am, as_, ac, MEAN_FMA, SIGMA_FMA, RCP_APPROX, 2 * COUNT)


@triton.jit
def lanes_finish(mean, m2, cnt, width, eps, LANES: tl.constexpr, PER_LANE: tl.constexpr,
                 MEAN_FMA: tl.constexpr, SIGMA_FMA: tl.constexpr, RCP_APPROX: tl.constexpr):
    """(mean, rstd), each [ROWS], from the states [ROWS, LANES] of threads 0 .. LANES - 1
    (:func:`welford_lanes`, :func:`welford_elements`): :func:`welford_finish`'s tree (offsets
    16..1 inside each warp, then warp w takes w + 2, then w + 1), the threads past LANES empty;
    the result is lane 0's. PER_LANE > 0: every one of the LANES threads holds that many
    elements, so the counts of each step are known, and so are the reciprocals."""
    WARPS: tl.constexpr = (LANES + 31) // 32
    L: tl.constexpr = LANES // WARPS  # live lanes of each warp
    C: tl.constexpr = PER_LANE if not RCP_APPROX else 0  # elements per live lane
    for k in tl.static_range(5):
        if (16 >> k) >= L:
            mean, m2, cnt = _with_empty(mean, m2, cnt, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C)
        else:
            mean, m2, cnt = _exchange_step(mean, m2, cnt, 16 >> k, MEAN_FMA, SIGMA_FMA, RCP_APPROX,
                                           C * (L // (32 >> k)))
    # each warp's lane 0 (lane w * L) now holds C * L elements
    if WARPS == 4:
        mean, m2, cnt = _exchange_step(mean, m2, cnt, 2 * L, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C * L)
    else:
        mean, m2, cnt = _with_empty(mean, m2, cnt, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C * L)
    if WARPS >= 2:
        mean, m2, cnt = _exchange_step(mean, m2, cnt, L, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C * L * (WARPS // 2))
    else:
        mean, m2, cnt = _with_empty(mean, m2, cnt, MEAN_FMA, SIGMA_FMA, RCP_APPROX, C * L)
    lane = tl.arange(0, LANES)[None, :]
    return _lane0(mean, lane), _rstd(_lane0(m2, lane), width, eps)


@triton.jit
def normalized(x, mean, rstd, w, b, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """ATen's output expression in fp32 (before the cast), d = x - mean, t = rstd * d:
    weight and bias ``fma(w, t, b)``; weight ``w * t``; bias ``fma(rstd, d, b)``; neither ``t``.
    The bias-only form is the order model's and did NOT match eager on the H200 probe: the op
    sends that variant to eager."""
    d = sub_rn(x, mean)
    if HAS_WEIGHT:
        t = mul_rn(rstd, d)
        if HAS_BIAS:
            y = tl.fma(w, t, b)
        else:
            y = mul_rn(w, t)
    elif HAS_BIAS:
        y = tl.fma(rstd, d, b)
    else:
        y = mul_rn(rstd, d)
    return y


