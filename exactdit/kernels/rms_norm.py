"""diffusers' decomposed RMSNorm, optionally with AdaLN modulation and the gated residual before it.

The eager chain (``exactdit.references.rms_norm``) is

    variance = x.to(float32).pow(2).mean(-1, keepdim=True)   # ATen generic reduce (Reduce.cuh)
    h = x * torch.rsqrt(variance + eps)                       # fp32
    [h = h.to(weight.dtype)]                                  # only for a half-precision weight
    out = h * weight                  (or h.to(x.dtype) without a weight)

The only hard part is the variance: its bits depend on the order of ATen's additions, which
depends on the launch shape ATen picks for the *real* (M, D) (see :mod:`exactdit.aten_reduce`).
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

from exactdit.kernels.elementwise import modulate_values
from exactdit.kernels.rows import next_power_of_2, row_offsets, row_strides, rows_of
from exactdit.numerics import LAUNCH_OPTIONS, add_rn, as_fp32, mul_rn, round_to, rounded, rsqrt_approx


@triton.jit
def _halving_tree(v, ROWS: tl.constexpr, OUTER: tl.constexpr, N: tl.constexpr, LOG_N: tl.constexpr):
    """``[ROWS, OUTER, N]`` -> ``[ROWS, OUTER]`` with ``N = 2**LOG_N``: element ``t`` adds
    element ``t + off`` for off = N/2, N/4, ..., 1 (one fp32 add per pair: the sum over a
    size-2 axis is exactly that add)."""
    for k in tl.static_range(LOG_N):
        v = tl.sum(tl.reshape(v, (ROWS, OUTER, 2, N >> (k + 1))), axis=2)
    return tl.reshape(v, (ROWS, OUTER))


@triton.jit
def row_total(acc, a1, a2, a3, ROWS: tl.constexpr, BW: tl.constexpr, WY: tl.constexpr,
               LOG_BW: tl.constexpr, LOG_WY: tl.constexpr, VECTORIZED: tl.constexpr):
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
    lanes = _halving_tree(tl.reshape(per_thread, (ROWS, WY, BW)), ROWS, WY, BW, LOG_BW)
    return tl.reshape(_halving_tree(tl.reshape(lanes, (ROWS, 1, WY)), ROWS, 1, WY, LOG_WY), (ROWS,))


@triton.jit
def _chunk_squares(x_ptr, update_ptr, gate_ptr, res_ptr, x_row, u_row, g_row, r_row, c, mask,
                   DTYPE: tl.constexpr, GATED: tl.constexpr, EVICT: tl.constexpr):
    """fp32 squares of one chunk of the rows (0 where masked). GATED: the rows are the new
    residual ``x + (g.float() * u.float()).to(DTYPE)``, stored to ``res_ptr`` on the way.
    EVICT: L2 eviction hint for the row loads (pass 2 reads the rows again)."""
    v = tl.load(x_ptr + x_row + c, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if GATED:
        # fp32 arithmetic rounded like the two eager ops (the packed dtype ops made this kernel
        # longer: 1,608 against 1,448 SASS instructions)
        u = tl.load(update_ptr + u_row + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + g_row + c, mask=mask, other=0.0).to(tl.float32)
        new_res = round_to(add_rn(v, rounded(mul_rn(g, u), DTYPE)), DTYPE)
        tl.store(res_ptr + r_row + c, new_res, mask=mask)
        v = new_res.to(tl.float32)
    return mul_rn(v, v)  # masked elements give +0, and adding +0 to a sum of squares is exact


@triton.jit(do_not_specialize=["n_rows", "inner", "n_chunks"])
def rms_norm_kernel(
    x_ptr, update_ptr, gate_ptr, weight_ptr, scale_ptr, shift_ptr, out_ptr, res_ptr, var_ptr,
    n_rows, inner, width, n_chunks, factor, eps,
    x_so, x_si, u_so, u_si, g_so, g_si, sc_so, sc_si, sh_so, sh_si, o_so, o_si, r_so, r_si, a_so, a_si,
    GATED: tl.constexpr, HAS_WEIGHT: tl.constexpr, MODULATE: tl.constexpr,
    HAS_SHIFT: tl.constexpr, UPCAST: tl.constexpr, WRITE_VAR: tl.constexpr, WRITE_OUT: tl.constexpr,
    VECTORIZED: tl.constexpr, MISALIGNED: tl.constexpr, BW: tl.constexpr, WY: tl.constexpr, LOG_BW: tl.constexpr,
    LOG_WY: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr, TAIL: tl.constexpr,
    PASS1_EVICT: tl.constexpr, PASS2_EVICT: tl.constexpr,
):
    """One kernel for ``rms_norm``, ``rms_norm_modulate`` and ``gated_rms_norm_modulate``.

    Input rows: ``x`` (DTYPE), or with GATED the new residual
    ``residual + (gate.float() * update.float()).to(DTYPE)`` (``x_ptr`` is the residual; the new
    residual is written to ``res_ptr`` in pass 1 and read back in pass 2).
    Variance: ATen's order for the emulated config (BW lanes x WY warps per row, VECTORIZED,
    ``n_chunks`` chunks of 4*T or T elements; CHUNKS = n_chunks as a constant for the scalar
    path, which unrolls to pick accumulators, 0 otherwise), times ``factor``. MISALIGNED
    (vectorized, D % 4 != 0): each row's misalignment in ATen's fp32 copy is its offset in
    that copy, ``row_offsets(rows, inner, a_so, a_si)``, modulo 4 floats (head/tail handling).
    Output (``out_ptr``'s dtype = OUT): ``h = x * rsqrt.approx(var + eps)`` in fp32; with a
    half weight ``h`` is rounded to the weight dtype and ``h * w`` rounded to it; with an fp32
    weight ``h * w`` in fp32; without a weight ``h`` rounded to OUT. MODULATE then applies
    ``modulate_values`` (OUT-typed scale/shift unless UPCAST) and rounds once to OUT.
    WRITE_VAR stores the fp32 variance per row (diagnostics); WRITE_OUT=False skips pass 2, which
    walks the rows in [ROWS, TAIL] tiles.
    PASS1_EVICT / PASS2_EVICT: L2 eviction hints for the row loads of each pass (no effect on bits).
    """
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    WDTYPE: tl.constexpr = weight_ptr.dtype.element_ty
    T: tl.constexpr = BW * WY
    C: tl.constexpr = 4 * T if VECTORIZED else T
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, C)
    x_row = row_offsets(rows, inner, x_so, x_si)[:, None]
    u_row = row_offsets(rows, inner, u_so, u_si)[:, None]
    g_row = row_offsets(rows, inner, g_so, g_si)[:, None]
    r_row = row_offsets(rows, inner, r_so, r_si)[:, None]

    # pass 1: sums of squares in ATen's order (chunk order is the accumulation order)
    acc = tl.zeros((ROWS, C), dtype=tl.float32)
    a1 = acc
    a2 = acc
    a3 = acc
    if VECTORIZED:
        start = 0
        vec_end = width
        if MISALIGNED:
            # Rows of the fp32 copy start s = (offset % 4) floats past a 16-byte boundary: the
            # h = (4 - s) % 4 head elements go into accumulator 0 of threads s..3 first, the
            # float4 vectors start at element h, and the (D - h) % 4 tail elements are added
            # into accumulator 0 of threads 0, 1, 2 after the vectors.
            s = (row_offsets(rows, inner, a_so, a_si) % 4).to(tl.int32)[:, None]
            start = (4 - s) % 4
            vec_end = width - (width - start) % 4
            p = cols[None, :] // 4
            first = (cols[None, :] % 4) == 0
            head = p - s
            head_ok = row_ok[:, None] & first & (head >= 0) & (head < start)
            acc = _chunk_squares(x_ptr, update_ptr, gate_ptr, res_ptr, x_row, u_row, g_row, r_row,
                                 tl.where(head_ok, head, 0), head_ok, DTYPE, GATED, PASS1_EVICT)
        for j in tl.range(0, n_chunks, loop_unroll_factor=UNROLL):  # sequential adds, any unrolling
            c = start + j * C + cols[None, :]
            acc = add_rn(acc, _chunk_squares(x_ptr, update_ptr, gate_ptr, res_ptr, x_row, u_row, g_row, r_row,
                                             c, row_ok[:, None] & (c < vec_end), DTYPE, GATED, PASS1_EVICT))
        if MISALIGNED:
            tail = vec_end + p
            tail_ok = row_ok[:, None] & first & (tail < width)
            acc = add_rn(acc, _chunk_squares(x_ptr, update_ptr, gate_ptr, res_ptr, x_row, u_row, g_row, r_row,
                                             tl.where(tail_ok, tail, 0), tail_ok, DTYPE, GATED, PASS1_EVICT))
    else:
        for j in tl.static_range(CHUNKS):  # n_chunks <= 4 here; chunk j feeds accumulator j % 4
            c = j * C + cols[None, :]
            sq = _chunk_squares(x_ptr, update_ptr, gate_ptr, res_ptr, x_row, u_row, g_row, r_row,
                                c, row_ok[:, None] & (c < width), DTYPE, GATED, PASS1_EVICT)
            if j % 4 == 0:
                acc = add_rn(acc, sq)
            elif j % 4 == 1:
                a1 = add_rn(a1, sq)
            elif j % 4 == 2:
                a2 = add_rn(a2, sq)
            else:
                a3 = add_rn(a3, sq)
    total = row_total(acc, a1, a2, a3, ROWS, BW, WY, LOG_BW, LOG_WY, VECTORIZED)
    var = mul_rn(total, as_fp32(factor))
    if WRITE_VAR:
        tl.store(var_ptr + rows, var, mask=row_ok)
    rstd = rsqrt_approx(add_rn(var, as_fp32(eps)))[:, None]

    if WRITE_OUT:
        # pass 2: the elementwise tail
        if GATED:
            tl.debug_barrier()  # the new residual written above is visible to every thread
            src_ptr = res_ptr
            src_row = r_row
        else:
            src_ptr = x_ptr
            src_row = x_row
        o_row = row_offsets(rows, inner, o_so, o_si)[:, None]
        if MODULATE:
            sc_row = row_offsets(rows, inner, sc_so, sc_si)[:, None]
            sh_row = row_offsets(rows, inner, sh_so, sh_si)[:, None]
        # any tiling is exact here (elementwise); TAIL-wide tiles keep loads and stores wide
        # (own names: pass 1's unrolled scalar loop leaves a [1, C]-shaped ``c`` in scope, which a
        # [1, TAIL] reassignment here would turn into a loop-carried variable of another shape)
        for t in tl.range(0, tl.cdiv(width, TAIL), loop_unroll_factor=UNROLL):
            tc = t * TAIL + tl.arange(0, TAIL)[None, :]
            mask = row_ok[:, None] & (tc < width)
            v = tl.load(src_ptr + src_row + tc, mask=mask, other=0.0, eviction_policy=PASS2_EVICT).to(tl.float32)
            y = mul_rn(v, rstd)
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + tc, mask=tc < width, other=0.0).to(tl.float32)
                if WDTYPE != tl.float32:
                    y = rounded(y, WDTYPE)
                y = mul_rn(y, w)
            y = round_to(y, OUT)
            if MODULATE:
                scale = tl.load(scale_ptr + sc_row + tc, mask=mask, other=0.0)
                shift = scale
                if HAS_SHIFT:
                    shift = tl.load(shift_ptr + sh_row + tc, mask=mask, other=0.0)
                y = modulate_values(y, scale, shift, HAS_SHIFT, UPCAST)
            tl.store(out_ptr + o_row + tc, y, mask=mask)


#: L2 eviction hints (pass 1, pass 2) for the row loads: pass 2 re-reads the rows pass 1 read.
L2_HINTS = ("", "")


def launch_shape(chunk: int, width: int) -> tuple[int, int, int, int]:
    """Default (ROWS, num_warps, UNROLL, TAIL): ~512 elements per pass-1 chunk tile, 4 warps,
    loops unrolled twice (more loads in flight; the accumulation order is unchanged), pass-2
    tiles of ~2048 elements. ROWS does not follow small row counts (masked rows cost little;
    fewer compiled variants). Chosen by ``bench_rms_norm.py --tune-quick`` on an H200: at
    [4224, 4096] 24.5 us (gated 49.7 us) against 27.4 us (63.7 us) with 128-wide pass-2 tiles
    and 4x unrolling."""
    rows = max(1, 512 // chunk)
    return rows, 4, 2, tail_block(chunk, width, rows)


def tail_block(chunk: int, width: int, rows: int) -> int:
    """Width of pass 2's tiles: ~2048 elements per tile of ``rows`` rows, at least one chunk,
    at most the row (rounded up to a power of two)."""
    return min(next_power_of_2(width), max(chunk, 2048 // rows))


def rms_norm_rows(
    x, weight, eps, factor, cfg, out, *, update=None, gate=None, new_residual=None,
    scale=None, shift=None, upcast=False, variance=None, write_out=True,
    copy_strides=None, rows_per_program=None, num_warps=None, unroll_factor=None, tail=None, l2_hints=None,
):
    """Launch :func:`rms_norm_kernel` over ``x``'s rows.

    ``cfg``: the emulated ATen config (:class:`exactdit.aten_reduce.ReduceConfig`; one launch,
    one CTA per row, D % 4 == 0 when vectorized). ``factor``: ATen's mean factor for the real M.
    With ``update``/``gate`` the rows are the new residual (written to ``new_residual``).
    ``variance``: optional fp32 [M] output of the per-row variance.
    ``copy_strides``: (outer, inner) strides of the rows in ATen's fp32 copy of ``x`` (needed
    only when D % 4 != 0 on the vectorized path: they decide each row's misalignment).
    """
    shape = tuple(x.shape)
    n_rows, inner, D = rows_of(shape)
    strides = []
    for t in (x, update, gate, scale, shift, out, new_residual):
        strides += list(row_strides(t, shape)) if t is not None else [0, 0]
    misaligned = bool(cfg.vectorize_input and D % 4 != 0)
    if misaligned and copy_strides is None:
        raise ValueError("rows misaligned in ATen's fp32 copy need copy_strides")
    strides += list(copy_strides) if misaligned else [0, 0]
    bw = cfg.block_width
    wy = cfg.warps_per_row
    chunk = 4 * bw * wy if cfg.vectorize_input else bw * wy
    chunks = -(-D // chunk)
    rows, warps, unroll, _ = launch_shape(chunk, D)
    rows = rows_per_program or rows
    tail = tail or tail_block(chunk, D, rows)
    warps = num_warps or warps
    unroll = unroll_factor or unroll
    dummy = x
    args = [
        x,
        update if update is not None else dummy,
        gate if gate is not None else dummy,
        weight if weight is not None else dummy,
        scale if scale is not None else dummy,
        shift if shift is not None else (scale if scale is not None else dummy),
        out if out is not None else dummy,
        new_residual if new_residual is not None else dummy,
        variance if variance is not None else dummy,
    ]
    grid = (-(-n_rows // rows),)
    rms_norm_kernel[grid](
        *args, n_rows, inner, D, chunks, float(factor), float(eps), *strides,
        GATED=update is not None, HAS_WEIGHT=weight is not None, MODULATE=scale is not None,
        HAS_SHIFT=shift is not None, UPCAST=bool(upcast), WRITE_VAR=variance is not None,
        WRITE_OUT=bool(write_out), VECTORIZED=bool(cfg.vectorize_input), MISALIGNED=misaligned, BW=bw, WY=wy,
        LOG_BW=bw.bit_length() - 1, LOG_WY=wy.bit_length() - 1,
        CHUNKS=0 if cfg.vectorize_input else chunks, ROWS=rows, UNROLL=unroll, TAIL=tail,
        PASS1_EVICT=(l2_hints or L2_HINTS)[0], PASS2_EVICT=(l2_hints or L2_HINTS)[1],
        num_warps=warps, **LAUNCH_OPTIONS,
    )
    return out
