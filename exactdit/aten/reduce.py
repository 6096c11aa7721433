"""Model of ATen's CUDA generic reduction for ``x.mean(-1)`` on fp32 rows.

Scope: ``x`` is a dense float32 tensor viewed as ``[M, D]`` (last dim stride 1,
rows back to back, storage start 16-byte aligned unless told otherwise) and the
op is ``x.mean(-1, keepdim=...)`` on an NVIDIA GPU (defaults: H200, 132 SMs,
2048 resident threads per SM). This is the variance step of diffusers'
``RMSNorm``.

Source read (see ``docs``/report): ``ATen/native/cuda/Reduce.cuh`` as shipped in
the torch 2.13.0 wheel headers, cross-checked against stored upstream snapshots
that already contain the two late-2025 numerics changes (descending warp
shuffle offsets; block-x combine before block-y combine in the main path),
which therefore are in 2.11 as well; ``ReduceMomentKernel.cu`` /
``SharedReduceOps.h`` (``MeanOps``) and ``ReduceOps.cpp`` (CUDA mean goes
straight to ``mean_stub``, not sum + div); ``TensorIterator.cpp`` (32-bit
splitting). Everything below is a paraphrase written for this project.

What ATen does for this case, in short
--------------------------------------
* TensorIterator turns ``[.., D]`` reduced over the last dim into a 2-d problem:
  ``D`` reduced values per output, ``M`` outputs, reduced dim fastest.
* If any operand would need offsets beyond int32 (``4*M*D`` bytes > 2**31-1),
  the iterator is cut in halves along the row dim (first half = ``M//2`` rows),
  recursively, and each piece is launched separately with *its own* row count
  deciding the launch shape. The mean factor is computed once from the full
  problem.
* Launch shape (``setReduceConfig`` for float, vt0 = 4, input vector = 4):

  - ``dim0 = D``, ``dim1 = M``. If ``D >= 128`` loads are float4 vectors
    ("vectorize along input") and ``dim0 = D // 4``.
  - ``p0 = 512 if dim0 >= 512 else largest power of two <= dim0``; same for
    ``p1`` from ``dim1``. ``bw = min(p0, 32)``; ``bh = min(p1, 512 // bw)``;
    then ``bw = min(p0, 512 // bh)``. Block is ``bw x bh`` threads.
  - Lanes along x split a row (lane stride 1 in units of the load).
  - ``vpt = ceil(D / bw)`` (counted in *elements*, even when vectorized). If
    ``vpt >= min(16 * bh, 256)`` the ``bh`` warps of a block also split the same
    row (one row per block); otherwise each y index takes its own row
    (``bh`` rows per block).
  - Only when warps split the row: if ``ceil(D / (bw*bh)) >= 256`` and the grid
    is not larger than ``num_sms * (2048 // (bw*bh))``, the row is additionally
    split across ``ctas`` blocks that combine through a global staging buffer.
    For ``D <= 16384`` this never triggers; it is modelled anyway.

* Per-thread work, vectorized path (``D >= 128``): the row start may be
  misaligned; ``s = (address / 4) % 4``. If ``s > 0`` the first ``4 - s``
  elements are the "head": lane ``t`` for ``s <= t < 4`` starts its accumulator
  0 with ``0 + row[t - s]``. The rest of the row (``D - h`` elements,
  ``h = (4 - s) % 4``) is read as aligned float4 vectors; vector ``k`` goes to
  the thread whose input index is ``k mod T`` (``T`` = threads that split the
  row), component ``i`` into that thread's accumulator ``i`` (4 accumulators,
  sequential adds). The leftover ``(D - h) % 4`` elements ("tail") are added
  into accumulator 0 of lanes ``0, 1, 2`` after the vector loop. Head and tail
  are done only by warp 0 of block 0 of the row. The four accumulators are
  then combined as ``((a0 + a1) + a2) + a3``.
* Non-vectorized path (``D < 128``): thread ``p`` reads elements ``p, p+T,
  p+2T, ...``; its ``j``-th element goes into accumulator ``j % 4``; combine as
  above.
* Across threads: first along x (lane ``t`` adds lane ``t + off`` for
  ``off = bw/2, bw/4, ..., 1``; the steps with ``off >= 32`` go through shared
  memory, the rest are warp shuffles, same arithmetic), then along y if the
  warps split the row (``warp w`` adds ``warp w + off``, ``off = bh/2 .. 1``).
  With a cross-block split, block ``c`` stores its total; the last block's
  thread ``q`` sums staged totals ``q, q + bw*bh, ...`` sequentially (from 0),
  then a y tree, then an x tree, as above.
* Project: ``out = total * factor`` (one fp32 multiply) with
  ``factor = float32(M) / float32(M * D)`` computed in fp32 on the host using
  the *full* M (not ``1/D``: it differs when ``M*D`` is not exactly
  representable in fp32).

Not modelled: NaN payloads (the GPU returns a canonical NaN), denormal
flushing (none expected: ATen is built without fast-math).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Sequence, Tuple

__all__ = [
    "ReduceConfig",
    "mean_lastdim_config",
    "mean_lastdim_launches",
    "mean_factor",
    "split_rows_for_32bit_indexing",
    "row_shift",
    "mean_lastdim_reference_order",
]

# Constants of the float32 instantiation (vt0 = 4, input vector = 4 floats,
# 16-byte alignment of a float4, 512 threads max for non-complex-double).
VT0 = 4
INPUT_VEC = 4
ALIGN_ELEMS = 4
MAX_THREADS = 512
WARP = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
INT32_MAX = 2**31 - 1


def _floor_pow2(n: int) -> int:
    """Largest power of two <= n, and at least 1."""
    n = int(n)
    if n < 1:
        return 1
    return 1 << (n.bit_length() - 1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """Launch shape ATen picks for one reduce launch of ``M`` rows of length ``D``.

    Fields that fix the addition order:

    ``vectorize_input``: float4 loads (D >= 128) vs scalar loads.
    ``block_width``: lanes (threadIdx.x) splitting one row; power of two.
    ``block_height``: threadIdx.y extent of the block.
    ``warps_split_row``: if True the ``block_height`` y-slices of a block share
      one row (combined by a y tree after the x tree); if False each y index
      owns its own row and ``rows_per_block == block_height``.
    ``ctas_per_output``: blocks sharing one row (global staging reduce) - 1 for
      every D <= 16384.
    ``threads_per_row``: ``block_width * (block_height if warps_split_row else
      1) * ctas_per_output``: number of distinct input indices; the thread with
      input index ``p`` reads load units ``p, p + threads_per_row, ...``.
    """

    M: int
    D: int
    vectorize_input: bool
    block_width: int
    block_height: int
    warps_split_row: bool
    ctas_per_output: int
    # derived / informative
    num_threads: int
    rows_per_block: int
    threads_per_row: int
    grid_x: int
    values_per_thread: int  # ATen's values_per_thread() after all splits (elements)
    vt0: int = VT0
    input_vec_size: int = INPUT_VEC

    @property
    def warps_per_row(self) -> int:
        return self.block_height if self.warps_split_row else 1

    def short(self) -> str:
        return (
            f"vec={int(self.vectorize_input)} bw={self.block_width} bh={self.block_height} "
            f"wsplit={int(self.warps_split_row)} ctas={self.ctas_per_output} "
            f"T={self.threads_per_row} rows/blk={self.rows_per_block} grid={self.grid_x}"
        )


def mean_lastdim_config(
    M: int,
    D: int,
    *,
    num_sms: int = 132,
    max_threads_per_sm: int = 2048,
    vectorize_min_dim0: int = 128,
) -> ReduceConfig:
    """Launch config ATen uses for one launch reducing ``M`` fp32 rows of ``D``.

    ``M`` here is the row count of the launch. For tensors needing the 32-bit
    split (``4*M*D > 2**31 - 1``) use :func:`mean_lastdim_launches`, which
    calls this per piece.

    ``vectorize_min_dim0`` is a hypothesis knob for the probe: the source read
    vectorizes when ``D >= 128``; older releases used ``D > 128`` (pass 129).
    """
    M = int(M)
    D = int(D)
    if M < 1 or D < 1:
        raise ValueError("M and D must be positive")
    num_outputs = M
    num_inputs = D

    dim0 = num_inputs
    dim1 = num_outputs
    vectorize = dim0 >= vectorize_min_dim0  # reduced dim fastest, stride 1, one reduced dim
    if vectorize:
        dim0 = dim0 // INPUT_VEC

    # block dimensions
    p0 = MAX_THREADS if dim0 >= MAX_THREADS else _floor_pow2(dim0)
    p1 = MAX_THREADS if dim1 >= MAX_THREADS else _floor_pow2(dim1)
    bw = min(p0, WARP)
    bh = min(p1, MAX_THREADS // bw)
    bw = min(p0, MAX_THREADS // bh)
    num_threads = bw * bh

    # lanes split the row
    step_input = bw
    step_output = 1
    vpt = _ceil_div(num_inputs, step_input)
    threshold = min(bh * MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD)
    warps_split = vpt >= threshold
    if warps_split:
        step_input *= bh
    else:
        step_output *= bh

    grid_x = _ceil_div(num_outputs, step_output)
    ctas = 1
    blocks_per_sm = max_threads_per_sm // num_threads
    target_grid = num_sms * blocks_per_sm
    vpt = _ceil_div(num_inputs, step_input)
    if warps_split and vpt >= MAX_VALUES_PER_THREAD and grid_x <= target_grid:
        c1 = _ceil_div(target_grid, grid_x)
        c2 = _ceil_div(vpt, MIN_VALUES_PER_THREAD)
        c3 = _ceil_div(vpt, MAX_VALUES_PER_THREAD)
        ctas = max(min(c1, c2), c3)
        if ctas > 1:
            step_input *= ctas
        else:
            ctas = 1
    vpt = _ceil_div(num_inputs, step_input)

    return ReduceConfig(
        M=M,
        D=D,
        vectorize_input=vectorize,
        block_width=bw,
        block_height=bh,
        warps_split_row=warps_split,
        ctas_per_output=ctas,
        num_threads=num_threads,
        rows_per_block=step_output,
        threads_per_row=step_input,
        grid_x=grid_x,
        values_per_thread=vpt,
    )


def _fits_32bit(rows: int, D: int) -> bool:
    """TensorIterator's 32-bit test for the [D reduced, rows] fp32 problem."""
    if rows * D > INT32_MAX:
        return False
    in_max = 1 + (D - 1) * 4 + (rows - 1) * 4 * D
    out_max = 1 + (rows - 1) * 4
    return in_max <= INT32_MAX and out_max <= INT32_MAX


