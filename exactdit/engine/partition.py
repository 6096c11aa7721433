"""Choosing the regions of a captured ATen graph that fused kernels replace.

Nodes the engine can emit (:mod:`exactdit.engine.aten_ops`, the reductions of
:mod:`exactdit.engine.templates`) are grouped greedily in graph order: a node joins the groups
of its producers when the union stays convex (no path leaves the group and comes back, so one
kernel can compute it) and holds at most one reduction (or one per piece of a cat that
separates them). A group becomes a region when its code can be emitted; a node that cannot be
emitted, or cannot be handed back (a view, or a value of another size than the region's domain,
that something outside the region reads) is set aside and the grouping is redone without it.
Regions that replace fewer than two eager kernels are dropped: they would gain nothing.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from exactdit import first_calls
from exactdit.engine.aten_ops import CAT, SHARES_STORAGE, VIEW, rule_for, shares_input_storage, why_not_fusable
from exactdit.engine.emit import Unfusable, shape_of
from exactdit.engine.region import Launch, Region
from exactdit.engine.templates import gemm as gemm_template
from exactdit.engine.templates import generate, reduction_kind, why_not_reduction

#: how many times the grouping is redone after setting nodes aside
MAX_ROUNDS = 30


@dataclasses.dataclass
class Partition:
    regions: list[Region]
    #: compute nodes left to ATen, with why
    left: dict[fx.Node, str]


#: ops that return views of their input (no kernel), besides the view rules
_LIST_VIEWS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default, torch.ops.aten.unbind.int,
               torch.ops.aten.chunk.default)


def _is_compute(node: fx.Node) -> bool:
    """A node that costs an eager kernel launch (not a view, getitem or placeholder)."""
    if node.op != "call_function" or node.target is operator.getitem or node.target in _LIST_VIEWS:
        return False
    rule = rule_for(node)
    return rule is None or rule.kind != VIEW


def candidate_reason(node: fx.Node) -> str | None:
    """None when a region can hold ``node`` (an op the engine emits, or a reduction); else why not."""
    if node.op != "call_function":
        return "not an op"
    if reduction_kind(node) is not None:
        return None
    why = why_not_reduction(node)  # a reduction the templates know, refused for this node
    return why_not_fusable(node) if why == "not a reduction" else why


def _users(node: fx.Node) -> list[fx.Node]:
    """A node's users, looking through ``split`` / ``unbind``: the getitems of a list view of
    the node read it."""
    out = []
    for u in node.users:
        if u.target in _LIST_VIEWS:
            out.extend(u.users)
        else:
            out.append(u)
    return out


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)) and val and isinstance(val[0], torch.Tensor):
        val = val[0]  # a reduction's tuple: its main output
    return val.numel() if isinstance(val, torch.Tensor) else 0


def _inputs(node: fx.Node) -> list[fx.Node]:
    """A node's inputs, looking through ``split`` / ``unbind`` (views that return lists): a
    getitem of one reads the list op's input."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0].target in _LIST_VIEWS:
        return node.args[0].all_input_nodes
    return node.all_input_nodes


@dataclasses.dataclass
class _Group:
    nodes: list[fx.Node]
    mask: int
    external: int  # producers outside the group
    reductions: int
    split_cat: fx.Node | None = None
    #: the GEMM whose output tile the group's kernel computes (it takes no node the GEMM reads,
    #: but its prologue: the cat along K the kernel reads piece by piece, see templates.gemm)
    gemm: fx.Node | None = None
    prologue: tuple[fx.Node, ...] = ()


