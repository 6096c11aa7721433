"""A region at run time: its fused kernels behind the verification gate.

Each region becomes a :class:`exactdit.gate.FusedOp` whose eager reference is the region's own
ATen nodes, copied out of the captured graph: the first call of each signature runs both and
compares bits and strides, a mismatch (or a kernel that raises) disables that signature and
returns the ATen result, and verified signatures launch the kernels only.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from exactdit import gate
from exactdit.engine import kernel_source, tables
from exactdit.engine.aten_ops import table_function
from exactdit.engine.region import Region
from exactdit.engine.templates import GeneratedKernel
from exactdit.numerics import LAUNCH_OPTIONS
from exactdit.ops._common import _INT_VIEW, _POISON


def reference_module(region: Region) -> fx.GraphModule:
    """The region's ATen nodes as a module: inputs in ``region.inputs`` order, a tuple of the
    outputs in ``region.outputs`` order."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for k, n in enumerate(region.inputs):
        p = graph.placeholder(f"in{k}")
        p.meta = dict(n.meta)
        env[n] = p
    def copy(n: fx.Node) -> fx.Node:
        if n in env:
            return env[n]
        if n.op != "call_function":
            raise ValueError(f"region {region.name} depends on {n} outside its inputs")
        for a in n.all_input_nodes:
            copy(a)
        env[n] = graph.node_copy(n, lambda a: env[a])
        return env[n]

    for n in region.nodes:
        copy(n)
    graph.output(tuple(env[n] for n in region.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


class RegionOp:
    """Callable that replaces a region in the rewritten graph: ``op(*inputs) -> outputs``."""

    def __init__(self, region: Region):
        self.region = region
        self.reference = reference_module(region)
        self._kernels: list | None = None
        self._out_layout = [(tuple(n.meta["val"].shape), tuple(n.meta["val"].stride()), n.meta["val"].dtype)
                            for n in region.outputs]
        self.op = gate.FusedOp(
            name=region.name,
            reference=self._reference,
            fused=self._fused,
            unsupported=self._unsupported,
            signature=self._signature,
            cuda_numerics=bool(region.reductions),
        )

    def __call__(self, *inputs):
        return gate.dispatch(self.op, *inputs)

    # --- gate callbacks -------------------------------------------------------------------------

    def _reference(self, *inputs):
        return tuple(self.reference(*inputs))

    def _unsupported(self, *inputs):
        return None

    def _signature(self, *inputs):
        return tuple(
            (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor) else t
            for t in inputs
        )

    def _fused(self, *inputs):
        region = self.region
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        tensors = dict(zip(region.inputs, inputs))
        outs = []
        for shape, stride, dtype in self._out_layout:
            out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            if gate.poison_outputs():
                out.view(_INT_VIEW[dtype]).fill_(_POISON[dtype])
            outs.append(out)
        table_data, table_consts = self._tables(device)
        for fn, k in self.kernels():
            args = []
            for p in k.params:
                if p[0] == "in":
                    args.append(tensors[k.inputs[p[1]]])
                elif p[0] == "out":
                    args.append(outs[p[1]])
                elif p[0] == "tab":
                    args.append(table_data[p[1]])
                elif p[0] == "in_stride":
                    args.append(tensors[k.inputs[p[1]]].stride(p[2]))
                else:
                    args.append(outs[p[1]].stride(p[2]))
            fn[k.grid](*args, **dict(k.constexprs), **table_consts, num_warps=k.num_warps, **LAUNCH_OPTIONS)
        return tuple(outs)

    # --- helpers --------------------------------------------------------------------------------

    def kernels(self) -> list[tuple[object, GeneratedKernel]]:
        if self._kernels is None:
            self._kernels = [(kernel_source.load(k.source), k) for k in self.region.kernels]
        return self._kernels

    def _tables(self, device) -> tuple[list[torch.Tensor], dict[str, int]]:
        data, consts = [], {}
        for k, node in enumerate(self.region.tables):
            dtype = node.meta["val"].dtype
            key = (str(node.target), tuple(map(str, node.args[1:])), tuple(sorted(map(str, node.kwargs.items()))))
            table, why = tables.table_for(key, table_function(node), dtype, device)
            if table is None:
                raise RuntimeError(f"no table for {key[0]}: {why}")
            data.append(table.data)
            consts.update(table.spec.constexprs(f"tab{k}"))
        return data, consts


def region_call_target(op: RegionOp):
    """A plain function for the graph node (FX prints its name in the generated code)."""

    def region(*inputs):
        return op(*inputs)

    region.__name__ = op.region.name.replace(".", "_")
    region.__qualname__ = region.__name__
    region.exactdit_region = op
    return region

