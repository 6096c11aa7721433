"""The fp32 order model of ATen's CUDA generic reduction for ``x.mean(-1)`` (what each thread adds,
in which order: :mod:`exactdit.aten.reduce`'s docstring describes it, and its launch configuration),
the tests' independent reference for the mean kernels."""

from __future__ import annotations

from typing import Optional, Sequence

from exactdit.aten.reduce import (  # noqa: F401
    ALIGN_ELEMS, INPUT_VEC, VT0, ReduceConfig, _ceil_div, mean_factor, mean_lastdim_launches,
)


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
