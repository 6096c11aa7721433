"""Each pointwise rule of the engine against the live eager CUDA kernels it replaces.

Small ATen graphs, one op family each (``tests.engine_helpers.POINTWISE_GRAPHS``), rewritten and
run twice (the gate verifying, then the verified kernels) against the same graph run op by op:
bits equal, no region disabled. Inputs carry +-0, +-inf, NaN, subnormals and the dtype's largest
values, where a rule is most likely to part from eager (``relu(-0.0)``, an FMA's single rounding).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import (HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, SIZE_ONE_GRAPHS, SIZE_ONE_LAYOUTS, GraphBuilder, aten,
                                  gated_residual, rewrite_and_check_against_eager, rows_adjacent_block,
                                  with_size_one_strides)
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


def _with_huge_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the dtype's largest value in every 7th row, at a column that moves with the
    row (so it lands in every thread of ATen's LayerNorm tree): squared, it overflows."""
    t = t.clone()
    rows = t.view(-1, t.shape[-1])
    picked = torch.arange(0, rows.shape[0], 7, device=t.device)
    rows[picked, picked % t.shape[-1]] = torch.finfo(t.dtype).max
    return t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim,heads,seq", [(4, 3, 333), (48, 5, 333), (64, 48, 17776), (96, 2, 61),
                                                (164, 3, 101), (256, 5, 333), (512, 2, 130), (3072, 1, 333)])
def test_layer_norm_per_head_equals_eager_cuda(head_dim, heads, seq, dtype):
    """The LayerNorm template (several rows per program up to 512 wide, a row per program above)
    on CogVideoX's per-head q/k layout, times a factor, against eager CUDA; rows with special and
    huge values (ATen's empty-thread combines turn an overflowing square into NaN)."""
    g = torch.Generator().manual_seed(head_dim + seq)
    x = _with_huge_values(with_special_values(rand((1, seq, heads * head_dim), dtype, "cuda", g)))
    u = rand((1, heads, seq, head_dim), dtype, "cuda", g)
    w, bias = rand((head_dim,), dtype, "cuda", g), rand((head_dim,), dtype, "cuda", g)
    b = GraphBuilder()
    xn, un, wn, bn = (b.input(t) for t in (x, u, w, bias))
    per_head = b.op(aten.transpose.int, b.op(aten.view.default, xn, [1, seq, heads, head_dim]), 1, 2)
    ln = b.op(aten.native_layer_norm.default, per_head, [head_dim], wn, bn, 1e-6)[0]
    gm = b.module(b.op(aten.mul.Tensor, ln, un))
    rewrite_and_check_against_eager(gm, [x, u, w, bias], f"layer norm {head_dim} x {heads * seq} {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("width,seq", [(516, 37), (1024, 1), (3072, 14566), (5120, 333)])
def test_rows_adjacent_in_memory_equal_eager_cuda(width, seq, dtype):
    """HunyuanVideo's image stream in the (B, C, L) memory of its patch embedding (3072 x 14566: its
    480x848, 33-frame size): gated residual, LayerNorm + modulation, the next gated residual, and a
    lone gated residual, in tiles of many rows, against eager CUDA; special and huge values."""
    g = torch.Generator().manual_seed(width + seq)
    x = _with_huge_values(with_special_values(rand((1, seq, width), dtype, "cuda", g)))
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, rows adjacent in memory
    attn, mlp = (with_special_values(rand((1, seq, width), dtype, "cuda", g)) for _ in range(2))
    gate, scale, shift = (rand((1, width), dtype, "cuda", g) for _ in range(3))
    for build, inputs in ((rows_adjacent_block, [x, attn, mlp, gate, scale, shift]), (gated_residual, [x, attn, gate])):
        b = GraphBuilder()
        gm = b.module(*build(b, *(b.input(t) for t in inputs)))
        rewrite_and_check_against_eager(gm, inputs, f"{build.__name__} {width} x {seq} {dtype}")


@pytest.mark.parametrize("meta", ["eager", "fake"])
@pytest.mark.parametrize("layout", SIZE_ONE_LAYOUTS, ids=lambda l: f"{'x'.join(map(str, l[0]))}-{l[1]}")
@pytest.mark.parametrize("name", list(SIZE_ONE_GRAPHS))
def test_region_outputs_have_eagers_strides_over_size_one_dims_cuda(name, layout, meta):
    """Issue 35 item 15 (Cosmos3's (1, 1, 6) rotary operands, its transposed (1, 2, 1, 6) attention
    output): regions built from row-major values (or fake ones) run on inputs whose size-1 dims have
    other strides, against eager CUDA, strides included."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    shape, strides = layout
    g = torch.Generator().manual_seed(7)
    dense = [rand(shape, torch.float32, "cuda", g) for _ in range(2)]
    inputs = [with_size_one_strides(t, strides) for t in dense]
    b = GraphBuilder()
    gm = b.module(SIZE_ONE_GRAPHS[name](b, *(b.input(t) for t in dense)))
    if meta == "fake":
        FakeTensorProp(gm).propagate(*inputs)
    rewrite_and_check_against_eager(gm, inputs, f"size-1 strides {name} {layout} {meta}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["mul", "mul first", "div", "add", "sub"])
@pytest.mark.parametrize("scale", [1.0 / 3.0, 2.0, -0.0, float("inf"), 1e-40, 3.4e38], ids=str)
def test_a_0_dim_fp32_tensor_meeting_a_half_tensor_equals_eager_cuda(op, dtype, scale):
    """A LoRA hot-swap's scale (a 0-dim fp32 CUDA tensor) in a half-precision op, then the residual
    add: the engine rounds it to the op's dtype as CUDA's kernel loads it. Special scales: a
    subnormal, one past the dtype's range, inf, -0."""
    g = torch.Generator().manual_seed(len(op) + int(dtype == torch.float16))
    x, base = with_special_values(rand((3, 33, 130), dtype, "cuda", g)), rand((3, 33, 130), dtype, "cuda", g)
    s = torch.tensor(scale, device="cuda")
    target = getattr(aten, op.split()[0]).Tensor
    b = GraphBuilder()
    xi, bi, si = (b.input(t) for t in (x, base, s))
    lora = b.op(target, si, xi) if op == "mul first" else b.op(target, xi, si)
    rewrite_and_check_against_eager(b.module(b.op(aten.add.Tensor, bi, lora)), [x, base, s], f"0-dim {op} {scale} {dtype}")
