"""rms_norm, rms_norm_modulate, gated_rms_norm_modulate: kernels against an independent CPU model.

Under the interpreter the kernels must equal, bit for bit, a pure-PyTorch model of the whole
chain: the variance from :func:`exactdit.aten_reduce.mean_lastdim_reference_order` (ATen's order
of additions for the *real* row count M), ``rsqrt`` replaced by the interpreter's stand-in
(correctly rounded ``1 / sqrt``), then the eager reference's elementwise tail. On a GPU the
same tests run against the model with CUDA's rsqrt unavailable, so they are CPU-only; the GPU
tests (test_gpu_rms_norm.py) compare against live eager instead.
"""

import random

import pytest
import torch

import exactdit
from exactdit import gate, ops, references
from exactdit.aten_reduce import mean_lastdim_config, mean_lastdim_reference_order
from exactdit.ops.rms_norm import GATED_RMS_NORM_MODULATE, RMS_NORM, RMS_NORM_MODULATE, reduce_config
from tests.conftest import DEVICE, ON_GPU
from tests.helpers import MODULATION_KINDS, activation, assert_bits_equal, modulation

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU model uses the interpreter's rsqrt stand-in")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHTS = [None, torch.bfloat16, torch.float16, torch.float32]
KINDS = ["bsd", "sbd", "sbd_as_bsd", "rows", "row_slice"]
EPS = 1e-6


