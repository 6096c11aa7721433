"""The ``exactdit`` torch.compile backend: capture, rewrite regions, run the rest as captured.

``torch.compile(module, backend="exactdit")`` (or :func:`make_backend` for a labelled one) captures
the module with Dynamo and AOTAutograd, which turn it into a graph of ATen ops. Run op by op,
that graph computes exactly what eager PyTorch computes. The backend replaces regions of it
(:mod:`exactdit.engine.partition`) by calls of gated fused kernels
(:mod:`exactdit.engine.runtime`) and returns the graph; no other compiler touches it, so every
op outside a region is the eager ATen kernel.

Only inference graphs are rewritten (the fused kernels have no backward): with autograd
recording, AOTAutograd's forward and backward graphs run unchanged.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import operator
import time

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from exactdit import first_calls
from exactdit.engine import capture_cache, coverage, specialize
from exactdit.engine.aten_ops import shares_input_storage
from exactdit.engine.partition import find_regions
from exactdit.engine.runtime import RegionOp, region_call_target

logger = logging.getLogger("exactdit")

_graph_ids = itertools.count()
aten = torch.ops.aten

#: node meta key: the name of the captured node a node was copied from (coverage maps times through it)
COPY_OF = "exactdit_copy_of"

#: list views that hand out pieces of a value
_PIECEWISE = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)

#: namespaces of distributed collectives: side effects across ranks, whatever their schemas say
_COLLECTIVES = ("_c10d_functional", "c10d_functional", "c10d")


def rewrite(gm: fx.GraphModule, label: str) -> coverage.GraphReport:
    """Replace the regions of ``gm`` (an ATen graph) by fused calls. The new graph is built
    beside the old one and swapped in only when complete."""
    start = time.perf_counter()
    with first_calls.phase("partition", label):
        prepare(gm.graph)
        partition = find_regions(gm, prefix=label)
        report = coverage.GraphReport.of(label, gm, partition)
        gm.graph = _rewritten(gm.graph, partition.regions)
        gm.recompile()
    report.seconds = time.perf_counter() - start
    return report


def prepare(graph: fx.Graph) -> None:
    """What the graph goes through before its regions are chosen (:func:`dedupe`, :func:`split_per_piece`)."""
    dedupe(graph)
    split_per_piece(graph)


def dedupe(graph: fx.Graph) -> int:
    """Compute each ATen op once per distinct (op, arguments): blocks often repeat a pure op on
    the same inputs (``silu(temb)`` for both of Flux's streams, ERNIE-Image's RoPE ``cos`` /
    ``sin`` for q and for k). A deterministic op on the same inputs gives the same bits, so the
    second call is the first's value. Ops with side effects, randomness or bitwise
    nondeterminism are left alone. Returns the number of nodes removed."""
    seen: dict = {}
    removed = 0
    returned = _returned_storages(graph)
    for node in list(graph.nodes):
        if node.op != "call_function" or not _pure(node.target):
            continue
        try:
            key = (node.target, _freeze(node.args), _freeze(node.kwargs))
            first = seen.setdefault(key, node)
        except TypeError:  # an unhashable argument
            continue
        if first is not node and not (node in returned and first in returned):
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            removed += 1
    return removed


def _returned_storages(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose storage the graph hands back: each output and, through views, its base.
    Two of them merged would give the caller one storage where eager gave two."""
    out: set[fx.Node] = set()
    stack = list(graph.output_node().all_input_nodes)
    while stack:
        node = stack.pop()
        if node in out:
            continue
        out.add(node)
        if shares_input_storage(node):
            stack.extend(node.all_input_nodes[:1])
    return out


def split_per_piece(graph: fx.Graph) -> int:
    """A pointwise value that is only read in pieces (``split`` / ``chunk`` / ``unbind``) is
    computed once per piece, each copy read by that piece alone: Wan2.2-TI2V's per-token
    modulation ``(table + temb.float()).chunk(6, dim=2)`` then fuses into each consumer's region,
    which reads its sixth of ``temb`` instead of ATen writing (and every region reading) the
    whole float32 sum. The copies are the same deterministic ops on the same inputs, so every
    piece keeps its bits; the work is the same (each copy is evaluated on its piece only).
    Returns the number of pieces given their own copy."""
    made = 0
    for split in list(graph.nodes):
        if split.op != "call_function" or split.target not in _PIECEWISE:
            continue
        pieces = list(split.users)
        chain = _private_pointwise(split.args[0])
        if len(pieces) < 2 or chain is None or not all(_read_by_fused_ops(p) for p in pieces):
            continue  # a piece ATen would read: its copy would compute the whole value again
        for piece in pieces:
            env: dict[fx.Node, fx.Node] = {}
            with graph.inserting_before(piece):
                for n in chain + [split, piece]:
                    env[n] = graph.node_copy(n, lambda a: env.get(a, a))
                    env[n].meta[COPY_OF] = n.meta.get(COPY_OF, n.name)
            piece.replace_all_uses_with(env[piece])
            graph.erase_node(piece)
        for n in reversed(chain + [split]):
            graph.erase_node(n)
        made += len(pieces)
    return made


