"""GPU-only: head_rms_norm, rope and qk_norm_rope kernels against live CUDA eager.

Run on the device: ``python -m pytest -m gpu tests/test_gpu_rope.py``. Kernels are called
directly (``FusedOp.fused``) with poisoned outputs (conftest), then the public ops are checked
to take the fused path. Shapes: ERNIE-Image's 32 heads x 128 at S = 4224 (+1), and other head
layouts; few dtype x head_dim combinations so that few kernels compile.
"""

import itertools

import pytest
import torch
from diffusers.models.transformers.transformer_ernie_image import ErnieImageEmbedND3

import exactdit
from exactdit import ops, references
from exactdit.ops.rope import HEAD_RMS_NORM, QK_NORM_ROPE, ROPE
from tests.helpers import assert_bits_equal

pytestmark = pytest.mark.gpu

HEADS = [(32, 128), (24, 64), (8, 256)]


def projections(B, S, H, hd, dtype, kind, seed):
    """q, k as the processor makes them: ``unflatten`` of a Linear output, or chunks of one
    fused QKV projection. Values like a Linear output (N(0, 1) times a per-channel scale)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 5, (H * hd,), device="cuda", generator=g).float())
    if kind == "unflatten":
        q, k = ((torch.randn(B, S, H * hd, device="cuda", generator=g) * scale).to(dtype) for _ in range(2))
    else:
        big = (torch.randn(B, S, 3, H * hd, device="cuda", generator=g) * scale).to(dtype).flatten(-2)
        q, k, _ = big.chunk(3, dim=-1)
    return q.unflatten(-1, (H, -1)), k.unflatten(-1, (H, -1))


def ernie_angles(B, S, hd, seed):
    """ERNIE-Image's fp32 angles [B, S, 1, hd]: its own embedder for head_dim 128 (image grid
    positions plus text positions), random pairs otherwise."""
    if hd == 128:
        side = max(1, int(S**0.5))
        ids = torch.zeros(B, S, 3, device="cuda")
        pos = torch.arange(S, device="cuda")
        ids[..., 0] = (pos >= side * side).float() * 64
        ids[..., 1] = (pos // side).float()
        ids[..., 2] = (pos % side).float()
        return ErnieImageEmbedND3(dim=hd, theta=256, axes_dim=(32, 48, 48))(ids)
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.rand(B, S, 1, hd // 2, device="cuda", generator=g) * 4000
    return torch.stack([t, t], dim=-1).reshape(B, S, 1, hd)


def weight(hd, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (1 + 0.5 * torch.randn(hd, device="cuda", generator=g)).to(dtype)


def _cases():
    for B, S, (H, hd) in itertools.product([1, 2], [1, 77, 1024, 4225], HEADS):
        yield B, S, H, hd, torch.bfloat16, "unflatten" if S != 77 else "fused_qkv"
    for dtype, (H, hd) in itertools.product([torch.float16, torch.float32], [HEADS[0], HEADS[2]]):
        yield 2, 4224, H, hd, dtype, "unflatten"
        yield 1, 77, H, hd, dtype, "fused_qkv"


@pytest.mark.parametrize("case", list(_cases()), ids=str)
def test_qk_norm_rope_bit_exact(case):
    B, S, H, hd, dtype, kind = case
    q, k = projections(B, S, H, hd, dtype, kind, seed=S + hd)
    wq, wk = weight(hd, dtype, 1), weight(hd, dtype, 2)
    freqs = ernie_angles(B, S, hd, seed=S)
    tables = references.rope_tables(freqs, dtype)
    ref = references.qk_norm_rope(q, k, wq, wk, 1e-6, freqs)
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, tables), ref, "qk_norm_rope tables")
    assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, 1e-6, freqs), ref, "qk_norm_rope angles")
    if kind == "unflatten":  # the halves alone (head_rms_norm takes contiguous x)
        assert_bits_equal(HEAD_RMS_NORM.fused(q, wq, 1e-6), references.head_rms_norm(q, wq, 1e-6), "head_rms_norm")
    assert_bits_equal(ROPE.fused(q, tables), references.rope(q, tables), "rope")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_no_weight_partial_rotation_and_eps(dtype):
    q, k = projections(2, 300, 4, 128, dtype, "unflatten", seed=3)
    q = q * 1e-3  # small rows: eps matters
    tables = references.rope_tables(ernie_angles(2, 300, 64, seed=4), dtype)
    for wq, wk, eps in [(None, None, 1e-6), (weight(128, dtype, 5), weight(128, dtype, 6), 1e-2), (None, None, None)]:
        ref = references.qk_norm_rope(q, k, wq, wk, eps, tables)
        assert_bits_equal(QK_NORM_ROPE.fused(q, k, wq, wk, eps, tables), ref, f"eps {eps}")


def test_public_op_at_production_shape_takes_the_fused_path():
    for B in (1, 2):
        q, k = projections(B, 4224, 32, 128, torch.bfloat16, "unflatten", seed=B)
        wq, wk = weight(128, torch.bfloat16, 7), weight(128, torch.bfloat16, 8)
        tables = references.rope_tables(ernie_angles(B, 4224, 128, seed=0), torch.bfloat16)
        for _ in range(2):
            out = ops.qk_norm_rope(q, k, wq, wk, 1e-6, tables)
            assert_bits_equal(out, references.qk_norm_rope(q, k, wq, wk, 1e-6, tables))
    rep = exactdit.report(show=False)["qk_norm_rope"]
    assert rep["fused"] == 4 and rep["eager"] == 0 and not rep["disabled"]


def test_what_aten_runs_differently_goes_eager():
    q, k = projections(1, 64, 4, 128, torch.bfloat16, "unflatten", seed=9)
    tables = references.rope_tables(ernie_angles(1, 64, 128, seed=0), torch.bfloat16)
    w32 = weight(128, torch.float32, 1)  # ATen's composite rms_norm
    assert_bits_equal(ops.qk_norm_rope(q, k, w32, w32, 1e-6, tables), references.qk_norm_rope(q, k, w32, w32, 1e-6, tables))
    flat = torch.randn(1 + q.numel(), device="cuda").to(torch.bfloat16)[1:].view(q.shape)  # misaligned
    w = weight(128, torch.bfloat16, 2)
    assert_bits_equal(ops.head_rms_norm(flat, w, 1e-6), references.head_rms_norm(flat, w, 1e-6))
    rep = exactdit.report(show=False)
    assert rep["qk_norm_rope"]["fused"] == 0 and rep["head_rms_norm"]["fused"] == 0
