"""The engine's op rules against CPU eager: pointwise regions (checked by the gate on the CPU)
and strided inputs. Kernels run in Triton's interpreter."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch

import exactdit
from exactdit import gate
from exactdit.engine.backend import rewrite
from tests.engine_helpers import (HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, SIZE_ONE_GRAPHS, SIZE_ONE_LAYOUTS, GraphBuilder,
                                  rewritten_run, with_size_one_strides)
from tests.helpers import assert_bits_equal, rand, with_special_values

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 7, 96), (1, 1, 64), (3, 33, 130)], ids=["2x7x96", "one row", "odd"])
@pytest.mark.parametrize("name", list(POINTWISE_GRAPHS))
def test_pointwise_regions_equal_cpu_eager(name, shape, dtype):
    if name in HALF_ONLY_GRAPHS and dtype == torch.float32:
        pytest.skip("fp32 transcendental functions stay with ATen")
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {shape}".encode()))  # (not hash(): salted per process)
    x, u = rand(shape, dtype, "cpu", g), rand(shape, dtype, "cpu", g)
    mod = rand((shape[0], shape[-1]), dtype, "cpu", g)
    if name == "clamp pow":
        x = x.clamp(-3, 3)
    rewritten_run(POINTWISE_GRAPHS[name], [x, u, mod])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("bounds", ["relu", (0.0, None), (-0.0, None), (None, 0.0), (None, -0.0), (-0.0, 0.0)],
                         ids=["relu", "min+0", "min-0", "max+0", "max-0", "-0..+0"])
def test_clamps_at_a_zero_order_minus_zero_below_plus_zero(bounds, dtype):
    """``relu`` and clamps at a zero bound give CUDA's zero signs (fmaxf / fminf: -0 below +0;
    ``relu(-0.0)`` is +0.0, where the CPU kernel keeps -0.0) on +-0 and +-inf; the product with a
    negative factor shows each zero's sign in the output. (No NaN: its bits through the CPU's
    bf16 product are not CUDA's; tests/engine/test_gpu_rules.py holds NaN to the GPU.)"""
    g = torch.Generator().manual_seed(11)
    x = with_special_values(rand((2, 7, 96), dtype, "cpu", g))
    x = torch.where(x.isnan(), torch.zeros_like(x), x)
    u = -rand((2, 7, 96), dtype, "cpu", g).abs()

    def build(b, x, u):
        c = b.op(aten.relu.default, x) if bounds == "relu" else b.op(aten.clamp.default, x, *bounds)
        return [b.op(aten.mul.Tensor, c, u)]

    rewritten_run(build, [x, u])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["mul", "mul first", "div", "add", "sub"])
def test_a_0_dim_fp32_tensor_is_rounded_to_the_result_dtype_as_cuda_loads_it(op, dtype):
    """A LoRA hot-swap's scale: a 0-dim fp32 tensor times a half-precision activation, then the
    residual add. CUDA's kernel rounds the scale to the activation's dtype as it loads it; 1/3 is
    not a bf16 or fp16 number, so a kernel that used it unrounded would differ. One region, no op
    left to ATen."""
    g = torch.Generator().manual_seed(5)
    x, base = rand((2, 7, 96), dtype, "cpu", g), rand((2, 7, 96), dtype, "cpu", g)
    scale = torch.tensor(1.0 / 3.0)
    target = getattr(aten, op.split()[0]).Tensor

    def build(b, x, base, scale):
        lora = b.op(target, scale, x) if op == "mul first" else b.op(target, x, scale)
        return [b.op(aten.add.Tensor, base, lora)]

    report = rewritten_run(build, [x, base, scale])
    assert len(report.regions) == 1 and not report.left, (report.regions, report.left, report.why_left)


@pytest.mark.parametrize("op", [aten.tanh.default, aten.exp.default, aten.silu.default])
def test_a_table_op_of_a_one_element_operand_looks_up_every_lane(op):
    """A tanh-gated residual with a one-element gate (``x + tanh(alpha) * x``): the gate loads as a
    0-d value, which the lookup's gather could not index (the region raised in Triton's
    interpreter; verified, the gate ran eager instead). It is broadcast first. One region."""
    g = torch.Generator().manual_seed(8)
    x, alpha = rand((2, 4, 8), torch.bfloat16, "cpu", g), rand((1,), torch.bfloat16, "cpu", g)

    def build(b, x, alpha):
        return [b.op(aten.add.Tensor, x, b.op(aten.mul.Tensor, b.op(op, alpha), x))]

    report = rewritten_run(build, [x, alpha])
    assert len(report.regions) == 1 and not report.left, (report.regions, report.left, report.why_left)


def test_permuted_and_strided_inputs():
    g = torch.Generator().manual_seed(3)
    x = rand((9, 2, 64), torch.bfloat16, "cpu", g).permute(1, 0, 2)  # [S, B, D] seen as [B, S, D]
    u = rand((2, 18, 64), torch.bfloat16, "cpu", g)[:, ::2]
    mod = rand((2, 64), torch.bfloat16, "cpu", g)
    rewritten_run(POINTWISE_GRAPHS["gated residual"], [x, u, mod])


