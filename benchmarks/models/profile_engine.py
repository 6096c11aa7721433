"""Where a model's time goes under the engine, block graph by block graph and region by region.

    python3 benchmarks/models/profile_engine.py --model flux --config full --height 1024 --width 1024 --batch 1

Captures the model's block graphs with real inputs, runs each graph op by op with CUDA events
around every ATen op (eager's kernels), and reports
* coverage: the share of eager's non-GEMM / non-attention kernel time that the engine's regions
  replace (per graph and for the whole model, weighted by how many blocks run each graph);
* per region: its eager ATen time, the fused kernel's time, and the memory floor (bytes of its
  inputs and outputs at the copy bandwidth measured in the same run).
Writes ``profile_engine_<model>.json`` to ``$OUT``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.runner import add_model_args, copy_bandwidth_gbs, environment, fused_from_the_first_call, model_and_inputs, write_json  # noqa: E402,E501
from exactdit.engine import timing  # noqa: E402
from exactdit.patches.engine import repeated_blocks  # noqa: E402
from exactdit.engine.runtime import RegionOp  # noqa: E402


def gpu_ms(fn) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (no host overhead)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median"))


def call_us(fn, calls: int = 50) -> float:
    """Wall time per back-to-back call (host issue time where it exceeds the GPU time)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    if not isinstance(t, torch.Tensor):
        return 0
    return min(t.numel(), t.untyped_storage().nbytes() // t.element_size()) * t.element_size()


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    args = ap.parse_args()
    fused_from_the_first_call()
    os.environ["EXACTDIT_TRUST"] = "1"  # time the kernels; equality is bench_engine's job
    bandwidth = copy_bandwidth_gbs()
    tr, kw = model_and_inputs(args)
    measured = timing.measure(tr, kw, repeated_blocks(tr))
    print("\n".join(timing.summary_lines([g for g, _, _ in measured])), flush=True)
    regions_out = []
    for graph, timer, partition in measured:
        values = {n.name: v for n, v in timer.values.items()}  # the partition is of a prepared copy
        for region in partition.regions:
            op = RegionOp(region)
            args_ = [values[n.name] for n in region.inputs]
            floor = (nbytes(args_) + sum(nbytes(values[n.name]) for n in region.outputs)) / bandwidth / 1e6
            regions_out.append(dict(graph=graph.name, region=region.name, kind=region.describe(), blocks=graph.blocks,
                                    eager_ms=gpu_ms(lambda: op.reference(*args_)), fused_ms=gpu_ms(lambda: op(*args_)),
                                    floor_ms=floor, call_us=call_us(lambda: op(*args_))))
    rows = [dataclasses.asdict(g) for g, _, _ in measured]
    total = {"share": sum(g.fused_away_ms * g.blocks for g, _, _ in measured)
             / max(sum(g.other_ms * g.blocks for g, _, _ in measured), 1e-9)}
    print("\n| region | blocks | eager us | fused us | floor us | x floor | call us |\n|---|---|---|---|---|---|---|")
    for r in sorted(regions_out, key=lambda r: -(r["fused_ms"] - r["floor_ms"]) * max(r["blocks"], 1)):
        print(f"| {r['region']} {r['kind']} | {r['blocks']} | {1e3 * r['eager_ms']:.1f} | {1e3 * r['fused_ms']:.1f} | "
              f"{1e3 * r['floor_ms']:.1f} | {r['fused_ms'] / max(r['floor_ms'], 1e-9):.2f} | {r['call_us']:.0f} |")
    from exactdit.engine import tables

    for key, (table, why) in tables._cache.items():
        print("table", key[0], key[-2], key[-1], table.spec if table else why)
    name = args.mini or f"{args.model}_{args.config}"
    write_json(f"profile_engine_{name}_b{args.batch}.json",
               {"graphs": rows, "regions": regions_out, "total": dict(total), "copy_gbs": bandwidth, **environment()})


if __name__ == "__main__":
    main()
