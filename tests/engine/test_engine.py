"""The engine on the CPU: index arithmetic, op rules against CPU eager, reduction templates against
CUDA's reduction orders (order models), whole captured blocks of every registered model, the gate,
the backend and the patch. Kernels run in Triton's interpreter."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import exactdit
from exactdit import gate
from exactdit.engine import coverage, tables, templates, timing
from exactdit.engine.backend import rewrite
from exactdit.engine.indexing import Atom, Ix, broadcast_index, column_values, reshape_index
from exactdit.harness import models
from exactdit.harness.models import qwen
from tests.engine_helpers import (HALF_ONLY_GRAPHS, POINTWISE_GRAPHS, GraphBuilder, capture_graphs, engine_eager_reasons,
                                  gated_residual, graph_break_then, rewrite_and_check, rope_graph, rows_adjacent_block,
                                  trusted, wrap_feed_forward)
from tests.helpers import assert_bits_equal, rand

aten = torch.ops.aten


# --- index arithmetic ------------------------------------------------------------------------


def _atoms(shape):
    return tuple(Ix.of(Atom(f"i{d}", n, d == len(shape) - 1)) for d, n in enumerate(shape))


def test_view_and_its_inverse_give_back_the_atoms():
    index = _atoms((2, 24, 4, 32))
    split = reshape_index(index, (2, 24, 4, 32), (2, 24, 128))
    assert reshape_index(split, (2, 24, 128), (2, 24, 4, 32)) == index
    pairs = reshape_index(index, (2, 24, 4, 32), (2, 24, 4, 16, 2))
    assert pairs[3].code() == "(i3 // 2)" and pairs[4].code() == "(i3 % 2)"
    assert reshape_index(pairs, (2, 24, 4, 16, 2), (2, 24, 4, 32)) == index


def test_index_bounds_and_broadcast():
    i = Ix.of(Atom("c", 16, True))
    assert (i * 4 + 3).floordiv(4) == i and (i * 4 + 3).mod(4) == Ix.constant(3)
    assert i.floordiv(16) == Ix() and i.mod(32) == i
    assert broadcast_index(_atoms((2, 5, 8)), (2, 5, 8), (2, 1, 8))[1] == Ix()
    assert i.minus_const(5) + 5 == i and i.minus_const(5) + 7 == i + 2  # a cat piece sliced back


def test_column_values_follow_what_an_index_computes():
    c = Atom("c", 512, True)
    head = Ix.of(c).mod(128)  # a column within its head, as a view to heads gives it
    partner_even = Ix.of(c).floordiv(128) * 128 + head.floordiv(2) * 2  # x[..., 0::2] of that head
    assert column_values(partner_even, c) == [v & ~1 for v in range(512)]
    assert column_values(partner_even + 1, c) == [v | 1 for v in range(512)]
    assert column_values(Ix.of(Atom("r", 4, False)) + Ix.of(c), c) is None  # another atom: unknown
    assert column_values(Ix.of(c).minus_const(64), c) == [v - 64 for v in range(512)]  # a cat piece's column
    assert column_values(Ix.of(Atom("(c * 3)", 1536, True)), c) is None  # an atom of unknown origin


# --- op rules against CPU eager (pointwise regions are checked by the gate on the CPU) ---------


def _rewritten_run(build, inputs, sources: list | None = None, kernels: list | None = None):
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


def _assert_partners_move_between_lanes(sources, move="rows_k.pair_"):
    """The rotary partner is moved between lanes of the tile: no gather, no second load of the row."""
    assert any(move in s for s in sources), sources
    assert not any("tl.gather" in s for s in sources), sources


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
    _rewritten_run(POINTWISE_GRAPHS[name], [x, u, mod])


def test_permuted_and_strided_inputs():
    g = torch.Generator().manual_seed(3)
    x = rand((9, 2, 64), torch.bfloat16, "cpu", g).permute(1, 0, 2)  # [S, B, D] seen as [B, S, D]
    u = rand((2, 18, 64), torch.bfloat16, "cpu", g)[:, ::2]
    mod = rand((2, 64), torch.bfloat16, "cpu", g)
    _rewritten_run(POINTWISE_GRAPHS["gated residual"], [x, u, mod])


# --- reduction templates against CUDA's orders ----------------------------------------------------------


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

    report = _rewritten_run(build, [x, u, mod, w, bias])
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
    report = _rewritten_run(build, [x, u, w, bias], sources)
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
    report = _rewritten_run(rows_adjacent_block, [x, attn, mlp, gate, scale, shift], sources)
    assert any("layer_norm" in d for d, _ in report.regions.values()), report.why_left
    assert any("ln_k.welford_elements" in src for src in sources), sources
    _rewritten_run(gated_residual, [x, attn, gate], kernels=kernels)
    assert [dict(k.constexprs)["BLOCK_R"] for k in kernels] == [templates.ROWS_ADJACENT_TILE[0]]

    def norm_of_cat(b, x, text, scale):  # HunyuanVideo's first single block: the streams joined, then normed
        ln = b.op(aten.native_layer_norm.default, b.op(aten.cat.default, [x, text], 1), [width], None, None, 1e-6)[0]
        return [b.op(aten.mul.Tensor, ln, b.op(aten.unsqueeze.default, scale, 1))]

    sources = []
    _rewritten_run(norm_of_cat, [x, rand((batch, 5, width), dtype, "cpu", g), scale], sources)
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
    report = _rewritten_run(build, [txt, img, w1, w2, table], sources)
    assert "fused_rms_norm" in next(iter(report.regions.values()))[0]
    _assert_partners_move_between_lanes(sources)


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

    report = _rewritten_run(build, [x, w])
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
    report = _rewritten_run(build, [x, w, table], sources)
    assert len(report.regions) == 1, report.lines()
    _assert_partners_move_between_lanes(sources)
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
    _rewritten_run(build, [x, w, cos, sin], sources)
    _assert_partners_move_between_lanes(sources, "rows_k.lanes_exchanged(")


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
    _rewritten_run(build, [x, w])


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
    report = _rewritten_run(build, [x, attn, gate, w])
    assert sum("mean" in d for d, _ in report.regions.values()) >= 1


# --- captured blocks of every registered model -------------------------------------------------


@pytest.mark.parametrize("name", [n for n in models.model_names() if n not in ("flux-schnell", "wan-1.3b")])
def test_captured_blocks_equal_cuda_order(name):
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=4)
    video = dict(num_frames=5) if models.get_spec(name).video else {}
    kw = models.forward_inputs(name, tr, batch=2, seed=5, height=32, width=32, **video)
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, name)


@pytest.mark.parametrize("name", ["qwen", "zimage"])
def test_captured_blocks_with_prompts_of_different_lengths(name):
    # a batch of two prompts, 9 and 4 tokens: Qwen-Image pads the text with a mask, Z-Image pads
    # each caption itself; the rewritten blocks hold to CUDA's orders with the padding in place
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs(name, tr, batch=2, seed=5, height=32, width=32, text_len=[9, 4])
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, name)


def test_qwen_image_edit_two_image_streams_and_per_token_modulation():
    # Qwen-Image-Edit-2511: a second (condition) image stream after the target's tokens, and
    # zero_cond_t's modulation picked per token through `where` (timestep 0 for the condition)
    cfg = {**models.get_spec("qwen").config("tiny"), **qwen.EDIT_CONFIG}
    tr = models.build_transformer("qwen", cfg, dtype=torch.bfloat16, seed=4)
    kw = qwen.with_condition_image(models.forward_inputs("qwen", tr, batch=1, seed=5, height=32, width=32), seed=6)
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, "qwen-edit")


# --- launch plans: the compiled launchers called directly ----------------------------------------------


@pytest.fixture
def interpreted_launchers(monkeypatch):
    """Launch plans on the CPU: each 'compiled launcher' takes the argument list a plan passes
    (every kernel parameter in order) and runs the kernel in Triton's interpreter from it."""
    from exactdit.device import launch

    launched = []

    def compile_for(fn, grid, args, kwargs, device):
        options = {k: v for k, v in kwargs.items() if k not in fn.arg_names}

        def call(grid_x, stream, *values):
            assert stream == "stream of None" and len(values) == len(fn.arg_names)
            launched.append(fn)
            fn[grid](**dict(zip(fn.arg_names, values)), **options)

        return launch.CompiledLaunch(call, (grid[0],), (), launch.bound_arguments(fn, args, kwargs))

    monkeypatch.setattr(launch, "supported", lambda device: True)
    monkeypatch.setattr(launch, "current_device", lambda: None)  # a CPU tensor's device index
    monkeypatch.setattr(launch, "current_stream", lambda index: f"stream of {index}")
    monkeypatch.setattr(launch, "compile_for", compile_for)
    return launched


