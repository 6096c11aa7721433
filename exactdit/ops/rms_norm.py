"""diffusers' decomposed RMSNorm, alone and fused with modulation and the gated residual.

The variance is ATen's generic mean reduction, whose order of additions depends on the real row
count M and width D; the kernel reproduces the configuration ATen picks
(:func:`exactdit.aten_reduce.mean_lastdim_launches`), including rows that start misaligned in
ATen's fp32 copy (D >= 128 with D % 4 != 0). Configurations not reproduced run eager: ATen's
32-bit split (``M * D`` beyond ~2**29), a row split across blocks (never for D <= 16384),
misaligned rows of a non-dense permuted view (whose fp32 copy layout is not modelled).
"""

from __future__ import annotations

import functools

import torch

from exactdit import references
from exactdit.aten_reduce import mean_factor, mean_lastdim_launches
from exactdit.gate import FusedOp, dispatch
from exactdit.kernels import rms_norm as kernels
from exactdit.kernels.rows import row_strides, rows_of
from exactdit.ops._common import (
    KERNEL_DTYPES,
    dtype_support,
    layout,
    n_rows,
    new_outputs,
    require_broadcast,
    require_gated_residual,
    require_tensors,
    unit_stride_support,
)



def reduce_config(x: torch.Tensor):
    """The single ATen reduce launch for ``x.float().pow(2).mean(-1)``, or a reason string when
    ATen's order is not reproduced for this shape."""
    return _reduce_config(n_rows(x), x.shape[-1])


@functools.lru_cache(maxsize=1024)
def _reduce_config(M: int, D: int):
    launches = mean_lastdim_launches(M, D)
    if len(launches) != 1:
        return "rows split for 32-bit indexing (M * D too large)"
    cfg = launches[0][2]
    if cfg.ctas_per_output != 1:
        return "row split across blocks"
    return cfg


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    expected = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def copy_row_strides(x: torch.Tensor):
    """(outer, inner) row strides of ATen's fp32 copy ``x.to(float32).pow(2)`` in the kernels'
    [outer, inner, D] view, or None when not modelled. A dense ``x`` keeps its strides (both
    ``.to`` and ``pow`` preserve a dense layout); a non-dense view whose rows are in logical order
    gets a contiguous copy. Only the rows' misalignment (offset mod 4) depends on this."""
    shape = tuple(x.shape)
    so, si = row_strides(x, shape)
    if _dense(x):
        return so, si
    rows, inner, D = rows_of(shape)
    outer = rows // inner
    if outer == 1 or inner == 1 or so >= si * inner:
        return inner * D, D
    return None


def _config_key(x: torch.Tensor) -> tuple:
    cfg = reduce_config(x)
    D = x.shape[-1]
    misaligned = cfg.vectorize_input and D % 4 != 0
    return (cfg.vectorize_input, cfg.block_width, cfg.warps_per_row, misaligned and copy_row_strides(x))


def out_dtype(x: torch.Tensor, weight: torch.Tensor | None) -> torch.dtype:
    """Eager's result dtype: x's without a weight, else the weight's (an fp32 weight promotes a
    half x to fp32; a half weight makes the result half whatever x is)."""
    return x.dtype if weight is None else weight.dtype


def _norm_unsupported(x, weight) -> str | None:
    if x.dtype not in KERNEL_DTYPES:
        return f"unsupported dtype {x.dtype}"
    reason = unit_stride_support(x.shape, x=x)
    if reason is not None:
        return reason
    if weight is not None:
        if weight.dtype not in KERNEL_DTYPES:
            return f"unsupported weight dtype {weight.dtype}"
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
            return "weight is not a [D] vector"
        if weight.shape[0] > 1 and weight.stride(0) != 1:
            return "weight not contiguous"
    cfg = reduce_config(x)
    if isinstance(cfg, str):
        return cfg
    if cfg.vectorize_input and x.shape[-1] % 4 != 0 and copy_row_strides(x) is None:
        return "misaligned rows (D % 4 != 0) of a non-dense permuted view"
    return None


def _mod_unsupported(y_dtype, shape, scale, shift, upcast) -> str | None:
    for name, t in (("scale", scale), ("shift", shift)):
        if t is None:
            continue
        if t.dtype not in KERNEL_DTYPES:
            return f"unsupported {name} dtype {t.dtype}"
        if not upcast and t.dtype != y_dtype:
            return "native modulation with mixed dtypes"
    return unit_stride_support(shape, scale=scale, shift=shift)


def _w_key(weight):
    return "none" if weight is None else (weight.dtype, weight.data_ptr() % 16 == 0)


_mean_factor = functools.lru_cache(maxsize=1024)(mean_factor)


def _launch(x, weight, eps, out, **kw):
    cfg = reduce_config(x)
    factor = _mean_factor(n_rows(x), x.shape[-1])
    # only misaligned rows (D % 4 != 0) depend on the layout of ATen's fp32 copy
    copy_strides = copy_row_strides(x) if x.shape[-1] % 4 else None
    return kernels.rms_norm_rows(x, weight, eps, factor, cfg, out, copy_strides=copy_strides, **kw)


# rms_norm -----------------------------------------------------------------------------------


def _rn_validate(x, weight, eps, op="rms_norm"):
    require_tensors(op, x=x)
    if weight is not None:
        require_tensors(op, weight=weight)


