"""Order model of ATen's exact (erf) GELU on CUDA (``GeluCUDAKernelImpl``, approximate='none'),
and the candidate evaluation orders the GPU probe (``benchmarks/probes/probe_aten_norms.py``) told apart."""

from __future__ import annotations

import math
from typing import Callable, Dict

import torch

from exactdit.aten.norms import F32, F64, fma_f32, fp32_full

__all__ = ["gelu_order_model", "gelu_candidates", "GELU_K_ALPHA"]


#: ``constexpr opmath_t kAlpha = M_SQRT1_2`` -> fp32(1/sqrt(2)) = 0.70710677f
GELU_K_ALPHA = float(torch.tensor(math.sqrt(0.5), dtype=F32))


def _erf64(u: torch.Tensor) -> torch.Tensor:
    return torch.erf(u.to(F64))


def gelu_order_model(x: torch.Tensor, *, erf: Callable = torch.erf) -> torch.Tensor:
    """``GeluCUDAKernelImpl`` (approximate='none'), opmath fp32, source order:

      h = fl(x * 0.5f); u = fl(x * 0.70710677f); e = erff(u); s = fl(1 + e)
      y = fl(h * s), then one cast to x.dtype

    (source ``x * 0.5 * (1 + erf(x * kAlpha))``, left-associative; there is no
    ``a*b + c`` for nvcc to contract.)  ``erf`` must be the GPU's ``erff``
    (``torch.erf`` on a CUDA fp32 tensor calls the same ``::erf(float)``) for a
    bit-exact result; on CPU torch.erf differs in the last bit sometimes.
    Input: any float tensor; returns x.dtype.
    """
    return gelu_candidates(erf)["src"](x.to(F32)).to(x.dtype)


def gelu_candidates(erf: Callable = torch.erf) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Candidate fp32 formulas for eager CUDA exact GELU; each takes an fp32
    tensor and returns fp32 (round to the input dtype afterwards).  Every op is
    a separate rounding unless named fma (exact single rounding via
    :func:`fma_f32`) or computed in float64 (stated per candidate).

    src         fl(fl(x*0.5) * fl(1 + erf(fl(x*a))))           a = 0.70710677f  (source order)
    cdf_first   fl(x * fl(0.5 * fl(1 + erf(fl(x*a)))))
    half_last   fl(0.5 * fl(x * fl(1 + erf(fl(x*a)))))         (== src: *0.5 is exact bar subnormals)
    fma_h_e_h   h = fl(x*0.5); fma(h, erf(fl(x*a)), h)         (distributed; needs reassociation)
    fma_x_e_x_h fl(0.5 * fma(x, erf(fl(x*a)), x))
    u_div       u = fl(x / 1.4142135f) instead of fl(x*a)
    u_f64       u = fl32(x * sqrt(0.5) in float64)
    erf_f64     e = fl32(erf64(fl(x*a)))  (double erf, rounded) then src
    all_f64     every step in float64, one rounding to fp32 at the end
    """
    a = GELU_K_ALPHA
    sqrt2_32 = float(torch.tensor(math.sqrt(2.0), dtype=F32))

    def _u(x):
        return x * fp32_full(x, a)

    def _src_from(x, e):
        h = x * fp32_full(x, 0.5)
        s = fp32_full(x, 1.0) + e
        return h * s

    def src(x):
        return _src_from(x, erf(_u(x)))

    def cdf_first(x):
        s = fp32_full(x, 1.0) + erf(_u(x))
        return x * (fp32_full(x, 0.5) * s)

    def half_last(x):
        s = fp32_full(x, 1.0) + erf(_u(x))
        return fp32_full(x, 0.5) * (x * s)

    def fma_h_e_h(x):
        h = x * fp32_full(x, 0.5)
        return fma_f32(h, erf(_u(x)), h)

    def fma_x_e_x_h(x):
        return fp32_full(x, 0.5) * fma_f32(x, erf(_u(x)), x)

    def u_div(x):
        return _src_from(x, erf(x / fp32_full(x, sqrt2_32)))

    def u_f64(x):
        u = (x.to(F64) * math.sqrt(0.5)).to(F32)
        return _src_from(x, erf(u))

    def erf_f64(x):
        return _src_from(x, _erf64(_u(x)).to(F32))

    def all_f64(x):
        x64 = x.to(F64)
        return (x64 * 0.5 * (1.0 + torch.erf(x64 * math.sqrt(0.5)))).to(F32)

    return {
        "src": src,
        "cdf_first": cdf_first,
        "half_last": half_last,
        "fma_h_e_h": fma_h_e_h,
        "fma_x_e_x_h": fma_x_e_x_h,
        "u_div": u_div,
        "u_f64": u_f64,
        "erf_f64": erf_f64,
        "all_f64": all_f64,
    }