def _complexrope_graph(b, x, freqs):
    """Qwen-Image's RoPE: ``view_as_real(view_as_complex(x.float()) * freqs).type_as(x)``."""
    shape = list(x.meta["val"].shape)
    pairs = b.op(aten.view.default, b.op(aten._to_copy.default, x, dtype=torch.float32), shape[:-1] + [-1, 2])
    rotated = b.op(aten.mul.Tensor, b.op(aten.view_as_complex.default, pairs), freqs)
    out = b.op(aten.view.default, b.op(aten.view_as_real.default, rotated), shape)
    return b.op(aten._to_copy.default, out, dtype=x.meta["val"].dtype)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_complex_rope_reads_each_frequency_pair_with_one_load(head_dim):
    """Qwen-Image / Z-Image: per-head RMSNorm, then ``view_as_complex(x.float()) * freqs``. Lane c
    loads part c % 2 of frequency c // 2 (one contiguous load per tile) and the parts move between
    the pair's lanes; frequencies strided along their last dim run eager, with the reason."""
    g = torch.Generator().manual_seed(head_dim)
    x, w = rand((2, 5, 3 * head_dim), torch.bfloat16, "cpu", g), rand((head_dim,), torch.bfloat16, "cpu", g)
    angles = torch.randn(5, 1, head_dim, generator=g)
    freqs = torch.polar(torch.ones_like(angles[..., ::2]), angles[..., ::2].contiguous())

    def build(b, x, w, freqs):
        heads = b.op(aten.view.default, x, [2, 5, 3, head_dim])
        x32 = b.op(aten._to_copy.default, heads, dtype=torch.float32)
        var = b.op(aten.mean.dim, b.op(aten.pow.Tensor_Scalar, x32, 2), [-1], True)
        h = b.op(aten.mul.Tensor, x32, b.op(aten.rsqrt.default, b.op(aten.add.Tensor, var, 1e-5)))
        normed = b.op(aten.mul.Tensor, b.op(aten._to_copy.default, h, dtype=torch.bfloat16), w)
        return [_complexrope_graph(b, normed, freqs)]

    b = GraphBuilder()
    gm = b.module(*build(b, *[b.input(t) for t in (x, w, freqs)]))
    rewrite_and_check(gm, [x, w, freqs], "crope")
    kernels = [k for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")
               for _, k in n.target.exactdit_region.kernels()]
    assert kernels
    for k in kernels:
        f = next(i for i, n in enumerate(k.inputs) if n.meta["val"].dtype == torch.complex64)
        # one load per pass over the columns (the last pass reads the frequencies)
        assert k.source.count(f"tl.load(in{f}_ptr") == 1, k.source
        assert "rows_k.pair_lane(" in k.source and "tl.gather" not in k.source

    strided = torch.polar(torch.ones_like(angles), angles)[..., ::2]
    b2 = GraphBuilder()
    unrewritten = b2.module(*build(b2, *[b2.input(t) for t in (x, w, freqs)]))
    with torch.no_grad(), trusted():
        assert_bits_equal(gm(x, w, strided)[0], unrewritten(x, w, strided)[0], "strided frequencies")
    reasons = {k: v["eager_reasons"] for k, v in exactdit.report(show=False).items() if k.startswith("crope")}
    assert any("strided along its last dim" in str(r) for r in reasons.values()), reasons