def split_rows_for_32bit_indexing(M: int, D: int) -> List[Tuple[int, int]]:
    """Row pieces ``(start, count)`` that ATen launches separately, in launch order.

    A piece that does not fit int32 byte offsets is cut into a first half of
    ``count // 2`` rows and the rest (the row dim always has the largest byte
    extent here), recursively.
    """
    M = int(M)
    D = int(D)
    if D * 4 > INT32_MAX:
        raise NotImplementedError("single row beyond int32 offsets is not modelled")
    out: List[Tuple[int, int]] = []

    def rec(start: int, n: int) -> None:
        if _fits_32bit(n, D):
            out.append((start, n))
            return
        first = n // 2
        rec(start, first)
        rec(start + first, n - first)

    rec(0, M)
    return out


def mean_lastdim_launches(
    M: int,
    D: int,
    *,
    num_sms: int = 132,
    max_threads_per_sm: int = 2048,
    vectorize_min_dim0: int = 128,
) -> List[Tuple[int, int, ReduceConfig]]:
    """``[(row_start, row_count, config), ...]`` for every kernel launch."""
    return [
        (s, n, mean_lastdim_config(n, D, num_sms=num_sms, max_threads_per_sm=max_threads_per_sm,
                                   vectorize_min_dim0=vectorize_min_dim0))
        for s, n in split_rows_for_32bit_indexing(M, D)
    ]


