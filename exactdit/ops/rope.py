"""ERNIE-Image's per-head QK RMSNorm (``F.rms_norm``) and rotary embedding, separately and
fused for q and k in one launch, bit-identical to eager.

The fused path takes what ATen's own fused RMSNorm kernel (``vectorized_layer_norm_kernel``)
would take: bf16/fp16/fp32 activations with a weight of the same dtype (or none), head_dim a
multiple of 4 (at most 1024), 16-byte aligned data. Everything else (mixed dtypes: ATen's
composite path; odd or misaligned rows: ATen's two-kernel fallback; other devices) runs eager.
"""

from __future__ import annotations

import torch

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.kernels import rope as kernels
from exactdit.ops._common import KERNEL_DTYPES, new_outputs, require_tensors

rope_tables = references.rope_tables

#: widest head the one-row-per-program kernel keeps in registers.
MAX_HEAD_DIM = 1024


def _eps(eps):
    """``F.rms_norm``'s default eps (``None``): fp32 machine epsilon, the opmath type's."""
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def _x_support(x: torch.Tensor, name: str) -> str | None:
    if x.dtype not in KERNEL_DTYPES:
        return f"unsupported dtype {x.dtype}"
    if x.dim() == 0 or x.dim() > 4:
        return f"{x.dim()}-d {name} (kernels take 1 to 4 dims)"
    if x.numel() == 0:
        return "empty tensor"
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        return f"{name} not contiguous along the last dim"
    return None




def _norm_support(x: torch.Tensor, weight: torch.Tensor | None, name: str) -> str | None:
    """Why ATen's ``F.rms_norm`` would not run its vectorized fused kernel here (or why ours
    cannot), or None."""
    n = x.shape[-1]
    if weight is not None and weight.dtype != x.dtype:
        return "weight dtype differs from the activation's (ATen's composite rms_norm)"
    if n % kernels.VEC != 0:
        return "head_dim not a multiple of 4 (ATen's non-vectorized norm)"
    if n > MAX_HEAD_DIM:
        return f"head_dim {n} > {MAX_HEAD_DIM}"
    # ATen vectorizes when the data is aligned to 4 * itemsize bytes (a non-contiguous input is
    # copied first, so always aligned). The gate caches plans by 16-byte alignment only, so
    # anything short of 16 bytes runs eager: correct, if conservative for 8-byte aligned bf16.
    if x.is_contiguous() and x.data_ptr() % 16 != 0:
        return f"{name} not 16-byte aligned (ATen may take its non-vectorized norm)"
    if weight is not None and weight.is_contiguous() and weight.data_ptr() % 16 != 0:
        return "weight not 16-byte aligned (ATen may take its non-vectorized norm)"
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return "channels-last input (ATen's composite rms_norm)"
    return None


def _validate_norm(x, weight, name, op="head_rms_norm", weight_name="weight"):
    # ``op`` / ``weight_name``: what the caller called and passed, so the message names them
    require_tensors(op, **{name: x})
    if weight is not None:
        require_tensors(op, **{weight_name: weight})
        if tuple(weight.shape) != (x.shape[-1],):
            raise ValueError(
                f"exactdit.ops.{op}: {weight_name} of shape {tuple(weight.shape)} does not match "
                f"{name}'s last dim {x.shape[-1]}"
            )


def _tables(freqs, dtype):
    """The ``(cos, sin)`` tables eager would use: given, or computed once from the angles."""
    return freqs if isinstance(freqs, tuple) else references.rope_tables(freqs, dtype)


def _rope_support(x: torch.Tensor, freqs) -> str | None:
    if isinstance(freqs, tuple):
        cos, sin = freqs
        if cos.dtype != x.dtype or sin.dtype != x.dtype:
            return "cos/sin tables of another dtype than the activation"
    else:
        cos = sin = freqs
        if freqs.dtype != torch.float32:
            return f"rotary angles of dtype {freqs.dtype} (expected fp32)"
    if cos.shape != sin.shape:
        return "cos and sin shapes differ"
    rot = cos.shape[-1]
    if rot % 2 or rot == 0 or rot > x.shape[-1]:
        return f"rotary width {rot} (kernels take an even width up to head_dim)"
    target = tuple(x.shape[:-1]) + (rot,)
    try:
        if torch.broadcast_shapes(cos.shape, target) != target:
            return "rotary tables broadcast beyond the activation"
    except RuntimeError:
        return "rotary tables do not broadcast to the activation"
    for t in (cos, sin):
        if t.dim() > 4:
            return "rotary tables of more than 4 dims"
        if rot > 1 and t.stride(-1) != 1:
            return "rotary tables not contiguous along the last dim"
    return None


def _rope_validate(x, freqs, op="rope"):
    require_tensors(op, x=x)
    if isinstance(freqs, tuple):
        if len(freqs) != 2:
            raise ValueError(f"exactdit.ops.{op}: freqs must be the angle tensor or a (cos, sin) pair")
        require_tensors(op, cos=freqs[0], sin=freqs[1])
    else:
        require_tensors(op, freqs=freqs)


def _table_layout(x, freqs):
    t = freqs[0] if isinstance(freqs, tuple) else freqs
    shape = tuple(x.shape[:-1]) + (t.shape[-1],)
    kind = "tables" if isinstance(freqs, tuple) else "angles"
    return (kind, t.shape[-1]) + tuple("b" if s == 0 else "s" for s in kernels.strides_4d(t, shape))


