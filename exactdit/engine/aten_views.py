"""The engine's rules for ATen's views, ``cat``/``stack`` and ``slice_scatter``: a view moves an
index from its output to its input (no data moves), a cat picks per index the input that holds the
element, a ``split``/``unbind`` output is a view of its input (registered for ``getitem``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx as fx

from exactdit.engine.aten_ops import _kwarg, _register
from exactdit.engine.emit import COMPLEX, FULL, ROW, Emitter, Unfusable, Val, shape_of
from exactdit.engine.indexing import Index, Ix, broadcast_index, int_code, reshape_index
from exactdit.engine.rules import CAT, VIEW, Rule, register_item_rule

aten = torch.ops.aten


# --- views --------------------------------------------------------------------------------------


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_SQUEEZES = (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
#: views that keep their input's elements in row-major order, only the shape changes (a squeeze's
#: or unsqueeze's rule drops or inserts the size-1 dims directly)
RESHAPES = _VIEWS + (aten.unsqueeze.default,) + _SQUEEZES
#: views that reorder their input's dims (:func:`permutation`)
PERMUTES = (aten.permute.default, aten.t.default, aten.transpose.int)


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _view_rule(index_of: Callable[[fx.Node, Index], Index]) -> Rule:
    def emit(em, node, index):
        return em.value(node.args[0], index_of(node, index))

    return Rule(VIEW, emit)


def _reshape(node, index):
    return reshape_index(index, shape_of(node), shape_of(node.args[0]))


def _unsqueeze(node, index):
    d = _dim(node.args[1], len(shape_of(node)))
    return index[:d] + index[d + 1:]


def _squeeze(node, index):
    in_shape = shape_of(node.args[0])
    if node.target is aten.squeeze.default:
        dims = [i for i, n in enumerate(in_shape) if n == 1]
    else:
        raw = node.args[1]
        dims = [_dim(d, len(in_shape)) for d in (raw if isinstance(raw, (list, tuple)) else [raw])]
        dims = [d for d in dims if in_shape[d] == 1]
    out, k = [], 0
    for i in range(len(in_shape)):
        if i in dims:
            out.append(Ix())
        else:
            out.append(index[k])
            k += 1
    return tuple(out)


def _expand(node, index):
    return broadcast_index(index, shape_of(node), shape_of(node.args[0]))


def permutation(node: fx.Node) -> list[int]:
    """The input dim of each output dim of a ``permute``, ``t`` or ``transpose``: output dim ``i``
    is input dim ``permutation(node)[i]``."""
    rank = len(shape_of(node))
    if node.target is aten.permute.default:
        return [_dim(d, rank) for d in node.args[1]]
    dims = list(range(rank))
    if node.target is aten.t.default:
        return dims[::-1]
    a, b = (_dim(d, rank) for d in node.args[1:3])
    dims[a], dims[b] = dims[b], dims[a]
    return dims


def _permute(node, index):
    out: list[Ix] = [Ix()] * len(index)
    for i, d in enumerate(permutation(node)):
        out[d] = index[i]
    return tuple(out)


def _select(node, index):
    in_shape = shape_of(node.args[0])
    d = _dim(node.args[1], len(in_shape))
    k = node.args[2] + in_shape[d] if node.args[2] < 0 else node.args[2]
    return index[:d] + (Ix.constant(k),) + index[d:]


def _slice_start(size: int, start, step) -> int:
    start = 0 if start is None else start
    if start < 0:
        start += size
    return min(max(start, 0), size)


def _slice(node, index):
    in_shape = shape_of(node.args[0])
    d = _dim(node.args[1] if len(node.args) > 1 else 0, len(in_shape))
    start = _slice_start(in_shape[d], node.args[2] if len(node.args) > 2 else 0, None)
    step = node.args[4] if len(node.args) > 4 else 1
    out = list(index)
    out[d] = index[d] * step + start
    return tuple(out)


def _slice_check(node):
    step = node.args[4] if len(node.args) > 4 else 1
    return None if isinstance(step, int) and step >= 1 else f"slice step {step!r}"


_register(_VIEWS, _view_rule(_reshape))


def _view_as_complex(em, node, index):
    x = node.args[0]
    re, im = (em.value(x, index + (Ix.constant(k),)) for k in (0, 1))
    if re.dtype != torch.float32:
        raise Unfusable("view_as_complex of a non-fp32 tensor")
    return Val(re.name, COMPLEX, max(re.kind, im.kind), im.name)


def _view_as_real(em, node, index):
    c = em.value(node.args[0], index[:-1])
    k = index[-1]
    if k.is_const:
        return c.part(k.const)
    kind = FULL if k.per_element else c.kind
    return em.let(f"tl.where({k.code()} == 0, {c.name}, {c.imag})", torch.float32, max(kind, c.kind))


_register([aten.view_as_complex.default], Rule(VIEW, _view_as_complex))
_register([aten.view_as_real.default], Rule(VIEW, _view_as_real))
_register([aten.unsqueeze.default], _view_rule(_unsqueeze))
_register(_SQUEEZES, _view_rule(_squeeze))
_register([aten.expand.default], _view_rule(_expand))
_register(PERMUTES, _view_rule(_permute))
_register([aten.select.int], _view_rule(_select))
_register([aten.slice.Tensor], Rule(VIEW, _view_rule(_slice).emit, _slice_check))


def forwards_index(node: fx.Node) -> bool:
    """Whether :func:`forward_index` inverts ``node``'s rule (a view of the same element count)."""
    return node.target in PERMUTES or node.target in RESHAPES


