"""The engine's op rules against CPU eager: pointwise regions (checked by the gate on the CPU)
and strided inputs. Kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, rewritten_run
from tests.helpers import rand

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
