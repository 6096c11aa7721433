"""What the engine did to each captured graph: regions replaced, ATen ops left, and why."""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading

import torch.fx as fx

_lock = threading.Lock()
_graphs: list["GraphReport"] = []
#: block label -> why it could not be captured whole (it runs as several graphs, see exactdit.patches.engine)
_in_parts: dict[str, str] = {}


def _op_name(node: fx.Node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


@dataclasses.dataclass
class GraphReport:
    name: str
    #: region name -> description (template[ops]) and the ATen kernels it replaces
    regions: dict[str, tuple[str, int]]
    #: ATen kernels left to eager, by op: count
    left: dict[str, int]
    #: reasons ATen kernels were left (reason -> count), GEMMs and attention excluded
    why_left: dict[str, int]
    nodes: int
    seconds: float = 0.0
    failed: str | None = None
    #: reasons ``mm`` / ``addmm`` nodes were left to cuBLAS (reason -> count)
    gemms_left: dict[str, int] = dataclasses.field(default_factory=dict)

    @staticmethod
    def of(name: str, gm: fx.GraphModule, partition) -> "GraphReport":
        from exactdit.engine.partition import _is_compute

        regions = {
            r.name: (r.describe(), sum(1 for n in r.nodes if _is_compute(n))) for r in partition.regions
        }
        left = collections.Counter(_op_name(n) for n in partition.left)
        why = collections.Counter(  # each reason names its op
            why if why.startswith(_op_name(n)) else f"{_op_name(n)}: {why}"
            for n, why in partition.left.items() if not is_gemm_or_attention(n)
        )
        from exactdit.engine.gemm import GEMM_TARGETS

        gemms = collections.Counter(why for n, why in partition.left.items() if n.target in GEMM_TARGETS)
        return GraphReport(name, regions, dict(left), dict(why), len(gm.graph.nodes), gemms_left=dict(gemms))

    @staticmethod
    def for_failure(name: str, gm: fx.GraphModule, why: str) -> "GraphReport":
        left = collections.Counter(_op_name(n) for n in gm.graph.nodes if n.op == "call_function")
        return GraphReport(name, {}, dict(left), {why: sum(left.values())}, len(gm.graph.nodes), failed=why)

    @property
    def fused_kernels(self) -> int:
        return sum(n for _, n in self.regions.values())

    def lines(self) -> list[str]:
        out = [f"graph {self.name}: {len(self.regions)} regions replace {self.fused_kernels} ATen kernels"
               f" ({self.nodes} nodes, rewritten in {self.seconds:.2f} s)"]
        if self.failed:
            out.append(f"  runs as captured: {self.failed}")
        kinds = collections.Counter(desc for desc, _ in self.regions.values())
        for desc, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
            out.append(f"  region x{n}: {desc}")
        left = ", ".join(f"{op} x{n}" for op, n in sorted(self.left.items(), key=lambda kv: -kv[1]))
        out.append(f"  left to ATen: {left or '-'}")
        for why, n in sorted(self.why_left.items(), key=lambda kv: -kv[1]):
            out.append(f"    x{n}: {why}")
        fused = sum(1 for desc, _ in self.regions.values() if desc.startswith("gemm["))
        if fused or any("are off" not in why for why in self.gemms_left):  # (silent while the path is off)
            out.append(f"  GEMMs fused with their epilogue: {fused}; left to cuBLAS: {sum(self.gemms_left.values())}")
            for why, n in sorted(self.gemms_left.items(), key=lambda kv: -kv[1]):
                out.append(f"    x{n}: {why}")
        return out


GEMM_OR_ATTENTION = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_scaled_dot_product",
                     "scaled_dot_product", "_flash_attention", "_efficient_attention")


def is_gemm_or_attention(node: fx.Node) -> bool:
    name = _op_name(node)
    return any(name == g or name.startswith(g) for g in GEMM_OR_ATTENTION)


def register(report: GraphReport) -> None:
    with _lock:
        _graphs.append(report)


def graphs() -> list[GraphReport]:
    with _lock:
        return list(_graphs)