def forward_index(node: fx.Node, index: Index) -> Index:
    """The index of the output element of a :data:`PERMUTES` or :data:`RESHAPES` view that is
    its input's element at ``index``: the view's rule read the other way (the templates follow a
    region's outputs forward from its domain, :func:`exactdit.engine.templates.base.output_index`)."""
    if node.target in PERMUTES:
        return tuple(index[d] for d in permutation(node))
    return reshape_index(index, shape_of(node.args[0]), shape_of(node))


def _split_pieces(base: fx.Node) -> list[tuple[int, int]] | None:
    """(start, size) of each output of a ``split`` / ``split_with_sizes`` along its dim."""
    size = shape_of(base.args[0])[_dim(base.args[2] if len(base.args) > 2 else 0, len(shape_of(base.args[0])))]
    if base.target is aten.split.Tensor:
        step = base.args[1]
        sizes = [min(step, size - s) for s in range(0, size, step)]
    else:
        sizes = list(base.args[1])
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return list(zip(starts, sizes))


def _split_item(base: fx.Node, k: int) -> Rule:
    """Output ``k`` of a ``split``: a view of its input shifted along the split dim."""
    def index_of(n, index, base=base, k=k):
        in_shape = shape_of(base.args[0])
        d = _dim(base.args[2] if len(base.args) > 2 else 0, len(in_shape))
        start = _split_pieces(base)[k][0]
        out = list(index)
        out[d] = index[d] + start
        return tuple(out)

    return Rule(VIEW, lambda em, n, index: em.value(base.args[0], index_of(n, index)))


def _unbind_item(base: fx.Node, k: int) -> Rule:
    """Output ``k`` of an ``unbind``: its input at ``k`` along the unbound dim."""
    def emit(em, n, index, base=base, k=k):
        in_shape = shape_of(base.args[0])
        d = _dim(base.args[1] if len(base.args) > 1 else 0, len(in_shape))
        return em.value(base.args[0], index[:d] + (Ix.constant(k),) + index[d:])

    return Rule(VIEW, emit)


register_item_rule(aten.split.Tensor, _split_item)
register_item_rule(aten.split_with_sizes.default, _split_item)
register_item_rule(aten.unbind.int, _unbind_item)


# --- cat / stack --------------------------------------------------------------------------------


def _cat_check(node):
    tensors = node.args[0]
    if not all(isinstance(t, fx.Node) for t in tensors):
        return "cat of non-graph values"
    dtypes = {t.meta["val"].dtype for t in tensors}
    if len(dtypes) != 1:
        return "cat with type promotion"
    return None


def cat_pieces(node: fx.Node) -> tuple[int, list[tuple[fx.Node, int, int]]]:
    """(dim, [(input, start, size)]) of a cat or stack along the dim of its output; stack
    inputs count as size-1 pieces (empty inputs skipped)."""
    rank = len(shape_of(node))
    d = _dim(_kwarg(node, "dim", 1, 0), rank)
    pieces, start = [], 0
    for t in node.args[0]:
        size = 1 if node.target is aten.stack.default else shape_of(t)[d] if len(shape_of(t)) == rank else 0
        if size:
            pieces.append((t, start, size))
        start += size
    return d, pieces


