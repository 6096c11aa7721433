"""Fused GEMM regions on the GPU against cuBLAS and eager CUDA kernels: ``torch.equal`` of the
rewritten graph's outputs (poisoned before each run) with the graph run op by op, random normal
operands, many shapes; then whole tiny models large enough for their GEMMs to be fused."""

from __future__ import annotations

import pytest
import torch

from exactdit.engine import coverage
from exactdit.engine.backend import rewrite
from exactdit.engine.templates import gemm
from exactdit.harness import models
from tests.engine_helpers import GraphBuilder, assert_patched_equals_eager, rewrite_and_check_against_eager

pytestmark = pytest.mark.gpu
aten = torch.ops.aten


def _linear_then(m, k, n, dtype, *, bias, epilogue, layout="nk", seed=0):
    torch.manual_seed(seed)
    b = GraphBuilder()
    x = b.input(torch.randn(m, k, device="cuda", dtype=dtype))
    if layout == "nk":
        wt = b.op(aten.t.default, b.input(torch.randn(n, k, device="cuda", dtype=dtype) * k ** -0.5))
    else:
        wt = b.input(torch.randn(k, n, device="cuda", dtype=dtype) * k ** -0.5)
    y = b.op(aten.addmm.default, b.input(torch.randn(n, device="cuda", dtype=dtype)), x, wt) if bias \
        else b.op(aten.mm.default, x, wt)
    return b.module(*epilogue(b, y, m, n, dtype)), b.inputs


def _gated(b, y, m, n, dtype):
    y3 = b.op(aten.view.default, y, [1, m, n])
    gate_ = b.input(torch.randn(1, 1, n, device="cuda", dtype=dtype))
    r = b.input(torch.randn(1, m, n, device="cuda", dtype=dtype))
    return [b.op(aten.add.Tensor, r, b.op(aten.mul.Tensor, gate_, y3))]


def _gelu_tanh(b, y, m, n, dtype):
    return [b.op(aten.gelu.default, y, approximate="tanh")]


def _gelu_and_output(b, y, m, n, dtype):
    return [b.op(aten.mul.Tensor, b.op(aten.gelu.default, y, approximate="tanh"), 2.0), y]


SHAPES = [(1024, 64, 3072), (1100, 3072, 3072), (4096, 3072, 9216), (4160, 3072, 3000), (4608, 15360, 3072),
          (2048, 5120, 128), (1536, 256, 1000)]


