"""diffusers' decomposed RMSNorm, alone and fused with modulation and the gated residual.

Kernels pending (issue 3): until they land every call runs the eager reference.
"""

from __future__ import annotations

import torch

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.ops._common import no_signature, not_yet_fused

RMS_NORM = FusedOp("rms_norm", references.rms_norm, references.rms_norm, not_yet_fused, no_signature)


def _rnm_reference(x, weight, eps, scale, shift, upcast):
    return references.rms_norm_modulate(x, weight, eps, scale, shift, upcast=upcast)


def _grnm_reference(residual, update, gate, weight, eps, scale, shift, upcast):
    return references.gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift, upcast=upcast)


RMS_NORM_MODULATE = FusedOp("rms_norm_modulate", _rnm_reference, _rnm_reference, not_yet_fused, no_signature)
GATED_RMS_NORM_MODULATE = FusedOp(
    "gated_rms_norm_modulate", _grnm_reference, _grnm_reference, not_yet_fused, no_signature
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """diffusers ``RMSNorm.forward`` (see :func:`exactdit.references.rms_norm`), bit for bit."""
    return dispatch(RMS_NORM, x, weight, eps)


def rms_norm_modulate(x, weight, eps, scale, shift=None, *, upcast=False):
    """``modulate(rms_norm(x, weight, eps), scale, shift, upcast=upcast)`` in one pass."""
    return dispatch(RMS_NORM_MODULATE, x, weight, eps, scale, shift, bool(upcast))


def gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift=None, *, upcast=False):
    """``x = residual_gate_add(residual, update, gate)`` then ``rms_norm_modulate(x, ...)``;
    returns ``(out, x)``."""
    return dispatch(GATED_RMS_NORM_MODULATE, residual, update, gate, weight, eps, scale, shift, bool(upcast))