@pytest.fixture
def both_launch_routes(monkeypatch, interpreted_launchers):
    """Every region call also runs through its generated launch plan and through Triton's JIT
    launch, outputs poisoned first: the same bits, every element written. Returns the regions seen."""
    from exactdit.engine import runtime

    checked = []
    plain_call = runtime.RegionOp.__call__

    def both_routes(self, *inputs):
        fast = self._specialize(*inputs)
        for a, b in zip(fast(*inputs, poisoned=True), self._fused(*inputs)):
            assert_bits_equal(a, b, self.region.name)
        checked.append(self.region.name)
        return plain_call(self, *inputs)

    monkeypatch.setattr(runtime.RegionOp, "__call__", both_routes)
    monkeypatch.setenv("EXACTDIT_POISON", "1")
    return checked


def test_launch_plans_of_a_captured_block_launch_what_the_jit_path_launches(both_launch_routes):
    # Wan: fp32 modules, LayerNorm + modulation, RMSNorm across heads, RoPE through strided slices
    tr = models.build_transformer("wan", "tiny", dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs("wan", tr, batch=1, seed=5, height=32, width=32, num_frames=5)
    for _, gm, inputs in capture_graphs(tr, kw):
        with torch.no_grad(), trusted():
            rewrite(gm, "wan")
            gm(*inputs)
    assert len(both_launch_routes) > 3


def test_launch_plans_with_tables_complex_inputs_and_several_outputs(both_launch_routes):
    g = torch.Generator().manual_seed(2)
    x, u = rand((2, 5, 64), torch.bfloat16, "cpu", g), rand((2, 5, 64), torch.bfloat16, "cpu", g)
    freqs = torch.polar(torch.ones(5, 1, 16), torch.randn(5, 1, 16, generator=g))

    def build(b, x, u, freqs):
        h = b.op(aten.mul.Tensor, u, b.op(aten.gelu.default, x, approximate="tanh"))  # a table
        q = _complexrope_graph(b, b.op(aten.view.default, x, [2, 5, 2, 32]), freqs)  # a complex input
        return [h, b.op(aten.add.Tensor, h, x), q]  # several outputs

    b = GraphBuilder()
    gm = b.module(*build(b, *[b.input(t) for t in (x, u, freqs)]))
    with torch.no_grad(), trusted():
        rewrite(gm, "plans")
        gm(x, u, freqs)
    assert len(both_launch_routes) >= 2


def test_a_verified_region_layout_is_served_by_its_launch_plan(interpreted_launchers):
    b = GraphBuilder()
    g = torch.Generator().manual_seed(1)
    inputs = [rand((3, 40), torch.bfloat16, "cpu", g), rand((3, 40), torch.bfloat16, "cpu", g), rand((3,), torch.bfloat16, "cpu", g)]
    gm = b.module(*POINTWISE_GRAPHS["gated residual"](b, *[b.input(t) for t in inputs]))
    with torch.no_grad():
        ref = gm(*inputs)
        rewrite(gm, "plan")
        for _ in range(3):
            assert_bits_equal(gm(*inputs)[0], ref[0], "plan")
    assert len(interpreted_launchers) == 3  # verified through the plan, then served by it
    assert exactdit.report(show=False)["plan.r0"]["fused"] == 3
    from triton import knobs

    hook = lambda metadata: None  # noqa: E731 - a profiler's launch hook: only Triton's JIT path calls it
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        with torch.no_grad():
            assert_bits_equal(gm(*inputs)[0], ref[0], "plan")
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(interpreted_launchers) == 3


# --- the gate, the backend, the patch ---------------------------------------------------------------


def test_a_wrong_region_is_disabled_and_eager_returned(monkeypatch):
    from exactdit.engine import runtime

    real = runtime.RegionOp._fused

    def wrong(self, *inputs):
        return tuple(o + 1 for o in real(self, *inputs))

    monkeypatch.setattr(runtime.RegionOp, "_fused", wrong)
    g = torch.Generator().manual_seed(0)
    inputs = [rand((2, 4, 64), torch.bfloat16, "cpu", g), rand((2, 4, 64), torch.bfloat16, "cpu", g),
              rand((2, 64), torch.bfloat16, "cpu", g)]
    b = GraphBuilder()
    nodes = [b.input(t) for t in inputs]
    gm = b.module(*POINTWISE_GRAPHS["gated residual"](b, *nodes))
    ref = gm(*inputs)
    rewrite(gm, "wrong")
    with pytest.warns(gate.ExactditMismatchWarning):
        out = gm(*inputs)
    assert_bits_equal(out[0], ref[0])
    stats = exactdit.report(show=False)["wrong.r0"]
    assert stats["disabled"] and stats["eager"] == 1 and stats["fused"] == 0
    assert_bits_equal(gm(*inputs)[0], ref[0])  # stays eager


def test_repeated_pure_ops_are_computed_once_and_random_ones_not():
    from exactdit.engine.backend import dedupe

    b = GraphBuilder()
    x = b.input(torch.randn(4, 8))
    a1, a2 = b.op(aten.silu.default, x), b.op(aten.silu.default, x)
    r1, r2 = b.op(aten.rand_like.default, x), b.op(aten.rand_like.default, x)
    gm = b.module(b.op(aten.add.Tensor, a1, a2), r1, r2)
    assert dedupe(gm.graph) == 1
    assert [n.target for n in gm.graph.nodes].count(aten.silu.default) == 1
    assert [n.target for n in gm.graph.nodes].count(aten.rand_like.default) == 2


def test_a_region_reads_an_empty_cat_piece_it_never_loads():
    # x_in[..., rot_dim:] is empty when RoPE covers the whole head (ERNIE-Image); under context
    # parallelism it slices a graph input, which the region's ATen reference must still receive
    def build(b, x, w, passed):
        y = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x, w), x)
        rest = b.op(aten.slice.Tensor, passed, 1, 8, 9223372036854775807)
        return (b.op(aten.mul.Tensor, b.op(aten.cat.default, [y, rest], -1), 2.0),)

    _rewritten_run(build, [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)])


