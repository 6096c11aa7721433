"""ERNIE-Image's GeGLU, ``up * F.gelu(gate)`` with the exact erf GELU, bit-identical to eager.

Fused for bf16/fp16/fp32 gate and up of one shape and dtype (1 to 3 dims, unit stride along
the last), given separately or as one fused ``[..., 2F]`` projection (gate first, then up; read
through strides, no copy). Anything else runs eager.

bf16 takes the kernel's table path (:mod:`exactdit.kernels.geglu`) once this device's table has
passed its check: eager's GELU of all 2^16 bf16 values is computed on the device, and the kernel,
fed every bf16 gate, must give exactly those bits. fp16, fp32, and bf16 on a device whose check
failed (or whose first bf16 call came during graph capture or compilation, when nothing can be
checked) compute GELU with erf.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from exactdit import references
from exactdit.gate import FusedOp, cannot_sync, dispatch, first_difference
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


logger = logging.getLogger("exactdit")

#: Use the bf16 table path where it has been checked (False: always erf; tests, benchmarks).
USE_TABLE = True

_tables: dict[torch.device, torch.Tensor | None] = {}
#: device -> why its table was refused (reported by ``table_status``).
_refused: dict[torch.device, str] = {}
_tables_lock = threading.Lock()


def every_bf16(device) -> torch.Tensor:
    """All 2^16 bf16 values, indexed by bit pattern 0x0000..0xFFFF."""
    return torch.arange(2**16, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16)


def build_gelu_table(device, eager_gelu=F.gelu) -> tuple[torch.Tensor | None, str | None]:
    """(table, None) when the kernel's table path reproduces ``eager_gelu`` (bf16 in, bf16 out)
    for every bf16 gate on ``device``; (None, why) otherwise. The check runs the kernel itself on
    all 2^16 gates with ``up = 1``, whose output ``bf16(1 * gelu)`` is the GELU bit for bit (NaNs
    included: the GPU's multiply and conversion give the canonical NaN that eager's conversion
    gives)."""
    gates = every_bf16(device)
    gelu = eager_gelu(gates)
    table = kernels.gelu_table(gelu)
    out = kernels.geglu(gates, torch.ones_like(gates), torch.empty_like(gates), table)
    problem = first_difference(out, gelu)
    if problem is not None:
        return None, f"the table path differs from eager GELU over all bf16 gates: {problem}"
    return table, None


def gelu_table(device: torch.device) -> torch.Tensor | None:
    """This device's checked bf16 GELU table, built on first use; None where it was refused."""
    if device in _tables:
        return _tables[device]
    with _tables_lock:
        if device not in _tables:
            if cannot_sync():
                table, why = None, "the first bf16 call came during graph capture or compilation"
            else:
                table, why = build_gelu_table(device)
            if why is not None:
                _refused[device] = why
                logger.warning("exactdit: geglu computes bf16 GELU with erf on %s: %s", device, why)
            _tables[device] = table
    return _tables[device]


def table_status() -> dict[str, str]:
    """Per device that has been asked: "table" or why bf16 GELU runs through erf there."""
    return {str(d): _refused.get(d, "table") for d in _tables}


def _table_for(g) -> torch.Tensor | None:
    if not USE_TABLE or g.dtype != torch.bfloat16:
        return None
    return gelu_table(g.device)


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
    if g.shape != u.shape:
        return "gate and up shapes differ (broadcast)"
    problem = dtype_support(g, u) or unit_stride_support(g.shape, gate=g, up=u)
    if problem is None and g.device.type == "cuda" and _table_for(g) is None and cuda_libdevice() is None:
        return "no CUDA toolkit libdevice matching torch's CUDA (Triton's own erf differs from ATen's)"
    return problem


def _signature(gate, up):
    g, u = _split(gate, up)
    s = g.shape
    path = "table" if _table_for(g) is not None else f"erf form {kernels.GELU_FORM}"
    return (path, up is None, g.dtype, s[-1], rows_class(n_rows(g)), layout(g, s), layout(u, s))


def _fused(gate, up):
    g, u = _split(gate, up)
    return kernels.geglu(g, u, new_outputs(references.geglu, g, u, device=g.device), _table_for(g))


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