def _x_layout(x):
    return (x.dim(), x.is_contiguous())


# head_rms_norm -------------------------------------------------------------------------------


def _hrn_unsupported(x, weight, eps):
    reason = _x_support(x, "x") or _norm_support(x, weight, "x")
    if reason is None and not x.is_contiguous():
        # ATen normalises a contiguous copy; which strides its output gets is not modelled here.
        return "non-contiguous x"
    return reason


def _hrn_signature(x, weight, eps):
    return (x.dtype, x.shape[-1], weight is not None, _x_layout(x))


def _hrn_fused(x, weight, eps):
    out = new_outputs(references.head_rms_norm, x, weight, eps, device=x.device)
    kernels.norm_rope([(x, weight, out)], _eps(eps), None, norm=True, rope=False)
    return out


HEAD_RMS_NORM = FusedOp(
    name="head_rms_norm",
    reference=references.head_rms_norm,
    fused=_hrn_fused,
    unsupported=_hrn_unsupported,
    signature=_hrn_signature,
    validate=lambda x, weight, eps: _validate_norm(x, weight, "x"),
    cuda_numerics=True,
)


# rope -----------------------------------------------------------------------------------------


def _rope_tables_ref(x, cos, sin):
    return references.rope(x, (cos, sin))


def _rope_unsupported(x, freqs):
    return _x_support(x, "x") or _rope_support(x, freqs)


def _rope_signature(x, freqs):
    return (x.dtype, x.shape[-1], _x_layout(x), _table_layout(x, freqs))


def _rope_fused(x, freqs):
    cos, sin = _tables(freqs, x.dtype)
    out = new_outputs(_rope_tables_ref, x, cos, sin, device=x.device)
    kernels.norm_rope([(x, None, out)], 0.0, (cos, sin), norm=False, rope=True)
    return out


ROPE = FusedOp(
    name="rope",
    reference=references.rope,
    fused=_rope_fused,
    unsupported=_rope_unsupported,
    signature=_rope_signature,
    validate=_rope_validate,
)


# qk_norm_rope ---------------------------------------------------------------------------------


def _qk_validate(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    _validate_norm(q, norm_q_weight, "q", "qk_norm_rope", "norm_q_weight")
    _validate_norm(k, norm_k_weight, "k", "qk_norm_rope", "norm_k_weight")
    _rope_validate(q, freqs, "qk_norm_rope")


def _qk_unsupported(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    if q.dtype != k.dtype:
        return "q and k of different dtypes"
    if q.shape != k.shape:
        return "q and k of different shapes"
    if (norm_q_weight is None) != (norm_k_weight is None):
        return "only one of q, k has a norm weight"
    return (
        _x_support(q, "q") or _x_support(k, "k")
        or _norm_support(q, norm_q_weight, "q") or _norm_support(k, norm_k_weight, "k")
        or _rope_support(q, freqs) or _rope_support(k, freqs)
    )


def _qk_signature(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    return (
        q.dtype, q.shape[-1], norm_q_weight is not None, _x_layout(q), _x_layout(k),
        _table_layout(q, freqs), _table_layout(k, freqs),
    )


def _qk_tables_ref(q, k, wq, wk, eps, cos, sin):
    return references.qk_norm_rope(q, k, wq, wk, eps, (cos, sin))


def _qk_fused(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    cos, sin = _tables(freqs, q.dtype)
    out_q, out_k = new_outputs(_qk_tables_ref, q, k, norm_q_weight, norm_k_weight, eps, cos, sin, device=q.device)
    pairs = [(q, norm_q_weight, out_q), (k, norm_k_weight, out_k)]
    return kernels.norm_rope(pairs, _eps(eps), (cos, sin), norm=True, rope=True)


QK_NORM_ROPE = FusedOp(
    name="qk_norm_rope",
    reference=references.qk_norm_rope,
    fused=_qk_fused,
    unsupported=_qk_unsupported,
    signature=_qk_signature,
    validate=_qk_validate,
    cuda_numerics=True,
)


def head_rms_norm(x, weight, eps):
    """``torch.nn.RMSNorm(head_dim, eps)`` / ``F.rms_norm`` over the last dim, bit for bit.

    Fused for contiguous bf16/fp16/fp32 ``x`` of 1 to 4 dims with a same-dtype ``weight`` [N]
    (or None) and N a multiple of 4 up to 1024; anything else runs eager.
    """
    return dispatch(HEAD_RMS_NORM, x, weight, eps)


def rope(x, freqs):
    """ERNIE-Image's ``apply_rotary_emb``; ``freqs`` is the fp32 angle tensor or the
    ``(cos, sin)`` pair from :func:`rope_tables`.

    Fused for bf16/fp16/fp32 ``x`` of 1 to 4 dims (unit stride along the last) with tables of
    x's dtype (or fp32 angles: the tables are then computed once by eager ops) that broadcast
    to ``x.shape[:-1] + (rot_dim,)``, rot_dim even and <= head_dim.
    """
    return dispatch(ROPE, x, freqs)


def qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    """``(rope(head_rms_norm(q)), rope(head_rms_norm(k)))`` for ``[B, S, heads, head_dim]`` q, k,
    in one launch; q, k may be strided views (e.g. of a fused QKV projection)."""
    return dispatch(QK_NORM_ROPE, q, k, norm_q_weight, norm_k_weight, eps, freqs)
