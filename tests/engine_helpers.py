"""Test plumbing for the engine: capture blocks of diffusers models on the CPU, and run a captured
graph as CUDA eager would (reductions through the order models), so that regions with
reductions can be held to CUDA's bits in Triton's interpreter."""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from exactdit.aten.norms import fma_f32, layer_norm_order_model, rms_norm_order_model
from exactdit.aten.reduce import mean_lastdim_reference_order
from exactdit.engine.backend import rewrite
from exactdit.engine import capture
from exactdit.patches.engine import repeated_blocks
from tests.helpers import assert_bits_equal, interpreter_rsqrt

aten = torch.ops.aten


def _mean(x, dims, keepdim=False, dtype=None):
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    out = mean_lastdim_reference_order(rows, num_rows=rows.shape[0])
    shape = x.shape[:-1] + ((1,) if keepdim else ())
    return out.reshape(shape)


def _layer_norm(x, normalized, weight, bias, eps):
    x = x.contiguous()  # ATen's native_layer_norm works on (and returns) the contiguous input
    y, mean, rstd = layer_norm_order_model(x, weight, bias, eps, rsqrt=interpreter_rsqrt, vectorized=True,
                                           return_stats=True)
    return y, mean, rstd


def _fused_rms(x, normalized, weight, eps=None):
    return rms_norm_order_model(x, weight, eps, rsqrt=interpreter_rsqrt, vectorized=True, return_rstd=True)


def _cast_on_load(fn):
    """CUDA's binary kernels load a 0-dim fp32 tensor that meets a bf16/fp16 tensor converted to
    the result dtype (``fetch_and_cast``); the CPU's read a second operand unrounded."""

    def binary(a, b, **kwargs):
        tensors = [t for t in (a, b) if isinstance(t, torch.Tensor)]
        if len(tensors) == 2 and {a.dim() == 0, b.dim() == 0} == {True, False}:
            wide = a if a.dim() == 0 else b
            other = b if wide is a else a
            if wide.dtype == torch.float32 and other.dtype in (torch.bfloat16, torch.float16):
                cast = wide.to(other.dtype)
                a, b = (cast, b) if wide is a else (a, cast)
        return fn(a, b, **kwargs)

    return binary


def _div(a, b):
    """CUDA divides by a Python number as a multiply by its fp32 reciprocal."""
    if isinstance(b, (int, float)) and isinstance(a, torch.Tensor) and a.is_floating_point():
        return a * (torch.ones((), dtype=torch.float32) / torch.tensor(float(b), dtype=torch.float32)).item()
    return torch.div(a, b)


def _mul(a, b):
    """CUDA's complex64 multiply: ``re = fma(ar, br, -fl(ai*bi))``, ``im = fma(ar, bi, fl(ai*br))``."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_complex() and b.is_complex():
        a, b = torch.broadcast_tensors(a, b)
        ar, ai, br, bi = a.real.contiguous(), a.imag.contiguous(), b.real.contiguous(), b.imag.contiguous()
        return torch.complex(fma_f32(ar, br, -(ai * bi)), fma_f32(ar, bi, ai * br))
    return torch.mul(a, b)


def _addcmul(a, b, c, value=1):
    """CUDA's addcmul in opmath: ``fma(b, c, a)`` for value 1, else ``fma(value, fl(b * c), a)``."""
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), c.dtype)
    a, b, c = a.float(), b.float(), c.float()
    value = torch.tensor(float(value), dtype=torch.float32)
    out = fma_f32(b, c, a) if float(value) == 1.0 else fma_f32(value, b * c, a)
    return out.to(dtype)


def _clamp(x, min=None, max=None):
    """CUDA's clamp-family kernels as torch 2.11 has them (``launch_clamp_scalar``): NaN stays,
    else ``fminf(fmaxf(v, min), max)`` in opmath, where fmaxf / fminf order -0 below +0
    (``relu(-0.0)`` is +0.0 there; the CPU kernels select and keep -0.0)."""
    v = x.float()
    y = v
    if min is not None:
        k = torch.tensor(float(min), dtype=torch.float32)
        y = torch.where((y < k) | ((y == k) & torch.signbit(y) & ~torch.signbit(k)), k, y)
    if max is not None:
        k = torch.tensor(float(max), dtype=torch.float32)
        y = torch.where((y > k) | ((y == k) & ~torch.signbit(y) & torch.signbit(k)), k, y)
    return torch.where(torch.isnan(v), v, y).to(x.dtype)


