"""Rules for the outputs of the reductions the templates compute (``native_layer_norm``,
``_fused_rms_norm``, ``mean``): each reads the row statistics the template's pass 1 computed."""

from __future__ import annotations

import torch
import torch.fx as fx

from exactdit.engine.emit import Emitter, Unfusable, Val, dtype_of
from exactdit.engine.indexing import Index, Ix
from exactdit.engine.rules import REDUCTION_OUTPUT, Rule, register_item_rule, register_rule
from exactdit.engine.templates.norms import _row_form, why_not_reduction

aten = torch.ops.aten


def _row_stats(em: Emitter, red: fx.Node, row: Index) -> dict:
    """The statistics of ``red`` for the row ``row`` (leading index) -- which must be the row
    the pass is on: a value cannot read another row's statistics."""
    stats = em.stats.get(red)
    if stats is None:
        raise Unfusable("the reduction's statistics are not computed before this value")
    if not _row_form(tuple(row) + (Ix(),), stats["shape"]).same_value(stats["row"]):
        raise Unfusable("reads the statistics of another row")
    return stats


def _stat_rule(field: str):
    def emit(em: Emitter, node: fx.Node, index: Index) -> Val:
        red = node.args[0]
        return _row_stats(em, red, index[:-1])[field]

    return Rule(REDUCTION_OUTPUT, emit)


def _layer_norm_output(em: Emitter, node: fx.Node, index: Index) -> Val:
    ln = node.args[0]
    x_node, _, weight, bias = ln.args[:4]
    stats = _row_stats(em, ln, index[:-1])
    x = em.widen(em.broadcast(em.value(x_node, index), 2))
    w = em.widen(em.value(weight, index[-1:])) if weight is not None else x
    b = em.widen(em.value(bias, index[-1:])) if bias is not None else x
    y = f"ln_k.normalized({x}, {stats['mean'].name}, {stats['rstd'].name}, {w}, {b}, {weight is not None}, {bias is not None})"
    return em.rounded(y, dtype_of(node), 2)


def _rms_norm_output(em: Emitter, node: fx.Node, index: Index) -> Val:
    red = node.args[0]
    x_node, _, weight = red.args[:3]
    stats = _row_stats(em, red, index[:-1])
    x = em.widen(em.broadcast(em.value(x_node, index), 2))
    w = em.widen(em.value(weight, index[-1:])) if weight is not None else x
    y = f"rope_k.rms_normed({x}, {w}, {stats['rstd'].name}, tl.float32, {weight is not None})"
    return em.rounded(em.code.let(y, "n"), dtype_of(node), 2)


def _outputs(*rules):
    return lambda base, k: rules[k] if k < len(rules) else None


_REDUCTION_OUTPUTS = {
    aten.native_layer_norm.default: _outputs(Rule(REDUCTION_OUTPUT, _layer_norm_output), _stat_rule("mean"),
                                             _stat_rule("rstd")),
    aten._fused_rms_norm.default: _outputs(Rule(REDUCTION_OUTPUT, _rms_norm_output), _stat_rule("rstd")),
}


def _mean_output(em: Emitter, node: fx.Node, index: Index) -> Val:
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    return _row_stats(em, node, index[:-1] if keepdim else index)["mean"]


for _target, _make in _REDUCTION_OUTPUTS.items():
    register_item_rule(_target, _make)
register_rule(aten.mean.dim, Rule(REDUCTION_OUTPUT, _mean_output, lambda node: why_not_reduction(node)))
