"""Benchmark the RMSNorm ops: eager vs torch.compile vs exactdit vs the copy-bandwidth floor.

Run on a CUDA GPU from the repository root:

    python benchmarks/bench_rms_norm.py            # main table + D sweep
    python benchmarks/bench_rms_norm.py --tune     # also sweep the kernel's launch shape

Times are medians in microseconds. ``*_graph_us``: the op replayed in a CUDA graph
(``triton.testing.do_bench_cudagraph``), no Python overhead; ``exactdit_call_us``: a plain
``do_bench`` of the public call (Python dispatch + launch included). The floor is the bytes the
op must move (activation-sized operands read once, outputs written once) at the copy bandwidth
measured in the same run. exactdit runs with EXACTDIT_TRUST=1 after one verified call.
Prints Markdown tables and writes ``bench_rms_norm.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import copy_bandwidth_gbs, environment, median_ms, outputs_equal, table, write_json  # noqa: E402

from exactdit import ops, references  # noqa: E402
from exactdit.aten_reduce import mean_factor  # noqa: E402
from exactdit.kernels.rms_norm import rms_norm_rows  # noqa: E402
from exactdit.ops.rms_norm import copy_row_strides, reduce_config  # noqa: E402

EPS = 1e-6


def graph_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def _inputs(shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    D = shape[-1]
    vec_shape = (shape[0], 1, D) if len(shape) == 3 else (D,)
    return rnd(*shape), rnd(*shape), rnd(*vec_shape), rnd(*vec_shape), rnd(*vec_shape), rnd(D)


def cases(shapes, which):
    for shape in shapes:
        x, u, gate, scale, shift, w = _inputs(shape)
        act = x.numel() * x.element_size()
        if "rms_norm" in which:
            yield "rms_norm (bf16 weight)", shape, (x, w, EPS), ops.rms_norm, references.rms_norm, 2 * act
        if "modulate" in which:
            yield (
                "rms_norm_modulate (fp32 chain)", shape, (x, None, EPS, scale, shift),
                lambda *a: ops.rms_norm_modulate(*a, upcast=True),
                lambda *a: references.rms_norm_modulate(*a, upcast=True), 2 * act,
            )
        if "gated" in which:
            yield (
                "gated_rms_norm_modulate (fp32 chain)", shape, (x, u, gate, None, EPS, scale, shift),
                lambda *a: ops.gated_rms_norm_modulate(*a, upcast=True),
                lambda *a: references.gated_rms_norm_modulate(*a, upcast=True), 4 * act,
            )


def bench(name, shape, args, op, ref, nbytes, bw):
    assert outputs_equal(op(*args), ref(*args)), name  # verifies (and registers) the signature
    compiled = torch.compile(ref, dynamic=False)
    compiled(*args)
    os.environ["EXACTDIT_TRUST"] = "1"
    try:
        row = {
            "op": name,
            "shape": "x".join(map(str, shape)),
            "eager_graph_us": graph_ms(lambda: ref(*args)) * 1e3,
            "compile_graph_us": graph_ms(lambda: compiled(*args)) * 1e3,
            "exactdit_graph_us": graph_ms(lambda: op(*args)) * 1e3,
            "exactdit_call_us": median_ms(lambda: op(*args)) * 1e3,
            "floor_us": nbytes / (bw * 1e9) * 1e6,
        }
    finally:
        os.environ.pop("EXACTDIT_TRUST")
    row["x_floor"] = row["exactdit_graph_us"] / row["floor_us"]
    row["vs_compile"] = row["compile_graph_us"] / row["exactdit_graph_us"]
    row["compile_bit_exact"] = bool(outputs_equal(compiled(*args), ref(*args)))
    return row


_HINTS = [("", ""), ("", "evict_first"), ("evict_last", "evict_first")]
TUNE_SPACE = list(itertools.product([1, 2, 4, 8, 16], [2, 4, 8], [1, 2, 4], [1024, 2048, 4096], _HINTS))


TUNE_COLS = ["rows", "warps", "unroll", "tail_tile", "hints", "us", "x_floor", "gated_us", "gated_x_floor", "bit_exact"]


def tune(shape, bw):
    """Launch-shape sweep of rms_norm_modulate and gated_rms_norm_modulate (fp32 chain) at
    ``shape``: rows per program x warps x unroll x pass-2 tile x L2 hints (TUNE_SPACE)."""
    x, u, gate, scale, shift, _ = _inputs(shape)
    ref = references.rms_norm_modulate(x, None, EPS, scale, shift, upcast=True)
    gref = references.gated_rms_norm_modulate(x, u, gate, None, EPS, scale, shift, upcast=True)
    cfg = reduce_config(x)
    M, D = x.numel() // x.shape[-1], x.shape[-1]
    f = mean_factor(M, D)
    floor = 2 * x.numel() * x.element_size() / (bw * 1e9) * 1e6
    rows = []
    for rpp, warps, unroll, tile, hints in TUNE_SPACE:
        launch = dict(rows_per_program=rpp, num_warps=warps, unroll_factor=unroll, tail=max(1, tile // rpp),
                      l2_hints=hints, copy_strides=copy_row_strides(x))
        out, gout, gres = torch.empty_like(ref), torch.empty_like(ref), torch.empty_like(ref)
        run = lambda: rms_norm_rows(x, None, EPS, f, cfg, out, scale=scale, shift=shift, upcast=True, **launch)  # noqa: E731
        grun = lambda: rms_norm_rows(x, None, EPS, f, cfg, gout, update=u, gate=gate, new_residual=gres,  # noqa: E731
                                     scale=scale, shift=shift, upcast=True, **launch)
        try:
            run()
            grun()
        except Exception as e:  # noqa: BLE001 - resource limits of a launch shape
            print(f"skip {launch}: {type(e).__name__}")
            continue
        us, gus = graph_ms(run) * 1e3, graph_ms(grun) * 1e3
        rows.append({"shape": "x".join(map(str, shape)), "rows": rpp, "warps": warps, "unroll": unroll,
                     "tail_tile": tile, "hints": "/".join(h or "-" for h in hints), "us": us, "x_floor": us / floor,
                     "gated_us": gus, "gated_x_floor": gus / (2 * floor),
                     "bit_exact": bool(torch.equal(out, ref) and torch.equal(gout, gref[0]) and torch.equal(gres, gref[1]))})
    rows.sort(key=lambda r: r["us"] + r["gated_us"])
    return rows


def anatomy(bw):
    """Where the time of rms_norm_modulate / gated_rms_norm_modulate at [4224, 4096] goes: the
    variance pass alone, ATen's own mean, the full kernel with and without L2 eviction hints."""
    shape = (4224, 4096)
    x, u, gate, scale, shift, _ = _inputs(shape)
    cfg = reduce_config(x)
    f = mean_factor(4224, 4096)
    ref = references.rms_norm_modulate(x, None, EPS, scale, shift, upcast=True)
    gref = references.gated_rms_norm_modulate(x, u, gate, None, EPS, scale, shift, upcast=True)
    floor = 2 * x.numel() * 2 / (bw * 1e9) * 1e6
    out, var = torch.empty_like(ref), torch.empty(4224, device="cuda")
    gout, gres = torch.empty_like(gref[0]), torch.empty_like(gref[1])
    variants = [("default", {}), ("hints last/first", {"l2_hints": ("evict_last", "evict_first")}),
                ("hints last/-", {"l2_hints": ("evict_last", "")}), ("hints -/first", {"l2_hints": ("", "evict_first")})]
    rows = []
    for label, kw in variants:
        fn = lambda: rms_norm_rows(x, None, EPS, f, cfg, out, scale=scale, shift=shift, upcast=True, **kw)  # noqa: E731
        us = graph_ms(fn) * 1e3
        rows.append({"what": f"rms_norm_modulate {label}", "us": us, "x_floor": us / floor, "equal": torch.equal(out, ref)})
        gfn = lambda: rms_norm_rows(x, None, EPS, f, cfg, gout, update=u, gate=gate, new_residual=gres,  # noqa: E731
                                    scale=scale, shift=shift, upcast=True, **kw)
        us = graph_ms(gfn) * 1e3
        rows.append({"what": f"gated {label}", "us": us, "x_floor": us / (2 * floor),
                     "equal": torch.equal(gout, gref[0]) and torch.equal(gres, gref[1])})
    fn = lambda: rms_norm_rows(x, None, EPS, f, cfg, None, variance=var, write_out=False)  # noqa: E731
    us = graph_ms(fn) * 1e3
    rows.append({"what": "variance pass only", "us": us, "x_floor": us / (floor / 2),
                 "equal": torch.equal(var, x.float().pow(2).mean(-1))})
    us = graph_ms(lambda: x.float().pow(2).mean(-1)) * 1e3
    rows.append({"what": "eager x.float().pow(2).mean(-1)", "us": us, "x_floor": us / (floor / 2), "equal": True})
    us = graph_ms(lambda: x.sum(-1)) * 1e3
    rows.append({"what": "eager x.sum(-1) (read floor)", "us": us, "x_floor": us / (floor / 2), "equal": True})
    print(table(rows, ["what", "us", "x_floor", "equal"]))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-quick", action="store_true", help="a 48-point launch-shape sweep at [4224, 4096] only")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--anatomy", action="store_true", help="where the time goes at [4224, 4096] only")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    print(f"copy bandwidth {bw:.0f} GB/s on {environment()['gpu']}")
    if args.anatomy:
        write_json("bench_rms_norm_anatomy.json", {"env": environment(), "copy_gbs": bw, "rows": anatomy(bw)})
        return
    if args.tune_quick:  # launch shape only: rows per program x warps x unroll at [4224, 4096]
        global TUNE_SPACE
        TUNE_SPACE = list(itertools.product([1, 2, 4], [4, 8], [2, 4], [2048, 4096], _HINTS[:2]))
        t = tune((4224, 4096), bw)
        print(table(t[:10], TUNE_COLS))
        write_json("bench_rms_norm_tune.json", {"env": environment(), "copy_gbs": bw, "tune": t})
        return
    cols = ["op", "shape", "eager_graph_us", "compile_graph_us", "exactdit_graph_us", "exactdit_call_us",
            "floor_us", "x_floor", "vs_compile", "compile_bit_exact"]
    main_rows = [bench(*c, bw) for c in cases([(4224, 4096), (2, 4224, 4096)], ("rms_norm", "modulate", "gated"))]
    print(table(main_rows, cols))
    sweep_rows = []
    if not args.no_sweep:
        widths = [64, 128, 1024, 1536, 2048, 3072, 4096, 5120, 6144, 8192, 12288, 16384]
        sweep_rows = [bench(*c, bw) for c in cases([(4224, D) for D in widths], ("modulate",))]
        print("\nD sweep, M = 4224, rms_norm_modulate (fp32 chain):")
        print(table(sweep_rows, cols))
    tune_rows = []
    if args.tune:
        for shape in [(4224, 4096), (4224, 8192)]:
            t = tune(shape, bw)
            tune_rows += t
            print(f"\nlaunch shapes at {shape} (best 8):")
            print(table(t[:8], TUNE_COLS))
    path = write_json("bench_rms_norm.json", {
        "env": environment(), "copy_gbs": bw, "main": main_rows, "sweep": sweep_rows, "tune": tune_rows,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
