"""The reduction templates against CUDA's reduction orders (the order models of exactdit.aten):
LayerNorm, F.rms_norm, the decomposed RMSNorm, RoPE partners moved between lanes. Kernels run in
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from exactdit import gate
from exactdit.engine import templates
from tests.engine_helpers import (
    POINTWISE_GRAPHS, assert_partners_move_between_lanes, gated_residual, rewritten_run, rope_graph, rows_adjacent_block,
)
from tests.helpers import rand

aten = torch.ops.aten


@pytest.mark.parametrize("width", [16, 32, 48, 64, 96, 3072])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_with_gated_prologue_and_modulation(width, affine):
    g = torch.Generator().manual_seed(width)
    x, u = rand((2, 5, width), torch.bfloat16, "cpu", g), rand((2, 5, width), torch.bfloat16, "cpu", g)
    mod = rand((2, width), torch.bfloat16, "cpu", g)
    w, bias = rand((width,), torch.bfloat16, "cpu", g), rand((width,), torch.bfloat16, "cpu", g)

    def build(b, x, u, mod, w, bias):
        h = POINTWISE_GRAPHS["gated residual"](b, x, u, mod)[0]
        ln = b.op(aten.native_layer_norm.default, h, [width], w if affine else None, bias if affine else None, 1e-6)[0]
        return [h, POINTWISE_GRAPHS["modulate"](b, ln, x, mod)[0]]

    report = rewritten_run(build, [x, u, mod, w, bias])
    assert any("layer_norm" in d for d, _ in report.regions.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [4, 48, 64, 164, 256, 512])
def test_layer_norm_per_head_many_rows_per_program(head_dim, dtype):
    """CogVideoX's q/k norm: LayerNorm over each head of a [B, S, H * D] projection seen as
    [B, H, S, D], times a RoPE-like factor. Rows of <= 512 go several to a program (lanes of one,
    two and four warps, part of a warp; a row count no program size divides); fp32 outputs show
    the statistics to the last bit."""
    g = torch.Generator().manual_seed(head_dim)
    heads, seq = 3, 67
    x = rand((2, seq, heads * head_dim), dtype, "cpu", g)
    u = rand((2, heads, seq, head_dim), dtype, "cpu", g)
    w, bias = rand((head_dim,), dtype, "cpu", g), rand((head_dim,), dtype, "cpu", g)

    def build(b, x, u, w, bias):
        per_head = b.op(aten.transpose.int, b.op(aten.view.default, x, [2, seq, heads, head_dim]), 1, 2)
        ln = b.op(aten.native_layer_norm.default, per_head, [head_dim], w, bias, 1e-6)[0]
        return [b.op(aten.mul.Tensor, ln, u)]

    sources = []
    report = rewritten_run(build, [x, u, w, bias], sources)
    assert any("layer_norm" in d for d, _ in report.regions.values()), report.why_left
    assert any("ln_k.lanes_finish" in src for src in sources)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("width,batch", [(516, 1), (1024, 2), (1536, 1)])
def test_rows_adjacent_in_memory_take_tiles_of_many_rows(width, batch, dtype):
    """An activation in the (B, C, L) memory of a patch embedding (HunyuanVideo's image stream):
    the LayerNorm region and a lone gated residual read and write it in tiles of many rows (the
    LayerNorm's statistics in ATen's thread order all the same); a row count no tile divides, tiles
    across two batch items; widths with every thread holding a vector in every iteration or not."""
    g = torch.Generator().manual_seed(width)
    seq = 37
    x = rand((batch, width, seq), dtype, "cpu", g).transpose(1, 2)  # (B, seq, width), rows adjacent
    attn, mlp = rand((batch, seq, width), dtype, "cpu", g), rand((batch, seq, width), dtype, "cpu", g)
    gate, scale, shift = (rand((batch, width), dtype, "cpu", g) for _ in range(3))
    sources, kernels = [], []
    report = rewritten_run(rows_adjacent_block, [x, attn, mlp, gate, scale, shift], sources)
    assert any("layer_norm" in d for d, _ in report.regions.values()), report.why_left
    assert any("ln_k.welford_elements" in src for src in sources), sources
    rewritten_run(gated_residual, [x, attn, gate], kernels=kernels)
    assert [dict(k.constexprs)["BLOCK_R"] for k in kernels] == [templates.ROWS_ADJACENT_TILE[0]]

    def norm_of_cat(b, x, text, scale):  # HunyuanVideo's first single block: the streams joined, then normed
        ln = b.op(aten.native_layer_norm.default, b.op(aten.cat.default, [x, text], 1), [width], None, None, 1e-6)[0]
        return [b.op(aten.mul.Tensor, ln, b.op(aten.unsqueeze.default, scale, 1))]

    sources = []
    rewritten_run(norm_of_cat, [x, rand((batch, 5, width), dtype, "cpu", g), scale], sources)
    assert any("ln_k.welford_elements" in src for src in sources)


@pytest.mark.parametrize("head_dim", [32, 128, 1024, 2560])
def test_fused_rms_norm_cat_and_rope(head_dim):
    """Flux's QK path: F.rms_norm per head on both streams, cat, interleaved RoPE: one region,
    one launch per stream (rows of 1024 take two passes)."""
    g = torch.Generator().manual_seed(head_dim)
    heads = 2
    txt, img = rand((1, 3, heads * head_dim), torch.bfloat16, "cpu", g), rand((1, 5, heads * head_dim), torch.bfloat16, "cpu", g)
    w1, w2 = rand((head_dim,), torch.bfloat16, "cpu", g), rand((head_dim,), torch.bfloat16, "cpu", g)
    table = rand((8, 1, head_dim), torch.float32, "cpu", g)

    def build(b, txt, img, w1, w2, table):
        a = b.op(aten._fused_rms_norm.default, b.op(aten.view.default, txt, [1, 3, heads, head_dim]), [head_dim], w1, 1e-6)[0]
        c = b.op(aten._fused_rms_norm.default, b.op(aten.view.default, img, [1, 5, heads, head_dim]), [head_dim], w2, 1e-6)[0]
        return [rope_graph(b, b.op(aten.cat.default, [a, c], 1), table)]

    sources = []
    report = rewritten_run(build, [txt, img, w1, w2, table], sources)
    assert "fused_rms_norm" in next(iter(report.regions.values()))[0]
    assert_partners_move_between_lanes(sources)


def test_norm_read_through_a_cat_of_its_slices_along_the_sequence():
    """HunyuanVideo's single block: RMSNorm per head over all tokens, then RoPE on the image
    tokens only, ``cat([rope(q[:, :img]), q[:, img:]], 1)``, the piece viewed across its sequence
    and head dims. Each piece reads the norm's statistics of its own row: one region."""
    g = torch.Generator().manual_seed(7)
    img, txt, heads, hd = 4, 5, 2, 16
    x = rand((1, img + txt, heads, hd), torch.bfloat16, "cpu", g)
    w = rand((hd,), torch.bfloat16, "cpu", g)

    def build(b, x, w):
        h = b.op(aten._to_copy.default, x, dtype=torch.float32)
        rstd = b.op(aten.rsqrt.default, b.op(aten.add.Tensor, b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, h, 2), [-1], True), 1e-6))
        normed = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, b.op(aten.mul.Tensor, h, rstd), dtype=torch.bfloat16), w)
        head = b.op(aten.slice.Tensor, normed, 1, 0, img)
        merged = b.op(aten.view.default, b.op(aten.view.default, head, [1, img * heads, hd]), [1, img, heads, hd])
        return [b.op(aten.cat.default, [b.op(aten.neg.default, merged), b.op(aten.slice.Tensor, normed, 1, img, img + txt)], 1)]

    report = rewritten_run(build, [x, w])
    assert len(report.regions) == 1 and "mean" in next(iter(report.regions.values()))[0], report.lines()


