"""The engine's rule registry: for each ATen overload, how the engine emits it (:class:`Rule`).

Rules are registered by :mod:`exactdit.engine.aten_ops` (pointwise ops, views, cats, tables) and by
the templates (:mod:`exactdit.engine.templates.outputs`: the outputs of the reductions they
compute); the emitter, the templates and the partitioner look them up here. This module imports
nothing of the engine, so every engine module may import it.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import torch.fx as fx

#: rule kinds, for the partitioner
POINTWISE, VIEW, CAT, UNARY_TABLE, REDUCTION_OUTPUT = "pointwise", "view", "cat", "table", "reduction output"


@dataclasses.dataclass(frozen=True)
class Rule:
    kind: str
    #: ``emit(emitter, node, index) -> Val``: the node's value at ``index`` as generated code
    emit: Callable[..., Any]
    #: why this node cannot be fused, or None
    check: Callable[[fx.Node], str | None] = lambda node: None
    #: the rule reproduces the CUDA kernel only, ATen's CPU kernel rounds differently for some
    #: inputs (the gate then cannot check it on the CPU)
    cuda_only: Callable[[fx.Node], bool] = lambda node: False


_RULES: dict[Any, Rule] = {}
#: ``getitem(base, k)``: base's overload -> ``make(base, k)``, the rule of output ``k`` (or None)
_ITEM_RULES: dict[Any, Callable[[fx.Node, int], "Rule | None"]] = {}


def register_rule(target, rule: Rule) -> None:
    """The rule of the ATen overload ``target``."""
    _RULES[target] = rule


def register_item_rule(target, make: Callable[[fx.Node, int], "Rule | None"]) -> None:
    """How ``getitem(base, k)`` of a ``target`` node is emitted: ``make(base, k)`` gives its rule."""
    _ITEM_RULES[target] = make


def rule_for(node: fx.Node) -> Rule | None:
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        base, k = node.args
        if not isinstance(base, fx.Node) or base.op != "call_function":
            return None
        make = _ITEM_RULES.get(base.target)
        return None if make is None else make(base, k)
    return _RULES.get(node.target)