def test_a_cat_sliced_to_its_first_piece_reads_only_that_piece():
    # HunyuanVideo's token refiner in fp32: cat([a, b], -1)[..., :width of a]; the slice's columns
    # all lie in the first piece, which needs no selection, and the second is never loaded
    def build(b, x, y):
        cat = b.op(aten.cat.default, [b.op(aten.mul.Tensor, x, 3.0), y], 1)
        return (b.op(aten.add.Tensor, b.op(aten.slice.Tensor, cat, 1, 0, 128), 1.0),)

    sources = []
    _rewritten_run(build, [torch.randn(2, 128), torch.randn(2, 64)], sources)
    assert sources and all("in1_ptr" not in s.split("):", 1)[1] for s in sources), sources


def test_rope_written_through_strided_slices_of_an_empty_tensor():
    # Wan's RoPE: out = empty_like(x); out[..., 0::2] = a; out[..., 1::2] = b, functionalized into
    # copy + slice_scatter; the uninitialised values are all overwritten, so the region is exact
    def build(b, x, c, s):
        x1, x2 = (b.op(aten.slice.Tensor, x, -1, k, 9223372036854775807, 2) for k in (0, 1))
        even = b.op(aten.sub.Tensor, b.op(aten.mul.Tensor, x1, c), b.op(aten.mul.Tensor, x2, s))
        odd = b.op(aten.add.Tensor, b.op(aten.mul.Tensor, x1, s), b.op(aten.mul.Tensor, x2, c))
        out = b.op(aten.empty_like.default, x)
        for k, v in enumerate((even, odd)):
            dst = b.op(aten.slice.Tensor, out, -1, k, 9223372036854775807, 2)
            out = b.op(aten.slice_scatter.default, out, b.op(aten.copy.default, dst, v), -1, k, 9223372036854775807, 2)
        return (b.op(aten._to_copy.default, out, dtype=torch.bfloat16),)

    x = torch.randn(2, 5, 3, 16, dtype=torch.bfloat16)
    sources = []
    report = _rewritten_run(build, [x, torch.randn(5, 1, 8), torch.randn(5, 1, 8)], sources)
    assert not any("slice_scatter" in line and "left" in line for line in report.lines()), report.lines()
    _assert_partners_move_between_lanes(sources)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_per_token_modulation_picked_by_an_integer_index(index_dtype):
    # Qwen-Image-Edit-2511: where(index == 0, mod_target, mod_condition) per token, then modulate
    def build(b, x, index, s0, s1):
        pick = b.op(aten.unsqueeze.default, b.op(aten.eq.Scalar, index, 0), -1)
        scale = b.op(aten.where.self, pick, s0, s1)
        return (b.op(aten.mul.Tensor, x, b.op(aten.add.Tensor, scale, 1)),)

    g = torch.Generator().manual_seed(3)
    index = torch.randint(0, 2, (2, 37), generator=g, dtype=index_dtype)
    inputs = [rand((2, 37, 64), torch.bfloat16, "cpu", g), index,
              rand((2, 1, 64), torch.bfloat16, "cpu", g), rand((2, 1, 64), torch.bfloat16, "cpu", g)]
    report = _rewritten_run(build, inputs)
    assert any("eq" in line and "fused" in line for line in report.lines()), report.lines()


