"""Bytes a forward's kernels move, by kind, as the engine partitions each captured block graph:
GEMMs left to cuBLAS (A, B, bias, output), fused GEMM regions, other regions, ATen ops left
(their inputs and outputs), attention. A CPU-side account (no GPU, no timing) of what a
partition costs in memory traffic, to compare partitions: ``--gemm`` off against auto.

    python3 benchmarks/probes/probe_bytes.py --model flux --size 1024 [--gemm off auto]

Blocks run at the model's production width with one block per stack, counted as many times as
the production config has blocks. Each value is counted where it is read and where it is written
(no cache reuse): a bound of the traffic, not a measurement of it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from exactdit.engine.capture import capture_graphs  # noqa: E402
from exactdit.engine.coverage import is_gemm_or_attention, op_name  # noqa: E402
from exactdit.engine.partition import _is_compute, find_regions  # noqa: E402
from exactdit.engine.templates import gemm  # noqa: E402
from exactdit.harness import models  # noqa: E402
from exactdit.harness.models.core import get_spec  # noqa: E402
from exactdit.patches.engine import repeated_blocks  # noqa: E402

STACKS = ("num_layers", "num_single_layers")


def size_of(node) -> int:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if isinstance(val, (tuple, list)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def account(gm) -> collections.Counter:
    """Bytes by kind for one run of a captured graph."""
    part = find_regions(gm)
    out: collections.Counter = collections.Counter()
    for r in part.regions:
        kind = "fused GEMM regions" if r.kind == "gemm" else "regions"
        out[kind] += sum(size_of(n) for n in r.inputs) + sum(size_of(n) for n in r.outputs)
    for n in part.left:
        if not _is_compute(n):
            continue
        moved = size_of(n) + sum(size_of(p) for p in n.all_input_nodes)
        kind = ("cuBLAS GEMMs" if n.target in gemm.GEMM_TARGETS else
                "attention" if is_gemm_or_attention(n) else f"ATen: {op_name(n)}")
        out[kind] += moved
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux")
    ap.add_argument("--config", default="full", help="the embedded config whose widths the blocks take")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--gemm", nargs="*", default=["off", "auto"], help="EXACTDIT_GEMM settings to compare")
    args = ap.parse_args()
    spec = get_spec(args.model)
    full = dict(spec.resolve_config(args.config))
    cfg = dict(full, **{k: 1 for k in STACKS if k in full})
    model = models.build_transformer(args.model, cfg, dtype=torch.bfloat16, seed=1)
    video = dict(num_frames=args.frames) if spec.video else {}
    kw = models.forward_inputs(args.model, model, batch=1, seed=2, height=args.size, width=args.size, **video)
    graphs = capture_graphs(model, kw, repeated_blocks(model))
    blocks = {}  # block class -> how many the production config has
    for k in STACKS:
        if k in full:
            blocks[k] = full[k]
    counts = list(blocks.values()) or [1]
    print(f"{args.model} {args.size}: graphs {[c.rsplit('.', 1)[-1] for c, _, _ in graphs]}, blocks per stack {counts}")
    for mode in args.gemm:
        os.environ[gemm.CHOICE_ENV] = mode
        total: collections.Counter = collections.Counter()
        for i, (_, gm, _) in enumerate(graphs):
            for kind, b in account(gm).items():
                total[kind] += b * counts[min(i, len(counts) - 1)]
        print(f"EXACTDIT_GEMM={mode}: {sum(total.values()) / 1e9:.2f} GB per forward's blocks")
        for kind, b in total.most_common():
            print(f"  {b / 1e9:8.2f} GB  {kind}")


if __name__ == "__main__":
    main()
