"""A region at run time: its fused kernels behind the verification gate.

Each region becomes a :class:`exactdit.gate.FusedOp` whose eager reference is the region's own
ATen nodes, copied out of the captured graph: the first call of each signature runs both and
compares bits and strides, a mismatch (or a kernel that raises) disables that signature and
returns the ATen result, and verified signatures launch the kernels only.
"""

from __future__ import annotations

import copy
import dataclasses
import weakref

import torch
import torch.fx as fx

from exactdit import first_calls, gate
from exactdit.device import compile_workers, launch
from exactdit.engine import kernel_source, tables
from exactdit.engine.aten_ops import cuda_only, table_function
from exactdit.engine.region import Region
from exactdit.engine.templates import GeneratedKernel, gemm
from exactdit.device.numerics import LAUNCH_OPTIONS


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
        self._plans: dict = {}
        self._table_cache: dict = {}
        complex_inputs = [n.meta["val"].dtype == torch.complex64 for n in region.inputs]
        self._complex_inputs = complex_inputs if any(complex_inputs) else None
        #: output (shape, strides, dtype) per input layout: eager's own (see :meth:`_out_layout`)
        self._out_layouts: dict = {}
        #: a GEMM region's way without its kernel (cuBLAS, then the epilogue), its kernel in the
        #: other candidate tile configurations, and per signature the way that was fastest and
        #: each way's median us
        self._alternative = RegionOp(region.alternative) if region.alternative is not None else None
        self._tile_variants: list | None = None
        self.choices: dict[tuple, tuple[str, dict[str, float]]] = {}
        if region.kind == "gemm":
            _GEMM_OPS.add(self)
        self.op = gate.FusedOp(
            name=region.name,
            reference=self._reference,
            fused=self._fused,
            unsupported=self._unsupported,
            signature=self._signature,
            cuda_numerics=bool(region.reductions) or any(cuda_only(n) for n in region.nodes),
            specialize=self._specialize,
            compiling=self._compiling,
        )

    def __call__(self, *inputs):
        return gate.dispatch(self.op, *inputs)

    # --- gate callbacks -------------------------------------------------------------------------

    def _reference(self, *inputs):
        outs = tuple(self.reference(*inputs))
        key = _layout_key(inputs)
        if key not in self._out_layouts:  # what the kernels' outputs take (the gate runs this first)
            self._out_layouts[key] = [(tuple(o.shape), tuple(o.stride()), o.dtype) for o in outs]
        return outs

    def _unsupported(self, *inputs):
        if self.region.kind == "gemm":
            try:
                self.tile_variants()  # (their TMA operands join the region's, checked below)
            except Exception:  # noqa: BLE001 - a tiling that cannot be built is not timed either
                pass
            why = gemm.layout_problem(self.region, inputs) or gemm.output_problem(self.region, self._out_layout(inputs))
            if why is not None:
                return why
        if self._complex_inputs:  # kernels read complex64 with the fp32 view's last strides (2, 1)
            for t, c in zip(inputs, self._complex_inputs):
                if c and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
                    return "a complex input strided along its last dim"
        return None

    def _signature(self, *inputs):
        return tuple(
            (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0) if isinstance(t, torch.Tensor) else t
            for t in inputs
        )

    def _fused(self, *inputs):
        device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else next(
            t.device for t in inputs if isinstance(t, torch.Tensor))
        layout = self._out_layout(inputs)
        if self._complex_inputs:  # kernels read complex64 through its fp32 view
            inputs = tuple(torch.view_as_real(t) if c else t for t, c in zip(inputs, self._complex_inputs))
        if self.region.kind == "gemm" and device.type == "cuda":
            gemm.ensure_allocator()
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in layout]
        if gate.poison_outputs():
            _poison(outs)
        strides = [stride for _, stride, _ in layout]
        for step, args in self._arguments(device, inputs, outs, strides):
            step.fn[step.grid](*args, **step.kwargs)
        return tuple(outs)

    def _specialize(self, *inputs):
        with first_calls.phase("plans", self.region.name):
            return self._specialized(*inputs)

    def _specialized(self, *inputs):
        if self.region.kind != "gemm" or gate.cannot_sync():
            return self._launch_plan(*inputs)
        ways = self.gemm_ways(*inputs)
        way, times = gemm.choose(ways, inputs)
        self.choices[gate.arg_key(inputs)] = (way, times)
        return ways[way]

    def gemm_ways(self, *inputs) -> dict:
        """A GEMM region's ways for inputs of this layout, which give the same bits: its kernel
        in each candidate tile configuration (``"fused <tiles>"``, through a launch plan where
        there is one; the region's own first) and ``"split"``, cuBLAS followed by the epilogue."""
        ways = {f"fused {gemm.first_tiles(self.region).label}": self._launch_plan(*inputs) or self._fused}
        for cfg, op in self.tile_variants():
            try:
                ways[f"fused {cfg.label}"] = op._launch_plan(*inputs) or op._fused
            except Exception:  # noqa: BLE001 - a configuration that does not compile here is not timed
                continue
        ways["split"] = self._split
        return ways

    def tile_variants(self) -> list:
        """[(tiles, RegionOp)]: a GEMM region's kernel in each other candidate tile configuration."""
        if self._tile_variants is None:
            self._tile_variants = []
            for cfg, kernel in gemm.other_tiles(self.region):
                variant = copy.copy(self.region)
                variant.kernels, variant.alternative = [kernel], None
                op = RegionOp(variant)
                op._out_layouts = self._out_layouts  # (the same nodes: the same output layouts)
                _GEMM_OPS.discard(op)
                self._tile_variants.append((cfg, op))
        return self._tile_variants

    def _compiling(self) -> bool:
        return any(compile_workers.compiling(fn) for fn, _ in self.kernels())

    def _split(self, *inputs, poisoned=False):
        """The GEMM by ATen (cuBLAS, after ATen's cat where the kernel reads A's K ranges from
        the cat's pieces), then the epilogue's own region (or its ATen nodes)."""
        if self._alternative is None:
            return self._reference(*inputs)
        env = dict(zip(self.region.inputs, inputs))
        mm = self.region.anchor
        for n in (gemm.prologue(self.region) or ((),))[0]:  # a cat the kernel reads as K ranges: ATen's
            env[n] = n.target(*fx.node.map_arg(n.args, env.__getitem__), **fx.node.map_arg(n.kwargs, env.__getitem__))
        env[mm] = mm.target(*fx.node.map_arg(mm.args, env.__getitem__), **fx.node.map_arg(mm.kwargs, env.__getitem__))
        alt = self._alternative.region
        env.update(zip(alt.outputs, self._alternative(*[env[n] for n in alt.inputs])))
        return tuple(env[n] for n in self.region.outputs)

    def _launch_plan(self, *inputs):
        """``fast(*inputs, poisoned=False)`` for calls whose inputs have exactly these inputs'
        layout (the gate's key): generated Python that allocates the outputs and calls each
        kernel's compiled launcher with every stride and constexpr already in place - no
        argument binding, key building or cache lookups per call. None where Triton's compiled
        launchers cannot be called directly (the interpreter, other Triton versions)."""
        device = gate.args_device(inputs)
        if not launch.supported(device):
            return None
        if self.region.kind == "gemm":
            gemm.ensure_allocator()
        layout = self._out_layout(inputs)
        views = tuple(torch.view_as_real(t) if c else t
                      for t, c in zip(inputs, self._complex_inputs or [False] * len(inputs)))
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in layout]
        data = self._tables(device)[0]
        names = {}
        for group, prefix in ((views, "in"), (outs, "out"), (data, "tab")):
            for i, t in enumerate(group):
                names.setdefault(id(t), f"{prefix}{i}")
        scope = {"current_device": launch.current_device, "current_stream": launch.current_stream,
                 "hooks_installed": launch.hooks_installed, "view_as_real": torch.view_as_real,
                 "plain": self._fused, "poison": _poison}
        scope.update({f"tab{i}": t for i, t in enumerate(data)})

        def name_of(value) -> str:  # literals inline, everything else through the scope
            if id(value) in names:
                return names[id(value)]
            if value is None or type(value) in (int, bool):
                return repr(value)
            scope[f"const{len(scope)}"] = value
            return f"const{len(scope) - 1}"

        params = ", ".join(f"in{i}" for i in range(len(inputs)))
        lines = [f"def fast({params}, poisoned=False):",
                 # launchers are loaded on one device, and skip Triton's launch hooks
                 f"    if current_device() != {device.index} or hooks_installed():",
                 f"        return plain({params})"]
        lines += [f"    in{i} = view_as_real(in{i})" for i, c in enumerate(self._complex_inputs or ()) if c]
        for j, (shape, stride, dtype) in enumerate(layout):
            # new_empty_strided of a kept empty tensor: fewer arguments to parse than empty_strided
            like = name_of(torch.empty(0, dtype=dtype, device=device))
            lines.append(f"    out{j} = {like}.new_empty_strided({shape!r}, {stride!r})")
        outputs = "".join(f"out{j}, " for j in range(len(outs)))
        lines += ["    if poisoned:", f"        poison(({outputs}))", f"    stream = current_stream({device.index})"]
        for plan, args in self._arguments(device, views, outs, [stride for _, stride, _ in layout]):
            if compile_workers.pending(plan.fn):
                with first_calls.phase("workers", self.region.name) as waited:
                    waited.count = compile_workers.wait(plan.fn)
            with first_calls.phase("compile", self.region.name) as timed:
                cached = launch.cached_kernels(plan.fn, device)
                compiled = launch.compile_for(plan.fn, plan.grid, args, plan.kwargs, device)
                timed.count = int(cached is None or launch.cached_kernels(plan.fn, device) != cached)
            exprs = [name_of(compiled.call)] + [name_of(v) for v in compiled.head] + ["stream"]
            exprs += [name_of(v) for v in compiled.tail + tuple(compiled.arguments)]
            lines.append(f"    {exprs[0]}({', '.join(exprs[1:])})")
        lines.append(f"    return ({outputs})")
        exec(compile("\n".join(lines), f"<exactdit launch plan {self.region.name}>", "exec"), scope)  # noqa: S102
        return scope["fast"]

    def compile_ahead(self) -> int:
        """Send this region's kernels to Triton's compile workers (:mod:`compile_workers`) for the
        layout its captured graph shows (the fake values' dtypes, strides and storage offsets),
        so that they compile while the model runs (its calls run the region's ATen nodes until
        they are: :attr:`gate.FusedOp.compiling`); a GEMM region's also in its other tile
        configurations and its epilogue alone, the ways its first calls time. Returns how many
        were sent: none off CUDA or for symbolic sizes."""
        ins = [n.meta.get("val") for n in self.region.inputs]
        if not all(isinstance(t, torch.Tensor) for t in ins):
            return 0
        device = gate.args_device(ins)
        if not launch.supported(device) or compile_workers.worker_count() == 0:
            return 0
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # (tables are built by launches)
            return 0
        ops = [self]
        if self.region.kind == "gemm":
            try:
                ops += [op for _, op in self.tile_variants()]
            except Exception:  # noqa: BLE001 - (a variant that cannot be built is not timed either)
                pass
            if self._alternative is not None:
                ops.append(self._alternative)
        return sum(op._send_ahead(device) for op in ops)

    def _send_ahead(self, device) -> int:
        ins = [n.meta.get("val") for n in self.region.inputs]
        outs = [n.meta.get("val") for n in self.region.outputs]
        if not all(isinstance(t, torch.Tensor) for t in ins + outs):
            return 0
        try:
            views = [torch.view_as_real(t) if c else t for t, c in zip(ins, self._complex_inputs or [False] * len(ins))]
            if not all(type(x) is int for t in views + outs for x in (*t.shape, *t.stride())):
                return 0
            stand = [launch.StandIn(t) for t in views]
            return sum(compile_workers.submit(plan.fn, plan.grid, args, plan.kwargs, device)
                       for plan, args in self._arguments(device, stand, [launch.StandIn(t) for t in outs],
                                                         [t.stride() for t in outs], [t.stride() for t in views]))
        except Exception:  # noqa: BLE001 - a guess that cannot be made: the first call compiles
            return 0

    def _arguments(self, device, views, outs, out_strides, in_strides=None):
        """Each launch with its arguments: the kernel's tensors from ``views`` (the inputs, complex
        ones as real views), ``outs`` and the tables, and the strides of inputs and outputs."""
        tensors = (views, outs, self._tables(device)[0])
        strides = (in_strides if in_strides is not None else [t.stride() for t in views], out_strides)
        for plan in self._launches(device):
            yield plan, tuple(i if kind == _INT else tensors[kind][i] if d < 0 else strides[kind][i][d]
                              for kind, i, d in plan.params)

    # --- helpers --------------------------------------------------------------------------------

    def _out_layout(self, inputs) -> list[tuple[tuple, tuple, torch.dtype]]:
        """Each output's (shape, strides, dtype) as eager gives them for inputs of this layout:
        read off one run of the region's ATen nodes, once per layout. The captured graph's fake
        values do not always have them: strides of size-1 dims follow the inputs' (TensorIterator
        orders dims by every operand's strides, size-1 dims included, unless all operands share
        one shape), and a fake value follows the fake inputs, whose size-1 strides can differ from
        the real ones (an attention output), or predicts them otherwise (``x * 0.5`` on a
        (1, 2, 1, 6) tensor of strides (12, 6, 12, 1): eager keeps them, the meta kernel gives
        (12, 6, 6, 1)). The kernels take any output strides. The gate's verification runs the
        reference before the kernel, which leaves its layout here: no second run."""
        layout = self._out_layouts.get(_layout_key(inputs))
        if layout is None:
            with torch.no_grad(), first_calls.phase("layout", self.region.name):
                self._reference(*inputs)
            layout = self._out_layouts[_layout_key(inputs)]
        return layout

    def kernels(self) -> list[tuple[object, GeneratedKernel]]:
        if self._kernels is None:
            with first_calls.phase("codegen", self.region.name, count=0):  # (counted when generated)
                self._kernels = [(kernel_source.load(k.source), k) for k in self.region.kernels]
        return self._kernels

    def _launches(self, device) -> list["_Launch"]:
        """Per device: each kernel with its arguments resolved to (source, index, dim) and its
        keyword arguments (constexprs, table constexprs, launch options) in one dict."""
        plans = self._plans.get(device)
        if plans is None:
            position = {n: i for i, n in enumerate(self.region.inputs)}
            consts = self._tables(device)[1]
            plans = []
            for fn, k in self.kernels():
                params = []
                for p in k.params:
                    if p[0] == "int":
                        params.append((_INT, p[2], -1))
                        continue
                    kind = {"in": 0, "out": 1, "tab": 2, "in_stride": 0, "out_stride": 1}[p[0]]
                    i = position[k.inputs[p[1]]] if kind == 0 else p[1]
                    params.append((kind, i, p[2] if len(p) > 2 else -1))
                kwargs = dict(k.constexprs, **consts, num_warps=k.num_warps, **dict(k.launch_options), **LAUNCH_OPTIONS)
                plans.append(_Launch(fn, k.grid, tuple(params), kwargs))
            self._plans[device] = plans
        return plans

    def _tables(self, device) -> tuple[list[torch.Tensor], dict[str, int]]:
        hit = self._table_cache.get(device)
        if hit is not None:
            return hit
        data, consts = [], {}
        for k, node in enumerate(self.region.tables):
            dtype = node.meta["val"].dtype
            key = (str(node.target), tuple(map(str, node.args[1:])), tuple(sorted(map(str, node.kwargs.items()))))
            table, why = tables.table_for(key, table_function(node), dtype, device)
            if table is None:
                raise RuntimeError(f"no table for {key[0]}: {why}")
            data.append(table.data)
            consts.update(table.spec.constexprs(f"tab{k}"))
        self._table_cache[device] = (data, consts)
        return data, consts


