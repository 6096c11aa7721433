"""Benchmark layer_norm and layer_norm_modulate: eager vs torch.compile vs exactdit vs the floor.

Run on a CUDA GPU from the repository root: ``python benchmarks/bench_layer_norm.py``
(``--tune``: only a sweep of the warps per program, ``kernels.layer_norm.NUM_WARPS``).
Prints a Markdown table and writes ``bench_layer_norm.json`` and ``bench_layer_norm.md`` (to
$OUT when set). GPU time is measured inside a CUDA graph (``do_bench_cudagraph``: no launch
overhead), call time with plain ``do_bench`` (includes Python and the gate's dispatch). The
floor is x read once plus the output written once at the copy bandwidth measured in the same
run. exactdit runs with EXACTDIT_TRUST=1 after one verified call so the raw kernel is timed.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbs, environment, median_ms, table, write_json  # noqa: E402

from exactdit import ops, references  # noqa: E402


def graph_us(fn) -> float:
    """Median GPU time of ``fn`` replayed in a CUDA graph, in us."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e3


def cases():
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    # the target shapes, both ops, with torch.compile
    for shape in [(4224, 4096), (2, 4224, 4096), (4224, 2, 4096)]:
        x = rnd(*shape)
        D = shape[-1]
        vshape = (D,) if len(shape) == 2 else ((shape[0], 1, D) if shape[0] == 2 else (1, shape[1], D))
        scale, shift = rnd(*vshape), rnd(*vshape)
        yield "layer_norm", shape, (x, 1e-6), {}, ops.layer_norm, references.layer_norm, True
        yield "ln+modulate native", shape, (x, 1e-6, scale, shift), {}, ops.layer_norm_modulate, references.layer_norm_modulate, True
        yield "ln+modulate fp32", shape, (x, 1e-6, scale, shift), {"upcast": True}, ops.layer_norm_modulate, references.layer_norm_modulate, False
    # width sweep (Flux 3072, SD3 1536/2432.., Wan 1536/5120, Qwen-Image 3072, ERNIE 4096)
    for D in (1536, 2048, 3072, 5120, 6144):
        x = rnd(4224, D)
        yield "layer_norm", (4224, D), (x, 1e-6), {}, ops.layer_norm, references.layer_norm, False
    w, b = rnd(3072), rnd(3072)
    x = rnd(4224, 3072)
    yield "layer_norm w+b", (4224, 3072), (x, 1e-6, w, b), {}, ops.layer_norm, references.layer_norm, False


def tune(bw):
    """Warps per program x the main cases (ERNIE-Image's shapes, a narrow and an affine width)."""
    from exactdit.kernels import layer_norm as kernels

    rows = []
    picked = [c for c in cases() if c[1] in ((4224, 4096), (4224, 1536), (4224, 3072))]
    os.environ["EXACTDIT_TRUST"] = "1"
    for warps in (1, 2, 4, 8):
        kernels.NUM_WARPS = warps
        for name, shape, args, kwargs, op, ref, _ in picked:
            nbytes = 2 * args[0].numel() * args[0].element_size()
            us = graph_us(lambda: op(*args, **kwargs))
            rows.append({"warps": warps, "op": name, "shape": "x".join(map(str, shape)), "us": us,
                         "x_floor": us / (nbytes / (bw * 1e9) * 1e6),
                         "bit_exact": bool(torch.equal(op(*args, **kwargs), ref(*args, **kwargs)))})
    os.environ.pop("EXACTDIT_TRUST")
    print(table([dict(r, x_floor=f"{r['x_floor']:.2f}") for r in rows], ["warps", "op", "shape", "us", "x_floor", "bit_exact"]))
    return rows


def main():
    bw = copy_bandwidth_gbs()
    if "--tune" in sys.argv:
        print(write_json("bench_layer_norm_tune.json", {"env": environment(), "copy_gbs": bw, "tune": tune(bw)}))
        return
    rows = []
    for name, shape, args, kwargs, op, ref, with_compile in cases():
        x = args[0]
        nbytes = 2 * x.numel() * x.element_size()
        assert torch.equal(op(*args, **kwargs), ref(*args, **kwargs))  # verifies the signature
        os.environ["EXACTDIT_TRUST"] = "1"
        row = {
            "op": name,
            "shape": "x".join(map(str, shape)),
            "eager_us": graph_us(lambda: ref(*args, **kwargs)),
            "exactdit_us": graph_us(lambda: op(*args, **kwargs)),
            "exactdit_call_us": median_ms(lambda: op(*args, **kwargs)) * 1e3,
            "floor_us": nbytes / (bw * 1e9) * 1e6,
            "compile_us": float("nan"),
            "compile_bit_exact": "-",
        }
        if with_compile:
            compiled = torch.compile(lambda *a: ref(*a, **kwargs), dynamic=False)
            compiled(*args)
            row["compile_us"] = graph_us(lambda: compiled(*args))
            row["compile_bit_exact"] = bool(torch.equal(compiled(*args), ref(*args, **kwargs)))
        os.environ.pop("EXACTDIT_TRUST")
        row["x_floor"] = row["exactdit_us"] / row["floor_us"]
        rows.append(row)
        print(row, flush=True)
    cols = ["op", "shape", "eager_us", "compile_us", "exactdit_us", "exactdit_call_us", "floor_us", "x_floor", "compile_bit_exact"]
    shown = [dict(r, x_floor=f"{r['x_floor']:.2f}") for r in rows]
    md = f"copy bandwidth {bw:.0f} GB/s on {environment()['gpu']}\n\n" + table(shown, cols)
    print(md)
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_layer_norm.md"), "w") as f:
        f.write(md + "\n")
    print(write_json("bench_layer_norm.json", {"env": environment(), "copy_gbs": bw, "rows": rows}))


if __name__ == "__main__":
    main()
