"""Each pointwise rule of the engine against the live eager CUDA kernels it replaces.

Small ATen graphs, one op family each (``tests.engine_helpers.POINTWISE_GRAPHS``), rewritten and
run twice (the gate verifying, then the verified kernels) against the same graph run op by op:
bits equal, no region disabled. Inputs carry +-0, +-inf, NaN, subnormals and the dtype's largest
values, where a rule is most likely to part from eager (``relu(-0.0)``, an FMA's single rounding).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, GraphBuilder, rewrite_and_check_against_eager
from tests.helpers import rand, with_special_values

pytestmark = pytest.mark.gpu

SHAPES = [(2, 7, 96), (1, 1, 64), (3, 33, 130), (1, 4096, 256)]


def check_rule(name: str, shape, dtype, device: str = "cuda") -> None:
    g = torch.Generator().manual_seed(sum(map(ord, name)) + sum(shape))
    x = with_special_values(rand(shape, dtype, device, g))
    u = with_special_values(rand(shape, dtype, device, g).flip(-1))
    mod = rand((shape[0], shape[-1]), dtype, device, g)
    b = GraphBuilder()
    nodes = [b.input(t) for t in (x, u, mod)]
    gm = b.module(*POINTWISE_GRAPHS[name](b, *nodes))
    rewrite_and_check_against_eager(gm, [x, u, mod], f"rule {name} {shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", list(POINTWISE_GRAPHS))
def test_rule_equals_eager_cuda(name, shape, dtype):
    if name in HALF_ONLY_GRAPHS and dtype == torch.float32:
        pytest.skip("fp32 transcendental functions stay with ATen")
    check_rule(name, shape, dtype)
