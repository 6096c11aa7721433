"""Public fused ops. Each has an eager reference (:mod:`exactdit.references`), a predicate, a
Triton kernel (:mod:`exactdit.kernels`) and goes through the gate (:mod:`exactdit.gate`)."""

from exactdit.ops.elementwise import modulate, residual_gate_add
from exactdit.ops.geglu import geglu
from exactdit.ops.geglu import table_status as gelu_table_status
from exactdit.ops.layer_norm import layer_norm, layer_norm_modulate
from exactdit.ops.rms_norm import gated_rms_norm_modulate, rms_norm, rms_norm_modulate
from exactdit.ops.rope import head_rms_norm, qk_norm_rope, rope, rope_tables

__all__ = [
    "gated_rms_norm_modulate",
    "geglu",
    "gelu_table_status",
    "head_rms_norm",
    "layer_norm",
    "layer_norm_modulate",
    "modulate",
    "qk_norm_rope",
    "residual_gate_add",
    "rms_norm",
    "rms_norm_modulate",
    "rope",
    "rope_tables",
]
