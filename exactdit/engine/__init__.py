"""exactdit's engine: exact rewriting of captured ATen graphs.

How a model enters the system, in order: ATen op semantics (:mod:`.aten_ops`) and the order
models of ATen's reductions (:mod:`exactdit.aten.norms`, :mod:`exactdit.aten.reduce`) ->
index arithmetic and code emission (:mod:`.indexing`, :mod:`.emit`, :mod:`.tables`) -> kernel
templates (:mod:`.templates`) -> regions of a captured graph (:mod:`.partition`) -> the gate
that checks each region against the ATen nodes it replaced (:mod:`.runtime`) -> the
torch.compile backend (:mod:`.backend`) -> ``exactdit.patch(pipe)``
(:mod:`exactdit.patches`).
"""

from exactdit.engine import templates  # noqa: F401  (registers the reduction rules)
from exactdit.engine.backend import make_backend, register, rewrite

register()

__all__ = ["make_backend", "register", "rewrite"]
