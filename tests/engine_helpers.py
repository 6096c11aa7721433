"""Test plumbing for the engine: capture blocks of diffusers models on the CPU, and run a captured
graph as CUDA eager would (reductions through the order models), so that regions with
reductions can be held to CUDA's bits in Triton's interpreter."""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from exactdit.aten_norms import fma_f32, layer_norm_order_model, rms_norm_order_model
from exactdit.aten_reduce import mean_lastdim_reference_order
from exactdit.engine.backend import rewrite
from exactdit.engine.capture import capture_graphs  # noqa: F401  (tests import it from here)
from tests.helpers import assert_bits_equal, interpreter_rsqrt

aten = torch.ops.aten


def _mean(x, dims, keepdim=False, dtype=None):
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    out = mean_lastdim_reference_order(rows, num_rows=rows.shape[0])
    shape = x.shape[:-1] + ((1,) if keepdim else ())
    return out.reshape(shape)


def _layer_norm(x, normalized, weight, bias, eps):
    y, mean, rstd = layer_norm_order_model(x, weight, bias, eps, rsqrt=interpreter_rsqrt, vectorized=True,
                                           return_stats=True)
    return y, mean, rstd


def _fused_rms(x, normalized, weight, eps=None):
    return rms_norm_order_model(x, weight, eps, rsqrt=interpreter_rsqrt, vectorized=True, return_rstd=True)


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


CUDA_ORDER = {
    aten.mul.Tensor: _mul,
    aten.div.Tensor: _div,
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


def engine_eager_reasons() -> dict:
    """Why patched blocks ran diffusers' code, per block class (``exactdit.report()``'s engine entries)."""
    import exactdit

    return {k: v["eager_reasons"] for k, v in exactdit.report(show=False).items() if k.startswith("engine.") and v["eager"]}


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


def assert_patched_equals_eager(tr, kw, forward, some_fused: bool = True) -> None:
    """Two patched forwards (verifying, then verified kernels) equal the unpatched one, no region
    disabled, some fused (unless ``some_fused`` is False: blocks the engine cannot capture)."""
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
    assert sum(v["fused"] for v in report.values()) > 0 or not some_fused