def test_per_token_modulation_read_in_pieces_fuses_into_each_consumer():
    # Wan2.2-TI2V-5B: one timestep per token, (table + temb.float()).chunk(6, dim=2) read by six
    # regions: each computes its own piece instead of ATen writing the float32 sum
    cfg = dict(models.get_spec("wan").config("tiny"), in_channels=48, out_channels=48)
    tr = models.build_transformer("wan", cfg, dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs("wan", tr, batch=2, seed=5, height=64, width=64, num_frames=5)
    assert kw["timestep"].shape == (2, 2 * 2 * 2) and kw["timestep"].stride(0) == 0
    for _, gm, inputs in capture_graphs(tr, kw):
        report = rewrite_and_check(gm, inputs, "wan2.2")
        left = next(line for line in report.lines() if "left to ATen" in line)
        assert re.search(r"\b(add|_to_copy) x", left) is None, left
    # the coverage report counts the captured sum, which no longer runs, as fused
    assert all(g.share == 1.0 for g, _, _ in timing.measure(tr, kw))


def test_a_value_read_whole_and_in_pieces_is_computed_once():
    from exactdit.engine.backend import split_per_piece

    x, t = torch.randn(4, 3, 8, dtype=torch.bfloat16), torch.randn(3, 8)
    b = GraphBuilder()
    total = b.op(aten.add.Tensor, b.op(aten._to_copy.default, b.input(x), dtype=torch.float32), b.input(t))
    gm = b.module(*[b.op(aten.mul.Tensor, piece, 2.0) for piece in b.op(aten.split.Tensor, total, 1, 1)])
    expected = gm(x, t)
    assert split_per_piece(gm.graph) == 3  # each piece gets its own add and cast
    gm.recompile()
    assert [n.target for n in gm.graph.nodes].count(aten.add.Tensor) == 3
    assert [n.target for n in gm.graph.nodes].count(aten._to_copy.default) == 3
    assert all(torch.equal(a, e) for a, e in zip(gm(x, t), expected))
    b = GraphBuilder()
    total = b.op(aten.add.Tensor, b.input(x), b.input(t))
    gm = b.module(total, *b.op(aten.split.Tensor, total, 1, 1))
    assert split_per_piece(gm.graph) == 0  # also read whole: computed once, as captured


def test_collectives_are_neither_merged_nor_reordered():
    from exactdit.engine.backend import _effectful, _pure

    g = fx.Graph()
    x = g.placeholder("x")
    c10d = torch.ops._c10d_functional
    for target in (c10d.all_to_all_single.default, c10d.wait_tensor.default, c10d.all_gather_into_tensor.default):
        assert not _pure(target) and _effectful(g.call_function(target, (x,)))
    assert _pure(aten.mul.Tensor) and not _effectful(g.call_function(aten.mul.Tensor, (x, x)))


def test_registered_backend_compiles_a_function():
    def f(x, g):
        return x + g * 2.0 * x

    x, g = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    out = torch.compile(f, backend="exactdit", fullgraph=True)(x, g)
    assert torch.equal(out, f(x, g))
    assert coverage.graphs()[-1].regions


def test_patch_unpatch_and_report_on_a_model():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        summary = exactdit.patch(tr)
        out = tr(**kw, return_dict=False)[0]
        assert summary["modules"]["FluxTransformerBlock"] == 1
        assert exactdit.unpatch(tr)["restored"]["FluxSingleTransformerBlock"] == 1
        again = tr(**kw, return_dict=False)[0]
    assert_bits_equal(out, ref) and assert_bits_equal(again, ref)
    assert all(m._compiled_call_impl is None for m in tr.modules())
    rep = exactdit.report(show=False)
    assert any(v["fused"] for k, v in rep.items() if k.startswith("FluxTransformer2DModel"))


FLUX_BLOCK = "FluxTransformer2DModel.FluxTransformerBlock"
FLUX_SINGLE_BLOCK = "FluxTransformer2DModel.FluxSingleTransformerBlock"


def _flux_with_feed_forward(wrap, seed: int):
    """A tiny Flux whose first double block's feed-forward runs ``wrap(ff, x)``, and its inputs."""
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=seed)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=seed + 1)
    wrap_feed_forward(tr.transformer_blocks[0], wrap)
    return tr, kw