@pytest.mark.parametrize("head_dim", [16, 128])
def test_rope_on_a_transposed_view_moves_partners_between_lanes(head_dim):
    """HunyuanVideo's single block: q (B, L, H * D) viewed per head and transposed to (B, H, L, D),
    RMSNorm per head, interleaved RoPE on the image tokens (a slice along L), cat with the text
    tokens. The RoPE's rows are the domain's in another order: its rotary partner still moves
    between lanes (no second load of the row at the partner's columns)."""
    g = torch.Generator().manual_seed(head_dim)
    img, txt, heads = 6, 5, 3
    x = rand((1, img + txt, heads * head_dim), torch.bfloat16, "cpu", g)
    w = rand((head_dim,), torch.bfloat16, "cpu", g)
    table = rand((img, head_dim), torch.float32, "cpu", g)

    def build(b, x, w, table):
        per_head = b.op(aten.transpose.int, b.op(aten.view.default, x, [1, img + txt, heads, head_dim]), 1, 2)
        x32 = b.op(aten._to_copy.default, per_head, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x32, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-6)))
        n = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)
        image, text = b.op(aten.slice.Tensor, n, 2, 0, img), b.op(aten.slice.Tensor, n, 2, img, img + txt)
        return [b.op(aten.cat.default, [rope_graph(b, image, table), text], 2)]

    sources = []
    report = rewritten_run(build, [x, w, table], sources)
    assert len(report.regions) == 1, report.lines()
    assert_partners_move_between_lanes(sources)
    assert not any("// 2) * 2" in s for s in sources), sources


