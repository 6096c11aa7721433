"""head_rms_norm, rope and qk_norm_rope kernels in Triton's interpreter (CPU).

The norm reproduces ATen's CUDA ``vectorized_layer_norm_kernel``, whose reduction order differs
from ATen's CPU kernel, so on CPU it is held to an independently written order model
(``aten_norms.rms_norm_order_model``) with the interpreter's stand-in for ``rsqrt.approx``, the
correctly rounded ``1 / sqrt`` (numpy's fp32 sqrt and division are IEEE; torch's CPU sqrt is not
always correctly rounded). RoPE is elementwise, so CPU eager is its reference. Kernels are
called directly (``FusedOp.fused``), outputs poisoned (conftest).
"""

import itertools

import pytest
import torch

import exactdit
from exactdit import aten_norms, ops, references
from exactdit.ops.rope import HEAD_RMS_NORM, QK_NORM_ROPE, ROPE, _norm_support, _rope_support, _x_support
from tests.conftest import DEVICE, ON_GPU
from tests.helpers import assert_bits_equal, interpreter_rsqrt, rand

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU order-model tests (GPU runs test_gpu_rope.py)")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def norm_model(x, weight, eps=1e-6):
    return aten_norms.rms_norm_order_model(x, weight, eps, rsqrt=interpreter_rsqrt, vectorized=True)


def qkv(B, S, H, hd, dtype, g, kind):
    """q, k as the attention processor hands them over: ``unflatten`` of a Linear output, or
    views of one fused QKV projection (strided rows)."""
    if kind == "unflatten":
        q, k = (rand((B, S, H * hd), dtype, DEVICE, g).unflatten(-1, (H, -1)) for _ in range(2))
    else:  # fused projection [B, S, 3 * H * hd] chunked
        q, k, _ = rand((B, S, 3 * H * hd), dtype, DEVICE, g).chunk(3, dim=-1)
        q, k = q.unflatten(-1, (H, -1)), k.unflatten(-1, (H, -1))
    return q, k


def angles(B, S, rot, g):
    """ERNIE-Image's fp32 angle layout [B, S, 1, rot] with pairs [t0, t0, t1, t1, ...]."""
    t = torch.rand(B, S, 1, rot // 2, generator=g) * 300
    return torch.stack([t, t], dim=-1).reshape(B, S, 1, rot).to(DEVICE)


# head_rms_norm ------------------------------------------------------------------------------

# head_dim: 16 vectors (half a warp), 24 (not a power of two), 32 (one warp), 64 (two warps),
# 80 (three warps), 160 (a second pass over the 128 threads), 256 (two passes)
HEAD_DIMS = [64, 96, 128, 256, 320, 640, 1024]


@pytest.mark.parametrize("dtype,hd", list(itertools.product(DTYPES, HEAD_DIMS)), ids=str)
def test_head_rms_norm_kernel_matches_order_model(dtype, hd):
    g = torch.Generator().manual_seed(hd)
    x = rand((2, 3, 5, hd), dtype, DEVICE, g)
    w = rand((hd,), dtype, DEVICE, g)
    for weight in (w, None):
        out = HEAD_RMS_NORM.fused(x, weight, 1e-6)
        assert_bits_equal(out, norm_model(x, weight), f"weight {weight is not None}")


@pytest.mark.parametrize("shape", [(128,), (7, 128), (3, 7, 64), (1, 1, 1, 256)], ids=str)
def test_head_rms_norm_any_rank_and_eps(shape):
    g = torch.Generator().manual_seed(1)
    x = rand(shape, torch.bfloat16, DEVICE, g, scale=1e-3)  # small rows: eps matters
    w = rand(shape[-1:], torch.bfloat16, DEVICE, g)
    for eps in (1e-6, 1e-2, None):
        model = aten_norms.rms_norm_order_model(x, w, eps, rsqrt=interpreter_rsqrt, vectorized=True)
        assert_bits_equal(HEAD_RMS_NORM.fused(x, w, eps), model, f"eps {eps}")


def test_fp32_sum_of_squares_is_fused_multiply_add():
    """For fp32 rows the model's fma(v, v, acc) and a mul-then-add sum differ (the GPU probe
    found ATen uses the FMA); the kernel follows the FMA model, so this test can tell."""
    g = torch.Generator().manual_seed(2)
    x = rand((64, 8, 128), torch.float32, DEVICE, g)
    out = HEAD_RMS_NORM.fused(x, None, 1e-6)
    no_fma = aten_norms.rms_norm_order_model(x, None, 1e-6, rsqrt=interpreter_rsqrt, vectorized=True, square_fma=False)
    assert_bits_equal(out, norm_model(x, None))
    assert not torch.equal(out, no_fma)


def test_reduction_order_is_not_a_plain_sum():
    """A sequential or pairwise fp32 sum gives other rstd values for some rows: the order
    model (and kernel) is a real constraint, not a tautology."""
    g = torch.Generator().manual_seed(3)
    x = rand((512, 256), torch.float32, DEVICE, g)
    _, rstd = aten_norms.rms_norm_order_model(x, None, 1e-6, rsqrt=interpreter_rsqrt, vectorized=True, return_rstd=True)
    var = (x * x).sum(-1, keepdim=True) / torch.full_like(rstd, 256.0)
    plain = interpreter_rsqrt(var + torch.full_like(var, 1e-6))
    assert not torch.equal(rstd, plain)


# rope ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,hd,rot,kind", list(itertools.product(DTYPES, [64, 128, 256], ["full", "half"], ["unflatten", "fused"])), ids=str
)
def test_rope_kernel_matches_eager(dtype, hd, rot, kind):
    rot = hd if rot == "full" else hd // 2
    g = torch.Generator().manual_seed(hd + rot)
    x, _ = qkv(2, 9, 3, hd, dtype, g, kind)
    freqs = angles(2, 9, rot, g)
    assert_bits_equal(ROPE.fused(x, freqs), references.rope(x, freqs), "angles")
    tables = references.rope_tables(freqs, dtype)
    assert_bits_equal(ROPE.fused(x, tables), references.rope(x, tables), "tables")