@functools.lru_cache(maxsize=1024)
def one_block_config(M: int, D: int) -> "ReduceConfig | str":
    """The configuration of ``x.mean(-1)`` over ``[M, D]`` when ATen reduces each row inside one
    block in one launch (what the fused kernels reproduce), else why not."""
    launches = mean_lastdim_launches(M, D)
    if len(launches) != 1:
        return "rows split for 32-bit indexing (M * D too large)"
    cfg = launches[0][2]
    if cfg.ctas_per_output != 1:
        return "row split across blocks"
    return cfg


@functools.lru_cache(maxsize=1024)
def mean_factor(M: int, D: int) -> float:
    """The fp32 scale ATen multiplies by: fl32(fl32(M) / fl32(M*D)) as a Python float."""
    import struct

    def f32(v: float) -> float:
        return struct.unpack("f", struct.pack("f", v))[0]

    # int -> float conversion: M*D < 2**53 so the double is exact and the
    # single rounding to fp32 matches a direct int64 -> float conversion.
    num = f32(float(int(M)))
    den = f32(float(int(M) * int(D)))
    # fp32 division correctly rounded: the double quotient of two fp32 values
    # rounded to fp32 equals the fp32 quotient (double has > 2*24+2 bits).
    return f32(num / den)


def row_shift(row: int, D: int, base_elem_offset: int = 0) -> int:
    """Misalignment ``s`` (in floats, 0..3) of the row start w.r.t. 16 bytes."""
    return (int(base_elem_offset) + int(row) * int(D)) % ALIGN_ELEMS


