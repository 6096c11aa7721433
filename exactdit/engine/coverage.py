"""What the engine did to each captured graph: regions replaced, ATen ops left, and why."""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch.fx as fx

from exactdit.state import STATE

_lock = threading.Lock()
_graphs: list["GraphReport"] = STATE.graphs
#: block label -> why it could not be captured whole (it runs as several graphs, see exactdit.patches.engine)
_in_parts: dict[str, str] = STATE.in_parts


def op_name(node: fx.Node) -> str:
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
        from exactdit.engine.templates.gemm import GEMM_TARGETS

        regions = {
            r.name: (r.describe(), sum(1 for n in r.nodes if _is_compute(n))) for r in partition.regions
        }
        left = collections.Counter(op_name(n) for n in partition.left)
        why = collections.Counter(  # each reason names its op
            why if why.startswith(op_name(n)) else f"{op_name(n)}: {why}"
            for n, why in partition.left.items() if not is_gemm_or_attention(n)
        )
        gemms = collections.Counter(why for n, why in partition.left.items() if n.target in GEMM_TARGETS)
        return GraphReport(name, regions, dict(left), dict(why), len(gm.graph.nodes), gemms_left=dict(gemms))

    @staticmethod
    def for_failure(name: str, gm: fx.GraphModule, why: str) -> "GraphReport":
        left = collections.Counter(op_name(n) for n in gm.graph.nodes if n.op == "call_function")
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
    name = op_name(node)
    return any(name == g or name.startswith(g) for g in GEMM_OR_ATTENTION)


def register(report: GraphReport) -> None:
    with _lock:
        _graphs.append(report)


def forget(names) -> None:
    """Drop the reports of the graphs ``names`` (graphs that are gone)."""
    names = set(names)
    with _lock:
        _graphs[:] = [g for g in _graphs if g.name not in names]


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
