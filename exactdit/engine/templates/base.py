"""What every kernel template shares: the generated kernel (source, arguments, grid), its
parameters and signature, table preambles, row indices, and forwarding an output's index
through the views between it and the region's domain."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from exactdit.engine.aten_ops import POINTWISE, UNARY_TABLE, rule_for
from exactdit.engine.aten_views import forward_index, forwards_index
from exactdit.engine.emit import Code, Emitter, Operand, is_wide, shape_of
from exactdit.engine.indexing import Atom, Index, Ix, reshape_index, row_int, row_ints_used
from exactdit.engine.region import Launch, Region
from exactdit.engine.tables import CONSTEXPR_FIELDS


@dataclasses.dataclass(frozen=True)
class GeneratedKernel:
    source: str
    #: the region inputs this kernel reads, in the order of its ``in<k>`` parameters
    inputs: tuple[fx.Node, ...]
    #: kernel parameters in order: ("in", k) / ("out", k) / ("tab", k) pointers, then
    #: ("in_stride", k, d) / ("out_stride", k, d) integers (k indexes ``inputs`` /
    #: the region's outputs / its tables), then ("int", name, value): the per-row integers
    #: (:func:`~exactdit.engine.indexing.row_ints`)
    params: tuple[tuple, ...]
    constexprs: tuple[tuple[str, int], ...]
    grid: tuple[int, ...]
    num_warps: int
    #: further launch options (``num_stages``) as (name, value) pairs
    launch_options: tuple[tuple[str, int], ...] = ()


def output_operands(region: Region) -> list[Operand]:
    return [
        Operand(f"out{k}_ptr", tuple(f"out{k}_s{d}" for d in range(len(shape_of(n)))), is_wide(n.meta["val"]))
        for k, n in enumerate(region.outputs)
    ]


def _params(region: Region, inputs: list[fx.Node]) -> tuple[tuple, ...]:
    params = [("in", k) for k in range(len(inputs))]
    params += [("out", k) for k in range(len(region.outputs))]
    params += [("tab", k) for k in range(len(region.tables))]
    params += [("in_stride", k, d) for k, n in enumerate(inputs) for d in range(_rank(n))]
    params += [("out_stride", k, d) for k, n in enumerate(region.outputs) for d in range(len(shape_of(n)))]
    return tuple(params)


def _rank(node: fx.Node) -> int:
    """Dims of the tensor a kernel reads for ``node``: complex64 through its fp32 view."""
    val = node.meta["val"]
    return val.dim() + (1 if val.dtype == torch.complex64 else 0)


def _param_name(p: tuple) -> str:
    if p[0] in ("in", "out", "tab"):
        return f"{p[0]}{p[1]}_ptr"
    if p[0] == "int":
        return p[1]
    return f"{p[0].split('_')[0]}{p[1]}_s{p[2]}"


def _signature(region: Region, params, constexpr_names: list[str]) -> str:
    names = [_param_name(p) for p in params]
    # per-row integers are sizes: not specialised on (16-divisibility, == 1), so one binary serves every size
    ints = [p[1] for p in params if p[0] == "int"]
    jit = f"@triton.jit(do_not_specialize={ints!r})" if ints else "@triton.jit"
    for k in range(len(region.tables)):
        names += [f"tab{k}_{f}: tl.constexpr" for f in CONSTEXPR_FIELDS]
    names += [f"{c}: tl.constexpr" for c in constexpr_names]
    return jit + "\ndef region_kernel(\n    " + ",\n    ".join(names) + ",\n):"


def _table_preamble(region: Region, code: Code) -> dict[fx.Node, str]:
    slots = {}
    for k, node in enumerate(region.tables):
        slot = f"tab{k}"
        code.line(f"if {slot}_WINDOW > 0:")
        code.line(f"    {slot} = tl.load({slot}_ptr + tl.arange(0, 2 * {slot}_WINDOW))")
        code.line("else:")
        code.line(f"    {slot} = tl.zeros([2], tl.int16)")
        slots[node] = slot
    return slots


def _row_atoms(code: Code, rows: str, shape: tuple[int, ...]) -> list[Ix]:
    """Index atoms of the leading dims of ``shape`` from the flat row index ``rows`` (int32: row
    counts stay below 2^31; offsets are computed in 64 bits, see ``indexing.offset_code``)."""
    lead = list(shape[:-1])
    atoms: list[Ix] = [Ix()] * len(lead)
    rest = rows
    for d in reversed(range(len(lead))):
        n = lead[d]
        if n == 1:
            continue
        outer = math.prod(lead[:d])
        expr = rest if outer == 1 else f"{rest} % {row_int(n)}"
        atoms[d] = Ix.of(Atom(code.let(expr, f"i{d}_"), n, False))
        if outer > 1:
            rest = code.let(f"{rest} // {row_int(n)}", "q")
    return atoms


def output_index(region: Region, out: fx.Node, index: Index) -> Index:
    """The index of ``out`` whose element this domain position computes. Where ``out`` is
    reached through same-sized ops from a value the domain indexes directly (the anchor, or
    what the anchor is computed from elementwise), the index follows those ops (a permuted copy
    gets the permuted index, so a reduction's outputs stay on their rows); otherwise the
    element of the same row-major rank."""
    path = _path(_coindexed(region.anchor, set(region.nodes)), out, set(region.nodes))
    if path is None:
        return reshape_index(index, region.domain, shape_of(out))
    for node in path:
        index = _forward(node, index)
    return index


def _coindexed(anchor: fx.Node, members: set) -> set[fx.Node]:
    """``anchor`` and the values it is computed from elementwise at the same index."""
    shape = shape_of(anchor)
    found, todo = set(), [anchor]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        if node in members and _forward_kind(node) == "same":
            todo.extend(a for a in node.all_input_nodes
                        if isinstance(a.meta.get("val"), torch.Tensor) and tuple(a.meta["val"].shape) == shape)
    return found


def _path(starts: set[fx.Node], out: fx.Node, members: set) -> list[fx.Node] | None:
    """Nodes from just after one of ``starts`` to ``out``, each computed from the previous one
    by an op of :func:`_forward` (same element count), or None."""
    numel = math.prod(shape_of(out))
    todo, seen = [(out, [])], set()
    while todo:
        node, after = todo.pop()
        if node in starts:
            return after
        if node in seen or node not in members or _forward_kind(node) is None:
            continue
        seen.add(node)
        for a in node.all_input_nodes:
            if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].numel() == numel:
                todo.append((a, [node] + after))
    return None


def _forward_kind(node: fx.Node) -> str | None:
    if forwards_index(node):
        return "view"
    rule = rule_for(node)
    if rule is not None and rule.kind in (POINTWISE, UNARY_TABLE):
        return "same"
    return None


def _forward(node: fx.Node, index: Index) -> Index:
    """The index of ``node``'s output element computed from its input element at ``index``."""
    return index if _forward_kind(node) == "same" else forward_index(node, index)


def _store_outputs(em: Emitter, region: Region, launch: Launch, index: Index, outs: list[Operand]) -> None:
    full = launch.full_index(index)
    for node, op in zip(region.outputs, outs):
        out_index = output_index(region, node, full)
        em.store(op, out_index, em.value(node, out_index))



def _kernel(region: Region, loads: dict, code: Code, consts: dict, grid, num_warps: int) -> GeneratedKernel:
    inputs = list(loads)
    body = code.text()
    params = _params(region, inputs) + tuple(("int", name, value) for name, value in row_ints_used(body))
    source = _signature(region, params, list(consts)) + "\n" + body + "\n"
    return GeneratedKernel(source, tuple(inputs), params, tuple(consts.items()), tuple(grid), num_warps)