# ---------------------------------------------------------------------------
# Order model (torch, CPU, float32). Every fp32 operation below is a single
# torch add or multiply of float32 tensors, so each result is rounded once.
# ---------------------------------------------------------------------------


def _combine4(acc):
    """((a0 + a1) + a2) + a3 over the last dim of size 4."""
    v = acc[..., 0] + acc[..., 1]
    v = v + acc[..., 2]
    v = v + acc[..., 3]
    return v


def _halving_tree(v, dim: int):
    """Lane ``t`` adds lane ``t + off`` for off = n/2, n/4, ..., 1; returns lane 0.

    ``v.shape[dim]`` must be a power of two. Models both the shared-memory
    stages and the warp shuffle-down stages (identical arithmetic).
    """
    n = v.shape[dim]
    assert n & (n - 1) == 0, n
    off = n // 2
    while off >= 1:
        v = v.narrow(dim, 0, off) + v.narrow(dim, off, off)
        off //= 2
    return v.squeeze(dim)


def _thread_values_vectorized(rows, cfg: ReduceConfig, s: int):
    """Per-thread totals [R, T] for rows sharing misalignment ``s``."""
    import torch

    R, D = rows.shape
    T = cfg.threads_per_row
    h = (ALIGN_ELEMS - s) % ALIGN_ELEMS  # head elements
    body = D - h
    nv = body // INPUT_VEC  # aligned float4 vectors
    ntail = body % INPUT_VEC
    # acc[r, p, i]: accumulator i of the thread with input index p.
    acc = torch.zeros((R, T, INPUT_VEC), dtype=torch.float32)
    if h:
        # lanes s..3 (warp 0, block 0) start accumulator 0 with ident + head
        acc[:, s:ALIGN_ELEMS, 0] = acc[:, s:ALIGN_ELEMS, 0] + rows[:, 0:h]
    if nv:
        J = _ceil_div(nv, T)
        V = torch.zeros((R, J * T, INPUT_VEC), dtype=torch.float32)
        V[:, :nv, :] = rows[:, h : h + nv * INPUT_VEC].reshape(R, nv, INPUT_VEC)
        V = V.reshape(R, J, T, INPUT_VEC)
        # iteration j: thread p loads vector p + j*T (padding zeros are exact no-ops)
        for j in range(J):
            acc = acc + V[:, j]
    if ntail:
        start = h + nv * INPUT_VEC
        # lanes 0..ntail-1 (warp 0, block 0) add one tail element to accumulator 0
        acc[:, 0:ntail, 0] = acc[:, 0:ntail, 0] + rows[:, start : start + ntail]
    return _combine4(acc)


def _thread_values_scalar(rows, cfg: ReduceConfig):
    """Per-thread totals [R, T] for the scalar-load path (D < 128)."""
    import torch

    R, D = rows.shape
    T = cfg.threads_per_row
    J = _ceil_div(D, T)
    V = torch.zeros((R, J * T), dtype=torch.float32)
    V[:, :D] = rows
    V = V.reshape(R, J, T)
    acc = torch.zeros((R, T, VT0), dtype=torch.float32)
    # thread p's j-th element (p + j*T) goes to accumulator j % 4
    for j in range(J):
        i = j % VT0
        acc[:, :, i] = acc[:, :, i] + V[:, j]
    return _combine4(acc)


