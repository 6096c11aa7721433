"""CPU tests for exactdit.aten.reduce (config rules and the fp32 order model)."""

import numpy as np
import pytest
import torch

from exactdit.aten.reduce import (
    ReduceConfig,
    mean_factor,
    mean_lastdim_config,
    mean_lastdim_launches,
    mean_lastdim_reference_order,
    row_shift,
    split_rows_for_32bit_indexing,
)

F = np.float32

# ---------------------------------------------------------------------------
# Config table, derived by hand from setReduceConfig (H200: 132 SMs, 2048
# threads/SM). Columns: M, D, vectorize, bw, bh, warps_split, ctas,
# threads_per_row, rows_per_block, grid_x.
# ---------------------------------------------------------------------------
CONFIG_TABLE = [
    # NUMERICS.md measured case: one warp per row, 16 rows per block
    (4096, 4096, True, 32, 16, False, 1, 32, 16, 256),
    (4224, 4096, True, 32, 16, False, 1, 32, 16, 264),
    # one row: 512 lanes, vpt = 8 < 16 so no warp split
    (1, 4096, True, 512, 1, False, 1, 512, 1, 1),
    # one row, D = 16384: vpt = 32 >= 16 -> "warp split" with bh = 1
    (1, 16384, True, 512, 1, True, 1, 512, 1, 1),
    # vpt = 512 >= 256 -> 16 warps share one row
    (16, 16384, True, 32, 16, True, 1, 512, 1, 16),
    # D = 8192: vpt = 256 reaches the cap -> warp split even at large M
    (4224, 8192, True, 32, 16, True, 1, 512, 1, 4224),
    (2, 8192, True, 256, 2, True, 1, 512, 1, 2),
    # D = 6144: vpt = 192 < 256 -> one warp per row
    (4224, 6144, True, 32, 16, False, 1, 32, 16, 264),
    # dim0 = 512 -> p0 = 512; bh = 8 -> bw = 64 (two warps along x)
    (8, 2048, True, 64, 8, False, 1, 64, 8, 1),
    # scalar path (D < 128): bw from floor_pow2(D) = 64
    (4096, 100, False, 32, 16, False, 1, 32, 16, 256),
    (1, 127, False, 64, 1, False, 1, 64, 1, 1),
    (8, 64, False, 64, 8, False, 1, 64, 8, 1),
    (17, 96, False, 32, 16, False, 1, 32, 16, 2),
    # D = 128 is the first vectorized width (dim0 >= 128)
    (1, 128, True, 32, 1, False, 1, 32, 1, 1),
    # dim0 = 250 -> 128; M = 3 -> bh = 2; bw = 128
    (3, 1000, True, 128, 2, False, 1, 128, 2, 2),
    # dim0 = 511 -> 256
    (2, 2047, True, 256, 2, False, 1, 256, 2, 1),
    # dim0 = 1023 -> 512, M = 7 -> bh = 4, bw = 128, vpt = 32 < 64
    (7, 4095, True, 128, 4, False, 1, 128, 4, 2),
    # M = 31 -> bh 16; D = 12288 vpt = 384 -> split
    (31, 12288, True, 32, 16, True, 1, 512, 1, 31),
    # global (multi-CTA) reduce, only reachable with very long rows:
    # vpt after warp split = 257 >= 256; c1 = 528, c2 = 17, c3 = 2 -> 17
    (1, 131075, True, 512, 1, True, 17, 512 * 17, 1, 1),
]


@pytest.mark.parametrize("row", CONFIG_TABLE, ids=lambda r: f"M{r[0]}_D{r[1]}")
def test_config_table(row):
    M, D, vec, bw, bh, split, ctas, T, rpb, grid = row
    c = mean_lastdim_config(M, D)
    got = (c.vectorize_input, c.block_width, c.block_height, c.warps_split_row,
           c.ctas_per_output, c.threads_per_row, c.rows_per_block, c.grid_x)
    assert got == (vec, bw, bh, split, ctas, T, rpb, grid)
    assert c.num_threads == bw * bh <= 512