CUDA_ORDER = {
    aten.relu.default: lambda x: _clamp(x, 0.0),
    aten.clamp_min.default: lambda x, min: _clamp(x, min=min),
    aten.clamp_max.default: lambda x, max: _clamp(x, max=max),
    aten.clamp.default: _clamp,
    aten.addcmul.default: _addcmul,
    aten.mul.Tensor: _cast_on_load(_mul),
    aten.div.Tensor: _cast_on_load(_div),
    aten.add.Tensor: _cast_on_load(torch.add),
    aten.sub.Tensor: _cast_on_load(torch.sub),
    aten.mean.dim: _mean,
    aten.native_layer_norm.default: _layer_norm,
    aten._fused_rms_norm.default: _fused_rms,
    aten.rsqrt.default: interpreter_rsqrt,
}


class CudaOrderInterpreter(fx.Interpreter):
    """Runs an ATen graph with CUDA's reduction orders (on CPU tensors)."""

    def call_function(self, target, args, kwargs):
        fn = CUDA_ORDER.get(target)
        if fn is not None:
            return fn(*args, **kwargs)
        return super().call_function(target, args, kwargs)


def capture_graphs(model: torch.nn.Module, kwargs: dict) -> list[tuple[str, fx.GraphModule, list]]:
    """The graphs of ``model``'s repeated blocks (those ``exactdit.patch`` patches) and their inputs
    (:func:`exactdit.engine.capture.capture_graphs`)."""
    return capture.capture_graphs(model, kwargs, repeated_blocks(model))


def engine_eager_reasons() -> dict:
    """Why patched blocks ran diffusers' code, per block class (``exactdit.report()``'s engine entries)."""
    import exactdit

    return {k: v["eager_reasons"] for k, v in exactdit.report(show=False).items() if k.startswith("engine.") and v["eager"]}


def flux_recording_reasons(double: int, single: int) -> dict:
    """:func:`engine_eager_reasons` of a Flux whose blocks (and final norm) ran diffusers' code on the
    one forward group offloading with streams recorded its layers' order."""
    from exactdit.patches.layer_hooks import RECORDING_ORDER

    counts = (("FluxTransformerBlock", double), ("FluxSingleTransformerBlock", single), ("AdaLayerNormContinuous", 1))
    return {f"engine.FluxTransformer2DModel.{c}": {RECORDING_ORDER: n} for c, n in counts}


