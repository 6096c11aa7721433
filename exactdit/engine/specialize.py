"""Graphs Dynamo captured with symbolic sizes, lowered at each signature they run at.

Dynamo captures a block with symbolic sizes once it has seen the block at two shapes (its automatic
dynamic shapes), or from the first call with ``exactdit.patch(..., dynamic=True)``: one graph of
torch calls for every sequence length. The engine's partition, indexing and templates read
concrete sizes, so such a graph is not rewritten as it is. AOTAutograd lowers it to ATen once,
with its sizes symbolic (:class:`Symbolic`); at each signature it runs at (the values of its
symbolic sizes) :func:`at_sizes` makes the ATen graph of those sizes (the size arithmetic done,
each value's metadata of those sizes), the engine rewrites that graph, and the result is kept for
the signature.

Why that graph is the one a capture at those sizes would give: Dynamo builds its guards after the
backend returns, so they hold the choices the model's Python and AOTAutograd made from sizes by
guarding (a reshape's copy, a matmul's folding), and :func:`at_sizes` runs no Python of the
model, only the ATen graph's size arithmetic. Choices ATen makes only where a fact is known
without a guard (``applySlice``'s whole slices) differ between symbolic and static sizes:
:func:`at_sizes` makes the static ones for indexing; any other such place would show as a graph
unlike the static capture's. tests/engine/test_specialize.py compares the two op for op on ten
production classes, and a review did on 32 minis. Dynamo captures sizes 0 and 1 as constants. Where the
symbolic lowering cannot be used (a graph with autograd recording, AOTAutograd's inputs not
Dynamo's), each signature goes through AOTAutograd with static sizes instead (slower, the same
graph). What a new resolution then costs is a pass over the ATen graph and the engine's rewrite,
not Dynamo's tracing of the model's Python or AOTAutograd (benchmarks/probes/probe_new_shapes.py).
"""

from __future__ import annotations

import logging
import operator
import struct
import threading

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true

from exactdit import first_calls, gate
from exactdit.engine import coverage

logger = logging.getLogger("exactdit")


#: signatures whose lowered graphs one symbolic graph keeps (a service meeting sizes without end
#: keeps the latest; Dynamo's static captures are bounded alike, by its recompile limit)
KEPT_SIGNATURES = 64


def _symbolic(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride(), value.storage_offset()))
    return False


def symbolic_positions(example_inputs) -> tuple[int, ...]:
    """The positions of a graph's inputs whose size (or value, for an integer) is symbolic."""
    return tuple(i for i, v in enumerate(example_inputs) if _symbolic(v))


def _value_key(value):
    """A scalar's value as a key: a float by its bits (``0.0 == -0.0``, and NaN equals nothing)."""
    return struct.pack("<d", value) if isinstance(value, float) else value


def _concrete(value):
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride()
    return value


#: what reads a tensor's value into the graph
_READS = {"item", "tolist", torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


def value_positions(gm, example_inputs) -> tuple[int, ...]:
    """The positions of the CPU scalars whose values ``gm`` reads (``.item()``): Dynamo passes a
    number it captured as a symbol (a float that changed between calls) as a 0-dim CPU tensor."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(i for i, (n, v) in enumerate(zip(placeholders, example_inputs))
                 if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() == 1
                 and any(u.target in _READS for u in n.users))


def _static_fakes(args) -> list:
    """``args`` with each tensor replaced by a fake of its sizes and strides, in a fake mode with a
    shape environment as Dynamo's (sizes static; an op whose output size follows the data, such as
    ``nonzero``, gets an unbacked size, as it does in Dynamo's graphs)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)
    return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a for a in args]


def with_values(gm: fx.GraphModule, values: dict[int, object]) -> fx.GraphModule:
    """A copy of ``gm`` in which each read of the scalar input at position ``i`` (``.item()``) is the
    constant ``values[i]``, as a static capture holds it."""
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, value in values.items():
        for read in (u for u in placeholders[position].users if u.target in _READS):
            env[read] = value
    for node in gm.graph.nodes:
        if node not in env:
            env[node] = graph.node_copy(node, lambda a: env[a])
    return fx.GraphModule(gm, graph)


def run_as_captured(gm: fx.GraphModule, example_inputs):
    """An AOTAutograd compiler that leaves the graph as it is."""
    return make_boxed_func(gm)


