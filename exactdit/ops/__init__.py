"""Public fused ops. Each has an eager reference (:mod:`exactdit.references`), a predicate, a
Triton kernel (:mod:`exactdit.kernels`) and goes through the gate (:mod:`exactdit.gate`)."""

from exactdit.ops.elementwise import modulate, residual_gate_add

__all__ = ["modulate", "residual_gate_add"]