@pytest.mark.parametrize("head_dim", [16, 128])
def test_rotate_half_rope_after_a_per_head_rms_norm(head_dim):
    """ERNIE-Image's RoPE, ``cat([-x2, x1]) * sin + x * cos`` (bf16), after diffusers' RMSNorm:
    each half's partner is the other half's lane, one exchange serves both cat pieces."""
    g = torch.Generator().manual_seed(head_dim)
    x, w = rand((2, 7, 3, head_dim), torch.bfloat16, "cpu", g), rand((head_dim,), torch.bfloat16, "cpu", g)
    cos, sin = (rand((1, 7, 1, head_dim), torch.bfloat16, "cpu", g) for _ in range(2))
    half = head_dim // 2

    def build(b, x, w, cos, sin):
        x32 = b.op(aten._to_copy.default, x, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x32, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-6)))
        n = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)
        x1, x2 = (b.op(aten.slice.Tensor, n, -1, k * half, (k + 1) * half) for k in (0, 1))
        rotated = b.op(aten.cat.default, [b.op(aten.neg.default, x2), x1], -1)
        return [b.op(aten.add.Tensor, b.op(aten.mul.Tensor, n, cos), b.op(aten.mul.Tensor, rotated, sin))]

    sources = []
    rewritten_run(build, [x, w, cos, sin], sources)
    assert_partners_move_between_lanes(sources, "rows_k.lanes_exchanged(")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_lane_moves_move_exact_bits(dtype):
    from exactdit.engine.kernel_source import load

    kernel = load(
        "@triton.jit\n"
        "def region_kernel(x_ptr, out_ptr, C: tl.constexpr, MOVE: tl.constexpr, D: tl.constexpr):\n"
        "    offs = tl.arange(0, 4)[:, None] * C + tl.arange(0, C)[None, :]\n"
        "    x = tl.load(x_ptr + offs)\n"
        "    if MOVE == 0:\n"
        "        y = rows_k.lanes_exchanged(x, D)\n"
        "    else:\n"
        "        y = rows_k.pair_lane(x, MOVE - 1)\n"
        "    tl.store(out_ptr + offs, y)\n")
    x = torch.arange(4 * 32, dtype=torch.int32).to(dtype).view(4, 32)
    x[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 2.0**-130])  # any bits, moved as they are
    c = torch.arange(32)
    for move, d, columns in [(0, 1, c ^ 1), (0, 4, c ^ 4), (0, 16, c ^ 16), (1, 1, c & ~1), (2, 1, c | 1)]:
        out = torch.full_like(x, 7.0)
        kernel[(1,)](x, out, 32, move, d)
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           x[:, columns].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (move, d)


