"""GPU-only: the RMSNorm kernels against live CUDA eager (diffusers' decomposed RMSNorm).

Run on the device: ``python -m pytest -m gpu tests/test_gpu_rms_norm.py``. Outputs are poisoned
(conftest) and the kernels are called directly (``FusedOp.fused``), so neither unwritten
elements nor the gate's fallback can hide an error; the public ops are checked to take the fused
path. Inputs have a large dynamic range (rows scaled by powers of two from 2**-12 to 2**12).
"""

import itertools

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.ops.rms_norm import GATED_RMS_NORM_MODULATE, RMS_NORM, RMS_NORM_MODULATE, reduce_config
from tests.helpers import assert_bits_equal

pytestmark = pytest.mark.gpu

EPS = 1e-6
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHTS = [None, torch.bfloat16, torch.float16, torch.float32]
ROW_COUNTS = [1, 2, 3, 17, 255, 256, 511, 512, 4224]
WIDTHS = [64, 128, 1000, 1536, 3072, 4096, 5120, 6144, 8192, 12288, 16384]
# scalar path below 128; above, D % 4 == 0 and misaligned rows (D % 4 != 0)
ODD_WIDTHS = [65, 100, 127, 132, 1028, 4100, 130, 1001, 4095, 8191]


def _rows(shape, dtype, seed, top=12):
    """Random values, whole rows scaled by 2**k (k in [-12, top]), elements by 2**[-3, 3]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g)
    k = torch.randint(-12, top + 1, shape[:-1] + (1,), device="cuda", generator=g).float()
    e = torch.randint(-3, 4, shape, device="cuda", generator=g).float()
    return (x * torch.exp2(k + e)).to(dtype)


def _weight(wdtype, D, seed):
    if wdtype is None:
        return None
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (1 + 0.5 * torch.randn(D, device="cuda", generator=g)).to(wdtype)


def _check_norm(x, w):
    assert not isinstance(reduce_config(x), str), reduce_config(x)
    assert_bits_equal(RMS_NORM.fused(x, w, EPS), references.rms_norm(x, w, EPS), f"{tuple(x.shape)} {reduce_config(x).short()}")


@pytest.mark.parametrize("D", WIDTHS + ODD_WIDTHS)
def test_rms_norm_every_row_count(D):
    """bf16 x, bf16 weight: every row count class (ATen's launch shape changes with M)."""
    w = _weight(torch.bfloat16, D, D)
    for M in ROW_COUNTS:
        _check_norm(_rows((M, D), torch.bfloat16, M * 7 + D), w)
    # B x S layouts with B = 2: [2, S, D], [S, 2, D], and the permuted [S, 2, D] -> [2, S, D] view
    for S in (1, 3, 256, 4224):
        x = _rows((2, S, D), torch.bfloat16, S + D)
        _check_norm(x, w)
        _check_norm(x.transpose(0, 1).contiguous(), w)
        _check_norm(x.transpose(0, 1).contiguous().permute(1, 0, 2), w)


@pytest.mark.parametrize("xdtype,wdtype", list(itertools.product(DTYPES, WEIGHTS)), ids=str)
def test_rms_norm_dtype_combinations(xdtype, wdtype):
    top = 2 if xdtype == torch.float16 else 12
    shapes = [(4224, 4096), (3, 100)]
    if wdtype == xdtype or wdtype is None:  # fewer compilations for the other launch shapes
        shapes += [(1, 3072), (17, 8192), (255, 1001)]
    for M, D in shapes:
        _check_norm(_rows((M, D), xdtype, M + D, top=top), _weight(wdtype, D, D))
    _check_norm(_rows((2, 300, 1536), xdtype, 5, top=top)[:, ::2], _weight(wdtype, 1536, 1))  # strided rows


def _mod(kind, shape, dtype, seed):
    """Modulation vectors in model layouts: [D], [B, 1, D] (outer), chunk view of [B, 1, 3D]."""
    B, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (0.3 * torch.randn(*s, device="cuda", generator=g)).to(dtype)  # noqa: E731
    if kind == "vec":
        return r(D)
    if kind == "outer":
        return r(B, 1, D)
    if kind == "chunk":
        return r(B, 1, 3 * D).chunk(3, dim=-1)[1]
    if kind == "full":
        return r(B, S, D)
    raise ValueError(kind)


MOD_CASES = [
    # (B, S, D, x dtype, weight dtype, scale kind, shift kind, upcast)
    (2, 4224, 4096, torch.bfloat16, None, "outer", "outer", True),  # ERNIE-Image adaLN
    (2, 4224, 4096, torch.bfloat16, torch.bfloat16, "chunk", "chunk", False),
    (1, 4224, 3072, torch.bfloat16, torch.bfloat16, "vec", None, False),
    (2, 17, 8192, torch.float16, torch.float16, "full", "vec", True),
    (2, 1, 1536, torch.float32, torch.float32, "outer", "chunk", False),
    (1, 255, 100, torch.bfloat16, torch.float32, "vec", "vec", True),
    (2, 3, 12288, torch.bfloat16, None, "chunk", None, True),
]


@pytest.mark.parametrize("case", MOD_CASES, ids=str)
def test_rms_norm_modulate_and_gated(case):
    B, S, D, dtype, wdtype, sk, hk, upcast = case
    top = 2 if dtype == torch.float16 else 12
    x = _rows((B, S, D), dtype, S + D, top=top)
    w = _weight(wdtype, D, D)
    ydtype = dtype if w is None else w.dtype
    scale = _mod(sk, (B, S, D), ydtype, 1)
    shift = None if hk is None else _mod(hk, (B, S, D), ydtype, 2)
    for xv in (x, x.transpose(0, 1).contiguous().permute(1, 0, 2)):  # dense and permuted views
        out = RMS_NORM_MODULATE.fused(xv, w, EPS, scale, shift, upcast)
        assert_bits_equal(out, references.rms_norm_modulate(xv, w, EPS, scale, shift, upcast=upcast), "modulate")
    update = _rows((B, S, D), dtype, 3, top=top - 4)
    gate = _mod(sk, (B, S, D), dtype, 4)
    out, res = GATED_RMS_NORM_MODULATE.fused(x, update, gate, w, EPS, scale, shift, upcast)
    ref_out, ref_res = references.gated_rms_norm_modulate(x, update, gate, w, EPS, scale, shift, upcast=upcast)
    assert_bits_equal(res, ref_res, "new residual")
    assert_bits_equal(out, ref_out, "gated out")


def test_public_ops_take_the_fused_path():
    x = _rows((2, 4224, 4096), torch.bfloat16, 9)
    u = _rows((2, 4224, 4096), torch.bfloat16, 10, top=6)
    vec = _mod("outer", x.shape, torch.bfloat16, 11)
    for _ in range(2):  # verified call, then trusted call
        assert torch.equal(ops.rms_norm(x, None, EPS), references.rms_norm(x, None, EPS))
        assert torch.equal(
            ops.rms_norm_modulate(x, None, EPS, vec, vec, upcast=True),
            references.rms_norm_modulate(x, None, EPS, vec, vec, upcast=True),
        )
        out, res = ops.gated_rms_norm_modulate(x, u, vec, None, EPS, vec, vec, upcast=True)
        ref_out, ref_res = references.gated_rms_norm_modulate(x, u, vec, None, EPS, vec, vec, upcast=True)
        assert torch.equal(out, ref_out) and torch.equal(res, ref_res)
    rep = exactdit.report(show=False)
    for name in ("rms_norm", "rms_norm_modulate", "gated_rms_norm_modulate"):
        assert rep[name]["fused"] == 2 and rep[name]["eager"] == 0 and not rep[name]["disabled"], (name, rep[name])


def test_misaligned_strided_rows():
    """D % 4 != 0 with strided (non-dense) rows: ATen's fp32 copy is contiguous."""
    x = _rows((600, 4095), torch.bfloat16, 2)[::2]
    _check_norm(x, None)
    _check_norm(_rows((3, 40, 1001), torch.bfloat16, 3)[:, 5:30], _weight(torch.bfloat16, 1001, 1))


def test_unemulated_layouts_run_eager():
    # misaligned rows of a non-dense permuted view: the fp32 copy's layout is not modelled
    x = _rows((17, 4, 4095), torch.bfloat16, 1)[:, ::2].permute(1, 0, 2)
    assert "misaligned" in RMS_NORM.unsupported(x, None, EPS)
    assert torch.equal(ops.rms_norm(x, None, EPS), references.rms_norm(x, None, EPS))
    assert exactdit.report(show=False)["rms_norm"]["eager"] == 1