@pytest.mark.parametrize("table_shape", ["bs1r", "1s1r", "sr", "r"])
def test_rope_broadcast_tables(table_shape):
    g = torch.Generator().manual_seed(4)
    B, S, H, hd = 2, 5, 4, 64
    x, _ = qkv(B, S, H, hd, torch.bfloat16, g, "unflatten")
    shape = {"bs1r": (B, S, 1, hd), "1s1r": (1, S, 1, hd), "sr": (S, 1, hd), "r": (hd,)}[table_shape]
    freqs = torch.rand(shape, generator=g).to(DEVICE) * 50
    tables = references.rope_tables(freqs, torch.bfloat16)
    assert_bits_equal(ROPE.fused(x, tables), references.rope(x, tables))
    assert_bits_equal(ROPE.fused(x, freqs), references.rope(x, freqs))


# qk_norm_rope -------------------------------------------------------------------------------


def qk_model(q, k, wq, wk, eps, tables):
    return tuple(references.rope(norm_model(x, w, eps), tables) for x, w in ((q, wq), (k, wk)))


@pytest.mark.parametrize(
    "dtype,hd,kind,weighted", list(itertools.product(DTYPES, [64, 128, 256], ["unflatten", "fused"], [True, False])), ids=str
)
def test_qk_norm_rope_kernel_matches_model(dtype, hd, kind, weighted):
    g = torch.Generator().manual_seed(hd)
    B, S, H = 2, 7, 3
    q, k = qkv(B, S, H, hd, dtype, g, kind)
    wq, wk = (rand((hd,), dtype, DEVICE, g) if weighted else None for _ in range(2))
    freqs = angles(B, S, hd, g)
    tables = references.rope_tables(freqs, dtype)
    ref = qk_model(q, k, wq, wk, 1e-6, tables)
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, tables), ref, "tables")
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, freqs), ref, "angles")


@pytest.mark.parametrize("dtype,hd", [(torch.bfloat16, 128), (torch.float32, 256), (torch.float16, 64)], ids=str)
def test_general_path_for_full_rotation(dtype, hd, monkeypatch):
    """Full rotation of a power-of-two head normally takes the halves fast path; the general
    path (partner reloads, whole-row reduction) must give the same bits."""
    from exactdit.kernels import rope as rope_kernels

    monkeypatch.setattr(rope_kernels, "HALVES", False)
    g = torch.Generator().manual_seed(hd + 1)
    q, k = qkv(2, 5, 3, hd, dtype, g, "fused")
    wq, wk = rand((hd,), dtype, DEVICE, g), rand((hd,), dtype, DEVICE, g)
    tables = references.rope_tables(angles(2, 5, hd, g), dtype)
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, tables), qk_model(q, k, wq, wk, 1e-6, tables))
    assert_bits_equal(ROPE.fused(q, tables), references.rope(q, tables))