def _rn_unsupported(x, weight, eps):
    return _norm_unsupported(x, weight)


def _rn_signature(x, weight, eps):
    return (x.dtype, _w_key(weight), x.shape[-1], _config_key(x), layout(x, x.shape))


def _rn_fused(x, weight, eps):
    out = new_outputs(references.rms_norm, x, weight, eps, device=x.device)
    return _launch(x, weight, eps, out)


RMS_NORM = FusedOp(
    name="rms_norm",
    reference=references.rms_norm,
    fused=_rn_fused,
    unsupported=_rn_unsupported,
    signature=_rn_signature,
    validate=_rn_validate,
    cuda_numerics=True,
)


# rms_norm_modulate --------------------------------------------------------------------------


def _rnm_reference(x, weight, eps, scale, shift, upcast):
    return references.rms_norm_modulate(x, weight, eps, scale, shift, upcast=upcast)


def _rnm_validate(x, weight, eps, scale, shift, upcast, op="rms_norm_modulate"):
    # ``op``: the public op the caller called, so its messages name it
    _rn_validate(x, weight, eps, op)
    require_tensors(op, scale=scale)
    if shift is not None:
        require_tensors(op, shift=shift)
    require_broadcast(op, x.shape, scale=scale, shift=shift)


def _rnm_unsupported(x, weight, eps, scale, shift, upcast):
    return _norm_unsupported(x, weight) or _mod_unsupported(out_dtype(x, weight), x.shape, scale, shift, upcast)


def _rnm_signature(x, weight, eps, scale, shift, upcast):
    s = x.shape
    return _rn_signature(x, weight, eps) + (
        bool(upcast), _dtype_or_none(scale), _dtype_or_none(shift), layout(scale, s), layout(shift, s)
    )


def _dtype_or_none(t):
    return None if t is None else t.dtype


def _rnm_fused(x, weight, eps, scale, shift, upcast):
    out = new_outputs(_rnm_reference, x, weight, eps, scale, shift, upcast, device=x.device)
    return _launch(x, weight, eps, out, scale=scale, shift=shift, upcast=upcast)


RMS_NORM_MODULATE = FusedOp(
    name="rms_norm_modulate",
    reference=_rnm_reference,
    fused=_rnm_fused,
    unsupported=_rnm_unsupported,
    signature=_rnm_signature,
    validate=_rnm_validate,
    cuda_numerics=True,
)


# gated_rms_norm_modulate --------------------------------------------------------------------


def _grnm_reference(residual, update, gate, weight, eps, scale, shift, upcast):
    return references.gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift, upcast=upcast)


def _grnm_validate(residual, update, gate, weight, eps, scale, shift, upcast):
    require_gated_residual("gated_rms_norm_modulate", residual, update, gate)
    _rnm_validate(residual, weight, eps, scale, shift, upcast, "gated_rms_norm_modulate")


def _grnm_unsupported(residual, update, gate, weight, eps, scale, shift, upcast):
    return (
        dtype_support(residual, update, gate)
        or unit_stride_support(residual.shape, update=update, gate=gate)
        or _rnm_unsupported(residual, weight, eps, scale, shift, upcast)
    )


def _grnm_signature(residual, update, gate, weight, eps, scale, shift, upcast):
    s = residual.shape
    return _rnm_signature(residual, weight, eps, scale, shift, upcast) + (layout(update, s), layout(gate, s))


def _grnm_fused(residual, update, gate, weight, eps, scale, shift, upcast):
    out, new_residual = new_outputs(
        _grnm_reference, residual, update, gate, weight, eps, scale, shift, upcast, device=residual.device
    )
    _launch(residual, weight, eps, out, update=update, gate=gate, new_residual=new_residual,
            scale=scale, shift=shift, upcast=upcast)
    return out, new_residual


GATED_RMS_NORM_MODULATE = FusedOp(
    name="gated_rms_norm_modulate",
    reference=_grnm_reference,
    fused=_grnm_fused,
    unsupported=_grnm_unsupported,
    signature=_grnm_signature,
    validate=_grnm_validate,
    cuda_numerics=True,
)


# public -------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """diffusers ``RMSNorm.forward`` (see :func:`exactdit.references.rms_norm`), bit for bit.

    x: bf16/fp16/fp32, [B, S, D], [S, B, D], [M, D] or [D] (views with unit stride along D).
    weight: None or a [D] vector of bf16/fp16/fp32 (any combination with x; the result dtype
    follows eager's promotion).
    """
    return dispatch(RMS_NORM, x, weight, float(eps))


def rms_norm_modulate(x, weight, eps, scale, shift=None, *, upcast=False):
    """``modulate(rms_norm(x, weight, eps), scale, shift, upcast=upcast)`` in one pass (one read
    of x, one write). scale/shift broadcast like :func:`exactdit.ops.modulate`'s; for the native
    chain (``upcast=False``) they must have the norm's result dtype, else it runs eager."""
    return dispatch(RMS_NORM_MODULATE, x, weight, float(eps), scale, shift, bool(upcast))


def gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift=None, *, upcast=False):
    """``x = residual_gate_add(residual, update, gate)`` then ``rms_norm_modulate(x, ...)`` in
    one pass; returns ``(out, x)``. residual, update and gate share one dtype."""
    return dispatch(
        GATED_RMS_NORM_MODULATE, residual, update, gate, weight, float(eps), scale, shift, bool(upcast)
    )