def uncompile(model: torch.nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


@contextlib.contextmanager
def trusted():
    """Fused paths without verification (on CPU, regions with CUDA reductions otherwise run
    eager): the test compares against the CUDA-order interpreter instead."""
    import os

    old = os.environ.get("EXACTDIT_TRUST")
    os.environ["EXACTDIT_TRUST"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["EXACTDIT_TRUST"]
        else:
            os.environ["EXACTDIT_TRUST"] = old


class GraphBuilder:
    """Builds an ATen graph op by op from real CPU tensors (each node's ``meta["val"]`` is the
    real result), for regions whose ops a CPU capture decomposes (``_fused_rms_norm``)."""

    def __init__(self):
        self.graph = fx.Graph()
        self.inputs: list[torch.Tensor] = []

    def input(self, t: torch.Tensor) -> fx.Node:
        node = self.graph.placeholder(f"in{len(self.inputs)}")
        node.meta["val"] = t
        self.inputs.append(t)
        return node

    def op(self, target, *args, **kwargs) -> fx.Node | tuple[fx.Node, ...]:
        def real(a):
            if isinstance(a, fx.Node):
                return a.meta["val"]
            if isinstance(a, (list, tuple)):
                return type(a)(real(x) for x in a)
            return a

        value = target(*real(args), **{k: real(v) for k, v in kwargs.items()})
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = value
        if isinstance(value, (tuple, list)):
            items = []
            for k, v in enumerate(value):
                item = self.graph.call_function(operator.getitem, (node, k))
                item.meta["val"] = v
                items.append(item)
            return tuple(items)
        return node

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return fx.GraphModule(torch.nn.Module(), self.graph)


def rewrite_and_check(gm, inputs, label: str = "test", need_regions: bool = True):
    """Rewrite ``gm``, run it (kernels in the interpreter) and hold every output to the graph run
    as CUDA runs it; returns the coverage report. ``need_regions``: the graph has something to fuse."""
    with torch.no_grad():
        ref = CudaOrderInterpreter(gm).run(*inputs)
        report = rewrite(gm, label)
        with trusted():
            out = gm(*inputs)
    assert (report.regions or not need_regions) and not report.failed, report.lines()
    for o, r in zip(out, ref):
        assert_bits_equal(o, r, label)
    return report


def wrap_feed_forward(block: torch.nn.Module, wrap) -> None:
    """``block.ff`` (a Flux double block's feed-forward) runs ``wrap(ff's forward, x)``."""
    forward = block.ff.forward
    block.ff.forward = lambda x: wrap(forward, x)


def graph_break_then(forward, x):
    """``forward(x)`` after a graph break (a wrap for :func:`wrap_feed_forward`)."""
    torch._dynamo.graph_break()
    return forward(x)


def assert_patched_equals_eager(tr, kw, forward) -> None:
    """Two patched forwards (verifying, then verified kernels) equal the unpatched one, no region
    disabled, some fused."""
    import exactdit
    from exactdit.harness.metrics import outputs_equal

    ref = forward(tr, kw)
    try:
        exactdit.patch(tr)
        out = forward(tr, kw)
        again = forward(tr, kw)
    finally:
        exactdit.unpatch(tr)
    assert outputs_equal(out, ref) and outputs_equal(again, ref)
    report = exactdit.report(show=False)
    assert not any(v["disabled"] for v in report.values()), {k: v["disabled"] for k, v in report.items() if v["disabled"]}
    assert sum(v["fused"] for v in report.values()) > 0


def assert_recaptured_blocks_fall_back(tr, kws: list, forward) -> None:
    """Blocks whose parts' shapes follow the data (a known limit, ``Mini.eager``): one forward per
    inputs in ``kws`` (more than RECAPTURES_ALLOWED + 2 of them, the same shapes, different
    values), patched, each equal to the unpatched one; by the last the blocks run diffusers' code,
    counted with the reason."""
    import exactdit
    from exactdit.harness.metrics import outputs_equal
    from exactdit.patches.engine import RECAPTURES_ALLOWED

    assert len(kws) > RECAPTURES_ALLOWED + 2
    refs = [forward(tr, kw) for kw in kws]
    torch._dynamo.reset()  # Dynamo's recompile limit, not ours, would stop an earlier test's parts capturing
    try:
        exactdit.patch(tr)
        outs = [forward(tr, kw) for kw in kws]
    finally:
        exactdit.unpatch(tr)
    assert all(outputs_equal(out, ref) for out, ref in zip(outs, refs))
    reasons = engine_eager_reasons()
    assert reasons and all("not captured" in r for v in reasons.values() for r in v), reasons


def rewrite_and_check_against_eager(gm, inputs, label: str) -> None:
    """Rewrite ``gm`` and hold two runs (the gate verifying its regions, then verified kernels)
    to the graph run op by op before the rewrite, bit for bit, with no region disabled: on the
    GPU this is each rule against the live eager CUDA kernels."""
    import exactdit

    with torch.no_grad():
        ref = gm(*inputs)
        report = rewrite(gm, label)
        runs = [gm(*inputs), gm(*inputs)]
    assert report.regions and not report.failed, report.lines()
    for out in runs:
        for o, r in zip(out, ref):
            assert_bits_equal(o, r, label)
    stats = exactdit.report(show=False)
    for name in report.regions:
        assert stats[name]["fused"] > 0 and not stats[name]["disabled"], (name, stats[name])


# --- small ATen graphs, one op family each: built by ``GraphBuilder`` from (x, u, g), x and u of
# one shape [B, S, D], g [B, D] (a per-row modulation vector) ----------------------------------------


def rows_adjacent_block(b, x, attn, mlp, gate, scale, shift):
    """HunyuanVideo's double block on its image stream ``x`` (B, L, C), which lies in the (B, C, L)
    memory of the patch embedding: gated residual, LayerNorm + modulation of it, the next gated
    residual (``gate``, ``scale``, ``shift``: (B, C) vectors)."""
    width = x.meta["val"].shape[-1]

    def per_row(v):
        return b.op(aten.unsqueeze.default, v, 1)

    res = gated_residual(b, x, attn, gate)[0]
    ln = b.op(aten.native_layer_norm.default, res, [width], None, None, 1e-6)[0]
    mod = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, ln, b.op(aten.add.Tensor, per_row(scale), 1)), per_row(shift))
    return [mod, gated_residual(b, res, mlp, gate)[0]]