def _read_by_fused_ops(piece: fx.Node) -> bool:
    """Whether ``piece`` (a getitem of a split) is read only by ops a region can hold, looking
    through views."""
    from exactdit.engine.aten_ops import VIEW, rule_for
    from exactdit.engine.partition import candidate_reason

    if piece.target is not operator.getitem:
        return False
    todo = list(piece.users)
    while todo:
        n = todo.pop()
        if n.op != "call_function" or candidate_reason(n) is not None:
            return False
        if rule_for(n) is not None and rule_for(n).kind == VIEW:
            todo.extend(n.users)
    return True


def _private_pointwise(value: fx.Node) -> list[fx.Node] | None:
    """``value`` and the producers only it reads, in graph order, when all are pointwise ops or
    views the engine emits; None otherwise (or when ``value`` has other readers)."""
    from exactdit.engine.aten_ops import POINTWISE, VIEW, rule_for, why_not_fusable

    if len(value.users) != 1:
        return None
    chain, todo = {value}, [value]
    while todo:
        n = todo.pop()
        rule = rule_for(n)
        if rule is None or rule.kind not in (POINTWISE, VIEW) or why_not_fusable(n) is not None:
            return None
        for p in n.all_input_nodes:
            if p.op == "call_function" and p not in chain and all(u in chain for u in p.users):
                chain.add(p)
                todo.append(p)
    order = {n: i for i, n in enumerate(value.graph.nodes)}
    return sorted(chain, key=order.__getitem__)


def _pure(target) -> bool:
    import torch

    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    banned = (torch.Tag.nondeterministic_seeded, getattr(torch.Tag, "nondeterministic_bitwise", None))
    if target._schema.is_mutable or target.namespace in _COLLECTIVES:
        return False
    return not any(t in target.tags for t in banned if t is not None)


def _effectful(node: fx.Node) -> bool:
    import torch

    target = node.target
    if node.op != "call_function" or target is operator.getitem:
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    return target._schema.is_mutable or target.namespace in _COLLECTIVES


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return (type(value).__name__,) + tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    hash(value)
    return value