def model_variance(x: torch.Tensor) -> torch.Tensor:
    """``x.float().pow(2).mean(-1, keepdim=True)`` in ATen's CUDA order for the real M.

    Where each row starts in ATen's fp32 copy decides its misalignment when D % 4 != 0; the
    copy's layout is taken from CPU eager (``.to`` and ``pow`` pick layouts the same way on
    every device) and handed to the order model as storage row numbers."""
    D = x.shape[-1]
    c = x.float()
    sq = c.pow(2)
    lead = sq.shape[:-1]
    offsets = torch.zeros(lead, dtype=torch.int64)
    for d, (n, st) in enumerate(zip(lead, sq.stride()[:-1])):
        shape = [1] * len(lead)
        shape[d] = n
        offsets = offsets + torch.arange(n).reshape(shape) * st
    offsets = offsets.reshape(-1)
    M = offsets.numel()
    assert torch.equal(torch.sort(offsets).values, torch.arange(M) * D), "fp32 copy is not dense"
    var = mean_lastdim_reference_order((c * c).reshape(M, D), num_rows=M, row_index=offsets // D)
    return var.reshape(*x.shape[:-1], 1)


def model_rms_norm(x, weight, eps):
    """The reference chain with the model variance and the interpreter's rsqrt."""
    var = model_variance(x)
    # interpreter rsqrt: fp32 sqrt correctly rounded, then 1 / s correctly rounded. Both are
    # done in float64 and rounded once to fp32, which is exact for these two operations
    # (torch's CPU fp32 sqrt is not always correctly rounded).
    s = torch.sqrt((var + torch.tensor(eps, dtype=torch.float32)).double()).float()
    rstd = (1.0 / s.double()).float()
    h = x * rstd
    if weight is None:
        return h.to(x.dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return h * weight


def _rows_with_range(x, g):
    """Scale whole rows by powers of two so rows differ in magnitude (large dynamic range)."""
    lead = x.shape[:-1]
    top = 2 if x.dtype == torch.float16 else 9  # fp16: stay finite through the gated product
    k = torch.randint(-8, top, lead + (1,), generator=g).float()
    return (x.float() * torch.exp2(k)).to(x.dtype)


def _x(kind, S, B, D, dtype, g):
    x = activation(kind, S, B, D, dtype, DEVICE, g)
    if kind in ("rows", "row_slice"):
        return x  # keep the view (row_slice is a strided view)
    return _rows_with_range(x, g) if kind != "sbd_as_bsd" else _rows_with_range(x.permute(1, 0, 2), g).permute(1, 0, 2)


def _weight(wdtype, D, g):
    if wdtype is None:
        return None
    return (1 + 0.5 * torch.randn(D, generator=g)).to(wdtype)


# (S, B, D): one to a few rows, 255..513 rows, scalar path (D < 128), non-powers of two, and
# D = 8192 with few rows (warps split the row: T = 512).
FIXED = [
    (1, 1, 64), (1, 1, 100), (1, 2, 127), (3, 1, 72), (17, 1, 96), (255, 2, 65),
    (1, 1, 128), (2, 1, 132), (3, 1, 1000), (17, 1, 1536), (1, 1, 2048), (1, 1, 2100),
    (255, 1, 256), (128, 2, 200), (256, 1, 384), (511, 1, 128), (171, 3, 160), (513, 1, 256),
    (2, 1, 8192), (5, 1, 8192), (17, 1, 8192),
    # D % 4 != 0 on the vectorized path: rows start misaligned in ATen's fp32 copy
    (3, 2, 130), (17, 1, 1001), (5, 2, 4095), (1, 1, 255), (2, 1, 8191), (255, 1, 131), (7, 2, 514),
]


def _cases():
    rng = random.Random(11)
    for i, (S, B, D) in enumerate(FIXED):
        yield S, B, D, DTYPES[i % 3], WEIGHTS[i % 4], KINDS[i % 5]
    for _ in range(10):
        S = rng.choice([1, 2, 3, 17, 255, 256, 300, 511, 512])
        B = rng.choice([1, 2]) if S < 300 else 1
        D = rng.choice([64, 80, 120, 128, 129, 260, 511, 512, 776, 1001, 1024, 1500, 2051])
        yield S, B, D, rng.choice(DTYPES), rng.choice(WEIGHTS), rng.choice(KINDS)


def _id(case):
    S, B, D, dt, wdt, kind = case
    return f"{S}x{B}x{D}-{str(dt)[6:]}-w{str(wdt)[6:] if wdt else 'none'}-{kind}"


@pytest.mark.parametrize("case", list(_cases()), ids=_id)
def test_rms_norm_kernel_matches_model(case):
    S, B, D, dtype, wdtype, kind = case
    g = torch.Generator().manual_seed(S * 131 + D)
    x = _x(kind, S, B, D, dtype, g)
    w = _weight(wdtype, D, g)
    assert not isinstance(reduce_config(x), str)
    out = RMS_NORM.fused(x, w, EPS)
    assert_bits_equal(out, model_rms_norm(x, w, EPS), f"config {reduce_config(x).short()}")
    # dtype and layout as eager
    ref = references.rms_norm(x, w, EPS)
    assert out.dtype == ref.dtype and out.stride() == ref.stride()


def _mod_cases():
    rng = random.Random(5)
    shapes = [(1, 1, 64), (3, 2, 256), (17, 2, 1001), (255, 1, 130), (4, 2, 96), (2, 1, 8192), (300, 1, 512), (5, 2, 1535)]
    for i, (S, B, D) in enumerate(shapes):
        yield (S, B, D, DTYPES[i % 3], WEIGHTS[(i + 1) % 4], KINDS[i % 5], MODULATION_KINDS[i % 6],
               MODULATION_KINDS[(i + 2) % 6] if i % 4 else None, bool(i % 2), rng.random() < 0.5)


def _mod_id(case):
    S, B, D, dt, wdt, kind, sk, hk, upcast, _ = case
    return f"{S}x{B}x{D}-{str(dt)[6:]}-w{str(wdt)[6:] if wdt else 'none'}-{kind}-{sk}-{hk}-up{int(upcast)}"


@pytest.mark.parametrize("case", list(_mod_cases()), ids=_mod_id)
def test_rms_norm_modulate_kernel_matches_model(case):
    S, B, D, dtype, wdtype, kind, sk, hk, upcast, _ = case
    g = torch.Generator().manual_seed(S * 17 + D)
    x = _x(kind, S, B, D, dtype, g)
    w = _weight(wdtype, D, g)
    y = model_rms_norm(x, w, EPS)
    mdtype = y.dtype if not upcast else DTYPES[(S + D) % 3]  # the fp32 chain takes any dtype
    scale = modulation(sk, x.shape, mdtype, DEVICE, g)
    shift = None if hk is None else modulation(hk, x.shape, mdtype, DEVICE, g)
    assert RMS_NORM_MODULATE.unsupported(x, w, EPS, scale, shift, upcast) is None
    out = RMS_NORM_MODULATE.fused(x, w, EPS, scale, shift, upcast)
    assert_bits_equal(out, references.modulate(y, scale, shift, upcast=upcast), "rms_norm_modulate")


@pytest.mark.parametrize("case", list(_mod_cases()), ids=_mod_id)
def test_gated_rms_norm_modulate_kernel_matches_model(case):
    S, B, D, dtype, wdtype, kind, sk, hk, upcast, _ = case
    g = torch.Generator().manual_seed(S * 19 + D)
    residual = _x(kind, S, B, D, dtype, g)
    update = _x(kind, S, B, D, dtype, g)
    if dtype == torch.float16:
        update = update / 256  # keep gate * update finite
    gate = modulation(MODULATION_KINDS[(S + D) % 6], residual.shape, dtype, DEVICE, g)
    w = _weight(wdtype, D, g)
    new_residual = references.residual_gate_add(residual, update, gate)
    y = model_rms_norm(new_residual, w, EPS)
    scale = modulation(sk, residual.shape, y.dtype, DEVICE, g)
    shift = None if hk is None else modulation(hk, residual.shape, y.dtype, DEVICE, g)
    out, res = GATED_RMS_NORM_MODULATE.fused(residual, update, gate, w, EPS, scale, shift, upcast)
    assert_bits_equal(res, new_residual, "new residual")
    assert_bits_equal(out, references.modulate(y, scale, shift, upcast=upcast), "out")


def test_row_count_changes_the_bits_and_the_kernel_follows():
    """The same rows reduced as part of M = 255 or M = 1 rows get different variances in ATen's
    order (T = 32 vs T = 512 threads per row); the kernel follows the real M."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(255, 2048, generator=g)  # fp32 output: a 1-ulp variance change shows
    assert mean_lastdim_config(255, 2048).threads_per_row != mean_lastdim_config(1, 2048).threads_per_row
    as_255 = model_rms_norm(x, None, EPS)
    as_1 = torch.cat([model_rms_norm(x[i : i + 1], None, EPS) for i in range(x.shape[0])])
    assert not torch.equal(as_255, as_1)
    assert_bits_equal(RMS_NORM.fused(x, None, EPS), as_255, "M = 255")
    assert_bits_equal(RMS_NORM.fused(x[:1], None, EPS), model_rms_norm(x[:1], None, EPS), "M = 1")


def test_public_ops_take_the_fused_path(monkeypatch):
    g = torch.Generator().manual_seed(4)
    x = activation("sbd", 9, 2, 256, torch.bfloat16, DEVICE, g)
    u = activation("sbd", 9, 2, 256, torch.bfloat16, DEVICE, g)
    vec = modulation("inner", x.shape, torch.bfloat16, DEVICE, g)
    w = _weight(torch.bfloat16, 256, g)
    # The gate cannot verify CUDA numerics against CPU eager: without EXACTDIT_TRUST a CPU call
    # runs eager, and says why.
    assert torch.equal(ops.rms_norm(x, w, EPS), references.rms_norm(x, w, EPS))
    assert exactdit.report(show=False)["rms_norm"]["eager_reasons"] == {gate.CPU_NUMERICS: 1}
    gate.reset()
    # Trusted, the public ops run the kernels, which follow the CUDA order model.
    monkeypatch.setenv("EXACTDIT_TRUST", "1")
    assert_bits_equal(ops.rms_norm(x, w, EPS), model_rms_norm(x, w, EPS))
    y = model_rms_norm(x, None, EPS)
    assert_bits_equal(ops.rms_norm_modulate(x, None, EPS, vec, vec, upcast=True), references.modulate(y, vec, vec, upcast=True))
    out, res = ops.gated_rms_norm_modulate(x, u, vec, w, EPS, vec)
    nr = references.residual_gate_add(x, u, vec)
    assert_bits_equal(res, nr)
    assert_bits_equal(out, references.modulate(model_rms_norm(nr, w, EPS), vec))
    rep = exactdit.report(show=False)
    for name in ("rms_norm", "rms_norm_modulate", "gated_rms_norm_modulate"):
        assert rep[name]["fused"] == 1 and rep[name]["eager"] == 0, (name, rep[name])


def test_unreproduced_configs_run_eager_with_a_reason():
    g = torch.Generator().manual_seed(1)
    # misaligned rows (D % 4 != 0) of a non-dense permuted view: fp32 copy layout not modelled
    x = torch.randn(5, 4, 130, generator=g).to(torch.bfloat16)[:, ::2].permute(1, 0, 2)
    assert "misaligned" in RMS_NORM.unsupported(x, None, EPS)
    assert torch.equal(ops.rms_norm(x, None, EPS), references.rms_norm(x, None, EPS))
    rep = exactdit.report(show=False)["rms_norm"]
    assert rep["fused"] == 0 and any("misaligned" in r for r in rep["eager_reasons"])
    huge = torch.zeros(1, 1024, dtype=torch.bfloat16).expand(2**20, 1024)  # M * D = 2**30: 32-bit split
    assert "32-bit" in RMS_NORM.unsupported(huge, None, EPS)
    # native modulation needs the norm's result dtype
    scale = torch.zeros(64, dtype=torch.bfloat16)
    x64 = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    assert "mixed" in RMS_NORM_MODULATE.unsupported(x64, torch.ones(64), EPS, scale, None, False)
    assert RMS_NORM_MODULATE.unsupported(x64, torch.ones(64), EPS, scale, None, True) is None


def test_signature_holds_the_emulated_config_not_m():
    a = torch.zeros(300, 1024, dtype=torch.bfloat16)
    b = torch.zeros(400, 1024, dtype=torch.bfloat16)  # same config (T = 32)
    c = torch.zeros(3, 1024, dtype=torch.bfloat16)  # T = 128
    assert RMS_NORM.signature(a, None, EPS) == RMS_NORM.signature(b, None, EPS)
    assert RMS_NORM.signature(a, None, EPS) != RMS_NORM.signature(c, None, EPS)


def test_launch_shape_does_not_change_the_bits():
    """Rows per program, warps, unrolling and the pass-2 tile width change the launch, never the
    arithmetic (a tail narrower than the chunk and wider than the row included)."""
    from exactdit.aten_reduce import mean_factor
    from exactdit.kernels.rms_norm import rms_norm_rows

    g = torch.Generator().manual_seed(2)
    x = activation("sbd", 20, 2, 512, torch.bfloat16, DEVICE, g)
    sc = modulation("inner", x.shape, torch.bfloat16, DEVICE, g)
    ref = references.modulate(model_rms_norm(x, None, EPS), sc, sc, upcast=True)
    u = activation("sbd", 20, 2, 512, torch.bfloat16, DEVICE, g)
    new_res = references.residual_gate_add(x, u, sc)
    gated_ref = references.modulate(model_rms_norm(new_res, None, EPS), sc, sc, upcast=True)
    cases = [(1, 1, 1, None), (2, 2, 2, 32), (16, 8, 4, None), (4, 4, 8, 1024), (4, 4, 1, 128), (1, 4, 2, 512)]
    for rows, warps, unroll, tail in cases:
        label = f"rows={rows} warps={warps} unroll={unroll} tail={tail}"
        out = torch.full_like(ref, float("nan"))
        rms_norm_rows(x, None, EPS, mean_factor(40, 512), reduce_config(x), out, scale=sc, shift=sc, upcast=True,
                      rows_per_program=rows, num_warps=warps, unroll_factor=unroll, tail=tail)
        assert_bits_equal(out, ref, label)
        out, res = torch.full_like(ref, float("nan")), torch.full_like(ref, float("nan"))
        rms_norm_rows(x, None, EPS, mean_factor(40, 512), reduce_config(x), out, update=u, gate=sc,
                      new_residual=res, scale=sc, shift=sc, upcast=True,
                      rows_per_program=rows, num_warps=warps, unroll_factor=unroll, tail=tail)
        assert_bits_equal(res, new_res, "new residual " + label)
        assert_bits_equal(out, gated_ref, "gated " + label)


@pytest.mark.parametrize("kind", KINDS)
def test_misaligned_rows_in_every_layout(kind):
    """D % 4 != 0: each row's misalignment follows its place in ATen's fp32 copy, which follows
    the layout (dense views keep theirs, strided rows get a contiguous copy)."""
    g = torch.Generator().manual_seed(7)
    x = _x(kind, 9, 2, 1001, torch.bfloat16, g)
    assert_bits_equal(RMS_NORM.fused(x, None, EPS), model_rms_norm(x, None, EPS), kind)
    u = _x(kind, 9, 2, 1001, torch.bfloat16, g)
    gate = modulation("outer", x.shape, torch.bfloat16, DEVICE, g)
    out, res = GATED_RMS_NORM_MODULATE.fused(x, u, gate, None, EPS, gate, None, True)
    nr = references.residual_gate_add(x, u, gate)
    assert_bits_equal(res, nr, "new residual")
    assert_bits_equal(out, references.modulate(model_rms_norm(nr, None, EPS), gate, None, upcast=True), kind)
