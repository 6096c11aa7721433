"""exactdit.engine.specialize: a block Dynamo captured with symbolic sizes (its second input shape)
is lowered at each later shape without Dynamo tracing its Python again, into the very ATen graph a
capture at that shape gives, and the forward stays equal to the unpatched one."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import exactdit
from exactdit import first_calls, state
from exactdit.engine import backend, coverage, specialize
from exactdit.harness import models
from exactdit.harness.metrics import outputs_equal
from exactdit.harness.models import run_forward
from tests import minis
from tests.engine_helpers import engine_eager_reasons, uncompile

SMALL, OTHER, THIRD = (32, 32), (48, 64), (64, 96)


#: Z-Image pads its token sequence to a multiple of 32: sizes whose padded lengths differ
SIZES = {"zimage": ((32, 32), (96, 96), (160, 128))}


def _harness(name: str):
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=3)
    sizes = SIZES.get(name, (SMALL, OTHER, THIRD))
    return tr, [models.forward_inputs(name, tr, batch=1, height=h, width=w, seed=4) for h, w in sizes]


def _mini(name: str, grids):
    def build():
        tr = minis.build(name, dtype=torch.bfloat16, seed=3)
        return tr, [minis.forward_inputs(name, tr, batch=1, seed=4, grid=minis.Grid(*g)) for g in grids]
    return build


#: the production classes of the harness and the minis with a grid: image and video, one and two streams
CASES = {name: (lambda name=name: _harness(name)) for name in ("flux", "qwen", "wan", "zimage", "ernie", "chroma")}
CASES.update({
    "flux2": _mini("flux2", [(1, 4, 4, 7), (1, 6, 8, 7), (1, 8, 12, 7)]),
    "sd3": _mini("sd3", [(1, 8, 8, 7), (1, 12, 16, 7), (1, 16, 24, 7)]),
    "hunyuan-video": _mini("hunyuan-video", [(2, 4, 4, 7), (3, 6, 8, 7), (4, 8, 12, 7)]),
    "ltx-video": _mini("ltx-video", [(2, 4, 4, 7), (3, 6, 8, 7), (4, 8, 12, 7)]),
})
FAST = ("flux", "wan")


def canonical(gm: fx.GraphModule) -> tuple:
    """``gm``'s ATen ops in order with their arguments (nodes by position, integer inputs by value)
    and each result's size, stride and dtype: equal for equal graphs, whatever their node names."""
    names: dict[fx.Node, object] = {}
    ops = []
    tensors = 0
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder":
            if isinstance(val, torch.Tensor):
                names[n], tensors = f"input{tensors}", tensors + 1
            else:
                names[n] = val  # an integer input is its value (a static capture holds it as a literal)
            continue
        args = fx.map_arg((n.args, n.kwargs), lambda a: names[a])
        layout = (tuple(val.shape), val.stride(), val.dtype) if isinstance(val, torch.Tensor) else None
        names[n] = f"node{len(ops)}"
        ops.append((n.op, str(n.target), repr(args), layout))
    return tuple(ops)


@pytest.fixture
def lowered(monkeypatch):
    """The canonical form of every graph the engine rewrites, by block class, as it rewrites them."""
    seen: dict[str, list] = {}
    rewrite = backend.rewrite

    def recording(gm, label):
        seen.setdefault(first_calls.block_of(label), []).append(canonical(gm))
        return rewrite(gm, label)

    monkeypatch.setattr(backend, "rewrite", recording)
    return seen


def _flat(graphs: dict) -> set:
    return {(cls, g) for cls, gs in graphs.items() for g in gs}


def _phase_count(phase: str) -> int:
    return first_calls.totals().get(phase, (0.0, 0))[1]