class _Grouper:
    def __init__(self, graph: fx.Graph, candidates: set[fx.Node], apart_from_gemms: frozenset = frozenset()):
        self.order = list(graph.nodes)
        self.graph_outputs = set(next(n for n in self.order if n.op == "output").all_input_nodes)
        self.pos = {n: i for i, n in enumerate(self.order)}
        self.anc: dict[fx.Node, int] = {}
        for n in self.order:
            m = 0
            for p in n.all_input_nodes:
                m |= self.anc[p] | (1 << self.pos[p])
            self.anc[n] = m
        self.candidates = candidates
        #: nodes that join no GEMM's group (see :func:`_wide_outputs`)
        self.apart_from_gemms = apart_from_gemms
        #: nodes a GEMM's kernel reads as its A's K ranges (a cat and its view), by GEMM: they
        #: join no other group
        self.prologues: dict[fx.Node, tuple[fx.Node, ...]] = {}
        for n in self.order:
            if n in candidates and reduction_kind(n) == "gemm":
                found = gemm_template.a_pieces(n)
                if found is not None and all(p in candidates for p in found[0]):
                    self.prologues[n] = tuple(found[0])
        self.in_prologue = {p for chain in self.prologues.values() for p in chain}

    def _convex(self, mask: int, external: int) -> bool:
        e = external & ~mask
        while e:
            low = e & -e
            p = self.order[low.bit_length() - 1]
            if self.anc[p] & mask:
                return False
            e ^= low
        return True

    def _bits(self, nodes) -> tuple[int, int]:
        """(mask, external producers) of a set of nodes."""
        mask = ext = 0
        for n in nodes:
            mask |= 1 << self.pos[n]
            for p in _inputs(n):
                ext |= 1 << self.pos[p]
        return mask, ext & ~mask

    def _with_prologue(self, red: fx.Node, near: list, bit: int, prod_bits: int, groups: list, group_of: dict):
        """A new group for reduction ``red`` that could not join its producers' group (which has a
        reduction of its own): the nodes of that group that only lead to ``red`` (its input chain,
        e.g. the cast and square of a sandwich norm's second RMSNorm) move into the new group."""
        moved: list[fx.Node] = []
        for g in near:
            members = set(g.nodes)
            take = {red}
            changed = True
            while changed:
                changed = False
                for n in g.nodes:
                    if n not in take and reduction_kind(n) is None and _users(n) and all(u in take for u in _users(n)) \
                            and any(n is p for t in take for p in _inputs(t)) and n not in self.graph_outputs:
                        take.add(n)
                        changed = True
            take.discard(red)
            if take:
                g.nodes = [n for n in g.nodes if n not in take]
                g.mask, g.external = self._bits(g.nodes)
                moved.extend(take)
            del members
        nodes = moved + [red]
        mask, ext = self._bits(nodes)
        group = _Group(nodes, mask, ext, 1)
        groups.append(group)
        for n in moved:
            group_of[n] = group
        return group

    def groups(self) -> list[_Group]:
        group_of: dict[fx.Node, _Group] = {}
        groups: list[_Group] = []
        for v in self.order:
            if v not in self.candidates or v in self.in_prologue:
                continue
            bit = 1 << self.pos[v]
            prod_bits = 0
            for p in _inputs(v):
                prod_bits |= 1 << self.pos[p]
            is_red = 1 if reduction_kind(v) is not None else 0
            if is_red and reduction_kind(v) == "gemm":  # starts its own group: its inputs come from memory
                chain = self.prologues.get(v, ())
                mask, ext = self._bits([*chain, v])
                g = _Group([*chain, v], mask, ext, 1, gemm=v, prologue=chain)
                groups.append(g)
                for n in g.nodes:
                    group_of[n] = g
                continue
            # a smaller operand (a broadcast table or modulation vector) does not pull its consumer into
            # its group when a full-size operand's group can take it, unless nothing else uses it: two
            # chains sharing a cos table stay two regions (the table computed once), a `1 + scale`
            # only v reads is recomputed in v's region; statistics still join their reduction
            producers = [p for p in _inputs(v) if p in group_of]
            full = [p for p in producers if _numel(p) >= _numel(v)]
            if full:
                full += [p for p in producers if p not in full and all(
                    u is v or u in group_of[p].nodes for n in group_of[p].nodes for u in _users(n))]
            near = []
            for p in full or producers:
                g = group_of[p]
                if all(g is not h for h in near) and not (g.gemm is not None and v in self.apart_from_gemms):
                    near.append(g)
            choice = None
            options = [near] + [[g] for g in sorted(near, key=lambda g: -len(g.nodes))] if near else []
            for option in options:
                mask = bit
                ext = prod_bits
                reds = is_red
                for g in option:
                    mask |= g.mask
                    ext |= g.external
                    reds += g.reductions
                gemm_groups = [g for g in option if g.gemm is not None]
                if gemm_groups and any(n in self.apart_from_gemms for g in option for n in g.nodes):
                    continue  # (a value kept out of GEMM groups does not join one through a consumer)
                if len(gemm_groups) > 1 or (gemm_groups and self.anc[gemm_groups[0].gemm] & mask
                                            & ~self._bits(gemm_groups[0].prologue)[0]):
                    continue  # a GEMM's kernel computes nothing its own operands are made of
                splits = [g.split_cat for g in option if g.split_cat is not None]
                split = _split_cat(v, option) if reds > 1 and not splits else None
                if reds > 1 and split is None and not (len(splits) == 1 and not is_red):
                    continue
                if len(splits) > 1:
                    continue
                if self._convex(mask, ext):
                    choice = (option, mask, ext & ~mask, reds, split)
                    break
            if choice is None and is_red:
                g = self._with_prologue(v, near, bit, prod_bits, groups, group_of)
            elif choice is None:
                g = _Group([v], bit, prod_bits, is_red)
                groups.append(g)
            else:
                option, mask, ext, reds, split = choice
                g = option[0]
                for other in option[1:]:
                    g.nodes.extend(other.nodes)
                    groups.remove(other)
                g.nodes.append(v)
                g.mask, g.external, g.reductions = mask, ext, reds
                g.gemm = next((o.gemm for o in option if o.gemm is not None), None)
                g.prologue = next((o.prologue for o in option if o.gemm is not None), ())
                g.split_cat = g.split_cat or split or next((o.split_cat for o in option if o.split_cat), None)
                for n in g.nodes:
                    group_of[n] = g
            group_of[v] = g
        for g in groups:
            g.nodes.sort(key=self.pos.__getitem__)
        return groups


