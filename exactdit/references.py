"""Eager references: the exact PyTorch expressions the fused ops reproduce.

These are the ground truth. The gate compares every new kernel signature against them, the
fallback path returns them, and the tests hold the kernels to them bit for bit. Each is written
exactly as the diffusers model code it stands for computes it, so that it rounds where eager
rounds.
"""

from __future__ import annotations

import torch


def residual_gate_add(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """ERNIE-Image's gated residual, ``residual + (gate.float() * update.float()).to(dtype)``.

    For bf16/fp16 operands this has the same bits as ``residual + gate * update`` (Flux, SD3):
    the fp32 product of two half-precision values is exact.
    """
    return residual + (gate.float() * update.float()).to(residual.dtype)


def modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None = None, *, upcast: bool = False
) -> torch.Tensor:
    """AdaLN modulation ``x * (1 + scale) + shift``.

    ``upcast=True``: ERNIE-Image's fp32 chain ``(x.float() * (1 + scale.float()) +
    shift.float()).to(x.dtype)``. ``upcast=False``: the native chain, each op rounded to x's dtype.
    ``shift=None`` drops the add.
    """
    if upcast:
        y = x.float() * (1 + scale.float())
        if shift is not None:
            y = y + shift.float()
        return y.to(x.dtype)
    y = x * (1 + scale)
    return y if shift is None else y + shift
