"""ERNIE-Image's per-head QK RMSNorm (``F.rms_norm``) and rotary embedding, separately and
fused for q and k in one launch.

Kernels pending (issue 4): until they land every call runs the eager reference.
"""

from __future__ import annotations

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.ops._common import no_signature, not_yet_fused

rope_tables = references.rope_tables

HEAD_RMS_NORM = FusedOp("head_rms_norm", references.head_rms_norm, references.head_rms_norm, not_yet_fused, no_signature)
ROPE = FusedOp("rope", references.rope, references.rope, not_yet_fused, no_signature)
QK_NORM_ROPE = FusedOp("qk_norm_rope", references.qk_norm_rope, references.qk_norm_rope, not_yet_fused, no_signature)


def head_rms_norm(x, weight, eps):
    """``torch.nn.RMSNorm(head_dim, eps)`` / ``F.rms_norm`` over the last dim, bit for bit."""
    return dispatch(HEAD_RMS_NORM, x, weight, eps)


def rope(x, freqs):
    """ERNIE-Image's ``apply_rotary_emb``; ``freqs`` is the fp32 angle tensor or the
    ``(cos, sin)`` pair from :func:`rope_tables`."""
    return dispatch(ROPE, x, freqs)


def qk_norm_rope(q, k, norm_q_weight, norm_k_weight, eps, freqs):
    """``(rope(head_rms_norm(q)), rope(head_rms_norm(k)))`` for ``[B, S, heads, head_dim]`` q, k."""
    return dispatch(QK_NORM_ROPE, q, k, norm_q_weight, norm_k_weight, eps, freqs)