@pytest.mark.parametrize("width", [64, 100, 4096])
@pytest.mark.parametrize("rows", [1, 37])
def test_decomposed_rms_norm(width, rows):
    """diffusers' RMSNorm (pow / mean / rsqrt), ATen's mean order for the actual row count."""
    g = torch.Generator().manual_seed(width + rows)
    x = rand((rows, width), torch.bfloat16, "cpu", g)
    w = rand((width,), torch.bfloat16, "cpu", g)

    def build(b, x, w):
        x32 = b.op(aten._to_copy.default, x, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-6)))
        return [b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)]

    if width % 4 and width >= 128:
        pytest.skip("misaligned rows stay with ATen")
    rewritten_run(build, [x, w])


@pytest.mark.parametrize("width", [100, 1000, 3840])
def test_sandwich_rms_norm(width):
    """Z-Image's sandwich: ``h = x + gate * RMSNorm(attn)`` (stored by pass 1 and read back by
    pass 2), then ``RMSNorm(h) * scale``."""
    g = torch.Generator().manual_seed(width)
    x, attn = rand((2, 7, width), torch.bfloat16, "cpu", g), rand((2, 7, width), torch.bfloat16, "cpu", g)
    gate, w = rand((2, 1, width), torch.bfloat16, "cpu", g), rand((width,), torch.bfloat16, "cpu", g)

    def rms(b, x, w):
        x32 = b.op(aten._to_copy.default, x, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x32, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-5)))
        return b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)

    def build(b, x, attn, gate, w):
        h = b.op(aten.add.Tensor, x, b.op(aten.mul.Tensor, gate, rms(b, attn, w)))
        return [h, rms(b, h, w)]

    if width % 4 and width >= 128:
        pytest.skip("misaligned rows stay with ATen")
    report = rewritten_run(build, [x, attn, gate, w])
    assert sum("mean" in d for d, _ in report.regions.values()) >= 1


def test_a_new_resolution_reuses_the_kernels_sources():
    """Row counts, divisors and cat boundaries along the sequence are kernel arguments: the same
    block at another sequence length or batch generates the same sources (Triton compiles them
    once), each run equal to the graph run as CUDA runs it. HunyuanVideo's single block: the
    streams joined, normed per head, RoPE on the image tokens only."""
    heads, hd = 2, 16

    def single_block(batch, img, txt):
        g = torch.Generator().manual_seed(img)
        x = rand((batch, img + txt, heads * hd), torch.bfloat16, "cpu", g)
        w = rand((hd,), torch.bfloat16, "cpu", g)
        shift = rand((batch, heads * hd), torch.bfloat16, "cpu", g)

        def build(b, x, w, shift):
            h = b.op(aten.add.Tensor, x, b.op(aten.unsqueeze.default, shift, 1))
            h = b.op(aten._to_copy.default, b.op(aten.view.default, h, [batch, img + txt, heads, hd]), dtype=torch.float32)
            rstd = b.op(aten.rsqrt.default, b.op(aten.add.Tensor, b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, h, 2), [-1], True), 1e-6))
            normed = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, b.op(aten.mul.Tensor, h, rstd), dtype=torch.bfloat16), w)
            image = b.op(aten.neg.default, b.op(aten.slice.Tensor, normed, 1, 0, img))
            return [b.op(aten.cat.default, [image, b.op(aten.slice.Tensor, normed, 1, img, img + txt)], 1)]

        kernels = []
        rewritten_run(build, [x, w, shift], kernels=kernels)
        assert kernels
        return kernels

    for first, other in ((single_block(1, 12, 5), single_block(1, 40, 5)),
                         (single_block(2, 12, 7), single_block(3, 33, 9))):  # (one batch row has no batch index)
        assert [k.source for k in other] == [k.source for k in first]
        assert [k.params for k in other] != [k.params for k in first]  # the same code, other sizes
        assert any("do_not_specialize" in k.source and "row_int" in k.source for k in first)
