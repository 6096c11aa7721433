"""Triton code for the values of a region, op by op, rounded exactly where eager rounds.

The emitter turns a value of the captured ATen graph, asked for at an index (see
:mod:`exactdit.engine.indexing`), into lines of a kernel body. Each ATen op is emitted by the
rule :mod:`exactdit.engine.aten_ops` holds for it, and every rule follows the same contract as
the eager CUDA kernel it stands for: operands widened to the op's math type (fp32 for bf16,
fp16 and fp32), one operation with ``.rn`` rounding and no FMA contraction (the
:mod:`exactdit.device.numerics` helpers), the result rounded once to the node's dtype. A value is
kept in a variable of the node's dtype, so the next op sees exactly the bits eager hands it.

Values live in one of three shapes of the kernel's tile: ``scalar``, ``row`` (one value per row
of the tile) and ``full``. Loads pick the mask of their shape; stores and half-precision packed
ops work on full tiles.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any, Callable

import torch
import torch.fx as fx

from exactdit.engine.indexing import Index, Ix, broadcast_index, column_values, offset_code
from exactdit.engine.rules import rule_for

#: value shapes, ordered
SCALAR, ROW, FULL = 0, 1, 2

TL_DTYPE = {torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16", torch.float32: "tl.float32", torch.bool: "tl.int1"}
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: complex64 tensors are read through their fp32 view (``torch.view_as_real``: one more dim of 2)
COMPLEX = torch.complex64


class Unfusable(Exception):
    """The region cannot be emitted exactly (unsupported op, dtype or access pattern).
    ``args``: (reason, the region node whose emission failed)."""


@dataclasses.dataclass(frozen=True)
class Val:
    """A value in the generated code: variable name, torch dtype, tile shape class. A complex64
    value is two fp32 variables: ``name`` the real parts, ``imag`` the imaginary parts."""

    name: str
    dtype: torch.dtype
    kind: int
    imag: str | None = None

    def part(self, k: int) -> "Val":
        """The real (0) or imaginary (1) parts of a complex value, as an fp32 value."""
        return Val(self.imag if k else self.name, torch.float32, self.kind)


@dataclasses.dataclass
class Tile:
    """What a kernel template provides to one pass over a region's domain."""

    domain: Index  # index atoms of the domain, one per dim
    full_shape: str  # the full tile's shape, e.g. "[BLOCK_R, BLOCK_C]"
    row_shape: str | None  # shape of per-row values, None when the pass handles one row (scalars)
    mask: str  # full-tile mask variable
    row_mask: str | None  # per-row mask variable (None with one row)
    #: the tile holds whole rows (columns 0 .. width-1 from tile column 0): a value wanted at
    #: other columns of the same row can be gathered from the tile instead of recomputed
    whole_rows: bool = False
    #: the tile's last axis holds this many consecutive columns (a power of two) from a multiple
    #: of it (0: not so): a value wanted at a column of the same aligned block -- a rotary
    #: partner -- is moved between lanes (``rows_k.pair_lane`` / ``rows_k.lanes_exchanged``)
    #: instead of recomputed
    aligned_columns: int = 0


@dataclasses.dataclass(frozen=True)
class Operand:
    """A tensor the kernel reads or writes: pointer and per-dim stride argument names; ``wide``
    when it has 2^31 elements or more (64-bit offsets throughout)."""

    ptr: str
    strides: tuple[str, ...]
    wide: bool = False


def is_wide(val: torch.Tensor) -> bool:
    """Whether offsets into ``val``'s storage may not fit 32 bits."""
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(val.shape, val.stride()))
    return max(span, val.numel()) >= 2**31


def f32_bits(value: float) -> int:
    """The fp32 bit pattern of ``value`` rounded to fp32 (round to nearest even, as C++'s
    ``static_cast<float>(double)``)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def f32_literal(value: float, shape: str = "[]") -> str:
    """Generated code of ``value`` rounded to fp32, given by its bits (no parsing of a decimal
    literal, no fp64 promotion of a Python float)."""
    return f"tl.full({shape}, {f32_bits(value)}, tl.uint32).to(tl.float32, bitcast=True)"


def f32(value: float) -> float:
    """``value`` rounded to fp32, as a Python float."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def dtype_of(node: Any) -> torch.dtype:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise Unfusable(f"{node} has no tensor value")
    return val.dtype