def _run_patched(tr, kws):
    outs = []
    exactdit.patch(tr, dynamic=None)
    try:
        for kw in kws:
            outs.append(run_forward(tr, kw))
    finally:
        exactdit.unpatch(tr)
        uncompile(tr)
    return outs


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in CASES])
def test_a_third_shape_is_lowered_into_the_graph_its_own_capture_gives(name, lowered):
    """Shapes A, B, C: B captures the blocks with symbolic sizes, C is lowered from that capture
    (no Dynamo capture) into exactly the ATen graphs a first capture at C gives; every forward
    equal to the unpatched one, nothing run as diffusers' code."""
    tr, kws = CASES[name]()
    with torch.no_grad():
        refs = [run_forward(tr, kw) for kw in kws]
        state.reset()
        torch._dynamo.reset()
        assert outputs_equal(_run_patched(tr, kws[2:])[0], refs[2])  # a fresh capture at C: static
        static = dict(lowered)
        lowered.clear()
        state.reset()
        exactdit.patch(tr, dynamic=None)
        try:
            outs = [run_forward(tr, kw) for kw in kws[:2]]
            captures, lowerings, earlier = _phase_count("capture"), _phase_count("specialize"), _flat(lowered)
            lowered.clear()
            outs.append(run_forward(tr, kws[2]))
        finally:
            exactdit.unpatch(tr)
            uncompile(tr)
    assert _phase_count("capture") == captures, first_calls.lines()  # C: no Dynamo capture, lowerings
    assert _phase_count("specialize") > lowerings, first_calls.lines()
    assert lowered and _flat(lowered) <= _flat(static)  # C's lowered graphs are those C's capture gives
    assert _flat(static) <= _flat(lowered) | earlier  # the rest: blocks whose inputs kept A's or B's sizes
    assert all(outputs_equal(out, ref) for out, ref in zip(outs, refs))
    assert engine_eager_reasons() == {}


class _Rows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return (y * torch.sigmoid(y) + x).reshape(-1, 4) * x.shape[1]  # a region: sigmoid, mul, add


def test_each_signature_is_lowered_once_and_a_failure_runs_dynamos_graph(monkeypatch):
    """The first shape is captured static, the second symbolic; each signature (the symbolic
    inputs' sizes) is made concrete once and kept. Where that fails, AOTAutograd lowers Dynamo's
    graph at those sizes; where that fails too, Dynamo's graph runs (what eager runs), counted with
    the reason, and the other signatures stay lowered."""
    made, aot = [], []
    real, make_lowering = specialize.at_sizes, backend.aot_autograd

    def sizes(args):
        return [a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 3]

    def failing_at_seven_and_nine(gm, args, indexings=None):
        made.append(sizes(args))
        if {7, 9} & set(sizes(args)):
            raise RuntimeError("cannot make\nsecond line")
        return real(gm, args, indexings)

    def aot_failing_at_seven(**kwargs):
        lower = make_lowering(**kwargs)

        def lowering(gm, args):
            aot.append(sizes(args))
            if 7 in sizes(args):
                raise RuntimeError("cannot lower\nsecond line")
            return lower(gm, args)

        return lowering

    monkeypatch.setattr(specialize, "at_sizes", failing_at_seven_and_nine)
    monkeypatch.setattr(backend, "aot_autograd", aot_failing_at_seven)
    module = _Rows().eval()
    compiled = torch.compile(module, backend=backend.make_backend("Rows"), fullgraph=True, dynamic=None)
    try:
        with torch.no_grad():
            for n in (3, 5, 7, 5, 7, 9, 9):
                x = torch.randn(2, n, 8)
                assert torch.equal(compiled(x), module(x))
    finally:
        torch._dynamo.reset()
    assert made == [[5], [7], [9]]  # 3: Dynamo's static capture; 5, 7, 9 made once each
    assert aot == [[3], [7], [9]]  # the static capture; 7 and 9 where at_sizes failed
    reasons = engine_eager_reasons()
    assert reasons == {"engine.Rows": {"not lowered at these sizes: RuntimeError: cannot lower": 2}}, reasons


def test_a_symbolic_graph_keeps_its_latest_signatures(monkeypatch):
    """Sizes without end (a service): the oldest lowering goes, and is lowered again if it returns."""
    lowerings = []
    real = specialize.PerSignature._lowered
    monkeypatch.setattr(specialize, "KEPT_SIGNATURES", 2)
    monkeypatch.setattr(specialize.PerSignature, "_lowered",
                        lambda self, args, values: (lowerings.append(args[-1].shape[1]), real(self, args, values))[1])
    module = _Rows().eval()
    compiled = torch.compile(module, backend=backend.make_backend("Rows"), fullgraph=True, dynamic=None)
    try:
        with torch.no_grad():
            for n in (3, 5, 7, 7, 9, 5, 9):
                x = torch.randn(2, n, 8)
                assert torch.equal(compiled(x), module(x))
    finally:
        torch._dynamo.reset()
    assert lowerings == [5, 7, 9, 5], lowerings  # 3: static capture; 5 was dropped for 9 and came back


