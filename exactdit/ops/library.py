"""exactdit ops as torch custom ops (namespace ``exactdit``), so torch.compile can trace models
that call them, with ``fullgraph=True``.

A custom op is opaque to torch.compile: the compiled graph calls the op's real implementation,
which is the public op from :mod:`exactdit.ops` (verification gate included), so inside a
compiled model every exactdit site still computes exactly what eager computes. Its fake
implementation is the eager reference run on fake tensors, which gives exactly eager's output
shapes, strides and dtypes. The ops carry the strictest stride tag this torch has
(``needs_exact_strides``), so Inductor hands them inputs laid out as eager would.

Model patches call the wrappers below: eagerly they call :mod:`exactdit.ops` directly (no
custom-op dispatch overhead); while torch.compile traces they call ``torch.ops.exactdit.*``.
The ops have no autograd formula; the patches run diffusers' own code when grad is enabled.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from exactdit import ops, references

_TAGS = tuple(
    getattr(torch.Tag, name) for name in ("needs_exact_strides",) if hasattr(torch.Tag, name)
) or tuple(getattr(torch.Tag, name) for name in ("needs_fixed_stride_order",) if hasattr(torch.Tag, name))


def _custom_op(name: str):
    return torch.library.custom_op(f"exactdit::{name}", mutates_args=(), tags=_TAGS)


# --- registrations ------------------------------------------------------------------------------


@_custom_op("residual_gate_add")
def _residual_gate_add(residual: Tensor, update: Tensor, gate: Tensor) -> Tensor:
    return ops.residual_gate_add(residual, update, gate)


@_residual_gate_add.register_fake
def _(residual, update, gate):
    return references.residual_gate_add(residual, update, gate)


@_custom_op("modulate")
def _modulate(x: Tensor, scale: Tensor, shift: Optional[Tensor], upcast: bool) -> Tensor:
    return ops.modulate(x, scale, shift, upcast=upcast)


@_modulate.register_fake
def _(x, scale, shift, upcast):
    return references.modulate(x, scale, shift, upcast=upcast)


@_custom_op("rms_norm_modulate")
def _rms_norm_modulate(
    x: Tensor, weight: Optional[Tensor], eps: float, scale: Tensor, shift: Optional[Tensor], upcast: bool
) -> Tensor:
    return ops.rms_norm_modulate(x, weight, eps, scale, shift, upcast=upcast)


@_rms_norm_modulate.register_fake
def _(x, weight, eps, scale, shift, upcast):
    return references.rms_norm_modulate(x, weight, eps, scale, shift, upcast=upcast)


@_custom_op("gated_rms_norm_modulate")
def _gated_rms_norm_modulate(
    residual: Tensor,
    update: Tensor,
    gate: Tensor,
    weight: Optional[Tensor],
    eps: float,
    scale: Tensor,
    shift: Optional[Tensor],
    upcast: bool,
) -> tuple[Tensor, Tensor]:
    return ops.gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift, upcast=upcast)


@_gated_rms_norm_modulate.register_fake
def _(residual, update, gate, weight, eps, scale, shift, upcast):
    return references.gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift, upcast=upcast)


@_custom_op("rope_tables")
def _rope_tables(freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return ops.rope_tables(freqs, dtype)


@_rope_tables.register_fake
def _(freqs, dtype):
    return references.rope_tables(freqs, dtype)


@_custom_op("qk_norm_rope")
def _qk_norm_rope(
    q: Tensor,
    k: Tensor,
    norm_q_weight: Optional[Tensor],
    norm_k_weight: Optional[Tensor],
    eps: Optional[float],
    cos: Tensor,
    sin: Tensor,
) -> tuple[Tensor, Tensor]:
    return ops.qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, (cos, sin))


@_qk_norm_rope.register_fake
def _(q, k, norm_q_weight, norm_k_weight, eps, cos, sin):
    return references.qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, (cos, sin))


@_custom_op("geglu")
def _geglu(gate: Tensor, up: Optional[Tensor]) -> Tensor:
    return ops.geglu(gate, up)


@_geglu.register_fake
def _(gate, up):
    return references.geglu(gate, up)


@_custom_op("layer_norm_modulate")
def _layer_norm_modulate(
    x: Tensor,
    eps: float,
    scale: Tensor,
    shift: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    upcast: bool,
) -> Tensor:
    return ops.layer_norm_modulate(x, eps, scale, shift, weight, bias, upcast=upcast)


@_layer_norm_modulate.register_fake
def _(x, eps, scale, shift, weight, bias, upcast):
    return references.layer_norm_modulate(x, eps, scale, shift, weight, bias, upcast=upcast)


#: The registered custom ops, by name (``torch.ops.exactdit.<name>``).
CUSTOM_OPS = {
    "residual_gate_add": _residual_gate_add,
    "modulate": _modulate,
    "rms_norm_modulate": _rms_norm_modulate,
    "gated_rms_norm_modulate": _gated_rms_norm_modulate,
    "rope_tables": _rope_tables,
    "qk_norm_rope": _qk_norm_rope,
    "geglu": _geglu,
    "layer_norm_modulate": _layer_norm_modulate,
}


# --- what model patches call ----------------------------------------------------------------------
# Same signatures as the public ops. Eagerly: the public op. While torch.compile traces: the custom op.

_compiling = torch.compiler.is_compiling


def residual_gate_add(residual, update, gate):
    if _compiling():
        return torch.ops.exactdit.residual_gate_add(residual, update, gate)
    return ops.residual_gate_add(residual, update, gate)


def modulate(x, scale, shift=None, *, upcast=False):
    if _compiling():
        return torch.ops.exactdit.modulate(x, scale, shift, bool(upcast))
    return ops.modulate(x, scale, shift, upcast=upcast)


def rms_norm_modulate(x, weight, eps, scale, shift=None, *, upcast=False):
    if _compiling():
        return torch.ops.exactdit.rms_norm_modulate(x, weight, float(eps), scale, shift, bool(upcast))
    return ops.rms_norm_modulate(x, weight, eps, scale, shift, upcast=upcast)


def gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift=None, *, upcast=False):
    if _compiling():
        return torch.ops.exactdit.gated_rms_norm_modulate(
            residual, update, gate, weight, float(eps), scale, shift, bool(upcast)
        )
    return ops.gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift, upcast=upcast)


def rope_tables(freqs, dtype):
    if _compiling():
        return tuple(torch.ops.exactdit.rope_tables(freqs, dtype))
    return ops.rope_tables(freqs, dtype)


def qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, cos, sin):
    """Note: ``cos`` and ``sin`` are separate arguments here (the public op takes a pair)."""
    if _compiling():
        return tuple(torch.ops.exactdit.qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, cos, sin))
    return ops.qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, (cos, sin))


def geglu(gate, up=None):
    if _compiling():
        return torch.ops.exactdit.geglu(gate, up)
    return ops.geglu(gate, up)


def layer_norm_modulate(x, eps, scale, shift=None, weight=None, bias=None, *, upcast=False):
    if _compiling():
        return torch.ops.exactdit.layer_norm_modulate(x, float(eps), scale, shift, weight, bias, bool(upcast))
    return ops.layer_norm_modulate(x, eps, scale, shift, weight, bias, upcast=upcast)