def _constant(value) -> bool:
    return type(value) in (int, float, bool)


def _reads_values(*values) -> bool:
    """Whether ``values`` hold a tensor or a size still symbolic (an unbacked one)."""
    return any(isinstance(a, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
               for a in torch.utils._pytree.tree_leaves(values))


def whole_slices_left_out(gm: fx.GraphModule) -> dict[tuple, object]:
    """The nodes of ``gm`` (Dynamo's graph) whose indexing leaves out a slice known to take a whole
    dim (ATen's ``applySlice``; known at static sizes, not always at symbolic ones), by name:
    ``operator.getitem`` with a tuple (``x[:, :n]``; a lone slice, ``x[:n]``, is kept) or
    ``operator.setitem`` with a tuple or a slice (``x[:, 0] = v``, ``x[:n] = v``). Keys: the graph's
    id and the node's name, as AOTAutograd's nodes name their source (``from_node``)."""
    kinds = {operator.getitem: (tuple,), operator.setitem: (tuple, slice)}
    return {(id(gm.graph), n.name): n.target for n in gm.graph.nodes if n.op == "call_function"
            and n.target in kinds and isinstance(n.args[1], kinds[n.target])}


#: the ops indexing makes for a slice, and the names of their arguments
_SLICES = {torch.ops.aten.slice.Tensor: ("x", "dim", "start", "end", "step"),
           torch.ops.aten.slice_scatter.default: ("x", "src", "dim", "start", "end", "step")}


def _made_for(node: fx.Node) -> tuple | None:
    """The node of Dynamo's graph (its graph's id, its name) that AOTAutograd made ``node`` for."""
    sources = node.meta.get("from_node")
    return (sources[-1].graph_id, sources[-1].name) if sources else None


def _indexing(node: fx.Node, indexings: dict) -> tuple | None:
    """The indexing (a name in ``indexings``) slice or slice scatter ``node`` was made for."""
    made_for = _made_for(node) if node.target in _SLICES else None
    return made_for if made_for in indexings else None


def _whole(node: fx.Node, args, kwargs) -> bool:
    """Whether slice (or slice scatter) ``node`` at these sizes covers all of its input's dim, known
    without a guard (ATen's test; an unbacked size is not known), and a scatter's source is a whole
    input of the base's dtype (the scatter is then its source)."""
    bound = {"dim": 0, "start": None, "end": None, "step": 1, **dict(zip(_SLICES[node.target], args)), **kwargs}
    x, start, end = bound["x"], bound["start"], bound["end"]
    if "src" in bound and (bound["src"].dtype != x.dtype or bound["src"].shape != x.shape):
        return False
    return (start is None or statically_known_true(start == 0)) and bound["step"] == 1 and (
        end is None or statically_known_true(x.shape[bound["dim"]] <= end))


def at_sizes(gm: fx.GraphModule, args, indexings: dict[tuple, object] | None = None) -> fx.GraphModule:
    """A copy of ``gm`` (an ATen graph with symbolic sizes) for inputs of the sizes of ``args`` (the
    call's), as a static capture at those sizes gives it:

    * each node that computes a size (``sym_size``, arithmetic on sizes) becomes the constant it
      computes, and an assertion on sizes that holds goes;
    * where an indexing (``indexings``: :func:`whole_slices_left_out` of Dynamo's graph) sliced all
      of a dim, the slice goes (ATen's ``applySlice`` leaves it out where that is known without
      a guard: at static sizes, not at symbolic ones), and so does the slice scatter that writes
      it back (``x[:, 0] = v``); a reading index left with nothing else is ``alias(x)``, as ATen's
      ``x[...]`` returns;
    * every other node is kept, its ``val`` of these sizes (fake tensors of a fresh mode), run as
      AOTAutograd traces (the Python dispatcher on, autocast off). Placeholders are kept, integer
      ones unused."""
    graph, indexings = fx.Graph(), indexings or {}
    fakes = _static_fakes(args)
    mode = next((f.fake_mode for f in fakes if isinstance(f, torch.Tensor)), None) or FakeTensorMode()
    env: dict[fx.Node, object] = {}  # node -> its node in the copy, or the constant it is
    vals: dict[fx.Node, object] = {}  # node -> its value at these sizes
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = {n: i for i, n in enumerate(placeholders)}
    made_by: dict[tuple, list[fx.Node]] = {}  # an indexing -> the tensors made for it (views, scatters)
    for node in gm.graph.nodes:
        if isinstance(node.meta.get("val"), torch.Tensor) and _made_for(node) in indexings:
            made_by.setdefault(_made_for(node), []).append(node)
    left_out: set[fx.Node] = set()
    with enable_python_dispatcher(), torch._C._DisableAutocast(), mode:
        for node in gm.graph.nodes:
            if node.op == "output":
                graph.output(fx.map_arg(node.args[0], lambda a: env[a]))
                continue
            if node.op == "placeholder":
                val = fakes[position[node]]
            elif node.op == "get_attr":
                val = getattr(gm, node.target)
                val = mode.from_tensor(val, static_shapes=True) if isinstance(val, torch.Tensor) else val
            else:
                call_args, call_kwargs = fx.map_arg((node.args, node.kwargs), lambda a: vals[a])
                indexing = _indexing(node, indexings)
                if indexing is not None and _whole(node, call_args, call_kwargs):
                    left_out.add(node)
                    kept = node.args[0] if node.target is torch.ops.aten.slice.Tensor else node.args[1]
                    vals[node] = vals[kept]
                    env[node] = env[kept]
                    if indexings[indexing] is operator.getitem and left_out.issuperset(made_by[indexing]):
                        vals[node] = torch.ops.aten.alias.default(vals[kept])
                        env[node] = graph.call_function(torch.ops.aten.alias.default, (env[kept],))
                        env[node].meta = {**_kept_meta(node), "val": vals[node]}
                    continue
                val = node.target(*call_args, **call_kwargs)
                if _constant(val) or (val is None and not _reads_values(call_args, call_kwargs)):
                    env[node] = vals[node] = val
                    continue
            vals[node] = val
            copy = graph.node_copy(node, lambda a: env[a])
            copy.meta = {**_kept_meta(node), "val": val}
            env[node] = val if _constant(val) else copy  # an integer input: its users take the value
    return fx.GraphModule(gm, graph)


def _kept_meta(node: fx.Node) -> dict:
    return {k: v for k, v in node.meta.items() if k not in ("tensor_meta", "unbacked_bindings")}


class Symbolic:
    """Dynamo's symbolic graph lowered to ATen once by AOTAutograd, its sizes symbolic: ``gm``, the
    ATen graph; :meth:`call` runs AOTAutograd's runtime wrapper (inputs, outputs, aliasing) around
    a graph :func:`at_sizes` made from ``gm`` and the engine rewrote. Raises ``ValueError`` where
    the ATen graph's inputs are not Dynamo's one for one (AOTAutograd dropped a duplicate, added an
    effect token) or no inference graph came (autograd recording)."""

    def __init__(self, gm: fx.GraphModule, example_inputs):
        self._local = threading.local()
        given: list = []

        def inference(aten_gm, aten_inputs):
            given.append(aten_gm)

            def run(args):
                return self._local.run(args)

            run._boxed_call = True
            return run

        self._wrapper = aot_autograd(fw_compiler=run_as_captured, bw_compiler=run_as_captured,
                                     inference_compiler=inference)(gm, example_inputs)
        if not given:
            raise ValueError("no inference graph (autograd recording)")
        self.gm = given[0]
        kinds = [isinstance(n.meta.get("val"), torch.Tensor) for n in self.gm.graph.nodes if n.op == "placeholder"]
        if kinds != [isinstance(a, torch.Tensor) for a in example_inputs]:
            raise ValueError("AOTAutograd's inputs are not Dynamo's one for one")

    def call(self, rewritten, args):
        """AOTAutograd's wrapper around ``rewritten`` (a boxed callable), on ``args``."""
        previous = getattr(self._local, "run", None)
        self._local.run = rewritten
        try:
            return self._wrapper(*args)
        finally:
            self._local.run = previous


def _without_unbacked(gm: fx.GraphModule) -> None:
    """Drop Dynamo's unbacked sizes from ``gm``'s nodes: a lowering at static sizes makes its own
    (a fresh shape environment)."""
    for node in gm.graph.nodes:
        node.meta.pop("unbacked_bindings", None)


class PerSignature:
    """What a Dynamo backend returns for a graph with symbolic sizes: at each new signature (the
    sizes and strides of the inputs whose sizes are symbolic, the values of symbolic integers and of
    the scalars the graph reads: :func:`value_positions`) it makes that signature's ATen graph
    (:func:`at_sizes` of the :class:`Symbolic` lowering) and has ``rewrite(graph, args)`` (the
    engine's AOTAutograd inference compiler) rewrite it; later calls at that signature run what it
    returned. Where the symbolic lowering cannot serve, ``lower(graph, args)`` (a Dynamo backend:
    AOTAutograd and the engine) lowers Dynamo's graph with the call's arguments as example inputs.
    Only the symbolic inputs are read: Dynamo's guards hold everything else."""

    def __init__(self, gm, example_inputs, label: str, lower, rewrite):
        self.gm, self.label, self.lower, self.rewrite = gm, label, lower, rewrite
        self.values = value_positions(gm, example_inputs)
        self.positions = symbolic_positions(example_inputs)
        self.indexings = whole_slices_left_out(gm)
        self.symbolic: Symbolic | None = None
        try:  # not where the graph reads a number: ATen's kernels take it as a double, a guard on its value
            self.symbolic = None if self.values else Symbolic(gm, example_inputs)
        except torch._dynamo.exc.RestartAnalysis:  # Dynamo's own signal to trace again, for Dynamo
            raise
        except Exception as e:  # noqa: BLE001 - each signature through AOTAutograd instead
            logger.info("exactdit: %s lowered per signature: %s: %s", label, type(e).__name__, e)
        if self.symbolic is None:
            _without_unbacked(gm)
        #: key -> (the lowered callable, the names of the graphs it registered)
        self.lowered: dict[tuple, tuple] = {}
        #: ``(args, key)``, called after each new signature is lowered (what a capture is for a static graph)
        self.on_new_signature = None
        self._lowering = threading.RLock()

    def __call__(self, *args):
        key = tuple(_concrete(args[i]) for i in self.positions)
        values = {i: args[i].item() for i in self.values} if self.values else {}
        if values:
            key += tuple(map(_value_key, values.values()))
        entry = self.lowered.get(key)
        if entry is None:
            with self._lowering:  # a second thread at this signature waits for the first's lowering
                entry = self.lowered.get(key) or self._new_signature(args, key, values)
        return entry[0](*args)

    def _new_signature(self, args, key, values):
        if len(self.lowered) >= KEPT_SIGNATURES:  # the oldest goes (lowered again if it comes back)
            self._forget(self.lowered.pop(next(iter(self.lowered)))[1])
        known = {g.name for g in coverage.graphs()}
        with first_calls.phase("specialize", self.label):
            run = self._lowered(args, values)
        entry = self.lowered[key] = (run, [g.name for g in coverage.graphs() if g.name not in known])
        if self.on_new_signature is not None:
            self.on_new_signature(args, key)
        return entry

    @staticmethod
    def _forget(graphs: list[str]) -> None:
        """What the process kept of a dropped lowering's graphs: their reports and their regions' gate state."""
        coverage.forget(graphs)
        for name in graphs:
            gate.forget(name + ".")

    def _made_concrete(self, args):
        symbolic, graph = self.symbolic, at_sizes(self.symbolic.gm, args, self.indexings)
        rewritten = self.rewrite(graph, [n.meta["val"] for n in graph.graph.nodes if n.op == "placeholder"])
        return lambda *call_args: symbolic.call(rewritten, call_args)

    def _lowered(self, args, values: dict):
        try:
            if self.symbolic is not None:
                try:
                    return self._made_concrete(args)
                except Exception as e:  # noqa: BLE001 - AOTAutograd at these sizes instead (slower, the same graph)
                    logger.info("exactdit: %s lowered at these sizes: %s: %s", self.label, type(e).__name__, e)
                    _without_unbacked(self.gm)
            return self.lower(with_values(self.gm, values) if values else self.gm, _static_fakes(args))
        except Exception as e:  # noqa: BLE001 - Dynamo's graph of torch calls still runs what eager runs
            why = f"not lowered at these sizes: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning("exactdit: %s %s", self.label, why)
            site, gm = f"engine.{self.label}", self.gm

            def eager(*call_args):
                gate.count_eager(site, why)
                return gm(*call_args)

            return eager
