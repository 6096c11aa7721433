"""Gated residual add and AdaLN modulation, bit-identical to eager."""

from __future__ import annotations

import torch

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.kernels import elementwise as kernels
from exactdit.ops._common import (
    dtype_support,
    layout,
    n_rows,
    new_outputs,
    require_broadcast,
    require_gated_residual,
    require_tensors,
    rows_class,
    unit_stride_support,
)



# residual_gate_add --------------------------------------------------------------------------


def _rga_validate(residual, update, gate):
    require_gated_residual("residual_gate_add", residual, update, gate)


def _rga_unsupported(residual, update, gate):
    return dtype_support(residual, update, gate) or unit_stride_support(
        residual.shape, residual=residual, update=update, gate=gate
    )


def _rga_signature(residual, update, gate):
    s = residual.shape
    return (residual.dtype, s[-1], rows_class(n_rows(residual)), layout(residual, s), layout(update, s), layout(gate, s))


def _rga_fused(residual, update, gate):
    return kernels.residual_gate_add(residual, update, gate, new_outputs(references.residual_gate_add, residual, update, gate, device=residual.device))


RESIDUAL_GATE_ADD = FusedOp(
    name="residual_gate_add",
    reference=references.residual_gate_add,
    fused=_rga_fused,
    unsupported=_rga_unsupported,
    signature=_rga_signature,
    validate=_rga_validate,
)


def residual_gate_add(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``residual + (gate.float() * update.float()).to(residual.dtype)``, bit for bit.

    ``residual`` and ``update`` share a shape ([B, S, D], [S, B, D], [M, D] or [D], views
    allowed); ``gate`` broadcasts to it ([D], [B, 1, D], [1, B, D], a full tensor or a ``chunk``
    view). bf16, fp16 and fp32 (all one dtype) run fused on CUDA; anything else runs eager.
    """
    return dispatch(RESIDUAL_GATE_ADD, residual, update, gate)


# modulate -----------------------------------------------------------------------------------


def _mod_validate(x, scale, shift, upcast):
    require_tensors("modulate", x=x, scale=scale)
    if shift is not None:
        require_tensors("modulate", shift=shift)
    require_broadcast("modulate", x.shape, scale=scale, shift=shift)


def _mod_unsupported(x, scale, shift, upcast):
    return dtype_support(x, scale, shift) or unit_stride_support(x.shape, x=x, scale=scale, shift=shift)


def _mod_signature(x, scale, shift, upcast):
    s = x.shape
    return (bool(upcast), x.dtype, s[-1], rows_class(n_rows(x)), layout(x, s), layout(scale, s), layout(shift, s))


def _mod_fused(x, scale, shift, upcast):
    return kernels.modulate(x, scale, shift, bool(upcast), new_outputs(_mod_reference, x, scale, shift, upcast, device=x.device))


def _mod_reference(x, scale, shift, upcast):
    return references.modulate(x, scale, shift, upcast=bool(upcast))


MODULATE = FusedOp(
    name="modulate",
    reference=_mod_reference,
    fused=_mod_fused,
    unsupported=_mod_unsupported,
    signature=_mod_signature,
    validate=_mod_validate,
)


def modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None, *, upcast: bool = False
) -> torch.Tensor:
    """AdaLN modulation ``x * (1 + scale) + shift``, bit for bit.

    ``upcast=True`` reproduces ``(x.float() * (1 + scale.float()) + shift.float()).to(x.dtype)``
    (ERNIE-Image); ``upcast=False`` the native chain with every op rounded to x's dtype (Flux,
    SD3, Qwen-Image). ``shift=None`` gives ``x * (1 + scale)``. Layouts as for
    :func:`residual_gate_add`.
    """
    return dispatch(MODULATE, x, scale, shift, upcast)
