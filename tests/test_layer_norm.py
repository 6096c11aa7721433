"""layer_norm / layer_norm_modulate: the kernel against the independent order model.

CPU eager LayerNorm uses another algorithm, so on CPU the kernel (under the interpreter) is
held bit for bit to :func:`exactdit.aten_norms.layer_norm_order_model` run with the
interpreter's ``rsqrt`` stand-in and the same FMA choices; the GPU tests
(tests/test_gpu_layer_norm.py) hold it to live CUDA eager. Kernels are called directly
(``FusedOp.fused`` / the launcher) with poisoned outputs.
"""

import itertools
import random

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.aten_norms import layer_norm_order_model
from exactdit.kernels import layer_norm as kernels
from exactdit.ops.layer_norm import LAYER_NORM, LAYER_NORM_MODULATE
from tests.conftest import DEVICE, ON_GPU
from tests.helpers import activation, assert_bits_equal, interpreter_rsqrt, modulation, rand

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU model tests; on a GPU see test_gpu_layer_norm.py")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
AFFINE = ["none", "weight", "bias", "both"]
KINDS = ["bsd", "sbd", "sbd_as_bsd", "rows", "row_slice"]


def model(x, eps, weight, bias, choices=None):
    ch = dict(kernels.CHOICES, **(choices or {}))
    return layer_norm_order_model(
        x, weight, bias, eps, rsqrt=interpreter_rsqrt, vectorized=True,
        mean_fma=ch["mean_fma"], sigma_fma=ch["sigma_fma"],
    )


def params(affine, D, dtype, g):
    w = rand((D,), dtype, DEVICE, g) if affine in ("weight", "both") else None
    b = rand((D,), dtype, DEVICE, g) if affine in ("bias", "both") else None
    return w, b


def assert_like_model(out, x, eps, w, b, what, choices=None, mod=None):
    ref = model(x, eps, w, b, choices)
    if mod is not None:
        scale, shift, upcast = mod
        ref = references.modulate(ref, scale, shift, upcast=upcast)
    assert_bits_equal(out.contiguous(), ref.contiguous(), what)


