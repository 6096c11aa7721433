"""Eager references: the exact PyTorch expressions the fused ops reproduce.

These are the ground truth. The gate compares every new kernel signature against them, the
fallback path returns them, and the tests hold the kernels to them bit for bit. Each is written
exactly as the diffusers model code it stands for computes it, so that it rounds where eager
rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """diffusers' ``RMSNorm.forward`` (non-NPU branch, no bias), the decomposed norm of
    ERNIE-Image's ``adaLN_sa_ln`` / ``adaLN_mlp_ln``.

    The variance is ATen's generic mean reduction of an fp32 copy; ``x * rsqrt(...)`` is fp32
    (x times an fp32 rstd); it is rounded to the weight's dtype only for a half-precision
    weight, then multiplied by the weight; with no weight it is rounded to x's dtype.
    """
    input_dtype = x.dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight is None:
        return h.to(input_dtype)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return h * weight


def rms_norm_modulate(x, weight, eps, scale, shift=None, *, upcast=False):
    """``modulate(rms_norm(x, weight, eps), scale, shift, upcast=upcast)``: ERNIE-Image's
    ``adaLN_sa_ln`` followed by its fp32 modulation chain (``upcast=True``)."""
    return modulate(rms_norm(x, weight, eps), scale, shift, upcast=upcast)


def gated_rms_norm_modulate(residual, update, gate, weight, eps, scale, shift=None, *, upcast=False):
    """The middle of an ERNIE-Image block: ``x = residual + gate * update`` (the fp32-product
    form), then ``modulate(rms_norm(x))``. Returns ``(out, x)``; ``x`` is the new residual."""
    new_residual = residual_gate_add(residual, update, gate)
    return rms_norm_modulate(new_residual, weight, eps, scale, shift, upcast=upcast), new_residual


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm(head_dim, eps)`` on the last dim, i.e. ``F.rms_norm``: one fused ATen
    kernel with its own reduction order and one rounding after the weight (not the decomposed
    diffusers RMSNorm)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ERNIE-Image's fp32 rotary angles, rounded to the activation dtype,
    exactly as its attention processor computes them (the same for every layer)."""
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def rope(x: torch.Tensor, freqs) -> torch.Tensor:
    """ERNIE-Image's ``apply_rotary_emb``: non-interleaved rotate-half over the first
    ``rot_dim`` channels, ``x * cos + rotate_half(x) * sin`` with every op rounded to x's dtype.

    ``freqs`` is the fp32 angle tensor ``[B, S, 1, rot_dim]`` or the ``(cos, sin)`` pair from
    :func:`rope_tables` (same bits; lets a model compute them once per forward).
    """
    cos, sin = freqs if isinstance(freqs, tuple) else rope_tables(freqs, x.dtype)
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    """ERNIE-Image's per-head ``norm_q`` / ``norm_k`` followed by its rotary embedding, for q and
    k (``[B, S, heads, head_dim]``). Returns ``(q, k)``."""
    return rope(head_rms_norm(q, norm_q_weight, eps), freqs), rope(head_rms_norm(k, norm_k_weight, eps), freqs)


def geglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """ERNIE-Image's feed-forward activation ``up * F.gelu(gate)`` (exact erf GELU).

    With ``up=None``, ``gate`` holds both projections as ``[..., 2F]``: gate first, then up.
    """
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return up * F.gelu(gate)


def layer_norm(x, eps, weight=None, bias=None):
    """``F.layer_norm`` over the last dim (ERNIE-Image's final norm has no affine)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def layer_norm_modulate(x, eps, scale, shift=None, weight=None, bias=None, *, upcast=False):
    """``modulate(layer_norm(x), scale, shift)``: ERNIE-Image's final ``AdaLNContinuous`` (native
    chain) and the LayerNorm AdaLN of Flux, SD3, Qwen-Image, HunyuanVideo and Wan."""
    return modulate(layer_norm(x, eps, weight, bias), scale, shift, upcast=upcast)
