"""Fused GEMM regions on the CPU (kernels in Triton's interpreter): an ``mm`` / ``addmm`` with the
pointwise work after it, against the same ATen graph run by CPU eager.

The interpreter's dot sums in numpy's order, so the GEMM operands here are small integers: every
partial sum is an integer below 2^24, exact in fp32 in any order, and the accumulator's rounding
to bf16 (the larger products) is then the one thing that can differ. Whether the kernel gives
cuBLAS's bits on a GPU is for the gate (and tests/test_gpu_gemm.py) to say."""

from __future__ import annotations

import pytest
import torch

from exactdit.engine.backend import rewrite
from exactdit.engine.templates import gemm
from tests.engine_helpers import GraphBuilder, trusted
from tests.helpers import assert_bits_equal

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def small_gemms(monkeypatch):
    """Fused GEMMs on (they are off by default), for a few hundred rows (the interpreter is slow)."""
    monkeypatch.setattr(gemm, "MIN_ROWS", 64)
    monkeypatch.setenv(gemm.CHOICE_ENV, "auto")


def _ints(shape, bound, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-bound, bound + 1, shape, generator=g).to(dtype)


def _gated_linear(m, k, n, *, bias=True, layout="nk", batch=2, dtype=torch.bfloat16):
    """``r + gate * linear(x, w, b)`` as a captured block has it: addmm on the flattened rows,
    a view back to [B, S, N], a per-batch gate."""
    b = GraphBuilder()
    x = b.input(_ints((m, k), 8, 1, dtype))
    if layout == "nk":
        w = b.input(_ints((n, k), 8, 2, dtype))
        wt = b.op(aten.t.default, w)
    else:
        wt = b.input(_ints((k, n), 8, 2, dtype))
    if bias:
        y = b.op(aten.addmm.default, b.input(torch.randn(n).to(dtype)), x, wt)
    else:
        y = b.op(aten.mm.default, x, wt)
    y3 = b.op(aten.view.default, y, [batch, m // batch, n])
    gate = b.input(torch.randn(batch, 1, n).to(dtype))
    r = b.input(torch.randn(batch, m // batch, n).to(dtype))
    out = b.op(aten.add.Tensor, r, b.op(aten.mul.Tensor, gate, y3))
    return b.module(out), b.inputs


class _Values(torch.fx.Interpreter):
    """Every node's value, by node name (region inputs are nodes of the graph before the rewrite)."""

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _run(gm, inputs):
    with torch.no_grad():
        ref = gm(*inputs)
        values = _Values(gm)
        values.values = {}
        values.run(*inputs)
        gm.meta["values"] = values.values
        report = rewrite(gm, "gemm-test")
        with trusted():
            out = gm(*inputs)
    return ref, out, report


def _regions(gm):
    return [n.target.exactdit_region for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")]


def _split(gm, op):
    """The region's other way (cuBLAS, then its epilogue) on the values the graph gave its inputs."""
    with trusted(), torch.no_grad():
        return op._split(*[gm.meta["values"][n.name] for n in op.region.inputs])


@pytest.mark.parametrize("m,k,n,bias,layout", [
    (256, 64, 96, True, "nk"),      # one column tile of 128, masked
    (130, 64, 200, False, "nk"),    # odd rows and columns: the last tiles masked both ways
    (128, 96, 256, True, "kn"),     # a row-major B, K not a multiple of the 64-wide k-tile
])
def test_gemm_with_its_epilogue_equals_eager(m, k, n, bias, layout):
    gm, inputs = _gated_linear(m, k, n, bias=bias, layout=layout)
    ref, out, report = _run(gm, inputs)
    regions = _regions(gm)
    assert [r.region.kind for r in regions] == ["gemm"], report.lines()
    assert regions[0].region.alternative is not None  # the epilogue alone (mul, add): one pointwise kernel
    assert_bits_equal(out[0], ref[0], "gated linear")
    # cuBLAS, then the epilogue's ATen nodes: the way the runtime times the kernel against
    assert_bits_equal(_split(gm, regions[0])[0], ref[0])


def test_every_way_the_runtime_times_gives_eagers_bits():
    """What the runtime times for a signature on a GPU: the kernel in each candidate tile
    configuration and cuBLAS followed by the epilogue (the one chosen is what the gate verifies)."""
    gm, inputs = _gated_linear(130, 64, 200)  # 200 columns: the wide candidates, partial tiles both ways
    ref, _, _ = _run(gm, inputs)
    (op,) = _regions(gm)
    args = [gm.meta["values"][n.name] for n in op.region.inputs]
    with trusted(), torch.no_grad():
        ways = op.gemm_ways(*args)
        assert list(ways) == [f"fused {t.label}" for t in gemm.WIDE_TILES] + ["split"]
        for name, fn in ways.items():
            assert_bits_equal(fn(*args)[0], ref[0], name)


def test_accumulator_rounds_once_before_the_epilogue():
    """Sums of up to 64 products of integers up to 8: up to 4096, not all bf16 numbers; eager
    rounds the GEMM's output to bf16 before ``gelu``-free epilogue ops read it."""
    gm, inputs = _gated_linear(128, 64, 128, bias=False)
    ref, out, _ = _run(gm, inputs)
    mm_out = (inputs[0].float() @ inputs[1].float().T)
    assert not torch.equal(mm_out, mm_out.bfloat16().float())  # the rounding is exercised
    assert_bits_equal(out[0], ref[0])


def test_an_epilogue_of_one_kernel_has_aten_as_its_alternative():
    b = GraphBuilder()
    x, w = b.input(_ints((128, 64), 8, 1)), b.input(_ints((64, 64), 8, 2))
    y = b.op(aten.mm.default, x, b.op(aten.t.default, w))
    out = b.op(aten.mul.Tensor, y, b.input(torch.randn(64).bfloat16()))
    gm = b.module(out, y)  # the GEMM's own output is handed back too
    ref, res, report = _run(gm, b.inputs)
    (op,) = _regions(gm)
    assert op.region.kind == "gemm" and op.region.alternative is None and len(op.region.outputs) == 2
    for o, r in zip(res, ref):
        assert_bits_equal(o, r)
    for o, n in zip(_split(gm, op), op.region.outputs):
        assert_bits_equal(o, gm.meta["values"][n.name], n.name)


def test_the_gemm_takes_no_prologue():
    """A value computed before the GEMM (a modulation of its input) is not in the GEMM's region:
    the kernel reads A from memory."""
    b = GraphBuilder()
    x = b.input(_ints((128, 64), 4, 1))
    a = b.op(aten.mul.Tensor, b.op(aten.add.Tensor, x, 1), 2)
    y = b.op(aten.mm.default, a, b.op(aten.t.default, b.input(_ints((64, 64), 4, 2))))
    out = b.op(aten.mul.Tensor, b.op(aten.add.Tensor, y, 1), 0.5)
    gm = b.module(out)
    ref, res, report = _run(gm, b.inputs)
    kinds = sorted(r.region.kind for r in _regions(gm))
    assert kinds == ["gemm", "pointwise"], report.lines()
    gemm_region = next(r.region for r in _regions(gm) if r.region.kind == "gemm")
    assert a not in gemm_region.nodes
    assert_bits_equal(res[0], ref[0])


@pytest.mark.parametrize("why,build", [
    ("rows", lambda b: (b.input(_ints((32, 64), 4, 1)), b.input(_ints((64, 64), 4, 2)))),
    ("fp32", lambda b: (b.input(torch.randn(128, 64)), b.input(torch.randn(64, 64)))),
    ("rows are not contiguous", lambda b: (b.op(aten.t.default, b.input(_ints((64, 128), 4, 1))),
                                           b.input(_ints((64, 64), 4, 2)))),
])
def test_gemms_the_kernel_does_not_take_stay_with_cublas(why, build):
    b = GraphBuilder()
    x, w = build(b)
    y = b.op(aten.mm.default, x, w)
    out = b.op(aten.mul.Tensor, b.op(aten.add.Tensor, y, 1), 2)
    gm = b.module(out)
    ref, res, report = _run(gm, b.inputs)
    assert all(r.region.kind != "gemm" for r in _regions(gm))
    assert any(why in reason for reason in report.gemms_left), report.lines()
    assert_bits_equal(res[0], ref[0])


def test_layout_problem_names_inputs_of_another_layout():
    gm, inputs = _gated_linear(128, 64, 64)
    _run(gm, inputs)
    (op,) = _regions(gm)
    args = [gm.meta["values"][n.name] for n in op.region.inputs]
    assert gemm.layout_problem(op.region, args) is None
    a_pos = op.region.inputs.index(gemm.operands(op.region.anchor)[0])
    args[a_pos] = args[a_pos].t().contiguous().t()  # same values, columns contiguous
    assert "layout" in gemm.layout_problem(op.region, args)


def test_choice_is_forced_by_the_environment(monkeypatch):
    ways = {"fused a": lambda *a: None, "fused b": lambda *a: None, "split": lambda *a: None}
    monkeypatch.setenv(gemm.CHOICE_ENV, "split")
    assert gemm.choose(ways, (torch.zeros(1),))[0] == "split"
    monkeypatch.setenv(gemm.CHOICE_ENV, "fused")
    assert gemm.choose(ways, (torch.zeros(1),))[0] == "fused a"
    monkeypatch.setenv(gemm.CHOICE_ENV, "auto")
    assert gemm.choose(ways, (torch.zeros(1),)) == ("fused a", {})  # no timing on the CPU


def test_fused_gemms_are_off_by_default(monkeypatch):
    monkeypatch.delenv(gemm.CHOICE_ENV)
    gm, inputs = _gated_linear(128, 64, 64)
    ref, out, report = _run(gm, inputs)
    assert all(r.region.kind != "gemm" for r in _regions(gm))
    assert any("are off" in why for why in report.gemms_left), report.lines()
    assert_bits_equal(out[0], ref[0])


def _cat_then_linear(k0, k1, *, m=130, n=200, batch=2, permuted=True, cat_read_too=False):
    """The single block's ``proj_out(cat([attn, act(mlp)], -1))`` with its gated residual: the
    first piece a head-merging view of an attention-like output (rows adjacent when
    ``permuted``), the second computed by a pointwise chain (integers stay integers)."""
    b = GraphBuilder()
    s = m // batch
    if permuted:  # [B, S, H, D] in memory, seen as [B, H, S, D] and back: a view that merges
        heads = b.op(aten.permute.default, b.input(_ints((batch, s, 2, k0 // 2), 4, 3)), [0, 2, 1, 3])
        attn = b.op(aten.view.default, b.op(aten.transpose.int, heads, 1, 2), [batch, s, k0])
    else:
        attn = b.input(_ints((batch, s, k0), 4, 3))
    mlp = b.input(_ints((batch, s, k1), 3, 4))
    act = b.op(aten.mul.Tensor, b.op(aten.add.Tensor, mlp, 1), 2)
    cat = b.op(aten.cat.default, [attn, act], -1)
    rows = b.op(aten.view.default, cat, [m, k0 + k1])
    w = b.input(_ints((n, k0 + k1), 4, 5))
    y = b.op(aten.addmm.default, b.input(torch.randn(n).bfloat16()), rows, b.op(aten.t.default, w))
    y3 = b.op(aten.view.default, y, [batch, s, n])
    out = b.op(aten.add.Tensor, b.input(torch.randn(batch, s, n).bfloat16()),
               b.op(aten.mul.Tensor, b.input(torch.randn(batch, 1, n).bfloat16()), y3))
    if cat_read_too:
        return b.module(out, b.op(aten.sum.default, cat)), b.inputs, cat
    return b.module(out), b.inputs, cat


@pytest.mark.parametrize("k1", [128, 96])  # the last piece: whole k-tiles, or a tail the descriptor pads
def test_a_cat_along_k_is_read_piece_by_piece(k1):
    """No cat is written: the GEMM's kernel reads each piece as the K range it fills, in order."""
    gm, inputs, cat = _cat_then_linear(64, k1)
    ref, out, report = _run(gm, inputs)
    (op,) = [r for r in _regions(gm) if r.region.kind == "gemm"]
    assert cat in op.region.nodes and gemm.prologue(op.region) is not None, report.lines()
    assert all(cat not in r.region.nodes for r in _regions(gm) if r is not op)
    assert "cat" not in report.left, report.lines()
    # the residual [2, 65, 200] is read as one [130, 200] matrix (its batch and token dims merge)
    assert op.region.kernels[0].source.count(".load([om, on_epi])") == 1
    assert_bits_equal(out[0], ref[0], "cat read as K ranges")
    args = [gm.meta["values"][n.name] for n in op.region.inputs]
    with trusted(), torch.no_grad():
        for name, fn in op.gemm_ways(*args).items():  # ATen's cat then cuBLAS, and each tile
            assert_bits_equal(fn(*args)[0], ref[0], name)
    pieces = [p for p, _, _ in gemm.prologue(op.region)[1]]
    assert gemm.layout_problem(op.region, args) is None
    first = op.region.inputs.index(pieces[0])
    # the same values with rows that do not merge (a batch stride that is not rows x row stride)
    spread = torch.zeros(args[first].shape[0], args[first].shape[1] + 1, args[first].shape[2]).bfloat16()
    spread[:, :-1] = args[first]
    args[first] = spread[:, :-1]
    assert "layout" in gemm.layout_problem(op.region, args)


def test_a_cat_piece_that_splits_a_k_tile_is_written_as_a_cat():
    """A first piece of 96 columns would end inside a 64-wide k-tile: the cat is written (by the
    pointwise region of its second piece) and the GEMM reads it."""
    gm, inputs, cat = _cat_then_linear(96, 64, permuted=False)
    ref, out, report = _run(gm, inputs)
    gemms = [r for r in _regions(gm) if r.region.kind == "gemm"]
    assert gemms and all(gemm.prologue(r.region) is None and cat not in r.region.nodes for r in gemms)
    assert_bits_equal(out[0], ref[0])


def test_a_cat_read_elsewhere_too_is_written():
    """A cat another op also reads must exist in memory: it is no prologue."""
    gm, inputs, cat = _cat_then_linear(64, 64, permuted=False, cat_read_too=True)
    assert gemm.a_pieces(next(n for n in gm.graph.nodes if n.target is aten.addmm.default)) is None
    ref, out, report = _run(gm, inputs)
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)


def _linear_in_fp32(narrow_again: bool):
    """A projection widened to fp32: for a norm after it (written wide: ``narrow_again`` False),
    or for Wan's fp32 gated residual, cast back before it is written (True)."""
    b = GraphBuilder()
    x, w = b.input(_ints((128, 64), 4, 1)), b.input(_ints((64, 64), 4, 2))
    y = b.op(aten.mm.default, x, b.op(aten.t.default, w))
    wide = b.op(aten._to_copy.default, y, dtype=torch.float32)
    z = b.op(aten.add.Tensor, b.input(torch.randn(128, 64)), b.op(aten.mul.Tensor, wide, b.input(torch.randn(64))))
    if narrow_again:
        z = b.op(aten._to_copy.default, z, dtype=torch.bfloat16)
    return b.module(z), b.inputs, wide


@pytest.mark.parametrize("narrow_again", [False, True])
def test_an_epilogue_writes_nothing_wider_than_its_gemm(narrow_again):
    """Writing the fp32 cast of a bf16 GEMM's output moves twice the bytes its reader needs: that
    cast stays out of the GEMM's region (its reader widens where it loads); a widening that the
    epilogue narrows again before writing stays in."""
    gm, inputs, wide = _linear_in_fp32(narrow_again)
    ref, out, report = _run(gm, inputs)
    regions = [r.region for r in _regions(gm)]
    in_gemm = any(r.kind == "gemm" and wide in r.nodes for r in regions)
    assert in_gemm == narrow_again, report.lines()
    assert any(wide in r.nodes for r in regions), report.lines()  # fused either way
    assert all(o.dtype.itemsize <= 2 for r in regions if r.kind == "gemm" for o in (n.meta["val"] for n in r.outputs))
    assert_bits_equal(out[0], ref[0])


@pytest.mark.parametrize("spec", ["128,128,64,4,3,2", "128,256,64,8,4,1,1", "64,128,64,4,3", "128,256,64,8,4,1,0,2"])
def test_a_forced_tile_configuration_is_the_one_built(spec, monkeypatch):
    """``EXACTDIT_GEMM_TILES`` (what bench_gemm.py --tiles sweeps): two programs per
    multiprocessor, warp specialisation; each gives eager's bits (no tile changes a bit)."""
    tiles = gemm.Tiles.parse(spec)
    assert gemm.Tiles.parse(tiles.spec) == tiles
    monkeypatch.setenv(gemm.TILES_ENV, spec)
    gm, inputs = _gated_linear(130, 64, 200)
    ref, out, _ = _run(gm, inputs)
    (op,) = _regions(gm)
    kernel = op.region.kernels[0]
    assert ("warp_specialize=True" in kernel.source) == tiles.ws
    assert ("tl.static_range(2)" in kernel.source) == (tiles.split == 2)  # the epilogue by column halves
    tile_count = -(-130 // tiles.bm) * -(-200 // tiles.bn)
    assert kernel.grid[0] == dict(kernel.constexprs)["PROGRAMS"] == min(4 * tiles.per_sm, tile_count)
    assert_bits_equal(out[0], ref[0], tiles.label)


def test_a_malformed_tile_configuration_is_a_clear_error():
    with pytest.raises(ValueError, match="BM,BN,BK,WARPS,STAGES"):
        gemm.Tiles.parse("128,128")
    with pytest.raises(ValueError, match="epilogue split"):
        gemm.Tiles.parse("128,128,64,4,3,1,0,3")


@pytest.mark.parametrize("k1", [128, 96])
def test_the_epilogue_by_column_halves_gives_the_same_bits(k1, monkeypatch):
    """The gated residual and a cat read as K ranges, with the epilogue run on each half of the
    accumulator in turn (odd rows and columns: partial tiles in both halves)."""
    monkeypatch.setenv(gemm.TILES_ENV, "128,128,64,4,3,1,0,2")
    gm, inputs, _ = _cat_then_linear(64, k1)
    ref, out, _ = _run(gm, inputs)
    (op,) = [r for r in _regions(gm) if r.region.kind == "gemm"]
    assert "acc_lo, acc_hi" in op.region.kernels[0].source
    assert_bits_equal(out[0], ref[0])


def test_whole_tile_epilogue_operands_go_through_tma_and_are_checked_per_call():
    """The residual is read and the output written as whole tiles by TMA descriptors, the gate as
    one row broadcast; a residual whose rows are not 16-byte aligned at a call is a layout the
    kernel was not built for (that call runs the region's ATen nodes)."""
    gm, inputs = _gated_linear(130, 64, 200, batch=1)
    ref, out, _ = _run(gm, inputs)
    (op,) = _regions(gm)
    source = op.region.kernels[0].source
    assert source.count(".load([om, on_epi])") == 1 and source.count(".store([om, on_epi]") == 1, source
    assert "tl.broadcast_to(r" in source  # the gate: one row, broadcast
    assert_bits_equal(out[0], ref[0])
    args = [gm.meta["values"][n.name] for n in op.region.inputs]
    assert gemm.layout_problem(op.region, args) is None
    residual = next(i for i, n in enumerate(op.region.inputs) if tuple(n.meta["val"].shape) == (1, 130, 200))
    wider = torch.zeros(1, 130, 203).bfloat16()
    wider[..., :200] = args[residual]
    args[residual] = wider[..., :200]  # rows of 203 elements: 406 bytes apart
    assert "epilogue operand" in gemm.layout_problem(op.region, args)


def test_the_pointer_epilogue_stays_a_choice(monkeypatch):
    monkeypatch.setenv(gemm.TILES_ENV, "128,256,64,8,4,1,0,1,0")
    gm, inputs = _gated_linear(130, 64, 200, batch=1)
    ref, out, _ = _run(gm, inputs)
    (op,) = _regions(gm)
    assert "on_epi])" not in op.region.kernels[0].source
    assert_bits_equal(out[0], ref[0])


# --- found by review (each fails without its fix) --------------------------------------------------

def test_rows_do_not_merge_across_a_size_one_dim():
    """(2, 1, 65, 200) with strides (14000, 14000, 200, 1): the size-1 dim's stride says nothing;
    the batches lie 14000 apart, not 65 x 200: not one [130, 200] matrix."""
    r = torch.randn(2, 70, 200).bfloat16()[:, None, :65]
    assert gemm.rows_of(r) is None and not gemm.tma_matrix(r, 130, 200)
    assert gemm.rows_of(torch.randn(2, 1, 65, 200)[:, :, :, :]) == 200
    b = GraphBuilder()
    y = b.op(aten.mm.default, b.input(_ints((130, 64), 4, 1)), b.op(aten.t.default, b.input(_ints((200, 64), 4, 2))))
    gm = b.module(b.op(aten.add.Tensor, b.input(r), b.op(aten.view.default, y, [2, 1, 65, 200])))
    ref, out, _ = _run(gm, b.inputs)
    assert_bits_equal(out[0], ref[0])


def test_an_operand_only_another_tiling_reads_through_tma_is_checked_before_any_way_runs():
    """A third whole-tile input: past the shared-memory budget of the first tiling (pointer
    loads), through TMA in another. A misaligned one must be refused before the ways are timed
    (on the H200 the misaligned TMA read killed the process: a sticky CUDA error)."""
    m, n = 130, 200
    b = GraphBuilder()
    y = b.op(aten.mm.default, b.input(_ints((m, 64), 4, 1)), b.op(aten.t.default, b.input(_ints((n, 64), 4, 2))))
    r1, r2, r3 = (b.input(torch.randn(m, n).bfloat16()) for _ in range(3))
    gm = b.module(b.op(aten.add.Tensor, b.op(aten.add.Tensor, r1, b.op(aten.mul.Tensor, r2, r3)), y))
    _run(gm, b.inputs)
    (op,) = _regions(gm)
    args = [gm.meta["values"][nd.name] for nd in op.region.inputs]
    i3 = op.region.inputs.index(r3)
    shifted = torch.empty(m * n + 1).bfloat16()[1:].view(m, n)  # 2 bytes past a 16-byte boundary
    shifted.copy_(args[i3])
    args[i3] = shifted
    assert op._unsupported(*args) is not None


def test_a_value_kept_out_of_gemm_groups_does_not_join_one_through_a_consumer():
    """An fp32 cast of the GEMM's output that is handed back, and a consumer of both it and the
    GEMM's output: the GEMM still takes an epilogue (before the fix: regrouped 30 times, then no
    region at all)."""
    b = GraphBuilder()
    y = b.op(aten.mm.default, b.input(_ints((128, 64), 4, 1)), b.op(aten.t.default, b.input(_ints((64, 64), 4, 2))))
    wide = b.op(aten._to_copy.default, y, dtype=torch.float32)
    out = b.op(aten._to_copy.default, b.op(aten.add.Tensor, wide, b.op(aten.mul.Tensor, y, 3)), dtype=torch.bfloat16)
    gm = b.module(out, wide)
    ref, res, report = _run(gm, b.inputs)
    assert any(r.region.kind == "gemm" for r in _regions(gm)), report.lines()
    for o, r in zip(res, ref):
        assert_bits_equal(o, r)


def test_a_bool_operand_is_not_read_through_tma():
    b = GraphBuilder()
    y = b.op(aten.mm.default, b.input(_ints((130, 64), 4, 1)), b.op(aten.t.default, b.input(_ints((256, 64), 4, 2))))
    keep = b.input(torch.rand(130, 256) > 0.5)
    gm = b.module(b.op(aten.where.self, keep, y, b.op(aten.mul.Tensor, y, 2)))
    ref, res, report = _run(gm, b.inputs)
    assert any(r.region.kind == "gemm" for r in _regions(gm)), report.lines()
    assert_bits_equal(res[0], ref[0])