@pytest.mark.parametrize("meta", ["eager", "fake"])
@pytest.mark.parametrize("layout", SIZE_ONE_LAYOUTS, ids=lambda l: f"{'x'.join(map(str, l[0]))}-{l[1]}")
@pytest.mark.parametrize("name", list(SIZE_ONE_GRAPHS))
def test_region_outputs_have_eagers_strides_over_size_one_dims(name, layout, meta):
    """Outputs are allocated with the strides eager gives for the inputs at hand, size-1 dims
    included: the graph is built from row-major inputs (``meta="eager"``: each value's strides are
    eager's for those) or its values are fake tensors of the strided inputs (``meta="fake"``, as
    AOTAutograd records them), and it runs on the strided inputs; the gate verifies every region
    (bits and strides) and none is disabled."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    shape, strides = layout
    g = torch.Generator().manual_seed(7)
    dense = [rand(shape, torch.float32, "cpu", g) for _ in range(2)]
    inputs = [with_size_one_strides(t, strides) for t in dense]
    b = GraphBuilder()
    gm = b.module(SIZE_ONE_GRAPHS[name](b, *(b.input(t) for t in dense)))
    if meta == "fake":
        FakeTensorProp(gm).propagate(*inputs)
    with torch.no_grad():
        ref = gm(*inputs)
        report = rewrite(gm, "strides")
        assert report.regions, report.lines()
        with warnings.catch_warnings():
            warnings.simplefilter("error", gate.ExactditMismatchWarning)
            out = gm(*inputs)
    assert out[0].stride() == ref[0].stride()
    assert_bits_equal(out[0], ref[0], name)
    stats = exactdit.report(show=False)
    assert all(not e["disabled"] for e in stats.values()) and sum(e["fused"] for e in stats.values()) >= 1


@pytest.mark.parametrize("op, bound", [("relu", None), ("clamp_min", 0.0), ("clamp_max", -0.0), ("clamp_min", 0.5)])
def test_zero_bound_clamps_are_left_to_aten_where_cuda_keeps_the_zeros_sign(monkeypatch, op, bound):
    """The clamp rule orders -0 below +0 at a zero bound, as torch 2.11's CUDA kernels do; where the
    live CUDA kernel returns the input on a tie instead (later PyTorch), zero-bound clamps are refused."""
    from types import SimpleNamespace

    from exactdit.engine import aten_ops

    aten = torch.ops.aten
    b = GraphBuilder()
    x = b.input(torch.randn(4, 8, dtype=torch.bfloat16))
    node = b.op(aten.relu.default, x) if op == "relu" else b.op(getattr(aten, op).default, x, bound)
    node.meta["val"] = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16)
    check = aten_ops.rule_for(node).check
    monkeypatch.setattr(aten_ops, "_ZERO_TIES", {0: (True, True)})
    assert check(node) is None
    lower = op != "clamp_max"
    for ties in ((False, True), (True, False)):  # only the direction whose ties differ is refused
        monkeypatch.setattr(aten_ops, "_ZERO_TIES", {0: ties})
        why = check(node)
        if bound == 0.5 or ties[0 if lower else 1]:  # no tie of zeros possible, or modelled right
            assert why is None
        else:
            assert why is not None and "keeps the sign of a zero" in why


def test_a_tie_probe_that_cannot_run_refuses_without_remembering(monkeypatch):
    """Where the probe cannot run (a graph being recorded on the GPU, no device) zero-bound clamps
    are refused for now, and the device is asked again next time."""
    from exactdit.engine import aten_ops

    def no_device(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(aten_ops, "_ZERO_TIES", {})
    monkeypatch.setattr(torch, "tensor", no_device)
    assert aten_ops.cuda_zero_ties_as_modelled(0) == (False, False)
    assert aten_ops._ZERO_TIES == {}


def test_only_a_0_dim_fp32_tensor_on_the_ops_device_is_cast_on_load():
    """A 0-dim tensor on another device (a CPU scalar meeting a CUDA tensor: ATen reads it unrounded),
    one that is not fp32, or a result that is not half precision: left to the other rules."""
    from exactdit.engine.aten_ops import _cast_on_load

    g = torch.fx.Graph()

    def node(val):
        n = g.placeholder(f"x{len(g.nodes)}")
        n.meta["val"] = val
        return n

    x = node(torch.empty(2, 3, dtype=torch.bfloat16))
    for scale, out, taken in [(torch.empty(()), torch.bfloat16, True), (torch.empty((), device="meta"), torch.bfloat16, False),
                              (torch.empty((), dtype=torch.float64), torch.bfloat16, False),
                              (torch.empty(()), torch.float32, False), (torch.empty(1), torch.bfloat16, False)]:
        s = node(scale)
        mul = g.call_function(aten.mul.Tensor, (x, s))
        mul.meta["val"] = torch.empty(2, 3, dtype=out)
        assert _cast_on_load(mul) == ({s} if taken else set()), (scale, out)
