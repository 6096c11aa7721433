"""Integer index expressions for generated kernels, and how ATen's view ops move them.

A generated kernel evaluates every value of a region at a multi-index of that value's own shape.
The kernel's loop supplies the index of the region's domain (one index atom per dim); view ops
(``view``, ``permute``, ``select``, ``slice``, ``expand``, ...) and ``cat`` map the index of
their output to the index of their input, so a value is never materialised to be viewed: its
producer is evaluated at the mapped index, and a load from memory uses the tensor's strides.

Indices are linear forms ``sum(coeff * atom) + const`` over atoms (named integer expressions of
the generated code) with known exclusive upper bounds. Floor division and remainder by a
constant are simplified when the form splits into a multiple of the divisor plus a part known to
be smaller than it -- which is what splitting and merging dims produce -- so a ``view`` and the
``view`` that undoes it leave the original atoms, and two indices of the same row compare equal.

Integers of per-row arithmetic (row counts, divisors, cat boundaries and offsets along the rows)
are written as kernel arguments while a kernel is generated (:func:`row_ints`), not as literals:
they are what a new resolution changes, so its kernels keep the same source and reuse the
compiled binaries. The structure still follows the sizes (a form that simplifies at one size may
not at another); sources that differ are simply compiled, and equal sources compute the same
values, because an argument holds exactly the literal it stands for.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from typing import Iterator, Sequence


class RowInts:
    """The per-row integers of one kernel being generated: value -> argument name, in order of use."""

    PATTERN = re.compile(r"\brow_int\d+\b")

    def __init__(self):
        self.names: dict[int, str] = {}

    def name(self, value: int) -> str:
        name = self.names.get(value)
        if name is None:
            name = self.names[value] = f"row_int{len(self.names)}"
        return name

    def used_in(self, source: str) -> list[tuple[str, int]]:
        """(name, value) of the arguments ``source`` reads, in order of first use."""
        used = set(self.PATTERN.findall(source))
        return [(name, value) for value, name in self.names.items() if name in used]


_ROW_INTS: contextvars.ContextVar[RowInts | None] = contextvars.ContextVar("row_ints", default=None)


@contextlib.contextmanager
def row_ints() -> Iterator[RowInts]:
    """Per-row integers written from here on become arguments of the kernel being generated."""
    ints = RowInts()
    token = _ROW_INTS.set(ints)
    try:
        yield ints
    finally:
        _ROW_INTS.reset(token)


def row_ints_used(source: str) -> list[tuple[str, int]]:
    """(name, value) of the per-row integer arguments ``source`` reads (none outside :func:`row_ints`)."""
    ints = _ROW_INTS.get()
    return [] if ints is None else ints.used_in(source)


def row_int(value: int) -> str:
    """``value`` in per-row index arithmetic: an argument's name inside :func:`row_ints` (0 and 1,
    which decide structure rather than size, stay literal), else the literal."""
    ints = _ROW_INTS.get()
    return str(value) if ints is None or value < 2 else ints.name(int(value))


def int_code(value: int, per_element: bool) -> str:
    """``value`` in an index expression: a literal per element, :func:`row_int` per row."""
    return str(value) if per_element else row_int(value)


@dataclasses.dataclass(frozen=True)
class Atom:
    """A named integer expression of the generated code, ``0 <= value < bound``."""

    code: str
    bound: int
    #: depends on the column loop (per element) rather than only on the row (per row)
    per_element: bool
    #: for ``base // k``, ``base % k`` and ``base - k``: (base, "//", "%" or "-", k), so that
    #: ``(x // k) * k + x % k`` folds back to ``x`` and a value can be computed from ``base``
    origin: tuple | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Ix:
    """``sum(coeff * atom) + const`` with non-negative coefficients and constant."""

    terms: tuple[tuple[Atom, int], ...] = ()
    const: int = 0

    # construction ------------------------------------------------------------------------------

    @staticmethod
    def of(atom: Atom) -> "Ix":
        return Ix(((atom, 1),), 0) if atom.bound > 1 else Ix()

    @staticmethod
    def constant(value: int) -> "Ix":
        if value < 0:
            raise ValueError("indices are non-negative")
        return Ix((), int(value))

    # queries -----------------------------------------------------------------------------------

    @property
    def is_const(self) -> bool:
        return not self.terms

    @property
    def bound(self) -> int:
        """Exclusive upper bound of the value."""
        return self.const + sum(c * (a.bound - 1) for a, c in self.terms) + 1

    @property
    def per_element(self) -> bool:
        return any(a.per_element for a, _ in self.terms)

    def code(self) -> str:
        each = self.per_element
        parts = [a.code if c == 1 else f"{a.code} * {int_code(c, each)}" for a, c in self.terms]
        if self.const or not parts:
            parts.append(int_code(self.const, each))
        return parts[0] if len(parts) == 1 else "(" + " + ".join(parts) + ")"

    # arithmetic --------------------------------------------------------------------------------

    def __add__(self, other: "Ix | int") -> "Ix":
        other = other if isinstance(other, Ix) else Ix.constant(other)
        coeffs: dict[Atom, int] = dict(self.terms)
        for a, c in other.terms:
            coeffs[a] = coeffs.get(a, 0) + c
        const = self.const + other.const
        # (x // k) * c * k + (x % k) * c  ->  x * c
        for a in list(coeffs):
            if a not in coeffs or a.origin is None or a.origin[1] != "%":
                continue
            base, _, k = a.origin
            q = next((b for b in coeffs if b.origin is not None and b.origin[1] == "//" and b.origin[0] == base
                      and b.origin[2] == k and coeffs[b] == coeffs[a] * k), None)
            if q is not None:
                c = coeffs.pop(a)
                coeffs.pop(q)
                folded = base * c
                for b, cb in folded.terms:
                    coeffs[b] = coeffs.get(b, 0) + cb
                const += folded.const
        # (x - k) * c + k * c  ->  x * c: a cat piece's index that a slice of the piece's source
        # moves back by the piece's start (the same row as the cat's, so it reads the same statistics)
        for a in list(coeffs):
            if a.origin is None or a.origin[1] != "-" or const < a.origin[2] * coeffs[a]:
                continue
            base, _, k = a.origin
            c = coeffs.pop(a)
            const -= k * c
            for b, cb in (base * c).terms:
                coeffs[b] = coeffs.get(b, 0) + cb
            const += base.const * c
        return Ix(_sorted(coeffs), const)

    def same_value(self, other: "Ix") -> bool:
        """Whether two forms compute the same value: the same terms by code (an atom's bound is
        what is known about it where it is read -- a cat piece knows more -- not its value)."""
        codes = lambda ix: sorted((a.code, c) for a, c in ix.terms)  # noqa: E731
        return self.const == other.const and codes(self) == codes(other)

    def minus_const(self, value: int) -> "Ix":
        """``self - value`` where the result is known to be non-negative (cat pieces)."""
        if value <= self.const:
            return Ix(self.terms, self.const - value)
        # the constant cannot absorb it: keep the subtraction as an atom of its own
        code = f"({self.code()} - {int_code(value, self.per_element)})"
        atom = Atom(code, max(1, self.bound - value), self.per_element, (self, "-", value))
        return Ix.of(atom)

    def __mul__(self, k: int) -> "Ix":
        if k == 0:
            return Ix()
        return Ix(tuple((a, c * k) for a, c in self.terms), self.const * k)

    def _split(self, k: int) -> tuple["Ix", "Ix"] | None:
        """(q, m) with self == q * k + m and 0 <= m < k, when the form allows it."""
        high: dict[Atom, int] = {}
        low: dict[Atom, int] = {}
        for a, c in self.terms:
            if c % k == 0:
                high[a] = c // k
            else:
                low[a] = c
        low_ix = Ix(_sorted(low), self.const % k)
        if low_ix.bound > k:
            return None
        return Ix(_sorted(high), self.const // k), low_ix

    def floordiv(self, k: int) -> "Ix":
        if k == 1:
            return self
        if self.bound <= k:
            return Ix()
        split = self._split(k)
        if split is not None:
            return split[0]
        code = f"({self.code()} // {int_code(k, self.per_element)})"
        return Ix.of(Atom(code, (self.bound - 1) // k + 1, self.per_element, (self, "//", k)))

    def mod(self, k: int) -> "Ix":
        if k == 1:
            return Ix()
        if self.bound <= k:
            return self
        split = self._split(k)
        if split is not None:
            return split[1]
        return Ix.of(Atom(f"({self.code()} % {int_code(k, self.per_element)})", k, self.per_element,
                          (self, "%", k)))


def column_values(ix: Ix, column: Atom) -> list[int] | None:
    """The values of ``ix`` at every value of ``column`` (0 .. bound - 1), where ``ix`` is a form
    of ``column`` alone (through floor divisions, remainders and subtractions); None otherwise. Lets an
    index be recognised by what it computes rather than by how its form was written."""
    memo: dict[Atom, list[int] | None] = {}

    def atom_values(a: Atom) -> list[int] | None:
        if a == column:
            return list(range(column.bound))
        if a not in memo:
            base = None if a.origin is None else form_values(a.origin[0])
            if base is None:
                memo[a] = None
            else:
                k, op = a.origin[2], a.origin[1]
                memo[a] = [v // k if op == "//" else v % k if op == "%" else v - k for v in base]
        return memo[a]

    def form_values(form: Ix) -> list[int] | None:
        total = [form.const] * column.bound
        for a, c in form.terms:
            vals = atom_values(a)
            if vals is None:
                return None
            total = [t + c * v for t, v in zip(total, vals)]
        return total

    return form_values(ix)


def _sorted(coeffs: dict[Atom, int]) -> tuple[tuple[Atom, int], ...]:
    return tuple(sorted(((a, c) for a, c in coeffs.items() if c), key=lambda ac: ac[0].code))


Index = tuple[Ix, ...]


def linearize(index: Index, shape: Sequence[int]) -> Ix:
    """Row-major linear position of ``index`` in ``shape``."""
    total = Ix()
    for i, n in zip(index, shape):
        total = total * int(n) + i
    return total


def delinearize(linear: Ix, shape: Sequence[int]) -> Index:
    """The multi-index of row-major position ``linear`` in ``shape``."""
    out = []
    for n in reversed(shape):
        out.append(linear.mod(int(n)))
        linear = linear.floordiv(int(n))
    return tuple(reversed(out))


def reshape_index(index: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Index into ``in_shape`` of the element at ``index`` of a view/reshape to ``out_shape``
    (views keep row-major element order). Dims are matched in groups of equal products so that
    the arithmetic stays local to the dims a view really splits or merges."""
    out_shape, in_shape = [int(n) for n in out_shape], [int(n) for n in in_shape]
    if math.prod(out_shape) != math.prod(in_shape):
        raise ValueError(f"cannot view {in_shape} as {out_shape}")
    result: list[Ix] = []
    i = j = 0
    while i < len(out_shape) or j < len(in_shape):
        # grow a group until both sides have the same product (size-1 dims join any group)
        gi, gj = [i], [j]
        po = out_shape[i] if i < len(out_shape) else 1
        pi = in_shape[j] if j < len(in_shape) else 1
        i, j = i + 1, j + 1
        while po != pi:
            if po < pi:
                gi.append(i)
                po *= out_shape[i]
                i += 1
            else:
                gj.append(j)
                pi *= in_shape[j]
                j += 1
        outs = [k for k in gi if k < len(out_shape)]
        ins = [k for k in gj if k < len(in_shape)]
        lin = linearize([index[k] for k in outs], [out_shape[k] for k in outs])
        result.extend(delinearize(lin, [in_shape[k] for k in ins]))
    return tuple(result)


def broadcast_index(index: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Index into an operand of ``in_shape`` broadcast to ``out_shape`` (aligned on the right;
    size-1 operand dims read element 0)."""
    lead = len(out_shape) - len(in_shape)
    if lead < 0:
        raise ValueError(f"{list(in_shape)} does not broadcast to {list(out_shape)}")
    return tuple(Ix() if int(n) == 1 else index[lead + k] for k, n in enumerate(in_shape))


def offset_code(index: Index, strides: Sequence[str], wide: bool = False) -> str:
    """``sum(index[d] * stride[d])`` in generated code, dims of index 0 dropped. Indices are 32-bit;
    per-row terms are widened to 64 bits before the multiply (computed once per row), per-element
    terms only for a tensor of 2^31 elements or more (``wide``)."""
    parts = []
    for ix, st in zip(index, strides):
        if ix.is_const and ix.const == 0:
            continue
        if ix.is_const:
            parts.append(f"tl.full((), {ix.const}, tl.int64) * {st}" if wide else f"{ix.const} * {st}")
        elif wide or not ix.per_element:
            parts.append(f"({ix.code()}).to(tl.int64) * {st}")
        else:
            parts.append(f"{ix.code()} * {st}")
    return " + ".join(parts) if parts else "0"
