"""How much of a model's eager time the engine fuses: each captured block graph run eagerly op by
op, its time split into GEMMs and attention, the ops the engine's regions replace, and the ops left
to ATen (``exactdit coverage``, ``benchmarks/models/profile_engine.py``)."""

from __future__ import annotations

import collections
import copy
import dataclasses

import torch.fx as fx

from exactdit.engine.backend import COPY_OF, prepare
from exactdit.engine.capture import NodeTimer, capture_graphs
from exactdit.engine.coverage import op_name, is_gemm_or_attention
from exactdit.engine.partition import _is_compute, find_regions


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


def measure(model, kwargs: dict, blocks, timer=None) -> list[tuple["GraphTime", object, object]]:
    """Capture ``model``'s graphs of the block classes named in ``blocks`` (its repeated blocks:
    :func:`exactdit.patches.engine.repeated_blocks`) on one forward with ``kwargs``, time each ATen
    op of each graph run eagerly op by op (CUDA events on the GPU), and split the time by what the
    engine fuses. Returns [(GraphTime, the NodeTimer with every node's value, the partition)]; the
    partition's nodes belong to the prepared copy of the graph (same names as the captured nodes
    they stand for)."""
    out = []
    for k, (cls, gm, inputs) in enumerate(capture_graphs(model, kwargs, blocks)):
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
                left[op_name(n)] += t
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