def test_two_threads_at_one_new_signature_lower_it_once(monkeypatch):
    """Two threads meeting a new size together: one lowers it, the other waits and runs the
    same lowering (no second lowering, no oldest signature dropped twice)."""
    import threading
    import time

    lowerings, running = [], threading.Lock()
    real = specialize.PerSignature._lowered

    def slow(self, args, values):
        lowerings.append(args[-1].shape[1])
        time.sleep(0.3)  # long enough for the other thread to arrive
        run = real(self, args, values)

        def one_at_a_time(*call_args):  # Triton's interpreter is not thread-safe (a GPU launch is)
            with running:
                return run(*call_args)
        return one_at_a_time

    monkeypatch.setattr(specialize, "KEPT_SIGNATURES", 1)
    monkeypatch.setattr(specialize.PerSignature, "_lowered", slow)
    module = _Rows().eval()
    compiled = torch.compile(module, backend=backend.make_backend("Rows"), fullgraph=True, dynamic=None)
    inputs = {n: torch.randn(2, n, 8) for n in (3, 5, 7)}
    equal = []

    def call(n):
        with torch.no_grad():
            equal.append(torch.equal(compiled(inputs[n]), module(inputs[n])))

    try:
        call(3), call(5)
        threads = [threading.Thread(target=call, args=(7,)) for _ in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        torch._dynamo.reset()
    assert equal == [True] * 4, equal
    assert lowerings == [5, 7], lowerings
    disabled = {k: v["disabled"] for k, v in exactdit.report(show=False).items() if v.get("disabled")}
    assert not disabled and not engine_eager_reasons(), disabled  # both threads' calls ran fused


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.eps = 1e-5

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:], eps=self.eps) * 3


def test_a_number_captured_as_a_symbol_is_a_constant_of_each_lowering(monkeypatch):
    """A float that changed between calls (a norm's eps) is captured as a symbol, passed as a CPU
    scalar the graph reads: each value is lowered as its own signature, its value a constant, as
    a static capture holds it; every call equal to eager."""
    module = _Normed().eval()
    compiled = torch.compile(module, backend=backend.make_backend("Normed"), fullgraph=True, dynamic=None)
    graphs = []
    real = specialize.PerSignature._lowered
    monkeypatch.setattr(specialize.PerSignature, "_lowered",
                        lambda self, args, values: (graphs.append(dict(values)), real(self, args, values))[1])
    try:
        with torch.no_grad():
            for n, eps in ((3, 1e-5), (5, 1e-2), (7, 1e-5), (7, 0.5), (7, 1e-5)):
                module.eps = eps
                x = torch.randn(2, n, 8) * 0.1
                assert torch.equal(compiled(x), module(x)), (n, eps)
    finally:
        torch._dynamo.reset()
    assert [list(v.values()) for v in graphs] == [[1e-2], [1e-5], [0.5]], graphs


def test_a_float_is_keyed_by_its_bits():
    """-0.0 == 0.0 in Python, not in the bits of ``1 / (x * s)``: each is its own signature."""
    def f(x, s):
        return 1 / (x * s)

    compiled = torch.compile(f, backend=backend.make_backend("Reciprocal"), fullgraph=True, dynamic=None)
    try:
        for n, s in ((3, 0.5), (5, 0.25), (7, 0.0), (7, -0.0), (7, 0.0)):
            x = torch.rand(n) + 1
            assert torch.equal(compiled(x, s), f(x, s)), (n, s)
    finally:
        torch._dynamo.reset()


def test_a_dropped_signature_leaves_no_reports_or_gate_state(monkeypatch):
    """Sizes without end: what the process keeps of a symbolic graph's lowerings (coverage reports,
    the regions' gate state) stays bounded by the signatures kept."""
    monkeypatch.setattr(specialize, "KEPT_SIGNATURES", 2)
    module = _Rows().eval()
    compiled = torch.compile(module, backend=backend.make_backend("Rows"), fullgraph=True, dynamic=None)
    try:
        with torch.no_grad():
            for n in range(3, 12):
                x = torch.randn(2, n, 8)
                assert torch.equal(compiled(x), module(x))
    finally:
        torch._dynamo.reset()
    graphs = [g.name for g in coverage.graphs() if g.name.startswith("Rows#")]
    assert len(graphs) == 3, graphs  # the static capture and the 2 signatures kept
    ops = {name.split(".r", 1)[0] for name in state.STATE.signatures if name.startswith("Rows#")}
    assert ops and ops <= set(graphs), (ops, graphs)