def _piece_index(node: fx.Node, index: Index, d: int, start: int, t: fx.Node) -> Index:
    if node.target is aten.stack.default:
        return index[:d] + index[d + 1:]
    local = index[d].minus_const(start) if start else index[d]
    size = shape_of(t)[d]
    if local.bound > size and local.const == 0 and len(local.terms) == 1 and local.terms[0][1] == 1 \
            and not local.per_element:
        # a row dim read only where the piece is selected: its index is below the piece's size,
        # which lets a view of the piece (a reshape over its dims) keep the index whole instead
        # of ``i % size`` (columns keep their atoms: lane moves recognise them)
        local = Ix.of(dataclasses.replace(local.terms[0][0], bound=size))
    return index[:d] + (local,) + index[d + 1:]


def _cat_emit(em: Emitter, node: fx.Node, index: Index) -> Val:
    d, pieces = cat_pieces(node)
    if node in em.pieces:  # this launch covers one piece: no selection needed
        t, start, _ = pieces[em.pieces[node]]
        return em.value(t, _piece_index(node, index, d, start, t))
    i = index[d]
    if i.is_const:
        for t, start, size in pieces:
            if start <= i.const < start + size:
                return em.value(t, _piece_index(node, index, d, start, t))
    kind = FULL if i.per_element else ROW
    result: Val | None = None
    for t, start, size in reversed(pieces):
        lo, hi = start, start + size
        if lo >= i.bound:  # past what the index reaches (the cat is sliced after): never read
            continue
        cond_parts = []
        if lo > 0:
            cond_parts.append(f"({i.code()} >= {int_code(lo, i.per_element)})")
        if hi < i.bound:
            cond_parts.append(f"({i.code()} < {int_code(hi, i.per_element)})")
        cond = em.code.let(" & ".join(cond_parts) or "True", "p") if cond_parts else None
        piece = (
            em.guarded(cond, kind, lambda t=t, start=start: em.value(t, _piece_index(node, index, d, start, t)),
                       (i, lo, hi, 1))
            if cond else em.value(t, _piece_index(node, index, d, start, t))
        )
        if result is None or cond is None:  # no condition: this piece holds every column reached
            result = piece
        else:
            k = max(piece.kind, result.kind, kind)
            result = em.let(f"tl.where({cond}, {piece.name}, {result.name})", result.dtype, k)
    return result


_register([aten.cat.default, aten.stack.default], Rule(CAT, _cat_emit, _cat_check))


def _slice_scatter_check(node):
    step = node.args[5] if len(node.args) > 5 else 1
    if step != 1 and not isinstance(step, int):
        return f"slice_scatter step {step!r}"
    base, src = node.args[0], node.args[1]
    if base.meta["val"].dtype != src.meta["val"].dtype:
        return "slice_scatter with type promotion"
    return None


def _slice_scatter_emit(em, node, index):
    base, src = node.args[0], node.args[1]
    shape = shape_of(node)
    d = _dim(node.args[2] if len(node.args) > 2 else 0, len(shape))
    start = _slice_start(shape[d], node.args[3] if len(node.args) > 3 else 0, None)
    end = node.args[4] if len(node.args) > 4 and node.args[4] is not None else shape[d]
    end = min(end + shape[d] if end < 0 else end, shape[d])
    step = node.args[5] if len(node.args) > 5 else 1
    i = index[d]
    num = lambda v: int_code(v, i.per_element)  # noqa: E731
    inside = [f"({i.code()} >= {num(start)})", f"({i.code()} < {num(end)})"]
    if step > 1:
        inside.append(f"((({i.code()}) - {num(start)}) % {num(step)} == 0)")
    kind = FULL if i.per_element else ROW
    cond = em.code.let(" & ".join(inside), "p")
    # where the condition holds i = start + step * local, so local = i // step - start // step: a
    # form of i itself (a rotary pair's lanes are then recognised as columns of the same tile)
    local = i.floordiv(step).minus_const(start // step) if step > 1 else i.minus_const(start)
    src_index = index[:d] + (local,) + index[d + 1:]
    inner = em.guarded(cond, kind, lambda: em.value(src, src_index), (i, start, end, step))
    outer = em.value(base, index)
    k = max(inner.kind, outer.kind, kind)
    return em.let(f"tl.where({cond}, {inner.name}, {outer.name})", outer.dtype, k)


_register([aten.slice_scatter.default], Rule(CAT, _slice_scatter_emit, _slice_scatter_check))