def test_config_fields_frozen():
    c = mean_lastdim_config(4096, 4096)
    assert isinstance(c, ReduceConfig)
    with pytest.raises(Exception):
        c.block_width = 64  # type: ignore[misc]


def test_num_sms_changes_global_split():
    # fewer SMs -> smaller target grid -> fewer CTAs per row (c1 = 4 with 1 SM)
    assert mean_lastdim_config(1, 131075, num_sms=1).ctas_per_output == 4
    assert mean_lastdim_config(1, 131075).ctas_per_output == 17


def test_32bit_split_pieces():
    # 4*rows*D - 3 <= 2**31 - 1  <=>  rows <= 32768 for D = 16384
    assert split_rows_for_32bit_indexing(32768, 16384) == [(0, 32768)]
    assert split_rows_for_32bit_indexing(32769, 16384) == [(0, 16384), (16384, 16385)]
    assert split_rows_for_32bit_indexing(100000, 16384) == [
        (0, 25000), (25000, 25000), (50000, 25000), (75000, 25000)]
    assert split_rows_for_32bit_indexing(4224, 4096) == [(0, 4224)]
    launches = mean_lastdim_launches(100000, 16384)
    assert [l[2].M for l in launches] == [25000] * 4


def test_mean_factor():
    f32 = lambda v: float(np.float32(v))
    assert mean_factor(4096, 4096) == 2.0 ** -12
    assert mean_factor(7, 3072) == f32(f32(7) / f32(7 * 3072))
    # M*D = 16785409 is not representable in fp32: factor != fl(1/D)
    assert mean_factor(4097, 4097) != f32(1.0 / 4097)
    assert mean_factor(4097, 4097) == f32(np.float32(4097) / np.float32(16785409))


def test_row_shift():
    assert [row_shift(r, 2047) for r in range(5)] == [0, 3, 2, 1, 0]
    assert [row_shift(r, 1000) for r in range(3)] == [0, 0, 0]
    assert row_shift(1, 4096, base_elem_offset=1) == 1


# ---------------------------------------------------------------------------
# Independent scalar simulator, written thread by thread with numpy float32
# scalars (each op rounds to fp32). Deliberately structured differently from
# the vectorized model: it follows the kernel's loops literally.
# ---------------------------------------------------------------------------
def _x_reduce(vals):
    v = list(vals)
    n = len(v)
    if n > 32:
        off = n // 2
        while off >= 32:
            v = [v[i] + v[i + off] if i < off else v[i] for i in range(n)]
            off //= 2
        n = 32
        v = v[:32]
    off = n // 2
    while off > 0:  # shuffle down: out-of-range source returns own value
        v = [v[i] + (v[i + off] if i + off < n else v[i]) for i in range(n)]
        off //= 2
    return v[0]


def _y_reduce(vals):
    v = list(vals)
    off = len(v) // 2
    while off > 0:
        v = [v[i] + v[i + off] if i < off else v[i] for i in range(len(v))]
        off //= 2
    return v[0]


def _sim_thread(row, cfg, s, x, y, c):
    D = len(row)
    T = cfg.threads_per_row
    wy = cfg.warps_per_row
    p = x + y * cfg.block_width + c * cfg.block_width * wy
    tail_ok = (y == 0 or not cfg.warps_split_row) and c == 0
    zero = F(0)
    if cfg.vectorize_input:
        base = 0
        end = D
        value = zero
        if s > 0:
            base -= s
            end += s
            if s <= x < 4 and tail_ok:
                value = value + row[base + x]
            end -= 4
            base += 4
        acc = [value, zero, zero, zero]
        idx = p
        while idx * 4 + 3 < end:
            for i in range(4):
                acc[i] = acc[i] + row[base + idx * 4 + i]
            idx += T
        tail_start = end - end % 4
        if tail_ok:
            k = tail_start + x
            if k < end:
                acc[0] = acc[0] + row[base + k]
    else:
        acc = [zero] * 4
        idx = p
        while idx + 3 * T < D:
            for i in range(4):
                acc[i] = acc[i] + row[idx + i * T]
            idx += 4 * T
        for i in range(4):
            if idx >= D:
                break
            acc[i] = acc[i] + row[idx]
            idx += T
    return ((acc[0] + acc[1]) + acc[2]) + acc[3]


