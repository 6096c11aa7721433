"""GPU-only: the LayerNorm kernels against live CUDA eager ``F.layer_norm`` (+ modulation).

Run on the device: ``python -m pytest -m gpu tests/test_gpu_layer_norm.py``. Outputs are
poisoned (conftest) and the kernels are called directly, so neither unwritten elements nor the
gate's fallback can hide an error; the public ops are checked to take the fused path.
"""

import random

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.ops.layer_norm import LAYER_NORM, LAYER_NORM_MODULATE
from tests.helpers import assert_bits_equal

pytestmark = pytest.mark.gpu
# Each (dtype, width, affine, modulation) is its own compilation: the case lists are kept short.

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS = [1, 2, 17, 255, 4224, 8448, 4097]
# multiples of 512 (every thread has the same count), other multiples of 4 (unequal counts)
WIDTHS = [64, 1536, 3072, 4096, 5120, 6144, 4, 12, 100, 1000, 2052, 4100, 6148]
AFFINE = ["none", "weight", "both"]  # bias-only runs eager (see ops.layer_norm)


def _x(rows, D, dtype, g, layout):
    """Rows with a per-channel offset and a per-row spread: means far from 0, varied scales."""
    spread = torch.exp2(torch.randint(-4, 5, (rows, 1), device="cuda", generator=g).float())
    base = torch.randn(rows, D, device="cuda", generator=g) * spread
    base = base + 3 * torch.randn(D, device="cuda", generator=g)
    if layout == "sbd_as_bsd" and rows % 2 == 0:  # ERNIE-Image's permuted view
        return base.to(dtype).view(rows // 2, 2, D).permute(1, 0, 2)
    if layout == "row_slice":
        return torch.cat([base, base], dim=1).to(dtype)[:, :D]
    return base.to(dtype)


def _params(affine, D, dtype, g):
    w = (1 + 0.5 * torch.randn(D, device="cuda", generator=g)).to(dtype) if affine != "none" else None
    b = torch.randn(D, device="cuda", generator=g).to(dtype) if affine == "both" else None
    return w, b


def _cases(n, seed):
    rng = random.Random(seed)
    for i in range(n):
        rows = ROWS[i % len(ROWS)]
        D = WIDTHS[i % len(WIDTHS)]  # every width at least twice, with varying row counts
        if rows >= 4224 and D > 4096:
            rows = 255  # keeps the run short; the full-size rows are covered at D = 4096 below
        yield rows, D, rng.choice(DTYPES), rng.choice(AFFINE), rng.choice(["rows", "sbd_as_bsd", "row_slice"])


@pytest.mark.parametrize("case", list(_cases(36, 0)), ids=str)
def test_layer_norm_matches_eager(case):
    rows, D, dtype, affine, layout = case
    g = torch.Generator(device="cuda").manual_seed(hash(case) % 2**31)
    x = _x(rows, D, dtype, g, layout)
    w, b = _params(affine, D, dtype, g)
    eps = 1e-6 if dtype != torch.float16 else 1e-5
    assert LAYER_NORM.unsupported(x, eps, w, b) is None
    assert_bits_equal(LAYER_NORM.fused(x, eps, w, b), references.layer_norm(x, eps, w, b), str(case))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("upcast", [False, True])
def test_layer_norm_modulate_matches_eager(dtype, upcast):
    g = torch.Generator(device="cuda").manual_seed(3 + int(upcast))
    for (rows, D), affine, (sk, with_shift) in zip(
        [(4224, 4096), (255, 3072), (17, 1000)],
        ["none", "both", "weight"],
        [("inner", True), ("vec", True), ("full", False)],
    ):
        x = _x(rows, D, dtype, g, "sbd_as_bsd" if rows % 2 == 0 else "rows")
        w, b = _params(affine, D, dtype, g)
        shape = x.shape
        if sk == "inner":  # [1, B, D] (or [1, D]) under the activation: Flux/ERNIE style vectors
            scale, shift = (torch.randn((1,) + tuple(shape[1:]), device="cuda", generator=g).to(dtype) for _ in range(2))
        elif sk == "vec":
            scale, shift = (torch.randn(D, device="cuda", generator=g).to(dtype) for _ in range(2))
        else:
            scale, shift = (torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(2))
        shift = shift if with_shift else None
        out = LAYER_NORM_MODULATE.fused(x, 1e-6, scale, shift, w, b, upcast)
        ref = references.layer_norm_modulate(x, 1e-6, scale, shift, w, b, upcast=upcast)
        assert_bits_equal(out, ref, f"{rows}x{D} {affine} {sk} shift={with_shift}")


def test_ernie_final_norm_through_the_public_ops():
    """``F.layer_norm(x, (4096,), None, None, 1e-6)`` on [S, B, 4096] bf16, then the native
    ``x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)``, B = 1 and 2."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (1, 2):
        x = torch.randn(4224, B, 4096, device="cuda", generator=g).to(torch.bfloat16)
        scale, shift = torch.randn(B, 2 * 4096, device="cuda", generator=g).to(torch.bfloat16).chunk(2, dim=-1)
        scale, shift = scale.unsqueeze(0), shift.unsqueeze(0)
        assert_bits_equal(ops.layer_norm(x, 1e-6), references.layer_norm(x, 1e-6))
        out = ops.layer_norm_modulate(x, 1e-6, scale, shift)
        assert_bits_equal(out, references.layer_norm_modulate(x, 1e-6, scale, shift))
    rep = exactdit.report(show=False)
    assert rep["layer_norm"]["fused"] == 2 and rep["layer_norm"]["eager"] == 0
    assert rep["layer_norm_modulate"]["fused"] == 2 and rep["layer_norm_modulate"]["eager"] == 0
    assert not rep["layer_norm"]["disabled"] and not rep["layer_norm_modulate"]["disabled"]


def test_eager_only_cases_stay_exact():
    """What the predicate sends to eager still returns eager's bits, with a reason."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(64, 4095, device="cuda", generator=g).to(torch.bfloat16)  # ATen's other path
    assert_bits_equal(ops.layer_norm(x, 1e-6), references.layer_norm(x, 1e-6))
    x = torch.randn(64, 4096, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(4096, device="cuda", generator=g).to(torch.bfloat16)
    assert_bits_equal(ops.layer_norm(x, 1e-6, None, b), references.layer_norm(x, 1e-6, None, b))
    reasons = exactdit.report(show=False)["layer_norm"]["eager_reasons"]
    assert sum(reasons.values()) == 2


def test_bias_only_kernel_status():
    """Records whether the order model's bias-only expression (kept in the kernel, not used by
    the op) matches eager; xfail until the probe pins it down."""
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(255, 4096, device="cuda", generator=g)
    b = torch.randn(4096, device="cuda", generator=g)
    ok = torch.equal(LAYER_NORM.fused(x, 1e-6, None, b), references.layer_norm(x, 1e-6, None, b))
    if not ok:
        pytest.xfail("bias-only expression not reproduced (known; the op runs eager for it)")
