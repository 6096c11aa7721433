"""Sweep the launch shape of the engine's decomposed-RMSNorm template ("mean") on a model's own regions.

    python3 benchmarks/tune_mean_template.py --model zimage --config full --height 1024 --width 1024

For every "mean" region of the model's first block graph and every (rows per program, warps,
loop unroll) of the sweep: GPU time (CUDA-graph replays) and its multiple of the region's
memory floor. The launch shape only changes how many rows one program handles and how far its
loop is unrolled, never a row's order of additions; each variant's outputs are still compared
with the region's ATen nodes (torch.equal) before it is timed. Writes tune_mean_template.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.common import add_model_args, copy_bandwidth_gbs, environment, model_and_inputs, write_json  # noqa: E402,E501
from benchmarks.profile_engine import gpu_ms, nbytes  # noqa: E402
from exactdit.engine import coverage  # noqa: E402
from exactdit.engine.runtime import RegionOp  # noqa: E402
from exactdit.engine import templates  # noqa: E402
from exactdit.kernels import rms_norm as rms_k  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    args = ap.parse_args()
    os.environ["EXACTDIT_TRUST"] = "1"  # equality is checked here, once per variant
    bandwidth = copy_bandwidth_gbs()
    tr, kw = model_and_inputs(args)
    graph, timer, partition = coverage.measure(tr, kw)[0]
    values = {n.name: v for n, v in timer.values.items()}
    default = templates.mean_launch_shape
    results = []
    for region in [r for r in partition.regions if r.kind == "mean"]:
        inputs = [values[n.name] for n in region.inputs]
        floor = (nbytes(inputs) + sum(nbytes(values[n.name]) for n in region.outputs)) / bandwidth / 1e6
        expected = RegionOp(region).reference(*inputs)
        for rows, warps, unroll in itertools.product([None, 4, 8, 16, 32], [4, 8], [2, 4]):
            def shape(chunk, width, rows=rows, warps=warps, unroll=unroll):
                r = default(chunk, width)[0] if rows is None else rows
                return r, warps, unroll, rms_k.tail_block(chunk, width, r)

            templates.mean_launch_shape = shape
            try:
                region.kernels = [templates.generate(region, launch) for launch in region.launches]
            finally:
                templates.mean_launch_shape = default
            op = RegionOp(region)
            out = op(*inputs)
            equal = all(torch.equal(a, b) for a, b in zip(out, expected))
            ms = gpu_ms(lambda: op(*inputs))
            results.append(dict(region=region.name, width=region.domain[-1], rows=rows or "default", warps=warps,
                                unroll=unroll, us=1e3 * ms, x_floor=ms / floor, equal=equal))
            print(f"| {region.name} | {region.domain[-1]} | {rows or 'default'} | {warps} | {unroll} | "
                  f"{1e3 * ms:.1f} | {ms / floor:.2f} | {equal} |", flush=True)
    write_json("tune_mean_template.json", {"model": args.model, "results": results, **environment()})


if __name__ == "__main__":
    main()