def _sim_row_sum(row, cfg, s):
    row = [F(v) for v in row]
    bw, wy, C = cfg.block_width, cfg.warps_per_row, cfg.ctas_per_output
    block_totals = []
    for c in range(C):
        warp_totals = []
        for y in range(wy):
            lanes = [_sim_thread(row, cfg, s, x, y, c) for x in range(bw)]
            warp_totals.append(_x_reduce(lanes))
        block_totals.append(_y_reduce(warp_totals))
    if C == 1:
        return block_totals[0]
    n = bw * cfg.block_height
    per_thread = []
    for q in range(n):
        a = F(0)
        for cc in range(q, C, n):
            a = a + block_totals[cc]
        per_thread.append(a)
    cols = []
    for x in range(bw):
        cols.append(_y_reduce([per_thread[x + y * bw] for y in range(cfg.block_height)]))
    return _x_reduce(cols)


def _rows_with_range(R, D, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(R, D, generator=g)
    # large dynamic range: per-row scales and a few spikes
    scale = torch.exp2(torch.randint(-20, 20, (R, 1), generator=g).float())
    h = h * scale
    spikes = torch.rand(R, D, generator=g) < 0.01
    h = torch.where(spikes, h * 1000.0, h)
    return h.float().pow(2)


SIM_CASES = [
    (4096, 4096, [0, 1, 4095]),
    (1, 4096, [0]),
    (2, 2047, [0, 1]),
    (5, 2047, [2, 3, 4]),
    (3, 1000, [1, 2]),
    (7, 4095, [1, 2, 3, 6]),
    (16, 16384, [0, 1, 2, 3, 4, 5]),
    (2, 8192, [0, 1]),
    (4224, 8192, [0, 1, 2, 3]),
    (31, 12288, [0, 1, 2]),
    (8, 2048, [3]),
    (1, 127, [0]),
    (4096, 100, [0, 77]),
    (17, 96, [16]),
    (1, 128, [0]),
    (3, 129, [1, 2]),
    (4097, 4097, [4096]),
    (1, 131075, [0]),  # multi-CTA path
]


@pytest.mark.parametrize("M,D,rows", SIM_CASES, ids=lambda v: str(v))
def test_model_matches_thread_simulator(M, D, rows):
    x = _rows_with_range(len(rows), D, seed=M * 7 + D)
    got = mean_lastdim_reference_order(x, num_rows=M, row_index=rows)
    cfg = mean_lastdim_launches(M, D)[0][2]
    factor = F(mean_factor(M, D))
    for k, r in enumerate(rows):
        s = row_shift(r, D)
        want = _sim_row_sum(x[k].numpy(), cfg, s) * factor
        assert np.float32(got[k].item()).view(np.uint32) == np.float32(want).view(np.uint32), (r, s)


@pytest.mark.parametrize("M,D", [(1, 64), (4, 96), (31, 127), (1, 4096), (7, 2047), (513, 1000),
                                 (4096, 3072), (17, 16384), (2, 5120)])
def test_close_to_float64_mean(M, D):
    g = torch.Generator().manual_seed(M + D)
    x = torch.randn(M, D, generator=g).pow(2)
    got = mean_lastdim_reference_order(x).double()
    ref = x.double().mean(-1)
    rel = ((got - ref).abs() / ref.abs()).max().item()
    assert rel < 1e-6


def test_deterministic_and_keeps_row_identity():
    x = _rows_with_range(64, 2047, seed=3)
    a = mean_lastdim_reference_order(x)
    b = mean_lastdim_reference_order(x.clone())
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # computing a subset of rows with their absolute indices gives the same bits
    sub = [5, 6, 7, 40]
    c = mean_lastdim_reference_order(x[sub], num_rows=64, row_index=sub)
    assert torch.equal(c.view(torch.int32), a[sub].view(torch.int32))


def test_order_depends_on_M():
    # same row content, reduced as part of M=1 vs M=4096: different trees, so
    # some rows must come out different (as measured on the H200).
    x = _rows_with_range(64, 4096, seed=11)
    one = torch.stack([mean_lastdim_reference_order(x[i:i + 1])[0] for i in range(64)])
    many = mean_lastdim_reference_order(x, num_rows=4096, row_index=list(range(64)))
    assert not torch.equal(one, many)


def test_order_depends_on_alignment():
    x = _rows_with_range(32, 2047, seed=5)
    a = mean_lastdim_reference_order(x, num_rows=8, row_index=[0] * 32)
    b = mean_lastdim_reference_order(x, num_rows=8, row_index=[1] * 32)
    assert not torch.equal(a, b)


def test_not_a_sequential_sum():
    x = _rows_with_range(64, 4096, seed=9)
    got = mean_lastdim_reference_order(x, return_sums=True)
    seq = torch.zeros(64)
    for j in range(4096):
        seq = seq + x[:, j]
    assert not torch.equal(got, seq)


@pytest.mark.parametrize("M,D", [(4096, 4096), (2, 2047), (7, 4095), (1, 127), (16, 16384),
                                 (3, 1000), (4096, 100), (5, 130)])
def test_each_element_counted_once(M, D):
    # one-hot rows at every position and for every misalignment: the sum must
    # be exactly the marker value (drops give 0, duplicates give 2x).
    eye = torch.eye(D) * 3.0
    for s in range(4):
        rows = [r for r in range(M) if row_shift(r, D) == s][:1]
        if not rows:
            continue
        got = mean_lastdim_reference_order(eye, num_rows=M, row_index=rows * D, return_sums=True)
        assert torch.equal(got, torch.full((D,), 3.0)), s


@pytest.mark.parametrize("M,D", [(1, 64), (4224, 4096), (3, 2047), (1, 16384), (9, 12288)])
def test_sum_of_ones_and_integers_exact(M, D):
    ones = torch.ones(min(M, 8), D)
    rows = list(range(min(M, 8)))
    s = mean_lastdim_reference_order(ones, num_rows=M, row_index=rows, return_sums=True)
    assert torch.equal(s, torch.full((len(rows),), float(D)))
    ints = (torch.arange(D) % 997 + 1).float().expand(len(rows), D)
    s = mean_lastdim_reference_order(ints, num_rows=M, row_index=rows, return_sums=True)
    assert torch.equal(s, torch.full((len(rows),), float(ints[0].double().sum())))


def test_project_is_multiply_by_factor():
    x = torch.ones(1, 4097) * 5.0
    got = mean_lastdim_reference_order(x, num_rows=4097, row_index=[0])
    want = torch.tensor(4097 * 5.0, dtype=torch.float32) * torch.tensor(mean_factor(4097, 4097), dtype=torch.float32)
    assert torch.equal(got, want.reshape(1))


def test_hypothesis_knobs():
    # D > 128 (older rule) makes D = 128 a scalar-load launch
    assert mean_lastdim_config(1, 128, vectorize_min_dim0=129).vectorize_input is False
    assert mean_lastdim_config(1, 129, vectorize_min_dim0=129).vectorize_input is True
    x = _rows_with_range(32, 16384, seed=2)
    a = mean_lastdim_reference_order(x, num_rows=64)  # D = 16384: warps split the row
    b = mean_lastdim_reference_order(x, num_rows=64, block_order="yx")
    assert not torch.equal(a, b)
    c = mean_lastdim_reference_order(x, num_rows=64, factor=1.0)
    assert torch.equal(c, mean_lastdim_reference_order(x, num_rows=64, return_sums=True))