def _split_cat(v: fx.Node, option: list[_Group]) -> fx.Node | None:
    """``v`` when it is a cat along a leading dim whose inputs come from groups with one
    reduction each: each piece then gets its own launch."""
    if rule_for(v) is None or rule_for(v).kind != CAT or v.target is not torch.ops.aten.cat.default:
        return None
    rank = len(shape_of(v))
    dim = v.args[1] if len(v.args) > 1 else v.kwargs.get("dim", 0)
    if (dim + rank if dim < 0 else dim) == rank - 1:
        return None
    if any(g.reductions > 1 or g.split_cat is not None for g in option):
        return None
    return v


def _launches(region_kind: str, members: set[fx.Node], domain, split_cat: fx.Node | None) -> list[Launch]:
    """One launch per piece of the cat that separates a region's reductions, or that a pointwise
    region computes as its domain (each piece's values only: no branch evaluated for nothing);
    otherwise one launch over the domain."""
    if split_cat is None or split_cat not in members:
        return [Launch(tuple(domain))]
    from exactdit.engine.aten_views import cat_pieces

    dim, pieces = cat_pieces(split_cat)
    launches = []
    for k, (t, start, size) in enumerate(pieces):
        shape = list(domain)
        shape[dim] = size
        launches.append(Launch(tuple(shape), ((split_cat, k),), dim, start))
    return launches


def _storage_seen_outside(alias: fx.Node, members: set, outputs_of_graph: set) -> bool:
    """Whether the storage ``alias`` (an alias or detach) shares is seen outside its region but
    through ``alias``: it belongs to a region input, or another value of it (its base, a view) is
    read outside. Only then does handing ``alias`` back as a storage of its own differ from eager."""
    base = alias
    while base in members and shares_input_storage(base):
        base = base.args[0]
    if base not in members:
        return True
    family, todo = {base}, [base]
    while todo:
        for u in todo.pop().users:
            if u in members and u not in family and shares_input_storage(u):
                family.add(u)
                todo.append(u)
    return any(m is not alias and (m in outputs_of_graph or any(u not in members for u in m.users)) for m in family)