def _rewritten(old: fx.Graph, regions) -> fx.Graph:
    """``old`` with each region's nodes replaced by one call of its :class:`RegionOp`; nodes
    keep their order where dependencies allow (a region goes where its first node was)."""
    position = {n: i for i, n in enumerate(old.nodes)}
    region_of = {n: r for r in regions for n in r.nodes}
    # units of the new graph: every node outside a region, and every region
    outputs = {n for r in regions for n in r.outputs}
    # list views (split, unbind) of a region's inner values are read only through the region
    inner = [n for n in old.nodes if n not in region_of and any(a in region_of and a not in outputs for a in n.all_input_nodes)]
    for n in inner:
        if any(u not in region_of for u in n.users):
            raise RuntimeError(f"exactdit: {n} reads a value inside a region")
    units: list = [n for n in old.nodes if n not in region_of and n not in inner and n.op != "output"] + list(regions)
    priority = {u: (min(position[n] for n in u.nodes) if u in regions else position[u]) for u in units}

    def unit_of(n: fx.Node):
        return region_of.get(n, n)

    needs = {}
    for u in units:
        inputs = u.inputs if u in regions else u.all_input_nodes
        needs[u] = {unit_of(n) for n in inputs} - {u}
    # collectives and other side effects keep their captured order: every rank must issue the
    # same collectives in the same sequence, whatever its local shapes made of its regions
    effects = [u for u in units if u not in regions and _effectful(u)]
    for before, after in zip(effects, effects[1:]):
        needs[after].add(before)
    users: dict = {u: [] for u in units}
    for u, deps in needs.items():
        for d in deps:
            users[d].append(u)
    waiting = {u: len(d) for u, d in needs.items()}
    ready = [(priority[u], k, u) for k, u in enumerate(units) if waiting[u] == 0]
    heapq.heapify(ready)
    index = {u: k for k, u in enumerate(units)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    done = 0
    while ready:
        _, _, u = heapq.heappop(ready)
        done += 1
        if u in regions:
            op = RegionOp(u)
            with first_calls.phase("ahead", u.name) as sent:  # (compiled by workers while the first regions run)
                sent.count = op.compile_ahead()
                if not sent.count:
                    sent.where = None  # nothing sent (off CUDA, no workers): no phase to show
            call = graph.call_function(region_call_target(op), tuple(env[n] for n in u.inputs))
            call.meta["exactdit_region"] = u.name
            for k, out in enumerate(u.outputs):
                env[out] = graph.call_function(operator.getitem, (call, k))
                env[out].meta = dict(out.meta)
        else:
            env[u] = graph.node_copy(u, lambda a: env[a])
        for v in users[u]:
            waiting[v] -= 1
            if waiting[v] == 0:
                heapq.heappush(ready, (priority[v], index[v], v))
    if done != len(units):
        raise RuntimeError("exactdit: regions would form a cycle")
    output = next(n for n in old.nodes if n.op == "output")
    graph.node_copy(output, lambda a: env[a])
    graph.eliminate_dead_code()  # list views whose items the regions read through
    graph.lint()
    return graph


def compile_graph(label: str):
    """An AOTAutograd inference compiler that rewrites the graph and runs it op by op."""

    def compiler(gm: fx.GraphModule, example_inputs):
        name = f"{label}#{next(_graph_ids)}"
        first_calls.claim_capture(label)  # the Dynamo compile under way is this block class's
        first_calls.install_capture_timer()  # (again, for the next, after a torch._dynamo.reset())
        capture_cache.store_pending(gm)  # before the rewrite changes it
        try:
            report = rewrite(gm, name)
        except Exception as e:  # noqa: BLE001 - a graph the engine cannot rewrite still runs as captured
            logger.warning("exactdit: %s runs as captured: %s: %s", name, type(e).__name__, e)
            report = coverage.GraphReport.for_failure(name, gm, f"{type(e).__name__}: {e}")
        coverage.register(report)
        return make_boxed_func(gm)

    return compiler


def make_backend(label: str = "graph"):
    """A torch.compile backend that rewrites inference graphs (see the module docstring);
    ``label`` names its graphs in :func:`exactdit.report`. A graph Dynamo captured with symbolic
    sizes is lowered once and made concrete at each signature it runs at (:mod:`exactdit.engine.specialize`)."""
    first_calls.install_capture_timer()
    source_headers_only_when_logged()
    rewrite = compile_graph(label)
    unchanged = specialize.run_as_captured
    aot = aot_autograd(fw_compiler=unchanged, bw_compiler=unchanged, inference_compiler=rewrite)

    def backend(gm: fx.GraphModule, example_inputs):
        if specialize.symbolic_positions(example_inputs):
            first_calls.claim_capture(label)
            return specialize.PerSignature(gm, example_inputs, label, aot, rewrite)
        key = capture_cache.key_for(gm, example_inputs) if capture_cache.enabled() else None
        if key is not None:
            lowered = capture_cache.load(key)
            if lowered is not None:  # what AOTAutograd would lower it to again (engine/capture_cache.py)
                return capture_cache.runner(rewrite(lowered, example_inputs))
        capture_cache.pending(key, len(example_inputs))
        try:
            return aot(gm, example_inputs)
        finally:
            capture_cache.pending(None)

    return backend


def source_headers_only_when_logged() -> None:
    """Dynamo (2.9-2.13) builds a source header for every call it records, trace logs on or off, and
    the header's function name tokenizes the whole source file the first time a process meets it:
    0.4 s of a fresh process's first Flux capture (10 files: diffusers' attention_dispatch.py,
    embeddings.py, ...; 1.45 -> 1.03 s on the CPU). The name serves those logs only, so it is looked
    up only while one of them is on. Nothing where this torch has no such lookup."""
    try:
        from torch._dynamo import funcname_cache, output_graph, symbolic_convert
    except ImportError:
        return
    lookup = getattr(symbolic_convert, "get_funcname", None)
    if lookup is None or getattr(lookup, "only_when_logged", False):
        return
    logs = [getattr(m, n) for m in (symbolic_convert, output_graph) for n in ("trace_call_log", "trace_source_log")
            if isinstance(getattr(m, n, None), logging.Logger)]

    def get_funcname(filename: str, lineno: int):
        if any(log.isEnabledFor(logging.DEBUG) for log in logs):
            return funcname_cache.get_funcname(filename, lineno)
        return None

    get_funcname.only_when_logged = True
    symbolic_convert.get_funcname = get_funcname


def _registered(gm, example_inputs, **kwargs):
    return make_backend()(gm, example_inputs)


def register() -> None:
    """Make ``torch.compile(..., backend="exactdit")`` available."""
    from torch._dynamo import list_backends, register_backend

    if "exactdit" not in list_backends(exclude_tags=()):
        register_backend(name="exactdit")(_registered)
