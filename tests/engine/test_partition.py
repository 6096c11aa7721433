"""Regions the partitioner forms: values computed once, cat pieces read or skipped, per-token
modulation, collectives kept in order."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.fx as fx

from exactdit.engine import timing
from exactdit.engine.backend import make_backend
from exactdit.harness import models
from exactdit.patches.engine import repeated_blocks
from tests.engine_helpers import (
    GraphBuilder, assert_partners_move_between_lanes, capture_graphs, rewrite_and_check, rewritten_run,
)
from tests.helpers import rand

aten = torch.ops.aten


def test_repeated_pure_ops_are_computed_once_and_random_ones_not():
    from exactdit.engine.backend import dedupe

    b = GraphBuilder()
    x = b.input(torch.randn(4, 8))
    a1, a2 = b.op(aten.silu.default, x), b.op(aten.silu.default, x)
    r1, r2 = b.op(aten.rand_like.default, x), b.op(aten.rand_like.default, x)
    gm = b.module(b.op(aten.add.Tensor, a1, a2), r1, r2)
    assert dedupe(gm.graph) == 1
    assert [n.target for n in gm.graph.nodes].count(aten.silu.default) == 1
    assert [n.target for n in gm.graph.nodes].count(aten.rand_like.default) == 2


def test_two_outputs_computed_alike_stay_two_tensors():
    # eager returns two tensors for `return x.silu(), x.silu()` (or views of each): merging them
    # would hand the caller one storage, where an in-place change to one output changes the other
    from exactdit.engine.backend import dedupe

    b = GraphBuilder()
    x = b.input(torch.randn(4, 8))
    s1, s2, s3 = (b.op(aten.silu.default, x) for _ in range(3))
    gm = b.module(s1, b.op(aten.t.default, s2), b.op(aten.add.Tensor, s3, 1.0))
    assert dedupe(gm.graph) == 1  # the silu only read inside the graph is still computed once
    returned = [a for a in gm.graph.output_node().args[0]]
    bases = [n if n.target is aten.silu.default else n.args[0] for n in returned[:2]]
    assert bases[0] is not bases[1]


def test_two_matmuls_returned_stay_two_storages():
    # x @ w on a 3-D x is view -> mm -> _unsafe_view: _unsafe_view shares its input's storage
    # though its schema says nothing of it; eager's second output is untouched by a change to the first
    def f(x, w):
        return x @ w, x @ w

    x, w = torch.randn(2, 3, 4), torch.randn(4, 5)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            a, c = torch.compile(f, backend=make_backend("Twice"), fullgraph=True)(x, w)
    finally:
        torch._dynamo.reset()
    a.add_(1)
    assert torch.equal(c, x @ w) and a.untyped_storage().data_ptr() != c.untyped_storage().data_ptr()


class _ViewOfIntermediate(torch.nn.Module):
    def forward(self, x, z):
        y = x * 2
        return y, y[:, : z.shape[1]]


@pytest.mark.parametrize("dynamic", [True, None, False])
def test_a_whole_index_of_a_returned_value_stays_a_view_of_it(dynamic):
    # where z covers all of x's dim 1 the slice is aten.alias (ATen's applySlice, and at_sizes alike):
    # fused as an identity it came back as its own storage, so a write into one output missed the
    # other; the sizes in a row reach that signature under each dynamic mode (review finding)
    import exactdit
    from exactdit.patches.engine import _sizes_symbolic

    module = _ViewOfIntermediate().eval()
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=make_backend("ViewOfIntermediate"), fullgraph=True,
                             dynamic=False if dynamic is False else None)
    try:
        with torch.no_grad():
            for i, (n, m) in enumerate(((5, 3), (7, 4), (6, 6))):
                x, z = torch.randn(2, n, 4), torch.randn(2, m)
                with _sizes_symbolic(((x, z), {})) if i == 0 and dynamic else contextlib.nullcontext():
                    out = compiled(x, z)
                ref = module(x, z)
                assert all(torch.equal(o, r) and o.stride() == r.stride() for o, r in zip(out, ref))
                shared = [o[1].untyped_storage().data_ptr() == o[0].untyped_storage().data_ptr() for o in (out, ref)]
                assert shared[0] == shared[1], (n, m)
        assert not any(r["disabled"] for r in exactdit.report(show=False).values())  # (not the gate's catch)
    finally:
        torch._dynamo.reset()


def _piece_of_an_alias(x):
    y = x * 2
    return y, y[:, :].unbind(0)[1], (y + 1).detach().chunk(2, 1)[0] * 3  # y[:, :] is aten.alias(y)


def _view_of_an_input_written_through(x):
    v = x[:, :].unbind(0)[-1][...].chunk(2, 0)[-1]
    v.t().mul_(3)
    return (v,)


def _offset_input():  # a storage offset and gaps
    return torch.arange(266).to(torch.bfloat16).as_strided((1, 5, 6), (262, 26, 2), 1)


def _rows_written_from_their_own_values(x):
    v = x - 0.25
    x[1:] = v[1:] + 1  # copy into a view of the input: eager's copy keeps the view's storage offset
    return (x * 3,)


def _offset_rows():
    return torch.arange(190.0).as_strided((3, 1, 7), (62, 30, 2), 1)


def _columns_shifted_in_place(x):
    x[..., 0] = 0.5  # select_scatter (ATen), then a slice_scatter into its value: both at x's offset
    x[..., 1:] = x[..., :-1] * 2
    return (x,)


def _offset_columns():
    return torch.arange(100.0).reshape(2, 5, 10).half()[..., 3:]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("f, make", [(_piece_of_an_alias, lambda: torch.arange(12.0).reshape(3, 4).bfloat16() / 7),
                                     (_view_of_an_input_written_through, _offset_input),
                                     (_rows_written_from_their_own_values, _offset_rows),
                                     (_columns_shifted_in_place, _offset_columns)])
def test_aliases_scatters_and_copies_into_views_keep_eagers_storages_and_offsets(f, make, dynamic):
    # an alias (or detach) fused as the identity and handed back by its region came back as a storage
    # of its own: a piece of it (unbind, chunk) returned no longer followed writes into the first
    # output, and under dynamic=True a returned view of an input lost its storage offset; a
    # slice_scatter or copy into a view of an input keeps the view's offset in eager, not in a
    # region's output (fuzzer findings). Regions hand none of them back now, and the gate compares
    # storages and offsets: nothing may be left for it to catch here
    import exactdit
    from exactdit import gate

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            x_eager, x_fused = make(), make()
            ref = f(x_eager)
            out = torch.compile(f, backend=make_backend("Alias"), fullgraph=True, dynamic=dynamic)(x_fused)
    finally:
        torch._dynamo.reset()
    assert gate.first_difference(list(out), list(ref)) is None and torch.equal(x_fused, x_eager)
    assert gate.sharing(x_fused, out) == gate.sharing(x_eager, ref)
    assert not any(r["disabled"] for r in exactdit.report(show=False).values())
    out[0].add_(1)
    ref[0].add_(1)
    assert all(torch.equal(o, r) for o, r in zip(out, ref)) and torch.equal(x_fused, x_eager)


@pytest.mark.parametrize("complex_op", ["clone", "mul"])
def test_a_complex_value_read_outside_through_view_as_real_is_left_to_aten(complex_op):
    """An fp32 model's complex RoPE (Lumina2's ``view_as_real(view_as_complex(q) * freqs)``, where
    ``type_as(q)`` casts nothing): the view is read outside the region, so the complex value itself
    was the region's output, which a kernel cannot write (Triton raised on its pointer; the gate
    ran eager instead). It is left to ATen, the rest stays fused; fuzzer finding."""
    import exactdit
    from exactdit.engine import coverage

    g = torch.Generator().manual_seed(6)
    q, w = rand((1, 2, 4, 4), torch.float32, "cpu", g), rand((4,), torch.float32, "cpu", g)
    freqs = torch.polar(torch.ones(4, 2), rand((4, 2), torch.float32, "cpu", g))

    def f(q):
        c = torch.view_as_complex((q * w + 0.5).reshape(*q.shape[:-1], -1, 2))
        c = c.clone() if complex_op == "clone" else c * freqs
        return (torch.view_as_real(c).flatten(3) + 1) * 2, torch.view_as_real(c)

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = torch.compile(f, backend=make_backend("Complex"), fullgraph=True)(q)
    finally:
        torch._dynamo.reset()
    for o, r in zip(out, f(q)):
        assert torch.equal(o, r) and o.stride() == r.stride()
    assert not any(r["disabled"] for r in exactdit.report(show=False).values())
    graph = [r for r in coverage.graphs() if r.name.startswith("Complex")][-1]
    assert len(graph.regions) == 2 and not graph.failed, graph  # before and after the complex value
    assert graph.why_left == {f"{complex_op}: set aside: its value must be handed to ATen": 1}, graph.why_left


def test_uninitialised_memory_is_not_handed_back_by_a_region():
    """``empty_like(v).copy_(...)`` where the copy stays outside the regions (its value is read by
    two): the region ending in ``empty_like`` handed back the kernel's zeros, and verification
    compared them with eager's uninitialised memory, disabling the signature or not as the
    allocator's leftovers fell (fuzzer finding). ``empty_like`` is left to ATen now."""
    import exactdit
    import torch.nn.functional as F

    from exactdit.engine import coverage

    def f(x):
        v = x[..., ::2]
        y = torch.empty_like(v).copy_(v * 2)
        n = F.layer_norm(torch.cat([y[:, :1] * 2, y], dim=1), (3,), eps=1e-6) * 2
        return n[:, 1:] + y,

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            g = torch.compile(f, backend=make_backend("Empty"), fullgraph=True)
            for seed in range(3):
                x = rand((1, 1, 2, 6), torch.bfloat16, "cpu", torch.Generator().manual_seed(seed))
                assert torch.equal(g(x)[0], f(x)[0])
    finally:
        torch._dynamo.reset()
    assert not any(r["disabled"] for r in exactdit.report(show=False).values())
    graph = [r for r in coverage.graphs() if r.name.startswith("Empty")][-1]
    assert graph.regions and not any("empty_like" in k and "set aside" not in k for k in graph.why_left)
    assert graph.left.get("empty_like") == 1, graph