def _patched_runs(tr, kws: list) -> tuple[list, list, list]:
    """(eager outputs, patched outputs, warnings) of one forward per inputs in ``kws``."""
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in kws]
        torch._dynamo.reset()
        exactdit.patch(tr)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [tr(**kw, return_dict=False)[0] for kw in kws]
        exactdit.unpatch(tr)
    return refs, outs, [str(w.message) for w in caught]


def _block_graphs(label: str) -> list:
    return [g for g in coverage.graphs() if g.name.startswith(label + "#")]


def test_a_block_with_a_graph_break_is_captured_in_parts():
    """A graph break inside a block (its feed-forward calls code Dynamo does not trace): the block
    runs as Dynamo's graphs around the break, each rewritten and fused; equal, listed in the
    report with the reason, nothing run eager, nothing captured again on a second call."""
    tr, kw = _flux_with_feed_forward(graph_break_then, seed=8)
    refs, outs, warned = _patched_runs(tr, [kw, kw])
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    assert "graph_break" in coverage.in_parts()[FLUX_BLOCK], coverage.in_parts()
    assert any("captured in parts" in w for w in warned), warned
    graphs = _block_graphs(FLUX_BLOCK)
    assert len([g for g in graphs if g.regions]) >= 2, [g.lines() for g in graphs]  # both sides of the break
    rep = exactdit.report(show=False)
    ran = {k.rsplit(".r", 1)[0] for k, v in rep.items() if FLUX_BLOCK + "#" in k and v["fused"]}
    assert len(ran) >= 2, ran
    assert engine_eager_reasons() == {}
    assert f"captured in parts (graph breaks): {FLUX_BLOCK}" in str(rep)
    # the second forward reused the graphs: each region ran once per forward
    assert all(v["fused"] == 2 for k, v in rep.items() if FLUX_BLOCK + "#" in k and v["fused"])


def test_a_block_dynamo_captures_nothing_of_runs_eager_with_the_reason():
    """A block whose whole forward Dynamo must skip (here ``torch.compiler.disable``d): no graph
    runs even in parts, so it runs diffusers' code, counted with the reason, and is not captured
    again."""
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=8)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=9)
    block = tr.transformer_blocks[0]
    block.forward = torch.compiler.disable(block.forward)
    refs, outs, warned = _patched_runs(tr, [kw, kw])
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    assert any("runs diffusers' code" in w for w in warned), warned
    reasons = exactdit.report(show=False)[f"engine.{FLUX_BLOCK}"]["eager_reasons"]
    assert len(reasons) == 1 and next(iter(reasons)).startswith("not captured: "), reasons
    assert sum(reasons.values()) == 2  # both calls