#: ops whose value eager lays out as its first argument, storage offset included (ATen's
#: ``clone_preserve_strides``; their fake values say offset 0)
_BASE_GEOMETRY = {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
                  torch.ops.aten.diagonal_scatter.default, torch.ops.aten.as_strided_scatter.default,
                  torch.ops.aten.copy.default}


def _at_an_offset(n: fx.Node) -> bool:
    """Whether eager may put ``n``'s value at a storage offset (a scatter or copy into a view of an
    input): a region's outputs are storages of their own, at offset 0. The fake values are right
    but for the ops above, so the base is followed through them and views down to a value whose
    offset is known: any offset on the way means eager's may not be 0."""
    if n.target not in _BASE_GEOMETRY and n.target not in SHARES_STORAGE:  # (an alias is where its input is)
        return False
    todo, seen = [n.args[0]], set()
    while todo:
        m = todo.pop()
        if not isinstance(m, fx.Node) or m in seen:
            continue
        seen.add(m)
        val = m.meta.get("val")
        if isinstance(val, torch.Tensor):
            offset = val.storage_offset()
            if not (type(offset) is int and offset == 0):
                return True
        elif not isinstance(val, (list, tuple)):
            return True  # nothing known: assume an offset
        if m.target in _BASE_GEOMETRY or shares_input_storage(m):
            todo.append(m.args[0])
    return False


def _region_from_group(g: _Group, name: str, outputs_of_graph: set[fx.Node]) -> tuple[Region | None, set[fx.Node], str | None]:
    """(region, nodes to set aside, why the group is not a region)."""
    members = set(g.nodes)
    # values read outside the region must be handed back: a view (ATen makes it from its base),
    # an alias (its input's storage: a region's output is a storage of its own, at offset 0), a
    # value eager puts at an offset (a scatter into a view of an input keeps the view's geometry)
    # or the tuple of a reduction cannot be
    bans = {
        n for n in g.nodes
        if (any(u not in members for u in _users(n)) or n in outputs_of_graph) and n is not g.gemm
        and (reduction_kind(n) is not None or rule_for(n).kind == VIEW or _at_an_offset(n)
             or (n.target in SHARES_STORAGE and _storage_seen_outside(n, members, outputs_of_graph)))
    }
    if bans:
        return None, bans, None
    reductions = [n for n in g.nodes if reduction_kind(n) is not None]
    outputs = [n for n in g.nodes if any(u not in members for u in _users(n)) or n in outputs_of_graph]
    if not outputs:
        return None, set(), "no output"
    if reductions:
        kinds = {reduction_kind(r) for r in reductions}
        if len(kinds) > 1:
            return None, set(reductions[1:]), None
        kind = kinds.pop()
        if kind == "gemm":  # the kernel iterates the GEMM's output
            g.split_cat = None
            anchor = g.gemm
        else:
            anchor = g.split_cat if g.split_cat is not None else reductions[0].args[0]
    else:
        kind = "pointwise"
        anchor = max(outputs, key=lambda n: math.prod(shape_of(n)))
        if anchor.target is torch.ops.aten.cat.default and g.split_cat is None:
            g.split_cat = anchor
    domain = shape_of(anchor)
    numel = math.prod(domain)
    # bool and complex results are not stored (a consumer outside reads ATen's; a kernel writes real lanes
    # only), nor uninitialised memory (eager's is whatever the allocator left: the gate would compare garbage)
    wrong_size = {n for n in outputs if math.prod(shape_of(n)) != numel or n.meta["val"].dtype == torch.bool
                  or n.meta["val"].dtype.is_complex or n.target is torch.ops.aten.empty_like.default}
    if wrong_size:
        return None, wrong_size, None
    n_kernels = sum(1 for n in g.nodes if _is_compute(n))
    if n_kernels < 2:
        return None, set(), "a GEMM with no epilogue stays with cuBLAS" if g.gemm is not None else "replaces a single kernel"
    region = Region(name, kind, list(g.nodes), [], outputs, tuple(domain), reductions, anchor)
    region.tables = [n for n in g.nodes if rule_for(n) is not None and rule_for(n).kind == "table"]
    region.launches = _launches(kind, members, domain, g.split_cat)
    try:
        with first_calls.phase("codegen", name, count=len(region.launches)):
            kernels = [generate(region, launch) for launch in region.launches]
    except Unfusable as e:
        culprit = e.args[1] if len(e.args) > 1 and e.args[1] in members else None
        if culprit is None:
            return None, set(), f"cannot emit: {e.args[0]}"
        return None, {culprit}, None
    inputs: list[fx.Node] = []
    for k in kernels:
        inputs.extend(n for n in k.inputs if n not in inputs)
    # values no kernel loads (an empty cat piece) are still read by the region's ATen reference
    inputs.extend(p for n in g.nodes for p in _inputs(n) if p not in members and p not in inputs)
    region.inputs = inputs
    region.kernels = kernels
    if kind == "gemm":
        region.alternative = _epilogue_region(g, name, outputs_of_graph)
    return region, set(), None