def _random_cases(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        S = rng.choice([1, 2, 3, 5])
        D = rng.choice([4, 8, 12, 64, 100, 252, 512, 516, 1000, 1536])
        yield S, rng.choice([1, 2]), D, rng.choice(DTYPES), rng.choice(AFFINE), rng.choice(KINDS)


@pytest.mark.parametrize("case", list(_random_cases(32, 0)), ids=str)
def test_layer_norm_kernel_matches_model(case):
    S, B, D, dtype, affine, kind = case
    g = torch.Generator().manual_seed(hash(case) % 2**31)
    x = activation(kind, S, B, D, dtype, DEVICE, g)
    x.add_(rand((D,), dtype, DEVICE, g, scale=4.0))  # per-channel offsets (a mean far from 0), layout kept
    w, b = params(affine, D, dtype, g)
    out = LAYER_NORM.fused(x, 1e-6, w, b)
    assert out.stride() == references.layer_norm(x, 1e-6, w, b).stride()
    assert_like_model(out, x, 1e-6, w, b, str(case))


@pytest.mark.parametrize("dtype,upcast", list(itertools.product(DTYPES, [False, True])))
def test_layer_norm_modulate_kernel_matches_model(dtype, upcast):
    g = torch.Generator().manual_seed(11 + int(upcast))
    for (kind, sk, hk), affine in zip(
        [("sbd", "inner", "inner"), ("bsd", "outer", "chunk"), ("rows", "vec", None), ("sbd_as_bsd", "full", "expanded")],
        AFFINE,
    ):
        x = activation(kind, 3, 2, 256, dtype, DEVICE, g)
        w, b = params(affine, 256, dtype, g)
        scale = modulation(sk, x.shape, dtype, DEVICE, g)
        shift = None if hk is None else modulation(hk, x.shape, dtype, DEVICE, g)
        out = LAYER_NORM_MODULATE.fused(x, 1e-5, scale, shift, w, b, upcast)
        ref = references.layer_norm_modulate(x, 1e-5, scale, shift, w, b, upcast=upcast)
        assert out.stride() == ref.stride()
        assert_like_model(out, x, 1e-5, w, b, f"{kind} {sk} {hk} {affine}", mod=(scale, shift, upcast))


@pytest.mark.parametrize("choices", [
    {"mean_fma": "second"}, {"mean_fma": "none"}, {"sigma_fma": False}, {"mean_fma": "none", "sigma_fma": False},
], ids=str)
def test_fma_choices_follow_the_model(choices):
    """Every contraction switch of the kernel matches the model's same switch (so the probe's
    answer can be applied by changing ``kernels.CHOICES`` alone)."""
    g = torch.Generator().manual_seed(5)
    x = rand((6, 1000), torch.float32, DEVICE, g) + 3.0
    for affine in ("none", "both"):
        w, b = params(affine, 1000, torch.float32, g)
        out = kernels.layer_norm(x, 1e-6, w, b, torch.full_like(x, float("nan")), choices=choices)
        assert_like_model(out, x, 1e-6, w, b, f"{choices} {affine}", choices=choices)


def test_runtime_loops(monkeypatch):
    """Rows too wide to unroll take runtime loops with the same bits."""
    monkeypatch.setattr(kernels, "MAX_UNROLL", 0)
    g = torch.Generator().manual_seed(12)
    x = rand((3, 2, 1028), torch.bfloat16, DEVICE, g) + 2.0
    w, b = params("both", 1028, torch.bfloat16, g)
    scale = modulation("outer", x.shape, torch.bfloat16, DEVICE, g)
    out = LAYER_NORM_MODULATE.fused(x, 1e-6, scale, None, w, b, True)
    assert_like_model(out, x, 1e-6, w, b, "runtime loops", mod=(scale, None, True))


def test_constant_reciprocals_are_correctly_rounded():
    """The unrolled kernel (per-element counts) and the tree of equal-count states (D % 512 == 0)
    use Python's ``1.0 / c`` rounded to fp32 as ATen's fp32 ``1.f / c`` (``div.rn``): no
    double-rounding case for the counts they can meet."""
    import numpy as np

    c = np.arange(1, kernels.MAX_CONSTANT_COUNT + 1, dtype=np.float64)
    assert np.array_equal(np.float32(1.0) / c.astype(np.float32), (1.0 / c).astype(np.float32))
    assert kernels.MAX_UNROLL * 4 <= kernels.MAX_CONSTANT_COUNT


def test_mean_fma_choice_matters():
    """The combine's FMA placement changes output bits when the combined counts differ (D not a
    multiple of 512), so the switch is not idle."""
    g = torch.Generator().manual_seed(6)
    x = rand((16, 1000), torch.float32, DEVICE, g) + 1.5  # unequal counts: nA, nB inexact
    outs = [kernels.layer_norm(x, 1e-6, None, None, torch.empty_like(x), choices={"mean_fma": m})
            for m in ("first", "second", "none")]
    assert not torch.equal(outs[0], outs[1]) or not torch.equal(outs[0], outs[2])


def test_ernie_final_norm():
    """ERNIE-Image's final norm: ``F.layer_norm(x, (4096,), None, None, 1e-6)`` on [S, B, 4096]
    bf16, then the native ``x * (1 + scale.unsqueeze(0)) + shift.unsqueeze(0)``."""
    g = torch.Generator().manual_seed(9)
    x = activation("sbd", 3, 2, 4096, torch.bfloat16, DEVICE, g)
    scale, shift = (rand((2, 4096), torch.bfloat16, DEVICE, g).unsqueeze(0) for _ in range(2))
    assert_like_model(LAYER_NORM.fused(x, 1e-6, None, None), x, 1e-6, None, None, "layer_norm")
    out = LAYER_NORM_MODULATE.fused(x, 1e-6, scale, shift, None, None, False)
    assert_like_model(out, x, 1e-6, None, None, "modulate", mod=(scale, shift, False))


def test_public_ops_take_the_fused_path():
    g = torch.Generator().manual_seed(7)
    x = activation("sbd_as_bsd", 5, 2, 128, torch.bfloat16, DEVICE, g)
    scale, shift = (modulation("inner", x.shape, torch.bfloat16, DEVICE, g) for _ in range(2))
    w = rand((128,), torch.bfloat16, DEVICE, g)
    # the gate compares against CPU eager, whose algorithm differs: compare to the model and
    # trust the kernel for this test
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EXACTDIT_TRUST", "1")
        assert_like_model(ops.layer_norm(x, 1e-6), x, 1e-6, None, None, "public layer_norm")
        out = ops.layer_norm_modulate(x, 1e-6, scale, shift, w, None)
        assert_like_model(out, x, 1e-6, w, None, "public modulate", mod=(scale, shift, False))
    rep = exactdit.report(show=False)
    assert rep["layer_norm"]["fused"] == 1 and rep["layer_norm"]["eager"] == 0
    assert rep["layer_norm_modulate"]["fused"] == 1 and rep["layer_norm_modulate"]["eager"] == 0


def test_unsupported_inputs_run_eager_with_a_reason():
    g = torch.Generator().manual_seed(8)
    x = rand((4, 100), torch.bfloat16, DEVICE, g)
    cases = {
        "non-vectorised": (rand((4, 102), torch.bfloat16, DEVICE, g), None, None),  # D % 4 != 0
        "misaligned": (rand((4 * 100 + 1,), torch.bfloat16, DEVICE, g)[1:].view(4, 100), None, None),
        "mixed": (x, rand((100,), torch.float32, DEVICE, g), None),
        "dtype": (rand((4, 100), torch.float64, DEVICE, g), None, None),
        "4-d": (rand((2, 2, 2, 100), torch.bfloat16, DEVICE, g), None, None),
        "bias only": (x, None, rand((100,), torch.bfloat16, DEVICE, g)),
    }
    for what, (xx, w, b) in cases.items():
        assert_bits_equal(ops.layer_norm(xx, 1e-5, w, b), references.layer_norm(xx, 1e-5, w, b), what)
    reasons = exactdit.report(show=False)["layer_norm"]["eager_reasons"]
    assert exactdit.report(show=False)["layer_norm"]["fused"] == 0
    assert any("non-vectorised" in r for r in reasons) and "mixed dtypes" in reasons
    assert any("bias without weight" in r for r in reasons)
    assert sum(reasons.values()) == len(cases)


def test_malformed_calls_raise():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError):
        ops.layer_norm(x, 1e-6, torch.ones(4))
    with pytest.raises(ValueError):
        ops.layer_norm_modulate(x, 1e-6, torch.ones(3, 8))
    with pytest.raises(TypeError):
        ops.layer_norm(x, None)