def _static_and_symbolic(module, name, make, sizes, lowered, dynamic=None):
    """(the graph a static capture at sizes[-1] gives, the graph at_sizes made there, every output equal)"""
    state.reset()
    torch._dynamo.reset()
    with torch.no_grad():
        static = torch.compile(module, backend=backend.make_backend(name), fullgraph=True, dynamic=False)
        static(*make(sizes[-1]))
        torch._dynamo.reset()
        expected = lowered[name][-1]
        lowered.clear()
        symbolic = torch.compile(module, backend=backend.make_backend(name), fullgraph=True, dynamic=dynamic)
        equal = []
        for s in sizes:
            a = make(s)
            b = [t.clone() if isinstance(t, torch.Tensor) else t for t in a]
            out, ref = symbolic(*a), module(*b)
            equal.append(all(torch.equal(o, r) for o, r in zip(out, ref)))
        torch._dynamo.reset()
    return expected, lowered[name][-1], equal


class _Slices(torch.nn.Module):
    def forward(self, x, n: int):
        whole = x[None, :, :] * 2  # indexing that takes all of dims 1, 2: no slice in a static capture
        part = x[:, 1:] * 3  # a real slice
        narrowed = x.narrow(1, 0, x.shape[1]) * 4  # narrow records its slice whatever it takes
        return whole, part, narrowed, x.reshape(x.shape[0], -1) * n  # sizes computed from sizes


def test_at_sizes_gives_a_static_captures_graph(lowered):
    """Size arithmetic folded to constants, an indexing slice that takes its whole input dropped
    (as ATen's indexing does where sizes are static), other slices kept: the graph made at a third
    shape is op for op the one a static capture there gives, and its result equal to eager."""
    make = lambda n: (torch.randn(2, n, 8), 2)  # noqa: E731
    expected, made, equal = _static_and_symbolic(_Slices().eval(), "Slices", make, [3, 5, 7], lowered)
    assert all(equal) and made == expected, (made, expected)
    assert sum("slice" in op[1] for op in made) == 2  # x[:, 1:] and the narrow
    assert not any("sym_size" in op[1] for op in made)


# --- indexing, unbacked sizes and autocast (cases a review found) ---------------------------------


class _PadUnbacked(torch.nn.Module):
    """Mochi's attention: the prompt's valid tokens (nonzero: an unbacked size), padded back."""

    def forward(self, x, mask):
        idx = mask.nonzero().flatten()
        valid = x[:, idx] * 2
        return (F.pad(valid, (0, 0, 0, x.shape[1] - valid.shape[1])),)


def test_unbacked_pad_is_lowered(lowered):
    """A pad of an unbacked size: at_sizes runs it under the Python dispatcher, as AOTAutograd traces
    (without it the C++ meta refuses a symbolic pad and every signature ran eager)."""
    make = lambda n: (torch.randn(2, n, 8), torch.arange(n) % 3 != 1)  # noqa: E731
    _, _, equal = _static_and_symbolic(_PadUnbacked().eval(), "PadUnbacked", make, [5, 7, 9], lowered)
    assert all(equal)
    assert engine_eager_reasons() == {}, engine_eager_reasons()


class _SetitemWhole(torch.nn.Module):
    """HunyuanVideo's token refiner: ``mask[:, :, :, 0] = True`` on a (B, 1, S, S) mask."""

    def forward(self, x):
        mask = (x[:, None, :, None] > 0) & (x[:, None, None, :] > 0)
        mask[:, :, :, 0] = True
        return (mask.float() * 2,)


def test_setitem_through_a_whole_slice_gives_the_static_graph(lowered):
    """Item assignment through slices that take all of a dim: no slice and no slice scatter (a full
    copy of the mask), as in a static capture (ATen's indexing leaves them out)."""
    make = lambda n: (torch.randn(2, n),)  # noqa: E731
    expected, made, equal = _static_and_symbolic(_SetitemWhole().eval(), "SetitemWhole", make, [3, 5, 7], lowered)
    assert all(equal)
    assert made == expected, "\n".join(map(str, made))


class _SingleSlice(torch.nn.Module):
    """``x[:n]`` (one slice, not a tuple): ATen's get_item passes disable_slice_optimization=True."""

    def forward(self, x, y):
        return (x[: y.shape[0]] * 2,)


def test_a_single_slice_index_stays_a_slice(lowered):
    make = lambda n: (torch.randn(n, 4), torch.randn(n + 2, 4))  # noqa: E731
    expected, made, equal = _static_and_symbolic(_SingleSlice().eval(), "SingleSlice", make, [3, 5, 7], lowered)
    assert all(equal)
    assert made == expected, (made, expected)


