"""ERNIE-Image's GeGLU, ``up * F.gelu(gate)`` with the exact erf GELU, bit-identical to eager.

Fused for bf16/fp16/fp32 gate and up of one shape and dtype (1 to 3 dims, unit stride along
the last), given separately or as one fused ``[..., 2F]`` projection (gate first, then up; read
through strides, no copy). Anything else runs eager.
"""

from __future__ import annotations

import torch

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.kernels import geglu as kernels
from exactdit.numerics import cuda_libdevice
from exactdit.ops._common import (
    dtype_support,
    layout,
    n_rows,
    new_outputs,
    require_tensors,
    rows_class,
    unit_stride_support,
)


def _split(gate, up):
    """(gate, up) as views; a fused projection is chunked like eager (no copy)."""
    return gate.chunk(2, dim=-1) if up is None else (gate, up)


def _validate(gate, up):
    require_tensors("geglu", gate=gate)
    if up is None:
        if gate.dim() == 0 or gate.shape[-1] % 2:
            raise ValueError(
                f"exactdit.ops.geglu: a fused projection needs an even last dim, got shape {tuple(gate.shape)}"
            )
        return
    require_tensors("geglu", up=up)
    try:
        torch.broadcast_shapes(gate.shape, up.shape)
    except RuntimeError:
        raise ValueError(
            f"exactdit.ops.geglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} do not broadcast"
        ) from None


def _unsupported(gate, up):
    g, u = _split(gate, up)
    if g.device.type == "cuda" and cuda_libdevice() is None:
        return "no CUDA toolkit libdevice matching torch's CUDA (Triton's own erf differs from ATen's)"
    if g.shape != u.shape:
        return "gate and up shapes differ (broadcast)"
    return dtype_support(g, u) or unit_stride_support(g.shape, gate=g, up=u)


def _signature(gate, up):
    g, u = _split(gate, up)
    s = g.shape
    return (kernels.GELU_FORM, up is None, g.dtype, s[-1], rows_class(n_rows(g)), layout(g, s), layout(u, s))


def _fused(gate, up):
    g, u = _split(gate, up)
    return kernels.geglu(g, u, new_outputs(references.geglu, g, u, device=g.device))


GEGLU = FusedOp(
    name="geglu",
    reference=references.geglu,
    fused=_fused,
    unsupported=_unsupported,
    signature=_signature,
    validate=_validate,
    cuda_numerics=True,
)


def geglu(gate, up=None):
    """``up * F.gelu(gate)``; with ``up=None`` ``gate`` is the fused ``[..., 2F]`` projection
    (gate first, then up)."""
    return dispatch(GEGLU, gate, up)