def test_parts_captured_again_for_inputs_already_run_fall_back_to_eager():
    """A value read after a graph break that changes between calls (a routing count, here a
    setting) makes Dynamo capture the parts again for inputs the block has run: after
    RECAPTURES_ALLOWED such calls, rather than capturing on every step, the block runs diffusers'
    code from its next call on."""
    from exactdit.patches.engine import RECAPTURED_REASON, RECAPTURES_ALLOWED

    setting = {"k": 1}

    def reads_a_value(ff, x):
        torch._dynamo.graph_break()
        y = ff(x)
        k = setting["k"]
        return torch.cat([y[:, :k], y[:, k:]], dim=1)  # y, whatever k: the graph specialises on it

    tr, kw = _flux_with_feed_forward(reads_a_value, seed=8)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        torch._dynamo.reset()
        exactdit.patch(tr)
        outs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(1, RECAPTURES_ALLOWED + 4):
                setting["k"] = k
                outs.append(tr(**kw, return_dict=False)[0])
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    reasons = exactdit.report(show=False)[f"engine.{FLUX_BLOCK}"]["eager_reasons"]
    assert reasons == {RECAPTURED_REASON: 1}  # the last call; the one before still ran the graphs it captured


def test_shapes_beyond_dynamos_recompile_limit_run_eager_and_the_captured_ones_stay_fused():
    from exactdit.patches.engine import RECOMPILE_LIMIT, RECOMPILE_LIMIT_REASON

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    calls = [models.forward_inputs("flux", tr, batch=1, height=h, width=32, seed=7) for h in (16, 32, 48)]
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in calls]
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=8):
            exactdit.patch(tr)
            assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
        with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [tr(**kw, return_dict=False)[0] for kw in calls]
            runs = _graph_runs("FluxTransformerBlock")
            again = tr(**calls[0], return_dict=False)[0]
            assert _graph_runs("FluxTransformerBlock") == runs + 1  # the first shape's graph ran
        exactdit.unpatch(tr)
    for out, ref in zip(outs + [again], refs + refs[:1]):
        assert_bits_equal(out, ref)
    reasons = exactdit.report(show=False)["engine.FluxTransformer2DModel.FluxTransformerBlock"]["eager_reasons"]
    assert list(reasons) == [RECOMPILE_LIMIT_REASON]


def _graph_runs(block: str) -> int:
    """Calls of the first region of every captured graph of ``block``'s class."""
    rep = exactdit.report(show=False)
    return sum(v["fused"] + v["eager"] for k, v in rep.items() if f".{block}#" in k and k.endswith(".r0"))


def _hooks_hold_the_class_forward(blocks) -> bool:
    """Each block's diffusers hook chain ends in the block class's own forward (as before a patch)."""
    def innermost(ref):
        return ref.original_forward if ref.original_forward is not None else ref.forward

    return all(innermost(b._diffusers_hook._fn_refs[0]).__func__ is type(b).forward for b in blocks)


def _cached_flux(cache_config, seeds, layers=(2, 2)):
    """A tiny Flux with a diffusers cache enabled, one forward's inputs per seed, and ``denoise()``
    running them in order in one cache context (the cache's state reset first)."""
    from diffusers.hooks import HookRegistry

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": layers[0], "num_single_layers": layers[1]}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    calls = [models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=s) for s in seeds]
    tr.enable_cache(cache_config)

    def denoise():
        HookRegistry.check_if_exists_or_initialize(tr).reset_stateful_hooks(recurse=True)
        with torch.no_grad(), tr.cache_context("cond"):
            return [tr(**kw, return_dict=False)[0] for kw in calls]

    return tr, calls, denoise