def _cross_thread(vals, cfg: ReduceConfig, block_order: str = "xy"):
    """Combine per-thread totals [R, T] into row totals [R] in ATen's order."""
    import torch

    R = vals.shape[0]
    bw = cfg.block_width
    wy = cfg.warps_per_row
    C = cfg.ctas_per_output
    # input index p = x + y*bw + c*bw*wy
    v = vals.reshape(R, C, wy, bw)
    if block_order == "xy":
        v = _halving_tree(v, 3)  # x first (shared-memory stages, then shuffles)
        v = _halving_tree(v, 2)  # then y (no-op when wy == 1)
    elif block_order == "yx":  # pre-late-2025 order, kept as a probe hypothesis
        v = _halving_tree(v, 2)
        v = _halving_tree(v, 2)
    else:
        raise ValueError(block_order)
    if C == 1:
        return v[:, 0]
    # global reduce: last block's thread q sums staged block totals q, q+n, ...
    n = bw * cfg.block_height
    Jc = _ceil_div(C, n)
    staged = torch.zeros((R, Jc * n), dtype=torch.float32)
    staged[:, :C] = v
    staged = staged.reshape(R, Jc, n)
    acc = torch.zeros((R, n), dtype=torch.float32)
    for j in range(Jc):
        acc = acc + staged[:, j]
    acc = acc.reshape(R, cfg.block_height, bw)
    acc = _halving_tree(acc, 1)  # y tree first here
    acc = _halving_tree(acc, 1)  # then x tree
    return acc


def mean_lastdim_reference_order(
    x,
    *,
    num_rows: Optional[int] = None,
    row_index: Optional[Sequence[int]] = None,
    base_elem_offset: int = 0,
    num_sms: int = 132,
    max_threads_per_sm: int = 2048,
    return_sums: bool = False,
    vectorize_min_dim0: int = 128,
    block_order: str = "xy",
    factor: Optional[float] = None,
):
    """fp32 ``x.mean(-1)`` computed with ATen's CUDA order of additions.

    ``x``: float32 tensor ``[R, D]`` (CPU) holding rows of the real problem.
    ``num_rows``: the real row count M of the GPU tensor (decides the launch
    shape and the factor); defaults to ``R``.
    ``row_index``: absolute row numbers of the rows in ``x`` (decide the
    misalignment and the 32-bit piece); defaults to ``0..R-1``.
    ``base_elem_offset``: ``(data_ptr // 4) % 4`` of the real tensor (0 for a
    fresh allocation).
    Returns a float32 tensor ``[R]`` (use ``.unsqueeze(-1)`` for keepdim), or
    the pre-project row sums when ``return_sums``.

    Hypothesis knobs (defaults = what the source says; the probe flips them to
    see which one the GPU follows): ``vectorize_min_dim0`` (see
    :func:`mean_lastdim_config`), ``block_order`` ("xy": lanes then warps;
    "yx": warps then lanes), ``factor`` (override the fp32 scale).
    """
    import torch

    if x.dim() != 2:
        raise ValueError("expected [R, D]")
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    R, D = x.shape
    M = R if num_rows is None else int(num_rows)
    if row_index is None:
        idx = torch.arange(R, dtype=torch.int64)
    else:
        idx = torch.as_tensor(list(row_index) if not torch.is_tensor(row_index) else row_index,
                              dtype=torch.int64).reshape(-1)
        if idx.numel() != R:
            raise ValueError("row_index length must equal x.shape[0]")
    if R and (int(idx.min()) < 0 or int(idx.max()) >= M):
        raise ValueError("row_index out of range")

    sums = torch.empty(R, dtype=torch.float32)
    for start, count, cfg in mean_lastdim_launches(
        M, D, num_sms=num_sms, max_threads_per_sm=max_threads_per_sm,
        vectorize_min_dim0=vectorize_min_dim0,
    ):
        in_piece = (idx >= start) & (idx < start + count)
        if not bool(in_piece.any()):
            continue
        if cfg.vectorize_input:
            shifts = (idx * D + int(base_elem_offset)) % ALIGN_ELEMS
            for s in range(ALIGN_ELEMS):
                sel = torch.nonzero(in_piece & (shifts == s)).reshape(-1)
                if sel.numel() == 0:
                    continue
                vals = _thread_values_vectorized(x[sel], cfg, s)
                sums[sel] = _cross_thread(vals, cfg, block_order)
        else:
            sel = torch.nonzero(in_piece).reshape(-1)
            vals = _thread_values_scalar(x[sel], cfg)
            sums[sel] = _cross_thread(vals, cfg, block_order)
    if return_sums:
        return sums
    f = mean_factor(M, D) if factor is None else float(factor)
    return sums * torch.tensor(f, dtype=torch.float32)
