"""Regions behind the gate: launch plans (the compiled launchers called directly), a wrong region
disabled, the registered backend, tables of eager's results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import exactdit
from exactdit import gate
from exactdit.engine import coverage, tables
from exactdit.engine.backend import rewrite
from exactdit.harness import models
from tests.engine_helpers import POINTWISE_GRAPHS, GraphBuilder, capture_graphs, rewrite_and_check, trusted
from tests.helpers import assert_bits_equal, rand

aten = torch.ops.aten


@pytest.fixture
def interpreted_launchers(monkeypatch):
    """Launch plans on the CPU: each 'compiled launcher' takes the argument list a plan passes
    (every kernel parameter in order) and runs the kernel in Triton's interpreter from it."""
    from exactdit.device import launch

    launched = []

    def compile_for(fn, grid, args, kwargs, device):
        options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}

        def call(grid_x, stream, *values):
            assert stream == "stream of None" and len(values) == len(fn.arg_names)
            launched.append(fn)
            fn[grid](**dict(zip(fn.arg_names, values)), **options)

        return launch.CompiledLaunch(call, (grid[0],), (), launch.bound_arguments(fn, args, kwargs))

    monkeypatch.setattr(launch, "supported", lambda device: True)
    monkeypatch.setattr(launch, "current_device", lambda: None)  # a CPU tensor's device index
    monkeypatch.setattr(launch, "current_stream", lambda index: f"stream of {index}")
    monkeypatch.setattr(launch, "compile_for", compile_for)
    return launched


def _complexrope_graph(b, x, freqs):
    """Qwen-Image's RoPE: ``view_as_real(view_as_complex(x.float()) * freqs).type_as(x)``."""
    shape = list(x.meta["val"].shape)
    pairs = b.op(aten.view.default, b.op(aten._to_copy.default, x, dtype=torch.float32), shape[:-1] + [-1, 2])
    rotated = b.op(aten.mul.Tensor, b.op(aten.view_as_complex.default, pairs), freqs)
    out = b.op(aten.view.default, b.op(aten.view_as_real.default, rotated), shape)
    return b.op(aten._to_copy.default, out, dtype=x.meta["val"].dtype)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_complex_rope_reads_each_frequency_pair_with_one_load(head_dim):
    """Qwen-Image / Z-Image: per-head RMSNorm, then ``view_as_complex(x.float()) * freqs``. Lane c
    loads part c % 2 of frequency c // 2 (one contiguous load per tile) and the parts move between
    the pair's lanes; frequencies strided along their last dim run eager, with the reason."""
    g = torch.Generator().manual_seed(head_dim)
    x, w = rand((2, 5, 3 * head_dim), torch.bfloat16, "cpu", g), rand((head_dim,), torch.bfloat16, "cpu", g)
    angles = torch.randn(5, 1, head_dim, generator=g)
    freqs = torch.polar(torch.ones_like(angles[..., ::2]), angles[..., ::2].contiguous())

    def build(b, x, w, freqs):
        heads = b.op(aten.view.default, x, [2, 5, 3, head_dim])
        x32 = b.op(aten._to_copy.default, heads, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x32, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-5)))
        normed = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)
        return [_complexrope_graph(b, normed, freqs)]

    b = GraphBuilder()
    gm = b.module(*build(b, *[b.input(t) for t in (x, w, freqs)]))
    rewrite_and_check(gm, [x, w, freqs], "crope")
    kernels = [k for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")
               for _, k in n.target.exactdit_region.kernels()]
    assert kernels
    for k in kernels:
        f = next(i for i, n in enumerate(k.inputs) if n.meta["val"].dtype == torch.complex64)
        # one load per pass over the columns (the last pass reads the frequencies)
        assert k.source.count(f"tl.load(in{f}_ptr") == 1, k.source
        assert "rows_k.pair_lane(" in k.source and "tl.gather" not in k.source

    strided = torch.polar(torch.ones_like(angles), angles)[..., ::2]
    b2 = GraphBuilder()
    unrewritten = b2.module(*build(b2, *[b2.input(t) for t in (x, w, freqs)]))
    with torch.no_grad(), trusted():
        assert_bits_equal(gm(x, w, strided)[0], unrewritten(x, w, strided)[0], "strided frequencies")
    reasons = {k: v["eager_reasons"] for k, v in exactdit.report(show=False).items() if k.startswith("crope")}
    assert any("strided along its last dim" in str(r) for r in reasons.values()), reasons