@pytest.mark.parametrize("way", ["fused", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
def test_gated_linear_equals_eager(m, k, n, dtype, way, monkeypatch):
    monkeypatch.setenv(gemm.CHOICE_ENV, way)
    gm, inputs = _linear_then(m, k, n, dtype, bias=True, epilogue=_gated)
    rewrite_and_check_against_eager(gm, inputs, f"gemm-{m}x{k}x{n}")


@pytest.mark.parametrize("epilogue", [_gelu_tanh, _gelu_and_output], ids=["gelu", "gelu+output"])
@pytest.mark.parametrize("bias,layout", [(True, "nk"), (False, "nk"), (True, "kn")])
def test_activation_epilogues_equal_eager(epilogue, bias, layout, monkeypatch):
    monkeypatch.setenv(gemm.CHOICE_ENV, "fused")
    gm, inputs = _linear_then(4096, 3072, 3072, torch.bfloat16, bias=bias, epilogue=epilogue, layout=layout)
    rewrite_and_check_against_eager(gm, inputs, "gemm-gelu")


def test_the_timed_choice_is_recorded_and_exact(monkeypatch):
    monkeypatch.setenv(gemm.CHOICE_ENV, "auto")
    gm, inputs = _linear_then(4096, 3072, 3072, torch.bfloat16, bias=True, epilogue=_gated)
    with torch.no_grad():
        ref = gm(*inputs)
        rewrite(gm, "gemm-choice")
        outs = [gm(*inputs) for _ in range(3)]
    for out in outs:
        assert torch.equal(out[0], ref[0])
    ops = [n.target.exactdit_region for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")]
    choices = [c for op in ops for c in op.choices.values()]
    candidates = {f"fused {cfg.label}" for cfg in gemm.tile_candidates(4096, 3072, 3072)}
    assert choices and all(way in times and set(times) == candidates | {"split"} and all(t > 0 for t in times.values())
                           for way, times in choices)


def test_a_way_that_raises_is_not_chosen(monkeypatch):
    monkeypatch.setenv(gemm.CHOICE_ENV, "auto")
    x = torch.randn(1024, 1024, device="cuda")

    def broken(*_):
        raise RuntimeError("out of shared memory")

    way, times = gemm.choose({"fused broken": broken, "fused slow": lambda t: t @ t @ t, "split": lambda t: t @ t}, (x,))
    assert way == "split" and set(times) == {"fused slow", "split"}


#: configurations ``bench_gemm.py --tiles`` is to try next (not candidates yet)
TRIAL_TILES = (gemm.Tiles(128, 128, 64, 8, 2, per_sm=2, split=2), gemm.Tiles(128, 256, 64, 8, 3, ws=True, split=2))


@pytest.mark.parametrize("tiles", gemm.WIDE_TILES + gemm.NARROW_TILES + TRIAL_TILES, ids=lambda t: t.label)
def test_every_candidate_tile_configuration_equals_eager(tiles, monkeypatch):
    """Each configuration the runtime may time and choose, forced, at an odd shape (partial tiles
    on both sides) with a gated epilogue."""
    monkeypatch.setenv(gemm.CHOICE_ENV, "fused")
    monkeypatch.setenv(gemm.TILES_ENV, tiles.spec)
    gm, inputs = _linear_then(4160, 3072, 3000, torch.bfloat16, bias=True, epilogue=_gated)
    rewrite_and_check_against_eager(gm, inputs, f"gemm-tiles-{tiles.label}")


@pytest.mark.parametrize("name,size", [("flux", 512), ("qwen", 512), ("wan", 256)])
def test_tiny_models_with_fused_gemms_equal_eager(name, size, monkeypatch):
    """Tiny configs at sizes whose token counts pass MIN_ROWS: their linears fuse with the
    gated residuals, GELUs and casts after them (forced, so the fused kernel itself is checked)."""
    monkeypatch.setenv(gemm.CHOICE_ENV, "fused")
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    video = dict(num_frames=9) if models.get_spec(name).video else {}
    kw = models.forward_inputs(name, tr, batch=2, seed=2, height=size, width=size, **video)
    assert_patched_equals_eager(tr, kw, models.run_forward)
    gemm_regions = [d for g in coverage.graphs() for d, _ in g.regions.values() if d.startswith("gemm[")]
    assert gemm_regions, [line for g in coverage.graphs() for line in g.lines()]


CAT_SHAPES = [(4608, 3072, 12288, 3072), (4160, 64, 200, 1000), (1024, 3072, 3072, 3072)]


@pytest.mark.parametrize("way", ["fused", "split"])
@pytest.mark.parametrize("m,k0,k1,n", CAT_SHAPES, ids=[f"{m}x({a}+{b})x{n}" for m, a, b, n in CAT_SHAPES])
def test_a_cat_along_k_read_as_k_ranges_equals_eager(m, k0, k1, n, way, monkeypatch):
    """The single block's ``proj_out(cat([attn, gelu(mlp)], -1))`` with its gated residual: the
    kernel reads the pieces where they lie (the attention output through its head-merging view)."""
    monkeypatch.setenv(gemm.CHOICE_ENV, way)
    torch.manual_seed(0)
    b = GraphBuilder()
    heads = b.input(torch.randn(1, m, 2, k0 // 2, device="cuda", dtype=torch.bfloat16))
    attn = b.op(aten.view.default, b.op(aten.transpose.int, b.op(aten.permute.default, heads, [0, 2, 1, 3]), 1, 2),
                [1, m, k0])
    act = b.op(aten.gelu.default, b.input(torch.randn(1, m, k1, device="cuda", dtype=torch.bfloat16)),
               approximate="tanh")
    rows = b.op(aten.view.default, b.op(aten.cat.default, [attn, act], -1), [m, k0 + k1])
    w = b.input(torch.randn(n, k0 + k1, device="cuda", dtype=torch.bfloat16) * (k0 + k1) ** -0.5)
    y = b.op(aten.addmm.default, b.input(torch.randn(n, device="cuda", dtype=torch.bfloat16)), rows,
             b.op(aten.t.default, w))
    gm = b.module(*_gated(b, y, m, n, torch.bfloat16))
    rewrite_and_check_against_eager(gm, b.inputs, f"gemm-cat-{m}x{k0}+{k1}x{n}")
    fused = [n.target.exactdit_region.region for n in gm.graph.nodes if hasattr(n.target, "exactdit_region")]
    assert any(r.kind == "gemm" and gemm.prologue(r) is not None for r in fused)