def gated_residual(b, x, attn, gate):
    """``x + attn * gate[:, None]``."""
    return [b.op(aten.add.Tensor, x, b.op(aten.mul.Tensor, attn, b.op(aten.unsqueeze.default, gate, 1)))]


def rope_graph(b, x, table):
    """Flux's ``apply_rotary_emb(use_real=True, unbind_dim=-1)`` with ``table`` as cos and sin."""
    shape = list(x.meta["val"].shape)
    pairs = b.op(aten.view.default, x, shape[:-1] + [-1, 2])
    real, imag = b.op(aten.unbind.int, pairs, -1)
    rotated = b.op(aten.view.default, b.op(aten.stack.default, [b.op(aten.neg.default, imag), real], -1), shape)
    t32 = _f32(b, table)
    out = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, _f32(b, x), t32), b.op(aten.mul.Tensor, _f32(b, rotated), t32))
    return b.op(aten._to_copy.default, out, dtype=x.meta["val"].dtype)


def _f32(b, t):
    return b.op(aten._to_copy.default, t, dtype=torch.float32)


def _split_rotation(b, x, u, g):
    """LTX-2's split RoPE in fp32: ``out = x * cos``, then ``out.addcmul_(-sin, partner)`` (``g``
    standing in for cos and sin)."""
    cos = _f32(b, b.op(aten.unsqueeze.default, g, 1))
    out = b.op(aten.mul.Tensor, _f32(b, x), cos)
    return b.op(aten._to_copy.default, b.op(aten.addcmul.default, out, b.op(aten.neg.default, cos), _f32(b, u)),
                dtype=x.meta["val"].dtype)


def _addcmul_modulate(b, x, u, g, **value):
    """``torch.addcmul(u, x, 1 + g)``: a modulation written as one addcmul."""
    return b.op(aten.addcmul.default, u, x, b.op(aten.add.Tensor, b.op(aten.unsqueeze.default, g, 1), 1), **value)


POINTWISE_GRAPHS = {
    "gated residual": lambda b, x, u, g: [b.op(aten.add.Tensor, x, b.op(aten.mul.Tensor, b.op(aten.unsqueeze.default, g, 1), u))],
    "modulate": lambda b, x, u, g: [b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x, b.op(aten.add.Tensor, b.op(aten.unsqueeze.default, g, 1), 1)), u)],
    "fp32 chain": lambda b, x, u, g: [b.op(aten._to_copy.default, b.op(aten.add.Tensor, b.op(aten.mul.Tensor, _f32(b, x), 0.7071067811865476), _f32(b, u)), dtype=x.meta["val"].dtype)],
    "div sub neg": lambda b, x, u, g: [b.op(aten.neg.default, b.op(aten.sub.Tensor, b.op(aten.div.Tensor, x, 3.0), b.op(aten.div.Tensor, u, x)))],
    "clamp pow": lambda b, x, u, g: [b.op(aten.clamp.default, b.op(aten.mul.Tensor, b.op(aten.pow.Tensor_Scalar, x, 2), u), -2.0, 2.0)],
    "relu": lambda b, x, u, g: [b.op(aten.mul.Tensor, b.op(aten.relu.default, x), u)],
    "addcmul": lambda b, x, u, g: [_addcmul_modulate(b, x, u, g)],
    "addcmul with a value": lambda b, x, u, g: [_addcmul_modulate(b, x, u, g, value=-0.3)],
    "fp32 split rotation": lambda b, x, u, g: [_split_rotation(b, x, u, g)],
    "gelu tanh times up": lambda b, x, u, g: [b.op(aten.mul.Tensor, u, b.op(aten.gelu.default, x, approximate="tanh"))],
    "silu times up": lambda b, x, u, g: [b.op(aten.mul.Tensor, b.op(aten.silu.default, x), u)],
    "tanh gate": lambda b, x, u, g: [b.op(aten.add.Tensor, x, b.op(aten.mul.Tensor, b.op(aten.tanh.default, b.op(aten.unsqueeze.default, g, 1)), u))],
    "interleaved rope": lambda b, x, u, g: [rope_graph(b, x, u)],
    "cat on the last dim": lambda b, x, u, g: [b.op(aten.cat.default, [x, b.op(aten.gelu.default, u, approximate="tanh")], 2)],
}

