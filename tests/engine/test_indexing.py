"""Index arithmetic of the engine (:mod:`exactdit.engine.indexing`) and the index maps of views."""

from __future__ import annotations

import pytest
import torch

from exactdit.engine.aten_views import forward_index, forwards_index
from exactdit.engine.indexing import Atom, Ix, broadcast_index, column_values, reshape_index
from exactdit.engine.rules import rule_for
from tests.engine_helpers import GraphBuilder

aten = torch.ops.aten


def _atoms(shape):
    return tuple(Ix.of(Atom(f"i{d}", n, d == len(shape) - 1)) for d, n in enumerate(shape))


def test_view_and_its_inverse_give_back_the_atoms():
    index = _atoms((2, 24, 4, 32))
    split = reshape_index(index, (2, 24, 4, 32), (2, 24, 128))
    assert reshape_index(split, (2, 24, 128), (2, 24, 4, 32)) == index
    pairs = reshape_index(index, (2, 24, 4, 32), (2, 24, 4, 16, 2))
    assert pairs[3].code() == "(i3 // 2)" and pairs[4].code() == "(i3 % 2)"
    assert reshape_index(pairs, (2, 24, 4, 16, 2), (2, 24, 4, 32)) == index


def test_index_bounds_and_broadcast():
    i = Ix.of(Atom("c", 16, True))
    assert (i * 4 + 3).floordiv(4) == i and (i * 4 + 3).mod(4) == Ix.constant(3)
    assert i.floordiv(16) == Ix() and i.mod(32) == i
    assert broadcast_index(_atoms((2, 5, 8)), (2, 5, 8), (2, 1, 8))[1] == Ix()
    assert i.minus_const(5) + 5 == i and i.minus_const(5) + 7 == i + 2  # a cat piece sliced back


def test_column_values_follow_what_an_index_computes():
    c = Atom("c", 512, True)
    head = Ix.of(c).mod(128)  # a column within its head, as a view to heads gives it
    partner_even = Ix.of(c).floordiv(128) * 128 + head.floordiv(2) * 2  # x[..., 0::2] of that head
    assert column_values(partner_even, c) == [v & ~1 for v in range(512)]
    assert column_values(partner_even + 1, c) == [v | 1 for v in range(512)]
    assert column_values(Ix.of(Atom("r", 4, False)) + Ix.of(c), c) is None  # another atom: unknown
    assert column_values(Ix.of(c).minus_const(64), c) == [v - 64 for v in range(512)]  # a cat piece's column
    assert column_values(Ix.of(Atom("(c * 3)", 1536, True)), c) is None  # an atom of unknown origin


class _Reads:
    """An emitter stand-in: a view's rule reads its input at an index, returned here."""

    def value(self, node, index):
        return index


@pytest.mark.parametrize("target, args", [
    (aten.permute.default, ([2, 0, 3, 1],)), (aten.permute.default, ([-1, 0, 1, -2],)),
    (aten.transpose.int, (1, -1)), (aten.view.default, ([6, 4],)), (aten.view.default, ([2, 3, 2, 2],)),
    (aten.reshape.default, ([2, 12],)), (aten._unsafe_view.default, ([24],)), (aten.unsqueeze.default, (1,)),
    (aten.squeeze.dim, (2,)), (aten.squeeze.default, ()), (aten.squeeze.dims, ([2],)),
], ids=lambda a: str(a))
def test_forward_index_inverts_each_views_rule(target, args):
    """Following a region's output forward (templates) and reading a view's input (its rule) are
    one map read both ways."""
    b = GraphBuilder()
    node = b.op(target, b.input(torch.zeros(2, 3, 1, 4)), *args)
    index = _atoms((2, 3, 1, 4))
    assert forwards_index(node)
    assert rule_for(node).emit(_Reads(), node, forward_index(node, index)) == index


def test_forward_index_of_t():
    b = GraphBuilder()
    node = b.op(aten.t.default, b.input(torch.zeros(3, 5)))
    index = _atoms((3, 5))
    assert forward_index(node, index) == index[::-1]
    assert rule_for(node).emit(_Reads(), node, index[::-1]) == index


def test_per_row_integers_become_arguments_while_a_kernel_is_generated():
    from exactdit.engine.indexing import row_int, row_ints, row_ints_used

    row = Atom("rows", 96, False)
    col = Atom("cols", 64, True)
    assert Ix.of(row).mod(24).terms[0][0].code == "(rows % 24)"  # outside generation: literals
    with row_ints() as ints:
        per_row = (Ix.of(row) * 3 + 7).floordiv(12)
        per_element = Ix.of(col) * 3 + 7
        source = f"{per_row.code()} {per_element.code()} {row_int(96)} {row_int(1)} {row_int(7)}"
        assert "row_int" not in per_element.code() and "7" in per_element.code()
        assert row_int(1) == "1" and row_int(0) == "0"  # structure, not size
        assert row_int(7) == row_int(7) != row_int(96)  # one argument per value
        used = row_ints_used(source)
        assert sorted(v for _, v in used) == [3, 7, 12, 96] and ints.used_in("nothing") == []
        assert all(name in source for name, _ in used)
    assert row_ints_used(source) == []
