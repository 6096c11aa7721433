"""A region: the ATen nodes of a captured graph that one fused launch (or one per cat piece)
replaces, with what it reads and what it must hand back."""

from __future__ import annotations

import dataclasses
import math

import torch.fx as fx

from exactdit.engine.indexing import Index


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a region's kernel. ``pieces`` names, for each ``cat`` it covers one input
    of, which input; the launch then iterates ``shape`` (that piece of the domain), whose index
    is the domain's shifted by ``offset`` along ``dim``."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[fx.Node, int], ...] = ()
    dim: int = 0
    offset: int = 0

    def full_index(self, index: Index) -> Index:
        if not self.offset:
            return index
        return index[: self.dim] + (index[self.dim] + self.offset,) + index[self.dim + 1:]


@dataclasses.dataclass(eq=False)
class Region:
    """Nodes replaced by one fused kernel.

    ``kind``: "pointwise", or the reduction template ("layer_norm", "fused_rms_norm", "mean").
    ``domain``: the shape the kernel iterates; every output has as many elements, and each
    output element is computed at the domain position of the same row-major rank.
    ``reductions``: reduction nodes whose per-row statistics the template computes.
    """

    name: str
    kind: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    domain: tuple[int, ...]
    reductions: list[fx.Node] = dataclasses.field(default_factory=list)
    #: the node of the domain's shape that domain positions index (outputs follow it)
    anchor: fx.Node | None = None
    tables: list[fx.Node] = dataclasses.field(default_factory=list)
    launches: list[Launch] = dataclasses.field(default_factory=list)
    #: a GEMM region's other way to the same bits: the GEMM left to cuBLAS and this region (its
    #: epilogue) after it; None when the epilogue is a single kernel (ATen's then)
    alternative: "Region | None" = None

    @property
    def numel(self) -> int:
        return math.prod(self.domain)

    def describe(self) -> str:
        ops = sorted({getattr(n.target, "__name__", str(n.target)).split(".")[0] for n in self.nodes
                      if n.op == "call_function"})
        return f"{self.kind}[{', '.join(ops)}]"