class _TupleWhole(torch.nn.Module):
    """``x[:, :n]`` taking all of x: ATen's get_item returns ``alias(x)``, not x."""

    def forward(self, x, y):
        return (x[:, : y.shape[1]] * 2,)


def test_a_whole_tuple_index_is_an_alias(lowered):
    make = lambda n: (torch.randn(2, n, 4), torch.randn(2, n + 2, 4))  # noqa: E731
    expected, made, equal = _static_and_symbolic(_TupleWhole().eval(), "TupleWhole", make, [3, 5, 7], lowered)
    assert all(equal)
    assert made == expected, (made, expected)


class _RotaryAfterText(torch.nn.Module):
    """CogView4's attention: ``query[:, :, text_len:, :] = rotary(query[:, :, text_len:, :])``."""

    def forward(self, q):
        q = q * 1
        q[:, :, 3:, :] = q[:, :, 3:, :] * 2
        return (q,)


def test_setitem_on_a_symbolic_batch_adds_no_copies(lowered):
    """The batch (symbolic from the second batch size on) indexed with ``:`` in an assignment: no
    slice and no slice scatter of the whole tensor, as in a static capture."""
    make = lambda b: (torch.randn(b, 2, 9, 4),)  # noqa: E731
    expected, made, equal = _static_and_symbolic(_RotaryAfterText().eval(), "RotaryAfterText", make, [2, 3, 5], lowered)
    assert all(equal)
    assert made == expected, "\n".join(map(str, made))


class _Fp32Inside(torch.nn.Module):
    """A block that keeps a product in fp32 (autocast off inside), run under the caller's autocast."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            y = x.float() @ self.w.float()
        return (torch.sigmoid(y) * 2 + 1,)


def test_the_callers_autocast_leaves_the_graph_as_captured(lowered):
    """at_sizes runs with autocast off, as AOTAutograd's runtime wrapper runs the graph: under the
    caller's autocast an fp32 matmul keeps its fp32 ``val`` (with it on, the engine wrote kernels
    loading fp32 tensors as bf16)."""
    module = _Fp32Inside().eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        make = lambda n: (torch.randn(2, n, 8),)  # noqa: E731
        expected, made, equal = _static_and_symbolic(module, "Fp32Inside", make, [3, 5, 7], lowered)
    assert all(equal)
    mm = [op for op in made if op[1] == "aten.mm.default"]
    assert made == expected, mm


class _SetitemLoneSlice(torch.nn.Module):
    """``x[:n] = v`` (one slice, not a tuple) that takes all of x."""

    def forward(self, x, y):
        x = x * 1
        x[: y.shape[0]] = 3.0
        return (x * 2,)


def test_a_lone_slice_assignment_gives_the_static_graph(lowered):
    make = lambda n: (torch.randn(n, 4), torch.randn(n + 2, 4))  # noqa: E731
    expected, made, equal = _static_and_symbolic(_SetitemLoneSlice().eval(), "SetitemLoneSlice", make, [3, 5, 7],
                                                 lowered)
    assert all(equal)
    assert made == expected, "\n".join(map(str, made))


class _UnbackedEnd(torch.nn.Module):
    """A slice whose end is a value read from a tensor (an unbacked size)."""

    def forward(self, x, m):
        return (x[:, : m.sum().item()] * 2,)


def test_a_slice_of_an_unbacked_size_is_made_concrete(monkeypatch):
    """Whether such a slice takes a whole dim is not known without a guard: it is kept (as ATen
    keeps it), and the signature is made by at_sizes, not handed to AOTAutograd; equal to eager."""
    aot, make_lowering = [], backend.aot_autograd

    def counting(**kwargs):
        lower = make_lowering(**kwargs)
        return lambda gm, args: (aot.append(1), lower(gm, args))[1]

    monkeypatch.setattr(backend, "aot_autograd", counting)
    monkeypatch.setattr(torch._dynamo.config, "capture_scalar_outputs", True)
    module = _UnbackedEnd().eval()
    compiled = torch.compile(module, backend=backend.make_backend("UnbackedEnd"), fullgraph=True, dynamic=True)
    try:
        with torch.no_grad():
            for n, k in ((5, 5), (7, 3), (9, 9)):
                x, m = torch.randn(2, n), torch.ones(k, dtype=torch.long)
                assert all(map(torch.equal, compiled(x, m), module(x, m)))
    finally:
        torch._dynamo.reset()
    assert aot == [] and engine_eager_reasons() == {}, (aot, engine_eager_reasons())