def test_an_alias_of_a_value_only_its_region_sees_is_handed_back_fused():
    # Qwen-Image 2.1's block returns alias(cat(...)) (a whole index): no other value of that storage
    # is read outside the region, so a storage of its own is what eager's caller can observe too
    def build(b, x):
        return (b.op(aten.alias.default, b.op(aten.cat.default, [b.op(aten.mul.Tensor, x, 2.0), x], -1)),)

    report = rewritten_run(build, [torch.randn(4, 8, dtype=torch.bfloat16)])
    assert [d for d, _ in report.regions.values()] == ["pointwise[alias, cat, mul]"]


def test_a_region_reads_an_empty_cat_piece_it_never_loads():
    # x_in[..., rot_dim:] is empty when RoPE covers the whole head (ERNIE-Image); under context
    # parallelism it slices a graph input, which the region's ATen reference must still receive
    def build(b, x, w, passed):
        y = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x, w), x)
        rest = b.op(aten.slice.Tensor, passed, 1, 8, 9223372036854775807)
        return (b.op(aten.mul.Tensor, b.op(aten.cat.default, [y, rest], -1), 2.0),)

    rewritten_run(build, [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)])


def test_a_cat_sliced_to_its_first_piece_reads_only_that_piece():
    # HunyuanVideo's token refiner in fp32: cat([a, b], -1)[..., :width of a]; the slice's columns
    # all lie in the first piece, which needs no selection, and the second is never loaded
    def build(b, x, y):
        cat = b.op(aten.cat.default, [b.op(aten.mul.Tensor, x, 3.0), y], 1)
        return (b.op(aten.add.Tensor, b.op(aten.slice.Tensor, cat, 1, 0, 128), 1.0),)

    sources = []
    rewritten_run(build, [torch.randn(2, 128), torch.randn(2, 64)], sources)
    assert sources and all("in1_ptr" not in s.split("):", 1)[1] for s in sources), sources


