"""Graphs Dynamo captured with symbolic sizes, lowered at each signature they run at.

Dynamo captures a block with symbolic sizes once it has seen the block at two shapes (its automatic
dynamic shapes): one graph of torch calls for every sequence length. The engine's partition,
indexing and templates read concrete sizes, so such a graph is not lowered as it is: at each
signature it runs at (the values of its symbolic sizes) AOTAutograd lowers it to ATen with the
call's tensors as example inputs (static sizes), the engine rewrites that graph, and the result
is kept for the signature.

Why that graph is the one a capture at those sizes would give: Dynamo's guards (checked before
the graph is called) hold every choice the model's Python made from sizes, and AOTAutograd meets
the same torch calls with the same concrete tensors as when Dynamo captures statically, so it
makes the same ATen choices (a reshape's copy, a matmul's folding). Dynamo captures sizes 0 and 1
as constants, never as symbols. What a new resolution then costs is AOTAutograd and the engine,
not Dynamo's tracing of the model's Python (HunyuanVideo's blocks on the CPU: about half a
capture; benchmarks/probes/probe_new_shapes.py).
"""

from __future__ import annotations

import logging
import struct

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

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


class PerSignature:
    """What a Dynamo backend returns for a graph with symbolic sizes: at each new signature (the
    sizes and strides of the inputs whose sizes are symbolic, the values of symbolic integers and of
    the scalars the graph reads: :func:`value_positions`) it
    calls ``lower(graph, args)`` (a Dynamo backend: AOTAutograd and the engine) with the call's
    arguments as example inputs; later calls at that signature run what it returned. Only the
    symbolic inputs are read: Dynamo's guards hold everything else."""

    def __init__(self, gm, example_inputs, label: str, lower):
        self.gm, self.label, self.lower = gm, label, lower
        for node in gm.graph.nodes:  # Dynamo's unbacked sizes: lowering makes its own (a fresh shape env)
            node.meta.pop("unbacked_bindings", None)
        self.values = value_positions(gm, example_inputs)
        self.positions = symbolic_positions(example_inputs)
        #: key -> (the lowered callable, the names of the graphs it registered)
        self.lowered: dict[tuple, tuple] = {}
        #: ``(args, key)``, called after each new signature is lowered (what a capture is for a static graph)
        self.on_new_signature = None

    def __call__(self, *args):
        key = tuple(_concrete(args[i]) for i in self.positions)
        values = {i: args[i].item() for i in self.values} if self.values else {}
        if values:
            key += tuple(map(_value_key, values.values()))
        entry = self.lowered.get(key)
        if entry is None:
            if len(self.lowered) >= KEPT_SIGNATURES:  # the oldest goes (lowered again if it comes back)
                self._forget(self.lowered.pop(next(iter(self.lowered)))[1])
            known = {g.name for g in coverage.graphs()}
            with first_calls.phase("specialize", self.label):
                run = self._lowered(args, values)
            entry = self.lowered[key] = (run, [g.name for g in coverage.graphs() if g.name not in known])
            if self.on_new_signature is not None:
                self.on_new_signature(args, key)
        return entry[0](*args)

    @staticmethod
    def _forget(graphs: list[str]) -> None:
        """What the process kept of a dropped lowering's graphs: their reports and their regions' gate state."""
        coverage.forget(graphs)
        for name in graphs:
            gate.forget(name + ".")

    def _lowered(self, args, values: dict):
        try:
            return self.lower(with_values(self.gm, values) if values else self.gm, _static_fakes(args))
        except Exception as e:  # noqa: BLE001 - Dynamo's graph of torch calls still runs what eager runs
            why = f"not lowered at these sizes: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            logger.warning("exactdit: %s %s", self.label, why)
            site, gm = f"engine.{self.label}", self.gm

            def eager(*call_args):
                gate.count_eager(site, why)
                return gm(*call_args)

            return eager