def test_first_block_cache_hooks_run_around_the_captured_blocks():
    from diffusers.hooks import FirstBlockCacheConfig

    # the second call repeats the first input: the cache skips the blocks after the first
    tr, calls, denoise = _cached_flux(FirstBlockCacheConfig(threshold=0.3), seeds=(7, 7, 8), layers=(3, 2))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    out = denoise()
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    # the cache's head block runs its graph on all three calls (inside the hook's compiler-disabled
    # new_forward), blocks 1 and 2 on the two calls the cache does not skip
    assert _graph_runs("FluxTransformerBlock") == 3 + 2 * 2
    assert _graph_runs("FluxSingleTransformerBlock") == 2 * 2
    exactdit.unpatch(tr)
    assert _hooks_hold_the_class_forward(list(tr.transformer_blocks) + list(tr.single_transformer_blocks))
    assert_bits_equal(denoise()[2], ref[2])  # unpatched, hooks as they were
    # hooks removed while patched: the blocks run their graphs without them
    exactdit.patch(tr)
    denoise()
    tr.disable_cache()
    runs = _graph_runs("FluxTransformerBlock")
    with torch.no_grad():
        assert_bits_equal(tr(**calls[2], return_dict=False)[0], ref[2])  # a call the cache computed in full
    exactdit.unpatch(tr)
    assert _graph_runs("FluxTransformerBlock") == runs + 3 and engine_eager_reasons() == {}
    assert all(type(b.forward).__name__ == "method" for b in tr.transformer_blocks)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_keeps_working(offload_type):
    """Group offloading (its hooks move parameters in torch.compiler.disable'd functions): with
    hooks on the blocks the blocks' forwards still run captured inside them; with hooks on the
    layers inside a block (leaf level) each hook breaks the graph and the block is captured in parts."""
    from diffusers.hooks import apply_group_offloading

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": 2, "num_single_layers": 3}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    cpu = torch.device("cpu")
    apply_group_offloading(tr, onload_device=cpu, offload_device=cpu, offload_type=offload_type,
                           **({"num_blocks_per_group": 1} if offload_type == "block_level" else {}))
    torch._dynamo.reset()
    exactdit.patch(tr)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # leaf level: "captured in parts"
        outs = [tr(**kw, return_dict=False)[0] for _ in range(2)]
        exactdit.unpatch(tr)
        outs.append(tr(**kw, return_dict=False)[0])
    for out in outs:
        assert_bits_equal(out, ref)
    assert engine_eager_reasons() == {}
    in_parts = coverage.in_parts()
    if offload_type == "block_level":
        assert not in_parts
        assert _graph_runs("FluxTransformerBlock") == 2 * 2 and _graph_runs("FluxSingleTransformerBlock") == 2 * 3
        assert _hooks_hold_the_class_forward(list(tr.transformer_blocks) + list(tr.single_transformer_blocks))
    else:
        assert set(in_parts) >= {FLUX_BLOCK, FLUX_SINGLE_BLOCK}, in_parts
        assert all(why.startswith("(blocks with hooks on their layers)") for why in in_parts.values())
        assert any(v["fused"] for k, v in exactdit.report(show=False).items() if k.startswith(FLUX_BLOCK + "#"))


@pytest.mark.parametrize("cache", ["pyramid_attention_broadcast", "mag_cache", "sea_cache"])
def test_caches_on_blocks_run_with_the_blocks_captured(cache):
    from diffusers.hooks import MagCacheConfig, PyramidAttentionBroadcastConfig, SeaCacheConfig

    steps = 4
    config = {
        "pyramid_attention_broadcast": lambda: PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: 500),
        "mag_cache": lambda: MagCacheConfig(num_inference_steps=steps, mag_ratios=[1.0] * steps, threshold=0.5),
        "sea_cache": lambda: SeaCacheConfig(),
    }[cache]
    tr, _, denoise = _cached_flux(config(), seeds=range(10, 10 + steps))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    out = denoise()
    exactdit.unpatch(tr)
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    assert _graph_runs("FluxTransformerBlock") > 0 and _graph_runs("FluxSingleTransformerBlock") > 0


def test_hooks_inside_blocks_capture_those_blocks_in_parts_until_removed():
    """TaylorSeer hooks each block's attention layer (a compiler-disabled forward inside the
    block): those blocks are captured in parts around it, until the cache is disabled; another
    model of the same classes is captured whole."""
    from diffusers.hooks import TaylorSeerCacheConfig

    tr, calls, denoise = _cached_flux(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
                                      seeds=range(10, 14))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captured in parts"
        out = denoise()
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    assert set(coverage.in_parts()) == {FLUX_BLOCK, FLUX_SINGLE_BLOCK}
    in_parts = _graph_runs("FluxTransformerBlock")
    assert in_parts > 0

    other = models.build_transformer("flux", {**models.get_spec("flux").config("tiny"), "num_layers": 2,
                                              "num_single_layers": 2}, dtype=torch.bfloat16, seed=7)
    exactdit.patch(other)
    with torch.no_grad():
        other(**calls[0], return_dict=False)
    whole = _graph_runs("FluxTransformerBlock") - in_parts
    assert whole == 2  # the classes are not marked as running in parts: one graph per block

    tr.disable_cache()
    with torch.no_grad():
        plain = tr(**calls[0], return_dict=False)[0]
    exactdit.unpatch(tr)
    exactdit.unpatch(other)
    # hooks gone: tr's blocks run the whole graph too
    assert _graph_runs("FluxTransformerBlock") - in_parts == whole + len(tr.transformer_blocks)
    with torch.no_grad():
        assert_bits_equal(plain, tr(**calls[0], return_dict=False)[0])


def test_tables_reproduce_eager_on_every_input():
    for fn in (torch.tanh, F.silu, lambda x: F.gelu(x, approximate="tanh")):
        for dtype in (torch.bfloat16, torch.float16):
            table, why = tables.build_table(fn, dtype, "cpu")
            assert why is None and table is not None
    spec = tables.derive_spec(torch.tanh(tables.every_value(torch.bfloat16, "cpu")), torch.bfloat16)
    assert 0 < spec.window <= tables.MAX_WINDOW  # the window, not the full table
