"""ERNIE-Image's GeGLU, ``up * F.gelu(gate)`` with the exact erf GELU.

Kernel pending (issue 4): until it lands every call runs the eager reference.
"""

from __future__ import annotations

from exactdit import references
from exactdit.gate import FusedOp, dispatch
from exactdit.ops._common import no_signature, not_yet_fused

GEGLU = FusedOp("geglu", references.geglu, references.geglu, not_yet_fused, no_signature)


def geglu(gate, up=None):
    """``up * F.gelu(gate)``; with ``up=None`` ``gate`` is the fused ``[..., 2F]`` projection
    (gate first, then up)."""
    return dispatch(GEGLU, gate, up)