def test_rope_written_through_strided_slices_of_an_empty_tensor():
    # Wan's RoPE: out = empty_like(x); out[..., 0::2] = a; out[..., 1::2] = b, functionalized into
    # copy + slice_scatter; the uninitialised values are all overwritten, so the region is exact
    def build(b, x, c, s):
        x1, x2 = (b.op(aten.slice.Tensor, x, -1, k, 9223372036854775807, 2) for k in (0, 1))
        even = b.op(aten.sub.Tensor, b.op(aten.mul.Tensor, x1, c), b.op(aten.mul.Tensor, x2, s))
        odd = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x1, s), b.op(aten.mul.Tensor, x2, c))
        out = b.op(aten.empty_like.default, x)
        for k, v in enumerate((even, odd)):
            dst = b.op(aten.slice.Tensor, out, -1, k, 9223372036854775807, 2)
            out = b.op(aten.slice_scatter.default, out, b.op(aten.copy.default, dst, v), -1, k, 9223372036854775807, 2)
        return (b.op(aten._to_copy.default, out, dtype=torch.bfloat16),)

    x = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    sources = []
    report = rewritten_run(build, [x, torch.randn(5, 1, 8), torch.randn(5, 1, 8)], sources)
    assert not any("slice_scatter" in line and "left" in line for line in report.lines()), report.lines()
    assert_partners_move_between_lanes(sources)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_per_token_modulation_picked_by_an_integer_index(index_dtype):
    # Qwen-Image-Edit-2511: where(index == 0, mod_target, mod_condition) per token, then modulate
    def build(b, x, index, s0, s1):
        pick = b.op(aten.unsqueeze.default, b.op(aten.eq.Scalar, index, 0), -1)
        scale = b.op(aten.where.self, pick, s0, s1)
        return (b.op(aten.mul.Tensor, x, b.op(aten.add.Tensor, scale, 1)),)

    g = torch.Generator().manual_seed(3)
    index = torch.randint(0, 2, (2, 37), generator=g, dtype=index_dtype)
    inputs = [rand((2, 37, 64), torch.bfloat16, "cpu", g), index,
              rand((2, 1, 64), torch.bfloat16, "cpu", g), rand((2, 1, 64), torch.bfloat16, "cpu", g)]
    report = rewritten_run(build, inputs)
    assert any("eq" in line and "region" in line for line in report.lines()), report.lines()


