"""One transformer forward through the engine against eager, the same run: equality and time.

    python3 benchmarks/models/bench_engine.py --model flux --config full --height 1024 --width 1024 --batch 1
        [--compile] [--cuda-graphs] [--repeat 10]
    python3 benchmarks/models/bench_engine.py --mini sd3 --compile    # a mini's released model (SD3.5 Large) at 1024x1024

Builds the model from its embedded config with seeded random weights (``exactdit.harness.models``,
or ``--mini``: a class of ``tests.minis`` at its released model's config and typical size)
on the GPU, times eager (CUDA-event median of ``--repeat`` forwards after warm-up), then
``exactdit.patch`` (first call = capture + kernel compilation, wall clock), checks the output with
``torch.equal`` against eager and times it the same way. ``--cuda-graphs``: also
``exactdit.patch(cuda_graphs=True)``.
``--compile``: also diffusers' regional torch.compile (Inductor; not exact).
Prints a table and writes ``bench_engine_<model>.json`` (results rows, coverage) to ``$OUT``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import exactdit  # noqa: E402
from benchmarks.runner import (add_model_args, append_results, environment, first_call_s, forward_ms,  # noqa: E402
                               model_and_inputs, model_label, outputs_equal, settle_graphs, write_json)
from exactdit.engine import coverage  # noqa: E402
from exactdit.engine.runtime import gemm_choices  # noqa: E402


def compile_regions(tr) -> None:
    """diffusers' regional compile (``compile_repeated_blocks(fullgraph=True)``); for a class that
    lists no ``_repeated_blocks`` (SD3, CogVideoX, ...) the same on the blocks exactdit patches."""
    if getattr(tr, "_repeated_blocks", None):
        tr.compile_repeated_blocks(fullgraph=True)
        return
    from exactdit.patches.engine import repeated_blocks

    classes = set(repeated_blocks(tr))
    for m in tr.modules():
        if type(m).__name__ in classes:
            m.compile(fullgraph=True)


def breakdown(forward) -> dict:
    """Kernel time of one forward by kind (GEMM, attention, the engine's regions, other ATen),
    idle gaps between kernels, and the median SM clock, board power and energy per forward while
    forwards run back to back: where the floor of the forward lies."""
    from benchmarks.models.profiling import clocks_while, profile_once

    with torch.no_grad():
        prof = profile_once(forward)
        clocks = clocks_while(forward, seconds=3.0)
    by_kind = dict(prof["kernel_ms_by_kind"])
    regions = sum(v for k, v in prof["kernel_ms_by_name"].items() if k.startswith("region_kernel"))
    by_kind["other"] = by_kind.get("other", 0.0) - regions
    by_kind["exactdit regions"] = regions
    out = {"kernel_ms": prof["kernel_ms"], "idle_ms": prof["idle_ms"], "span_ms": prof["span_ms"],
           "kernel_ms_by_kind": by_kind, "sm_mhz": clocks["sm_mhz"], "power_w": clocks["power_w"],
           "energy_j": clocks["energy_j"]}
    print("breakdown", {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()
                        if k != "kernel_ms_by_kind"}, {k: round(v, 2) for k, v in by_kind.items()}, flush=True)
    print("idle before (ms, next kernel)", [(round(v, 3), k) for v, k in prof["idle_before_kernel_ms"][:8]], flush=True)
    print("largest gaps (us, after, before)", prof["largest_gaps_us"][:6], flush=True)
    top = sorted(prof["kernel_ms_by_name"].items(), key=lambda kv: -kv[1])[:14]
    print("kernels by time (ms)", [(round(v, 2), k[:70]) for k, v in top], flush=True)
    return out


def time_path(rows: list, path: str, tr, kw, ref, args, settle=None) -> dict:
    """One path already set up on ``tr``: its first call (wall clock), ``settle()`` if given, then the
    median forward, checked against eager's output, printed, its row added (with the kernel
    breakdown if asked)."""
    first = first_call_s(tr, kw)
    if settle is not None:
        settle()
    ms, out = forward_ms(tr, kw, args.repeat)
    row = dict(path=path, ms=ms, equal=outputs_equal(out, ref), first_call_s=first)
    rows.append(row)
    print(f"{path} {ms:.2f} ms (first call {first:.1f} s) equal={row['equal']}", flush=True)
    if args.breakdown:
        row.update(breakdown(lambda: tr(**kw, return_dict=False)))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true", help="also exactdit.patch(cuda_graphs=True)")
    ap.add_argument("--breakdown", action="store_true", help="kernel time by kind, idle gaps, SM clock, power")
    ap.add_argument("--gemm", choices=["auto", "fused", "split"],
                    help="fused GEMMs on (EXACTDIT_GEMM), for the exactdit run; off by default")
    ap.add_argument("--gemm-off-too", action="store_true",
                    help="with --gemm: also exactdit with every GEMM left to cuBLAS, in the same run")
    ap.add_argument("--group-offload", action="store_true",
                    help="diffusers' block-level group offloading (weights on the CPU, one block at a time on "
                         "the GPU, prefetched on a stream) for every path")
    args = ap.parse_args()
    if args.gemm:
        import os

        os.environ["EXACTDIT_GEMM"] = args.gemm
    env = environment()
    t = time.perf_counter()
    tr, kw = model_and_inputs(args)
    model, shape = model_label(args)
    print(f"built {model} in {time.perf_counter() - t:.1f} s", flush=True)
    if args.group_offload:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(tr.to("cpu"), onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    offload = " (group offload)" if args.group_offload else ""
    rows = []
    eager_ms, ref = forward_ms(tr, kw, args.repeat)
    rows.append(dict(path="eager", ms=eager_ms, equal=True))
    print(f"eager {eager_ms:.2f} ms", flush=True)

    print("patched", exactdit.patch(tr), flush=True)
    row = time_path(rows, f"exactdit, EXACTDIT_GEMM={args.gemm}" if args.gemm else "exactdit", tr, kw, ref, args)
    lines = [line for g in coverage.graphs() for line in g.lines()]
    choices = gemm_choices()
    for c in choices:
        print(f"gemm {c['region']} {c['m']}x{c['k']}x{c['n']} {c['ops']}: {c['way']} (us per way: {c['us']})")
    row["gemm_choices"] = choices
    report = exactdit.report(show=False)
    disabled = {k: v["disabled"] for k, v in report.items() if v["disabled"]}
    eager_calls = {k: v["eager_reasons"] for k, v in report.items() if v["eager"]}
    print("\n".join(lines))
    if disabled:
        print("DISABLED", disabled)
    if eager_calls:
        print("EAGER", eager_calls)
    exactdit.unpatch(tr)

    if args.gemm_off_too:
        import os

        os.environ.pop("EXACTDIT_GEMM", None)
        torch._dynamo.reset()
        exactdit.patch(tr)
        time_path(rows, "exactdit, GEMMs left to cuBLAS", tr, kw, ref, args)
        exactdit.unpatch(tr)
        torch._dynamo.reset()

    if args.cuda_graphs:
        from exactdit.patches import cuda_graphs

        exactdit.patch(tr, cuda_graphs=True)
        # recorded, and block graphs timed against the forward without them, before the median
        row = time_path(rows, "exactdit + CUDA graphs", tr, kw, ref, args, settle=lambda: settle_graphs(tr, kw))
        graphs = cuda_graphs.graphed(tr).summary()
        row["graph_mib"] = graphs["memory_bytes"] / 2**20
        print("graphs", graphs, flush=True)
        exactdit.unpatch(tr)

    if args.compile:
        torch._dynamo.reset()
        compile_regions(tr)
        time_path(rows, "regional torch.compile", tr, kw, ref, args)
    for r in rows:
        r.update(model=f"{model} {shape}", ratio_to_eager=eager_ms / r["ms"], path=r["path"] + offload, **env)
    print("| path | ms | x eager | equal | first call s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {r['ms']:.2f} | {r['ratio_to_eager']:.2f} | {r['equal']} | {r.get('first_call_s', '')} |")
    append_results([dict(model_or_op=model, shape=shape, dtype="bf16", path=r["path"], ms=r["ms"],
                         ratio=r["ratio_to_eager"], ratio_kind="eager_ms/ms", equal=r["equal"],
                         **{k: r[k] for k in ("first_call_s", "kernel_ms_by_kind", "idle_ms", "sm_mhz", "power_w", "graph_mib",
                                              "gemm_choices")
                            if k in r}) for r in rows], "benchmarks/models/bench_engine.py")
    write_json(f"bench_engine_{args.mini or args.model}_{'production' if args.mini else args.config}_b{args.batch}.json",
               {"rows": rows, "coverage": lines, "disabled": disabled, "eager": eager_calls})


if __name__ == "__main__":
    main()
