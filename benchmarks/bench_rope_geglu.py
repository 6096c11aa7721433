"""Benchmark qk_norm_rope and geglu at ERNIE-Image's shapes: eager vs torch.compile vs exactdit
vs the copy-bandwidth floor.

Run on a CUDA GPU from the repository root: ``python benchmarks/bench_rope_geglu.py``
(``--tune``: only a launch-shape sweep of qk_norm_rope).
GPU times are medians of CUDA-graph replays (launch overhead excluded, as in a GPU-bound
model); ``exactdit_call_us`` is the plain per-call time including Python dispatch. The floor is
the bytes the op must move (q and k read and written; gate and up read, the product written;
the bf16 cos/sin tables read once) at the copy bandwidth measured in the same run. exactdit runs
with EXACTDIT_TRUST=1 after one verified call so the raw kernel is timed. Prints a Markdown
table and writes ``bench_rope_geglu.json`` (to $OUT when set).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    FFN, HEAD_DIM, HEADS, S, copy_bandwidth_gbs, environment, graph_median_ms, median_ms, outputs_equal, table, write_json,
)

from exactdit import ops, references  # noqa: E402



def cases():
    dtype = torch.bfloat16
    for B in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(B)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(dtype)  # noqa: E731
        q = rnd(B, S, HEADS * HEAD_DIM).unflatten(-1, (HEADS, -1))
        k = rnd(B, S, HEADS * HEAD_DIM).unflatten(-1, (HEADS, -1))
        wq, wk = rnd(HEAD_DIM), rnd(HEAD_DIM)
        freqs = torch.rand(B, S, 1, HEAD_DIM, device="cuda", generator=g) * 1000
        tables = references.rope_tables(freqs, dtype)
        act = q.numel() * q.element_size()
        tab = 2 * tables[0].numel() * tables[0].element_size()
        yield ("qk_norm_rope", f"{B}x{S}x{HEADS}x{HEAD_DIM}", (q, k, wq, wk, 1e-6, tables),
               ops.qk_norm_rope, references.qk_norm_rope, 4 * act + tab)
        gate, up = rnd(B, S, FFN), rnd(B, S, FFN)
        act = gate.numel() * gate.element_size()
        yield "geglu", f"{B}x{S}x{FFN}", (gate, up), ops.geglu, references.geglu, 3 * act
        fused = torch.cat([gate, up], dim=-1)
        yield "geglu fused [.., 2F]", f"{B}x{S}x{2 * FFN}", (fused, None), ops.geglu, references.geglu, 3 * act
        # the erf path (fp16/fp32, and bf16 where the table is refused): its launcher directly
        yield "geglu erf path (kernel)", f"{B}x{S}x{FFN}", (gate, up), erf_geglu, references.geglu, 3 * act


def erf_geglu(gate, up):
    from exactdit.kernels import geglu as kernels

    return kernels.geglu(gate, up, torch.empty_like(gate))


def tune(bw):
    """qk_norm_rope launch sweep (elements per program x warps) at 1 x 4224 x 32 x 128."""
    from exactdit.kernels import rope

    name, shape, args, op, ref, nbytes = next(cases())
    expected = ref(*args)
    rows = []
    os.environ["EXACTDIT_TRUST"] = "1"
    for elements, warps in itertools.product([1024, 2048, 4096, 8192, 16384], [2, 4, 8, 16]):
        rope.ROW_BLOCK_ELEMENTS, rope.NUM_WARPS = elements, warps
        try:
            exact = outputs_equal(op(*args), expected)  # compiles this launch shape outside the graph
            us = graph_median_ms(lambda: op(*args)) * 1e3
        except Exception as e:  # noqa: BLE001 - resource limits of a launch shape
            print(f"skip {elements} elements x {warps} warps: {type(e).__name__}")
            continue
        rows.append({"elements": elements, "warps": warps, "us": us, "x_floor": us / (nbytes / (bw * 1e9) * 1e6),
                     "bit_exact": exact})
    os.environ.pop("EXACTDIT_TRUST")
    rows.sort(key=lambda r: r["us"])
    print(table(rows[:8], ["elements", "warps", "us", "x_floor", "bit_exact"]))
    return rows


def main():
    bw = copy_bandwidth_gbs()
    if "--tune" in sys.argv:
        print(write_json("bench_rope_geglu_tune.json", {"env": environment(), "copy_gbs": bw, "tune": tune(bw)}))
        return
    rows = []
    for name, shape, args, op, ref, nbytes in cases():
        assert outputs_equal(op(*args), ref(*args))  # verifies the signature
        os.environ["EXACTDIT_TRUST"] = "1"
        compiled = torch.compile(ref, dynamic=False)
        compiled(*args)
        row = {
            "op": name,
            "shape": shape,
            "eager_us": graph_median_ms(lambda: ref(*args)) * 1e3,
            "compile_us": graph_median_ms(lambda: compiled(*args)) * 1e3,
            "exactdit_us": graph_median_ms(lambda: op(*args)) * 1e3,
            "floor_us": nbytes / (bw * 1e9) * 1e6,
            "exactdit_call_us": median_ms(lambda: op(*args)) * 1e3,
        }
        os.environ.pop("EXACTDIT_TRUST")
        row["x_floor"] = row["exactdit_us"] / row["floor_us"]
        row["compile_bit_exact"] = outputs_equal(compiled(*args), ref(*args))
        rows.append(row)
    cols = ["op", "shape", "eager_us", "compile_us", "exactdit_us", "floor_us", "x_floor", "exactdit_call_us", "compile_bit_exact"]
    print(f"copy bandwidth {bw:.0f} GB/s on {environment()['gpu']}")
    print(table(rows, cols))
    print(write_json("bench_rope_geglu.json", {"env": environment(), "copy_gbs": bw, "rows": rows}))


if __name__ == "__main__":
    main()