def test_per_token_modulation_read_in_pieces_fuses_into_each_consumer():
    # Wan2.2-TI2V-5B: one timestep per token, (table + temb.float()).chunk(6, dim=2) read by six
    # regions: each computes its own piece instead of ATen writing the float32 sum
    cfg = dict(models.get_spec("wan").config("tiny"), in_channels=48, out_channels=48)
    tr = models.build_transformer("wan", cfg, dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs("wan", tr, batch=2, seed=5, height=64, width=64, num_frames=5)
    assert kw["timestep"].shape == (2, 2 * 2 * 2) and kw["timestep"].stride(0) == 0
    for _, gm, inputs in capture_graphs(tr, kw):
        report = rewrite_and_check(gm, inputs, "wan2.2")
        left = next(line for line in report.lines() if "left to ATen" in line)
        assert re.search(r"\b(add|_to_copy) x", left) is None, left
    # the coverage report counts the captured sum, which no longer runs, as fused
    assert all(g.share == 1.0 for g, _, _ in timing.measure(tr, kw, repeated_blocks(tr)))


def test_a_value_read_whole_and_in_pieces_is_computed_once():
    from exactdit.engine.backend import split_per_piece

    x, t = torch.randn(4, 3, 8, dtype=torch.bfloat16), torch.randn(3, 8)
    b = GraphBuilder()
    total = b.op(aten.add.Tensor, b.op(aten._to_copy.default, b.input(x), dtype=torch.float32), b.input(t))
    gm = b.module(*[b.op(aten.mul.Tensor, piece, 2.0) for piece in b.op(aten.split.Tensor, total, 1, 1)])
    expected = gm(x, t)
    assert split_per_piece(gm.graph) == 3  # each piece gets its own add and cast
    gm.recompile()
    assert [n.target for n in gm.graph.nodes].count(aten.add.Tensor) == 3
    assert [n.target for n in gm.graph.nodes].count(aten._to_copy.default) == 3
    assert all(torch.equal(a, e) for a, e in zip(gm(x, t), expected))
    b = GraphBuilder()
    total = b.op(aten.add.Tensor, b.input(x), b.input(t))
    gm = b.module(total, *b.op(aten.split.Tensor, total, 1, 1))
    assert split_per_piece(gm.graph) == 0  # also read whole: computed once, as captured


def test_collectives_are_neither_merged_nor_reordered():
    from exactdit.engine.backend import _effectful, _pure

    g = fx.Graph()
    x = g.placeholder("x")
    c10d = torch.ops._c10d_functional
    for target in (c10d.all_to_all_single.default, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default):
        assert not _pure(target) and _effectful(g.call_function(target, (x,)))
    assert _pure(aten.mul.Tensor) and not _effectful(g.call_function(aten.mul.Tensor, (x, x)))


def test_dynamo_names_source_functions_only_while_its_trace_logs_are_on():
    """The backend stops Dynamo tokenizing every traced source file for log headers nobody reads."""
    import inspect
    import logging

    from torch._dynamo import funcname_cache, symbolic_convert

    from exactdit.engine.backend import make_backend

    make_backend("test")
    lookup = symbolic_convert.get_funcname
    line = inspect.currentframe().f_lineno
    assert lookup(__file__, line) is None
    log = symbolic_convert.trace_call_log
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        assert lookup(__file__, line) == funcname_cache.get_funcname(__file__, line) is not None
    finally:
        log.setLevel(level)
