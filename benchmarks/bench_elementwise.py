"""Benchmark residual_gate_add and modulate: eager vs torch.compile vs exactdit vs the floor.

Run on a CUDA GPU from the repository root: ``python benchmarks/bench_elementwise.py``.
GPU times are medians of CUDA-graph replays (launch overhead excluded, as in a GPU-bound
model); ``exactdit_call_us`` is the plain per-call time including Python dispatch. Prints a Markdown table and writes ``bench_elementwise.json`` (to $OUT when set). The floor is
the bytes the op must move (activation-sized operands read once, output written once; broadcast
vectors are negligible) at the copy bandwidth measured in the same run. exactdit runs with
EXACTDIT_TRUST=1 after one verified call so the raw kernel is timed.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbs, environment, graph_median_ms, median_ms, table, write_json  # noqa: E402

from exactdit import ops, references  # noqa: E402


def cases():
    for shape in [(4224, 4096), (2, 4224, 4096)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
        x, u = rnd(*shape), rnd(*shape)
        vec = lambda: rnd(*((shape[0], 1, shape[-1]) if len(shape) == 3 else (shape[-1],)))  # noqa: E731
        gate, scale, shift = vec(), vec(), vec()
        act = x.numel() * x.element_size()
        yield "residual_gate_add", shape, (x, u, gate), {}, ops.residual_gate_add, references.residual_gate_add, 3 * act
        yield "modulate fp32 chain", shape, (x, scale, shift), {"upcast": True}, ops.modulate, references.modulate, 2 * act
        yield "modulate native", shape, (x, scale, shift), {"upcast": False}, ops.modulate, references.modulate, 2 * act


def main():
    bw = copy_bandwidth_gbs()
    rows = []
    for name, shape, args, kwargs, op, ref, nbytes in cases():
        assert torch.equal(op(*args, **kwargs), ref(*args, **kwargs))  # verifies the signature
        os.environ["EXACTDIT_TRUST"] = "1"
        compiled = torch.compile(lambda *a: ref(*a, **kwargs), dynamic=False)
        compiled(*args)
        row = {
            "op": name,
            "shape": "x".join(map(str, shape)),
            "eager_us": graph_median_ms(lambda: ref(*args, **kwargs)) * 1e3,
            "compile_us": graph_median_ms(lambda: compiled(*args)) * 1e3,
            "exactdit_us": graph_median_ms(lambda: op(*args, **kwargs)) * 1e3,
            "floor_us": nbytes / (bw * 1e9) * 1e6,
            "exactdit_call_us": median_ms(lambda: op(*args, **kwargs)) * 1e3,
        }
        os.environ.pop("EXACTDIT_TRUST")
        row["pct_of_copy_bw"] = 100 * row["floor_us"] / row["exactdit_us"]
        row["compile_bit_exact"] = bool(torch.equal(compiled(*args), ref(*args, **kwargs)))
        rows.append(row)
    cols = ["op", "shape", "eager_us", "compile_us", "exactdit_us", "floor_us", "pct_of_copy_bw", "exactdit_call_us", "compile_bit_exact"]
    print(f"copy bandwidth {bw:.0f} GB/s on {environment()['gpu']}")
    print(table(rows, cols))
    print(write_json("bench_elementwise.json", {"env": environment(), "copy_gbs": bw, "rows": rows}))


if __name__ == "__main__":
    main()