_GEMM_OPS: "weakref.WeakSet[RegionOp]" = weakref.WeakSet()

#: the kind of a launch parameter that is a per-row integer (its value in place of the index)
_INT = 3


def gemm_choices() -> list[dict]:
    """Per fused-GEMM region and signature: the GEMM's shape, its epilogue, which way ran (the
    fused kernel in one tile configuration, or ``split``: cuBLAS then the epilogue) and each way's
    median us (none where the way was not timed)."""
    rows = []
    for op in list(_GEMM_OPS):
        a, b, _ = gemm.operands(op.region.anchor)
        (m, k), n = a.meta["val"].shape, b.meta["val"].shape[1]
        for way, times in op.choices.values():
            rows.append({"region": op.region.name, "ops": op.region.describe(), "m": m, "k": k, "n": n,
                         "way": way, "us": {w: round(t, 1) for w, t in times.items()}})
    return sorted(rows, key=lambda r: r["region"])


@dataclasses.dataclass(frozen=True)
class _Launch:
    fn: object
    grid: tuple[int, ...]
    #: per kernel parameter: (0 inputs / 1 outputs / 2 tables, index, dim for a stride or -1), or
    #: (_INT, value, -1) for a per-row integer
    params: tuple[tuple[int, int, int], ...]
    kwargs: dict


def _layout_key(inputs) -> tuple:
    """What of a region's inputs its output layouts depend on."""
    return tuple((t.shape, t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t for t in inputs)


def _poison(outs) -> None:
    for out in outs:
        out.view(gate.INT_VIEW[out.dtype]).fill_(gate.POISON[out.dtype])


def region_call_target(op: RegionOp):
    """A plain function for the graph node (FX prints its name in the generated code)."""

    def region(*inputs):
        return op(*inputs)

    region.__name__ = op.region.name.replace(".", "_")
    region.__qualname__ = region.__name__
    region.exactdit_region = op
    return region