def note_in_parts(label: str, why: str) -> None:
    with _lock:
        _in_parts[label] = why


def in_parts() -> dict[str, str]:
    """Blocks captured as several graphs (graph breaks), by label: why not as one."""
    with _lock:
        return dict(_in_parts)


def reset() -> None:
    with _lock:
        _graphs.clear()
        _in_parts.clear()


@dataclasses.dataclass
class GraphTime:
    """Eager per-op time of one captured block graph, split by what the engine does with it."""

    name: str
    blocks: int  # blocks of the model's forward that ran this graph
    gemm_attention_ms: float
    other_ms: float  # every other ATen kernel
    fused_away_ms: float  # of ``other_ms``, the ops the engine's regions replace
    left_ms: dict[str, float]  # of ``other_ms``, the ops left to ATen, by op

    @property
    def share(self) -> float:
        return self.fused_away_ms / self.other_ms if self.other_ms else 1.0


def measure(model, kwargs: dict, timer=None) -> list[tuple["GraphTime", object, object]]:
    """Capture ``model``'s block graphs on one forward with ``kwargs``, time each ATen op of each
    graph run eagerly op by op (CUDA events on the GPU), and split the time by what the engine
    fuses. Returns [(GraphTime, the NodeTimer with every node's value, the partition)]; the
    partition's nodes belong to the prepared copy of the graph (same names as the captured nodes
    they stand for)."""
    from exactdit.engine.backend import COPY_OF, prepare
    from exactdit.engine.capture import NodeTimer, capture_graphs
    from exactdit.engine.partition import _is_compute, find_regions

    out = []
    for k, (cls, gm, inputs) in enumerate(capture_graphs(model, kwargs)):
        weight = gm.meta["calls"]  # the blocks that ran this graph (a recapture takes its own)
        node_timer = (timer or NodeTimer)(gm)
        ms = node_timer.timed(inputs)
        # regions of the graph as rewrite() prepares it (copies keep their origin's name), eager
        # time of the graph as captured: a captured op counts as fused unless something made
        # from it is left to ATen
        prepared = fx.GraphModule(gm, copy.deepcopy(gm.graph))
        prepare(prepared.graph)
        partition = find_regions(prepared, f"{cls}#{k}")
        left_names = {n.meta.get(COPY_OF, n.name) for n in partition.left}
        other = {n: t for n, t in ms.items() if _is_compute(n) and not is_gemm_or_attention(n)}
        fused = {n for n in other if n.name not in left_names}
        left = collections.Counter()
        for n, t in other.items():
            if n not in fused:
                left[_op_name(n)] += t
        out.append((GraphTime(cls, weight, sum(t for n, t in ms.items() if is_gemm_or_attention(n)),
                              sum(other.values()), sum(t for n, t in other.items() if n in fused), dict(left)),
                    node_timer, partition))
    return out


def summary_lines(times: list["GraphTime"]) -> list[str]:
    """One line per graph and one for the model (graphs weighted by their blocks)."""
    lines = []
    total = collections.Counter()
    for g in times:
        lines.append(f"{g.name}: x{g.blocks} blocks, GEMM+attention {g.gemm_attention_ms:.3f} ms, other ATen "
                     f"{g.other_ms:.3f} ms, of which fused {g.fused_away_ms:.3f} ms ({100 * g.share:.1f}%)")
        for op, t in sorted(g.left_ms.items(), key=lambda kv: -kv[1])[:6]:
            lines.append(f"    left to ATen: {op} {t:.3f} ms")
        total["gemm"] += g.gemm_attention_ms * g.blocks
        total["other"] += g.other_ms * g.blocks
        total["fused"] += g.fused_away_ms * g.blocks
    share = total["fused"] / total["other"] if total["other"] else 1.0
    lines.append(f"model (blocks): GEMM+attention {total['gemm']:.1f} ms, other ATen {total['other']:.1f} ms, "
                 f"fused {total['fused']:.1f} ms = {100 * share:.1f}% of the non-GEMM / non-attention time")
    return lines