def _wide_outputs(g: _Group, outputs_of_graph: set[fx.Node]) -> set[fx.Node]:
    """The values a GEMM's group would write wider than the GEMM's own output (a cast to fp32 for
    the norm after a projection): its consumer can widen the GEMM's output where it reads it, so
    writing them wide only moves more bytes. They join no GEMM's group."""
    if g.gemm is None:
        return set()
    members = set(g.nodes)
    size = g.gemm.meta["val"].element_size()
    return {n for n in g.nodes if n is not g.gemm and isinstance(n.meta.get("val"), torch.Tensor)
            and n.meta["val"].element_size() > size
            and (n in outputs_of_graph or any(u not in members for u in _users(n)))}


def _epilogue_region(g: _Group, name: str, outputs_of_graph: set[fx.Node]) -> Region | None:
    """The GEMM region's nodes but its GEMM, as a pointwise region that reads the GEMM's output
    (cuBLAS then this kernel: the alternative the runtime times the fused kernel against), or
    None where that is not a region of its own (a single kernel)."""
    rest = [n for n in g.nodes if n is not g.gemm and n not in g.prologue]
    sub = _Group(rest, 0, 0, 0)  # (masks are the grouper's business; a region needs the nodes only)
    region, _, _ = _region_from_group(sub, name + ".epilogue", outputs_of_graph)
    return region


def find_regions(gm: fx.GraphModule, prefix: str = "region") -> Partition:
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    graph_outputs = set(out_node.all_input_nodes)
    reasons: dict[fx.Node, str] = {}
    candidates = set()
    for n in graph.nodes:
        why = candidate_reason(n)
        if why is None:
            candidates.add(n)
        elif _is_compute(n):
            reasons[n] = why
    banned: set[fx.Node] = set()
    apart: set[fx.Node] = set()
    regions: list[Region] = []
    for _ in range(MAX_ROUNDS):
        grouper = _Grouper(graph, candidates - banned, frozenset(apart))
        regions, new_bans, new_apart = [], set(), set()
        for g in grouper.groups():
            new_apart |= _wide_outputs(g, graph_outputs)
            if g.gemm is not None and new_apart & set(g.nodes):
                continue  # grouped again without them
            region, bans, why = _region_from_group(g, f"{prefix}.r{len(regions)}", graph_outputs)
            new_bans |= bans
            if region is not None:
                regions.append(region)
            elif why is not None:
                for n in g.nodes:
                    if _is_compute(n):
                        reasons.setdefault(n, why)
        if not new_bans and not (new_apart - apart):
            break
        banned |= new_bans
        apart |= new_apart
    # nodes set aside for another group's sake (e.g. a value of another size than that group's
    # domain: CogVideoX's gated residuals before the norm of their cat) can still form regions of
    # their own, which the first regions then read from memory (convex groups: no cycles)
    for g in _Grouper(graph, (candidates & banned) - {n for r in regions for n in r.nodes}, frozenset(apart)).groups():
        region, _, _ = _region_from_group(g, f"{prefix}.r{len(regions)}", graph_outputs)
        if region is not None:
            regions.append(region)
    fused = {n for r in regions for n in r.nodes}
    left = {n: reasons.get(n, "set aside: its value must be handed to ATen") for n in graph.nodes
            if _is_compute(n) and n not in fused}
    return Partition(regions, left)
