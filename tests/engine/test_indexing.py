"""Index arithmetic of the engine (:mod:`exactdit.engine.indexing`)."""

from __future__ import annotations

import torch

from exactdit.engine.indexing import Atom, Ix, broadcast_index, column_values, reshape_index

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
