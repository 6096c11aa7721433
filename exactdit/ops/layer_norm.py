"""``F.layer_norm``, alone and followed by modulation (ERNIE-Image's final norm, the LayerNorm
AdaLN of Flux, SD3, Qwen-Image, HunyuanVideo, Wan).

Kernels pending (issue 4): until they land every call runs the eager reference.
"""

from __future__ import annotations

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.ops._common import no_signature, not_yet_fused


def _ln_reference(x, eps, weight, bias):
    return references.layer_norm(x, eps, weight, bias)


def _lnm_reference(x, eps, scale, shift, weight, bias, upcast):
    return references.layer_norm_modulate(x, eps, scale, shift, weight, bias, upcast=upcast)


LAYER_NORM = FusedOp("layer_norm", _ln_reference, _ln_reference, not_yet_fused, no_signature)
LAYER_NORM_MODULATE = FusedOp("layer_norm_modulate", _lnm_reference, _lnm_reference, not_yet_fused, no_signature)


def layer_norm(x, eps, weight=None, bias=None):
    """``F.layer_norm(x, (D,), weight, bias, eps)``, bit for bit."""
    return dispatch(LAYER_NORM, x, eps, weight, bias)


def layer_norm_modulate(x, eps, scale, shift=None, weight=None, bias=None, *, upcast=False):
    """``modulate(layer_norm(x, eps, weight, bias), scale, shift, upcast=upcast)`` in one pass."""
    return dispatch(LAYER_NORM_MODULATE, x, eps, scale, shift, weight, bias, bool(upcast))