def shape_of(node: Any) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise Unfusable(f"{node} has no tensor value")
    return tuple(int(n) for n in val.shape)


#: lane moves of any dtype, by the column each lane reads (exchanges ``c ^ d``: _lane_move)
_PAIR_MOVES = {
    "same": lambda c: c,
    "rows_k.pair_lane({}, 0)": lambda c: c & ~1,
    "rows_k.pair_lane({}, 1)": lambda c: c | 1,
}


class Emitter:
    """Emits the values of one pass of a kernel over a region.

    ``members``: the region's nodes (emitted by their rules); any other node is an input of the
    kernel, and gets an operand in ``loads`` (shared by all passes of a kernel) the first time
    it is read. ``stored``: values already written by an earlier pass, read back instead of
    recomputed; ``stats``: per-row results of reductions; ``pieces``: ``cat`` nodes whose
    piece this launch covers (see templates)."""

    def __init__(self, code: "Code", tile: Tile, *, members, loads: dict, stored: dict | None = None,
                 stats: dict | None = None, pieces: dict | None = None, tables: dict | None = None):
        self.code = code
        self.tile = tile
        self.members = members
        self.loads = loads
        self.stored = {} if stored is None else stored
        self.stats = {} if stats is None else stats  # shared with the template, filled between passes
        self.pieces = {} if pieces is None else pieces
        self.tables = {} if tables is None else tables
        self._memo: dict[tuple, Val] = {}
        self._guard: str | None = None
        self._guard_kind = SCALAR
        #: the guard's conditions as (index, lo, hi, step): lo <= index < hi, index - lo a
        #: multiple of step (what a lane move may rely on)
        self._lanes: tuple = ()
        self._lane_values: dict = {}
        #: (operand, index) of every load and store emitted, for the template's choice of tile
        self.accesses: list[tuple[Operand, Index]] = []

    # --- plumbing -------------------------------------------------------------------------------

    def let(self, expr: str, dtype: torch.dtype, kind: int, hint: str = "v") -> Val:
        return Val(self.code.let(expr, hint), dtype, kind)

    def shape(self, kind: int) -> str | None:
        if kind == FULL:
            return self.tile.full_shape
        if kind == ROW:
            return self.tile.row_shape
        return None

    def effective(self, kind: int) -> int:
        """ROW values are scalars when the pass handles one row."""
        return SCALAR if kind == ROW and self.tile.row_shape is None else kind

    def broadcast(self, v: Val, kind: int) -> Val:
        if self.effective(v.kind) >= self.effective(kind):
            return v
        return self.let(f"tl.broadcast_to({v.name}, {self.shape(kind)})", v.dtype, kind, "b")

    def widen(self, v: Val) -> str:
        """fp32 code for a float value (exact)."""
        if v.dtype == torch.float32:
            return v.name
        if v.dtype == torch.bfloat16:
            return self.code.let(f"widen_bf16({v.name})", "w")
        if v.dtype == torch.float16:
            return self.code.let(f"{v.name}.to(tl.float32)", "w")
        raise Unfusable(f"cannot widen {v.dtype}")

    def rounded(self, fp32_code: str, dtype: torch.dtype, kind: int) -> Val:
        """An fp32 result rounded once to ``dtype`` (``tensor.to(dtype)``)."""
        if dtype == torch.float32:
            return self.let(fp32_code, dtype, kind)
        if dtype in (torch.bfloat16, torch.float16):
            return self.let(f"round_to({fp32_code}, {TL_DTYPE[dtype]})", dtype, kind)
        raise Unfusable(f"cannot round to {dtype}")

    # --- values ---------------------------------------------------------------------------------

    def value(self, node: Any, index: Index) -> Val:
        """``node``'s value at ``index`` (an index of node's own shape)."""
        if not isinstance(node, fx.Node):
            raise Unfusable(f"expected a graph value, got {node!r}")
        key = (node, tuple(ix.code() for ix in index), self._guard)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        gathered = self._gathered(node, index)
        if gathered is not None:
            val = gathered
        elif node in self.stored:
            val = self.load(self.stored[node], index, dtype_of(node))
        elif node not in self.members and dtype_of(node) == COMPLEX:
            val = self._complex_input(node, index)
        elif node not in self.members:
            val = self.load(self.input_operand(node), index, dtype_of(node))
        else:
            rule = rule_for(node)
            if rule is None:
                raise Unfusable(f"no rule for {node.target}", node)
            try:
                val = rule.emit(self, node, index)
            except Unfusable as e:
                if len(e.args) < 2:  # the innermost member that could not be emitted
                    raise Unfusable(e.args[0], node) from None
                raise
        self._memo[key] = val
        return val

    def _gathered(self, node: fx.Node, index: Index) -> Val | None:
        """``node`` at other columns of the tile's own rows (a rotary partner, a permutation
        within the row), taken from ``node`` computed at the tile's columns: one set of loads and
        arithmetic serves both. Needs a node whose rows are the tile's (indices of the leading dims
        that do not depend on the column) and as wide, and
        either a column the tile's aligned block holds (``c & ~1``, ``c | 1``, ``c ^ d``: a lane
        move, :meth:`_lane_move`) or whole rows (any column: ``tl.gather``)."""
        tile = self.tile
        column = tile.domain[-1]
        if not index or index[-1] == column or not index[-1].per_element or dtype_of(node) == COMPLEX:
            return None
        # the other dims may be the tile's rows in another order (a RoPE on a transposed view of
        # the domain): what matters is that they name the lane's own row, whatever its column
        if shape_of(node)[-1] != column.bound or any(ix.per_element for ix in index[:-1]):
            return None
        move = self._lane_move(index[-1], dtype_of(node)) if tile.aligned_columns > 1 else None
        if move is None and not tile.whole_rows:
            return None
        saved = self._guard, self._guard_kind, self._lanes
        self._guard, self._guard_kind, self._lanes = None, SCALAR, ()  # every lane, not one cat piece's
        try:
            natural = self.value(node, index[:-1] + (column,))
        finally:
            self._guard, self._guard_kind, self._lanes = saved
        if self.effective(natural.kind) != FULL:
            return None
        if move == "same":
            return natural
        if move is not None:
            return self.let(move.format(natural.name), natural.dtype, FULL, "pl")
        width = column.bound
        lanes = self.code.let(
            f"tl.broadcast_to(tl.minimum({index[-1].code()}, {width - 1}), {tile.full_shape})", "gi")
        return self.let(f"tl.gather({natural.name}, {lanes}, {len(tile.full_shape.split(',')) - 1})",
                        natural.dtype, FULL, "ga")

    def _lane_move(self, ix: Ix, dtype: torch.dtype) -> str | None:
        """The lane move (code with ``{}`` for the tile's value) that reads column ``ix`` of each
        tile column c, when on every lane this pass computes (the conditions of the cat pieces
        it is inside, where they are forms of the column) ``ix`` is c itself, its pair's even or
        odd column, or ``c ^ d`` for a power of two d within the tile's aligned block (exchanges
        move 16- or 32-bit float bits: ``dtype`` a float dtype)."""
        column = self.tile.domain[-1]
        if len(column.terms) != 1 or column.terms[0][1] != 1 or column.const:
            return None
        atom = column.terms[0][0]
        values = column_values(ix, atom)
        if values is None:
            return None
        lanes = [c for c in range(atom.bound) if self._lane_computed(c, atom)]
        moves = dict(_PAIR_MOVES)
        d = 1
        while 2 * d <= self.tile.aligned_columns and dtype in FLOAT_DTYPES:
            moves[f"rows_k.lanes_exchanged({{}}, {d})"] = lambda c, d=d: c ^ d
            d *= 2
        for move, of in moves.items():
            if all(values[c] == of(c) for c in lanes):
                return move
        return None

    def _lane_computed(self, c: int, atom) -> bool:
        """Whether column ``c`` is among the lanes the current cat pieces compute (conditions not
        expressible in the column count as true: the check is then stricter, never looser)."""
        for ix, lo, hi, step in self._lanes:
            values = self._lane_values.get((ix, atom))
            if values is None:
                values = self._lane_values[(ix, atom)] = column_values(ix, atom) or []
            if values and not (lo <= values[c] < hi and (values[c] - lo) % step == 0):
                return False
        return True

    def _complex_input(self, node: fx.Node, index: Index) -> Val:
        """A complex64 input at ``index``, read through its fp32 view (last strides 2 and 1: the
        region runs eager for a complex input strided along its last dim). Where each tile column
        c asks for element c // 2 -- the interleaved fp32 view of a complex product, the rotary
        frequencies -- lane c loads part c % 2 of it, so one contiguous load reads both parts,
        and each part is moved to both lanes of its pair; otherwise two loads."""
        op = self.input_operand(node)
        column = self.tile.domain[-1]
        if self._pairs_hold(index):
            parts = Operand(op.ptr, op.strides[:-2] + ("1",), op.wide)  # (c // 2) * 2 + c % 2 == c
            f = self.load(parts, index[:-1] + (column,), torch.float32)
            if self.effective(f.kind) == FULL:
                re, im = (self.let(f"rows_k.pair_lane({f.name}, {k})", torch.float32, FULL, "pl") for k in (0, 1))
                return Val(re.name, COMPLEX, FULL, im.name)
        re, im = (self.load(op, index + (Ix.constant(k),), torch.float32) for k in (0, 1))
        return Val(re.name, COMPLEX, max(re.kind, im.kind), im.name)

    def _pairs_hold(self, index: Index) -> bool:
        """Whether ``index`` asks, at each tile column c, for element c // 2 of a row the whole
        pair (c & ~1, c | 1) shares: the tile holds aligned pairs of an even width, the other dims
        do not depend on the column, and the cat pieces being computed keep pairs together."""
        column = self.tile.domain[-1]
        if self.tile.aligned_columns < 2 or len(column.terms) != 1 or column.terms[0][1] != 1 or column.const:
            return False
        atom = column.terms[0][0]
        if atom.bound % 2 or any(ix.per_element for ix in index[:-1]):
            return False
        if column_values(index[-1], atom) != [c // 2 for c in range(atom.bound)]:
            return False
        for ix, lo, hi, step in self._lanes:
            if not ix.per_element:
                continue
            values = column_values(ix, atom)
            if values is None:
                return False
            inside = [lo <= v < hi and (v - lo) % step == 0 for v in values]
            if any(inside[c] != inside[c ^ 1] for c in range(atom.bound)):
                return False
        return True

    def input_operand(self, node: fx.Node) -> Operand:
        op = self.loads.get(node)
        if op is None:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise Unfusable(f"{node} is not a tensor")
            k = len(self.loads)
            strides = tuple(f"in{k}_s{d}" for d in range(val.dim()))
            if val.dtype == COMPLEX:  # the fp32 view's last two strides (see RegionOp._unsupported)
                strides = strides[:-1] + ("2", "1") if strides else ("1",)
            op = Operand(f"in{k}_ptr", strides, is_wide(val))
            self.loads[node] = op
        return op

    def operand(self, node: fx.Node, arg: Any, index: Index) -> Val | float:
        """An operand of a pointwise ``node`` at the node's ``index``: a tensor broadcast to the
        node's shape, or a Python number."""
        if isinstance(arg, fx.Node):
            return self.value(arg, broadcast_index(index, shape_of(node), shape_of(arg)))
        if isinstance(arg, bool) or not isinstance(arg, (int, float)):
            raise Unfusable(f"unsupported operand {arg!r}")
        return float(arg)

    def load(self, operand: Operand, index: Index, dtype: torch.dtype) -> Val:
        self.accesses.append((operand, index))
        offset = offset_code(index, operand.strides, operand.wide)
        kind = FULL if any(ix.per_element for ix in index) else (ROW if any(not ix.is_const for ix in index) else SCALAR)
        guard_kind = self.effective(self._guard_kind) if self._guard else SCALAR
        kind = max(self.effective(kind), guard_kind)
        mask = self.mask_for(kind)
        if self._guard:
            if not mask:
                mask = self._guard
            elif guard_kind < self.effective(kind):  # (the interpreter rejects a scalar & tensor mask)
                mask = f"tl.where({self._guard}, {mask}, False)"
            else:
                mask = f"{mask} & {self._guard}"
        ptr = f"{operand.ptr} + ({offset})"
        if kind > SCALAR and self.effective(kind) > SCALAR:
            ptr = f"{ptr} + tl.zeros({self.shape(kind)}, tl.int32)"  # pointer of the tile's shape
        if dtype == torch.bool:
            raise Unfusable("bool tensors are not loaded")
        expr = f"tl.load({ptr}, mask={mask}, other=0.0)" if mask else f"tl.load({ptr})"
        return self.let(expr, dtype, kind, "x")

    def mask_for(self, kind: int) -> str | None:
        kind = self.effective(kind)
        if kind == FULL:
            return self.tile.mask
        if kind == ROW:
            return self.tile.row_mask
        return None

    def guarded(self, condition: str, kind: int, fn: Callable[[], Val], lanes: tuple) -> Val:
        """Evaluate ``fn`` with loads masked by ``condition`` as well (one branch of a cat).
        ``lanes``: the condition as data, ``(index, lo, hi, step)`` (what lane moves rely on)."""
        saved = self._guard, self._guard_kind, self._lanes
        if self._guard:
            condition = self.code.let(f"{self._guard} & {condition}", "g")
            kind = max(kind, self._guard_kind)
        self._guard, self._guard_kind = condition, kind
        self._lanes = self._lanes + (lanes,)
        try:
            return fn()
        finally:
            self._guard, self._guard_kind, self._lanes = saved

    def store(self, operand: Operand, index: Index, v: Val) -> None:
        v = self.broadcast(v, FULL)
        self.accesses.append((operand, index))
        offset = offset_code(index, operand.strides, operand.wide)
        # (a pointer of the tile's shape even where the rows are one row of size-1 dims)
        self.code.line(f"tl.store({operand.ptr} + ({offset}) + tl.zeros({self.tile.full_shape}, tl.int32), "
                       f"{v.name}, mask={self.tile.mask})")

    def constant(self, value: float, dtype: torch.dtype, kind: int = SCALAR) -> Val:
        """A scalar operand as eager's CUDA kernels see it: rounded to fp32 (opmath) and, for a
        half-precision tensor value, to that dtype."""
        v = self.let(f32_literal(value, self.shape(kind) or "[]"), torch.float32, kind, "k")
        return v if dtype == torch.float32 else self.rounded(v.name, dtype, kind)


class Code:
    """Lines of a kernel body with common-subexpression reuse of ``let`` bindings."""

    def __init__(self, indent: str = "    ", counter: list[int] | None = None):
        self.indent = indent
        self.lines: list[str] = []
        self._names: dict[str, str] = {}
        self._counter = counter if counter is not None else [0]

    def let(self, expr: str, hint: str = "v") -> str:
        name = self._names.get(expr)
        if name is None:
            self._counter[0] += 1
            name = f"{hint}{self._counter[0]}"
            self._names[expr] = name
            self.lines.append(f"{self.indent}{name} = {expr}")
        return name

    def line(self, text: str) -> None:
        self.lines.append(f"{self.indent}{text}")

    def scope(self, indent: str) -> "Code":
        """A nested block (a loop body): fresh bindings, names that never clash with ours."""
        return Code(indent, self._counter)

    def extend(self, inner: "Code") -> None:
        self.lines.extend(inner.lines)

    def text(self) -> str:
        return "\n".join(self.lines)
