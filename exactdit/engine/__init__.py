"""exactdit's engine: exact rewriting of captured ATen graphs.

How a model enters the system, in order: index arithmetic and code emission (:mod:`.indexing`,
:mod:`.emit`, :mod:`.tables`), the rule registry (:mod:`.rules`) and the rules of ATen's ops
(:mod:`.aten_ops`, :mod:`.aten_views`) -> kernel templates (:mod:`.templates`, following the order
models of :mod:`exactdit.aten` with the device library :mod:`exactdit.device`) -> regions of a
captured graph (:mod:`.partition`) -> the gate that checks each region against the ATen nodes it
replaced (:mod:`.runtime`) -> the torch.compile backend (:mod:`.backend`) ->
``exactdit.patch(pipe)`` (:mod:`exactdit.patches`). See docs/architecture.md.
"""

from exactdit.engine import aten_ops, aten_views, templates  # noqa: F401  (register their rules)
from exactdit.engine.backend import make_backend, register, rewrite

register()

__all__ = ["make_backend", "register", "rewrite"]