def test_q_and_k_of_different_layouts():
    """q and k of different strides cannot share one launch; they get one each."""
    g = torch.Generator().manual_seed(11)
    q, _ = qkv(2, 5, 3, 128, torch.bfloat16, g, "unflatten")
    _, k = qkv(2, 5, 3, 128, torch.bfloat16, g, "fused")
    w = rand((128,), torch.bfloat16, DEVICE, g)
    tables = references.rope_tables(angles(2, 5, 128, g), torch.bfloat16)
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, w, w, 1e-6, tables), qk_model(q, k, w, w, 1e-6, tables))


def test_qk_norm_rope_partial_rotation_and_one_token():
    g = torch.Generator().manual_seed(5)
    for B, S, H, hd, rot in [(1, 1, 2, 128, 64), (2, 3, 1, 256, 32), (1, 4, 8, 96, 96)]:
        q, k = qkv(B, S, H, hd, torch.bfloat16, g, "unflatten")
        wq, wk = rand((hd,), torch.bfloat16, DEVICE, g), rand((hd,), torch.bfloat16, DEVICE, g)
        tables = references.rope_tables(angles(B, S, rot, g), torch.bfloat16)
        out = QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, tables)
        assert_bits_equal(out, qk_model(q, k, wq, wk, 1e-6, tables), f"{(B, S, H, hd, rot)}")


def test_output_layout_is_eagers():
    g = torch.Generator().manual_seed(6)
    q, k = qkv(2, 5, 2, 64, torch.bfloat16, g, "fused")
    tables = references.rope_tables(angles(2, 5, 64, g), torch.bfloat16)
    out_q, out_k = QK_NORM_ROPE.fused(q, k, None, None, 1e-6, tables)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert out_q.stride() == references.rope(q, tables).stride()


# public ops and the predicate ---------------------------------------------------------------


def test_public_rope_takes_the_fused_path():
    g = torch.Generator().manual_seed(7)
    q, _ = qkv(1, 6, 2, 64, torch.bfloat16, g, "unflatten")
    tables = references.rope_tables(angles(1, 6, 64, g), torch.bfloat16)
    for _ in range(2):
        assert_bits_equal(ops.rope(q, tables), references.rope(q, tables))
    rep = exactdit.report(show=False)["rope"]
    assert rep["fused"] == 2 and rep["eager"] == 0 and len(rep["verified"]) == 1


def test_norm_ops_run_eager_on_cpu():
    """The norm kernels reproduce CUDA's order, not CPU's: on CPU the public ops go eager."""
    g = torch.Generator().manual_seed(8)
    q, k = qkv(1, 3, 2, 64, torch.bfloat16, g, "unflatten")
    w = rand((64,), torch.bfloat16, DEVICE, g)
    tables = references.rope_tables(angles(1, 3, 64, g), torch.bfloat16)
    assert_bits_equal(ops.qk_norm_rope(q, k, w, w, 1e-6, tables), references.qk_norm_rope(q, k, w, w, 1e-6, tables))
    assert_bits_equal(ops.head_rms_norm(q, w, 1e-6), references.head_rms_norm(q, w, 1e-6))
    rep = exactdit.report(show=False)
    assert rep["qk_norm_rope"]["fused"] == 0 and rep["head_rms_norm"]["fused"] == 0


@pytest.mark.parametrize(
    "case,reason",
    [
        ("weight_fp32", "weight dtype differs"),
        ("head_dim_30", "multiple of 4"),
        ("misaligned", "16-byte aligned"),
        ("odd_rot", "rotary width"),
        ("table_dtype", "another dtype"),
    ],
)
def test_unsupported_inputs_are_named(case, reason):
    """What ATen would run differently (or the kernel cannot take) goes eager, with a reason.
    The predicates only look at metadata, so their device-independent parts run here."""
    g = torch.Generator().manual_seed(9)
    hd = 30 if case == "head_dim_30" else 64
    q, _ = qkv(1, 3, 2, hd, torch.bfloat16, g, "unflatten")
    w = rand((hd,), torch.float32 if case == "weight_fp32" else torch.bfloat16, DEVICE, g)
    if case == "misaligned":
        q = rand((1 + 3 * 2 * hd,), torch.bfloat16, DEVICE, g)[1:].view(1, 3, 2, hd)
    rot = hd
    tables = references.rope_tables(angles(1, 3, rot, g), torch.float32 if case == "table_dtype" else torch.bfloat16)
    if case == "odd_rot":
        tables = tuple(t[..., :61] for t in tables)
    got = _x_support(q, "q") or _norm_support(q, w, "q") or _rope_support(q, tables)
    assert got is not None and reason in got, got
