"""The power-cap floor of a forward, measured: the energy its GEMMs and attention need alone.

    python3 benchmarks/models/energy_floor.py --model flux --config full --height 1024 --width 1024
    python3 benchmarks/models/energy_floor.py --mini sd3

At the board's power cap a forward's time is its energy divided by the power the cap allows, so
a forward cannot be faster than the energy of the kernels exactness leaves as they are (cuBLAS's
GEMMs, the attention backend's kernels) divided by that power. This measures that claim instead
of assuming it: every GEMM and attention op of the model's block graphs (captured with real
inputs) runs back to back with its own inputs, and NVML's energy counter gives its energy per
call (``clocks_while``); each op counts as many times as the forward runs it. The forward itself
(eager, and exactdit with CUDA graphs) is measured the same way, in the same process. Printed:
per op kind the energy and back-to-back time, their sums, and the floor in ms at the forward's
own power: the time no fusion of the other work can go below while these kernels stay.

What is not counted: work outside the blocks (embedders, the final projection), which every way
runs. Needs NVML (``nvidia-ml-py``); without it only times are printed. Rows go to the results file.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.models.profiling import clocks_while  # noqa: E402
from benchmarks.runner import add_model_args, append_results, environment, forward_ms, model_and_inputs, model_label  # noqa: E402,E501
from exactdit.engine import timing  # noqa: E402
from exactdit.engine.coverage import is_gemm_or_attention, op_name  # noqa: E402
from exactdit.patches.engine import repeated_blocks  # noqa: E402

SECONDS = 1.0  # back to back per op: long enough for the clock to settle at the cap


def signature(node, args) -> tuple:
    flat = [a for a in args if isinstance(a, torch.Tensor)]
    return (str(node.target), tuple((tuple(t.shape), t.stride(), t.dtype) for t in flat))


def op_calls(measured) -> list[dict]:
    """Each distinct GEMM / attention call of the block graphs: how to call it and how many times
    a forward does."""
    calls: dict[tuple, dict] = {}
    for graph, timer, _ in measured:
        values = timer.values
        for node in timer.module.graph.nodes:
            if node.op != "call_function" or not is_gemm_or_attention(node):
                continue
            args = torch.fx.node.map_arg(node.args, values.__getitem__)
            kwargs = torch.fx.node.map_arg(node.kwargs, values.__getitem__)
            key = signature(node, list(args) + list(kwargs.values()))
            entry = calls.setdefault(key, {"op": op_name(node), "count": 0,
                                           "fn": (lambda t=node.target, a=args, k=kwargs: t(*a, **k))})
            entry["count"] += graph.blocks
    return list(calls.values())


def back_to_back(fn, calls: int = 20) -> dict:
    """us per call queued back to back (CUDA events), and energy per call at the cap (NVML).
    Off the GPU (the CPU smoke test of this script): wall clock, no energy."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return {"us": (time.perf_counter() - start) * 1e6, "j": None, "sm_mhz": None, "power_w": None}
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    c = clocks_while(fn, seconds=SECONDS, synchronize_each=False)
    return {"us": start.elapsed_time(end) * 1e3 / calls, "j": c["energy_j"], "sm_mhz": c["sm_mhz"],
            "power_w": c["power_w"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--no-exactdit", action="store_true", help="measure eager's forward only")
    args = ap.parse_args()
    tr, kw = model_and_inputs(args, device="cuda" if torch.cuda.is_available() else "cpu")
    whole_forward = clocks_while if torch.cuda.is_available() else (lambda fn, seconds: {
        "energy_j": None, "power_w": None, "sm_mhz": None, "done": fn()})
    with torch.no_grad():
        measured = timing.measure(tr, kw, repeated_blocks(tr))
        by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for entry in op_calls(measured):
            m = back_to_back(entry["fn"])
            kind = "attention" if entry["op"] not in ("mm", "addmm", "bmm", "baddbmm") else "gemm"
            by_kind[kind]["us"] += m["us"] * entry["count"]
            by_kind[kind]["j"] += (m["j"] or 0.0) * entry["count"]
            by_kind[kind]["calls"] += entry["count"]
            mj = f"{m['j'] * 1e3:.2f} mJ" if m["j"] is not None else "no energy counter"
            print(f"{entry['op']} x{entry['count']}: {m['us']:.1f} us, {mj}, {m['sm_mhz']} MHz, {m['power_w']} W",
                  flush=True)
        whole = {"eager": whole_forward(lambda: tr(**kw), seconds=8.0)}  # (before the patch: in place)
        whole["eager"]["ms"] = forward_ms(tr, kw, 5)[0]
        if not args.no_exactdit:
            import exactdit

            graphs = torch.cuda.is_available()
            exactdit.patch(tr, cuda_graphs=graphs)
            for _ in range(3):  # capture, verification, recording
                tr(**kw)
            name = "exactdit + graphs" if graphs else "exactdit"
            whole[name] = whole_forward(lambda: tr(**kw), seconds=8.0)
            whole[name]["ms"] = forward_ms(tr, kw, 5)[0]
    model, shape = model_label(args)
    env = environment()
    floor_j = sum(c["j"] for c in by_kind.values())
    rows = []
    for name, c in whole.items():
        power = c["power_w"] or 0.0
        c.pop("done", None)
        floor_ms = floor_j / power * 1e3 if power and floor_j else None
        floor = floor_ms and round(floor_ms, 1)
        print(f"{name}: {c['ms']:.1f} ms, {c['energy_j']} J per forward at {power} W, {c['sm_mhz']} MHz; GEMM + "
              f"attention alone {floor_j:.2f} J -> floor {floor} ms at that power", flush=True)
        rows.append(dict(model_or_op=model, shape=shape, dtype="bf16", path=name, ms=c["ms"],
                         energy_j=c["energy_j"], power_w=power, sm_mhz=c["sm_mhz"], floor_ms=floor_ms,
                         ratio_kind="energy floor: GEMM + attention J / forward power",
                         by_kind={k: dict(v) for k, v in by_kind.items()}, **env))
    for kind, c in by_kind.items():
        print(f"{kind}: {c['calls']} calls, {c['us'] / 1e3:.1f} ms back to back, {c['j']:.2f} J")
    append_results(rows, "benchmarks/models/energy_floor.py")


if __name__ == "__main__":
    os.environ.setdefault("EXACTDIT_WAIT_FOR_KERNELS", "1")
    main()
