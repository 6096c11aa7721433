"""Sweep the elementwise kernels' tile (elements per program, widest tile, warps) on a GPU.

``python benchmarks/tune_elementwise.py [--only NAME]``: prints GPU time (CUDA-graph replay
medians) per tile for residual_gate_add and both modulate chains at [4224, 4096] and
[4224, 2, 4096] bf16, and GeGLU at [4224, 12288] and [2, 4224, 12288], as a percentage of the copy
bandwidth measured in the same run; writes tune_elementwise.json. ``--only`` keeps the ops whose
name contains NAME.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbs, environment, graph_median_ms, table, write_json  # noqa: E402

from exactdit.kernels import rows  # noqa: E402
from exactdit.ops.elementwise import MODULATE, RESIDUAL_GATE_ADD  # noqa: E402
from exactdit.ops.geglu import GEGLU  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    only = ap.parse_args().only
    bw = copy_bandwidth_gbs()
    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for shape in [(4224, 4096), (4224, 2, 4096), (4224, 12288), (2, 4224, 12288)]:
        x, u = (torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
        # ERNIE-Image's layout: [S, B, D] activations, [1, B, D] modulation vectors
        vec_shape = (1, shape[1], shape[-1]) if len(shape) == 3 else (shape[-1],)
        vec = torch.randn(*vec_shape, device="cuda", generator=g).to(torch.bfloat16)
        act = x.numel() * 2
        if shape[-1] == 12288:
            cases = [("geglu", lambda: GEGLU.fused(x, u), 3 * act)]
        else:
            cases = [
                ("residual_gate_add", lambda: RESIDUAL_GATE_ADD.fused(x, u, vec), 3 * act),
                ("modulate fp32 chain", lambda: MODULATE.fused(x, vec, vec, True), 2 * act),
                ("modulate native", lambda: MODULATE.fused(x, vec, vec, False), 2 * act),
            ]
        cases = [c for c in cases if only in c[0]]
        for elements, max_width, warps in itertools.product([2048, 4096, 8192, 16384], [1024, 2048], [4, 8, 16]):
            if warps * 32 * 2 > elements:
                continue
            rows.ELEMENTWISE_TILE.update(elements=elements, max_width=max_width, num_warps=warps)
            for name, fn, nbytes in cases:
                us = graph_median_ms(fn, rep_ms=50) * 1e3
                floor = nbytes / (bw * 1e9) * 1e6
                results.append({"op": name, "shape": "x".join(map(str, shape)), "elements": elements,
                                "max_width": max_width, "warps": warps, "us": us, "pct_of_copy_bw": 100 * floor / us})
    best = {}
    for r in results:
        k = (r["op"], r["shape"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    print(f"copy bandwidth {bw:.0f} GB/s")
    print(table(list(best.values()), ["op", "shape", "elements", "max_width", "warps", "us", "pct_of_copy_bw"]))
    totals = {}
    for r in results:
        totals.setdefault((r["elements"], r["max_width"], r["warps"]), []).append(r["pct_of_copy_bw"])
    ranked = sorted(totals.items(), key=lambda kv: -min(kv[1]))[:5]
    print("tiles by worst-case % of copy bandwidth:", [(k, round(min(v), 1)) for k, v in ranked])
    write_json("tune_elementwise.json", {"env": environment(), "copy_gbs": bw, "results": results})


if __name__ == "__main__":
    main()