@pytest.fixture
def both_launch_routes(monkeypatch, interpreted_launchers):
    """Every region call also runs through its generated launch plan and through Triton's JIT
    launch, outputs poisoned first: the same bits, every element written. Returns the regions seen."""
    from exactdit.engine import runtime

    checked = []
    plain_call = runtime.RegionOp.__call__

    def both_routes(self, *inputs):
        fast = self._specialize(*inputs)
        for a, b in zip(fast(*inputs, poisoned=True), self._fused(*inputs)):
            assert_bits_equal(a, b, self.region.name)
        checked.append(self.region.name)
        return plain_call(self, *inputs)

    monkeypatch.setattr(runtime.RegionOp, "__call__", both_routes)
    monkeypatch.setenv("EXACTDIT_POISON", "1")
    return checked


def test_launch_plans_of_a_captured_block_launch_what_the_jit_path_launches(both_launch_routes):
    # Wan: fp32 modules, LayerNorm + modulation, RMSNorm across heads, RoPE through strided slices
    tr = models.build_transformer("wan", "tiny", dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs("wan", tr, batch=1, seed=5, height=32, width=32, num_frames=5)
    for _, gm, inputs in capture_graphs(tr, kw):
        with torch.no_grad(), trusted():
            rewrite(gm, "wan")
            gm(*inputs)
    assert len(both_launch_routes) > 3


def test_launch_plans_with_tables_complex_inputs_and_several_outputs(both_launch_routes):
    g = torch.Generator().manual_seed(2)
    x, u = rand((2, 5, 64), torch.bfloat16, "cpu", g), rand((2, 5, 64), torch.bfloat16, "cpu", g)
    freqs = torch.polar(torch.ones(5, 1, 16), torch.randn(5, 1, 16, generator=g))

    def build(b, x, u, freqs):
        h = b.op(aten.mul.Tensor, u, b.op(aten.gelu.default, x, approximate="tanh"))  # a table
        q = _complexrope_graph(b, b.op(aten.view.default, x, [2, 5, 2, 32]), freqs)  # a complex input
        return [h, b.op(aten.add.Tensor, h, x), q]  # several outputs

    b = GraphBuilder()
    gm = b.module(*build(b, *[b.input(t) for t in (x, u, freqs)]))
    with torch.no_grad(), trusted():
        rewrite(gm, "plans")
        gm(x, u, freqs)
    assert len(both_launch_routes) >= 2


def _gated_residual():
    """A small region graph (x + gate * y over 3 rows of 40) and its inputs."""
    b = GraphBuilder()
    g = torch.Generator().manual_seed(1)
    inputs = [rand((3, 40), torch.bfloat16, "cpu", g), rand((3, 40), torch.bfloat16, "cpu", g), rand((3,), torch.bfloat16, "cpu", g)]
    return b.module(*POINTWISE_GRAPHS["gated residual"](b, *[b.input(t) for t in inputs])), inputs


def test_a_verified_region_layout_is_served_by_its_launch_plan(interpreted_launchers):
    gm, inputs = _gated_residual()
    with torch.no_grad():
        ref = gm(*inputs)
        rewrite(gm, "plan")
        for _ in range(3):
            assert_bits_equal(gm(*inputs)[0], ref[0], "plan")
    assert len(interpreted_launchers) == 3  # verified through the plan, then served by it
    assert exactdit.report(show=False)["plan.r0"]["fused"] == 3
    from triton import knobs

    hook = lambda metadata: None  # noqa: E731 - a profiler's launch hook: only Triton's JIT path calls it
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        with torch.no_grad():
            assert_bits_equal(gm(*inputs)[0], ref[0], "plan")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(interpreted_launchers) == 3


@pytest.mark.parametrize("route", ["launch plan", "jit"])
def test_verification_runs_the_regions_aten_nodes_once(route, request):
    """The first call of a signature runs the region's ATen nodes once: the gate's reference run
    also gives the layout the kernel's outputs take."""
    if route == "launch plan":
        request.getfixturevalue("interpreted_launchers")
    gm, inputs = _gated_residual()
    with torch.no_grad():
        ref = gm(*inputs)
        rewrite(gm, "once")
        (op,) = [n.target.exactdit_region for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")]
        runs, reference = [], op.reference
        op.reference = lambda *a: runs.append(1) or reference(*a)
        for _ in range(2):
            assert_bits_equal(gm(*inputs)[0], ref[0], "once")
    assert len(runs) == 1 and exactdit.report(show=False)["once.r0"]["fused"] == 2


def test_a_wrong_region_is_disabled_and_eager_returned(monkeypatch):
    from exactdit.engine import runtime

    real = runtime.RegionOp._fused

    def wrong(self, *inputs):
        return tuple(o + 1 for o in real(self, *inputs))

    monkeypatch.setattr(runtime.RegionOp, "_fused", wrong)
    g = torch.Generator().manual_seed(0)
    inputs = [rand((2, 4, 64), torch.bfloat16, "cpu", g), rand((2, 4, 64), torch.bfloat16, "cpu", g),
              rand((2, 64), torch.bfloat16, "cpu", g)]
    b = GraphBuilder()
    nodes = [b.input(t) for t in inputs]
    gm = b.module(*POINTWISE_GRAPHS["gated residual"](b, *nodes))
    ref = gm(*inputs)
    rewrite(gm, "wrong")
    with pytest.warns(gate.ExactditMismatchWarning):
        out = gm(*inputs)
    assert_bits_equal(out[0], ref[0])
    stats = exactdit.report(show=False)["wrong.r0"]
    assert stats["disabled"] and stats["eager"] == 1 and stats["fused"] == 0
    assert_bits_equal(gm(*inputs)[0], ref[0])  # stays eager


def test_registered_backend_compiles_a_function():
    def f(x, g):
        return x + g * 2.0 * x

    x, g = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    out = torch.compile(f, backend="exactdit", fullgraph=True)(x, g)
    assert torch.equal(out, f(x, g))
    assert coverage.graphs()[-1].regions


def test_tables_reproduce_eager_on_every_input():
    for fn in (torch.tanh, F.silu, lambda x: F.gelu(x, approximate="tanh")):
        for dtype in (torch.bfloat16, torch.float16):
            table, why = tables.build_table(fn, dtype, "cpu")
            assert why is None and table is not None
    spec = tables.derive_spec(torch.tanh(tables.every_value(torch.bfloat16, "cpu")), torch.bfloat16)
    assert 0 < spec.window <= tables.MAX_WINDOW  # the window, not the full table


def test_a_table_asked_for_while_a_graph_is_rewritten_is_built_from_real_values():
    """A region's kernels are sent to the compile workers at the rewrite, under Dynamo's fake
    mode: the table they take is built outside it (it was an exception, and the kernel compiled
    at the first call instead), holds real bits, and is the one later calls get."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    key = ("test fake mode tanh", (), ())
    with FakeTensorMode():
        table, why = tables.table_for(key, torch.tanh, torch.bfloat16, "cpu")
    assert why is None and not isinstance(table.data, FakeTensor)
    assert torch.equal(table.data, tables.build_table(torch.tanh, torch.bfloat16, "cpu")[0].data)
    assert tables.table_for(key, torch.tanh, torch.bfloat16, "cpu")[0] is table


def _specialised(args) -> list:
    """What Triton's specialisation reads of each argument: a tensor's dtype and 16-byte alignment,
    any other value itself."""
    return [(a.dtype, a.data_ptr() % 16 == 0) if hasattr(a, "data_ptr") else a for a in args]


def test_a_region_runs_eager_while_a_worker_compiles_its_kernel(monkeypatch):
    """A region whose kernel a compile worker has not finished answers with its ATen nodes (eager's
    bits, counted with the reason); the call after the worker finished verifies and fuses it."""
    from concurrent.futures import Future

    from exactdit.device import compile_workers
    from exactdit.engine.partition import find_regions
    from exactdit.engine.runtime import RegionOp

    monkeypatch.delenv("EXACTDIT_WAIT_FOR_KERNELS", raising=False)
    g = torch.Generator().manual_seed(3)
    x = rand((3, 40), torch.bfloat16, "cpu", g)
    b = GraphBuilder()
    xi = b.input(x)
    gm = b.module(b.op(torch.ops.aten.mul.Tensor, b.op(torch.ops.aten.add.Tensor, xi, xi), 0.3))
    (region,) = find_regions(gm, "compiling").regions
    op, future = RegionOp(region), Future()
    monkeypatch.setattr(compile_workers, "_PENDING", {fn: [future] for fn, _ in op.kernels()})
    expected = (x + x) * 0.3
    assert torch.equal(op(x)[0], expected)
    assert exactdit.report(show=False)[region.name]["eager_reasons"] == {gate.COMPILING: 1}
    future.set_result(True)
    assert torch.equal(op(x)[0], expected) and torch.equal(op(x)[0], expected)
    rep = exactdit.report(show=False)[region.name]
    assert rep["verified"] and rep["fused"] == 2 and rep["eager"] == 1  # (the verifying call returns the kernel's output)
