"""The engine's op rules against CPU eager: pointwise regions (checked by the gate on the CPU)
and strided inputs. Kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import warnings

import exactdit
from exactdit import gate
from exactdit.engine.backend import rewrite
from tests.engine_helpers import (HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, SIZE_ONE_GRAPHS, SIZE_ONE_LAYOUTS, GraphBuilder,
                                  rewritten_run, with_size_one_strides)
from tests.helpers import assert_bits_equal, rand

aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", [(2, 7, 96), (1, 1, 64), (3, 33, 130)], ids=["2x7x96", "one row", "odd"])
@pytest.mark.parametrize("name", list(POINTWISE_GRAPHS))
def test_pointwise_regions_equal_cpu_eager(name, shape, dtype):
    if name in HALF_ONLY_GRAPHS and dtype == torch.float32:
        pytest.skip("fp32 transcendental functions stay with ATen")
    g = torch.Generator().manual_seed(hash((name, shape)) % 2**31)
    x, u = rand(shape, dtype, "cpu", g), rand(shape, dtype, "cpu", g)
    mod = rand((shape[0], shape[-1]), dtype, "cpu", g)
    if name == "clamp pow":
        x = x.clamp(-3, 3)
    rewritten_run(POINTWISE_GRAPHS[name], [x, u, mod])


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