#: graphs whose transcendental functions are tables of bf16 / fp16 values (fp32 stays with ATen)
HALF_ONLY_GRAPHS = ("gelu tanh times up", "silu times up", "tanh gate", "cat on the last dim")

#: region graphs over (x, y) of one shape: TensorIterator ops with a wrapped number (ordered by
#: every operand's strides, size-1 dims included), of same-shaped operands (its fast set-up), a
#: broadcast operand, a cast (``empty_like``'s preserved strides) and a cat
SIZE_ONE_GRAPHS = {
    "times a number": lambda b, x, y: b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x, 0.5), 0.25),
    "product": lambda b, x, y: b.op(aten.neg.default, b.op(aten.mul.Tensor, x, y)),
    "broadcast row": lambda b, x, y: b.op(aten.mul.Tensor, b.op(aten.add.Tensor, x, b.op(
        aten.slice.Tensor, b.op(aten.view.default, y, [-1]), 0, 0, x.meta["val"].shape[-1])), 3.0),
    "cast": lambda b, x, y: b.op(aten._to_copy.default, b.op(aten.mul.Tensor, x, y), dtype=torch.bfloat16),
    "rotate half": lambda b, x, y: b.op(aten.mul.Tensor, b.op(aten.cat.default, [
        b.op(aten.neg.default, b.op(aten.slice.Tensor, x, -1, 3, 6)), b.op(aten.slice.Tensor, x, -1, 0, 3)], -1), y),
}
#: (shape, strides of the size-1 dims in turn): Cosmos3's (1, 1, 6) rotary tables and the
#: (1, 2, 1, 6) attention output, transposed, whose size-1 stride eager keeps
SIZE_ONE_LAYOUTS = [((1, 2, 1, 6), (12, 12)), ((1, 2, 1, 6), (1, 72)), ((1, 1, 6), (6, 6)), ((1, 1, 6), (1, 36)),
                    ((2, 1, 6), (1,)), ((2, 1, 6), (24,)), ((1, 1, 6), (0, 0))]


def with_size_one_strides(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """``t``'s values in a tensor whose size-1 dims have ``strides`` (the others dense, row-major)."""
    picked = iter(strides)
    dense = torch.empty(t.shape, dtype=t.dtype).stride()
    strides = [next(picked) if n == 1 else st for n, st in zip(t.shape, dense)]
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def rewritten_run(build, inputs, sources: list | None = None, kernels: list | None = None):
    """Rewrite the graph ``build(b, *nodes)`` makes and check it (:func:`rewrite_and_check`);
    the generated kernels (their sources) are appended to ``kernels`` (``sources``)."""
    b = GraphBuilder()
    nodes = [b.input(t) for t in inputs]
    gm = b.module(*build(b, *nodes))
    report = rewrite_and_check(gm, inputs)
    generated = [k for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")
                 for _, k in n.target.exactdit_region.kernels()]
    if sources is not None:
        sources.extend(k.source for k in generated)
    if kernels is not None:
        kernels.extend(generated)
    return report


def assert_partners_move_between_lanes(sources, move="rows_k.pair_"):
    """The rotary partner is moved between lanes of the tile: no gather, no second load of the row."""
    assert any(move in s for s in sources), sources
    assert not any("tl.gather" in s for s in sources), sources
