"""Where the time of one ERNIE-Image forward goes, eager vs patched (full config, bf16, B=1,
1024x1024 unless ERNIE_BENCH_CONFIG / ERNIE_BENCH_SIZE say otherwise):

- wall: CUDA-event median of a forward launched from Python;
- host: how long Python takes to *issue* the forward (perf_counter, no sync at the end): when it
  approaches wall, the GPU waits for the host;
- graph: CUDA-event median of replaying a captured CUDA graph of the forward (no host cost);
- kernels: sum of GPU kernel durations in one profiled forward, and the idle gaps between them;
- host per exactdit op: perf_counter around each fused-op call during one forward;
- runtime calls that block the host (synchronize, device-to-host copies), counted;
- median SM clock and board power while the forward runs back to back (nvidia-smi);
- host cost of one call: an empty Triton kernel, a fused op's launcher, the op through the gate.

Run on a CUDA GPU from the repository root: ``python benchmarks/profile_ernie.py``; prints
Markdown and writes ``profile_ernie.json`` to $OUT.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import time
from collections import Counter, defaultdict

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, table, write_json  # noqa: E402
import exactdit  # noqa: E402
from exactdit.harness.sampling import forward, forward_inputs, latent_hw_for  # noqa: E402
from exactdit.harness.tiny import build_transformer  # noqa: E402
from exactdit.ops import library as lib  # noqa: E402
from bench_ernie import kind, median_ms  # noqa: E402

CONFIG = os.environ.get("ERNIE_BENCH_CONFIG", "full")
HEIGHT, WIDTH = (int(v) for v in os.environ.get("ERNIE_BENCH_SIZE", "1024x1024").lower().split("x"))
FUSED_SITES = ("rms_norm_modulate", "gated_rms_norm_modulate", "qk_norm_rope", "geglu", "residual_gate_add",
               "layer_norm_modulate", "rope_tables")


def host_median_ms(fn, reps: int = 7) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def graph_of(fn):
    """Capture ``fn`` into a CUDA graph; returns (replay, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def profile_once(fn) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels, runtime = [], Counter()
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif e.name.startswith(("cuda", "cu")):
            runtime[e.name] += 1
    kernels.sort()
    busy = sum(end - start for start, end, _ in kernels) / 1e3
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    gaps = [(kernels[i + 1][0] - kernels[i][1], kernels[i][2][:50], kernels[i + 1][2][:50]) for i in range(len(kernels) - 1)]
    gap_ms = sum(max(g, 0) for g, _, _ in gaps) / 1e3
    by_kind, by_name = defaultdict(float), defaultdict(float)
    for start, end, name in kernels:
        by_kind[kind(name)] += (end - start) / 1e3
        by_name[name[:100]] += (end - start) / 1e3
    by_next = defaultdict(float)
    for g, _, after in gaps:
        by_next[after] += max(g, 0) / 1e3
    blocking = {k: v for k, v in runtime.items() if any(w in k for w in ("ynchronize", "Memcpy", "EventQuery"))}
    return {
        "kernels": len(kernels),
        "kernel_ms_by_kind": dict(by_kind),
        "kernel_ms_by_name": dict(by_name),
        "kernel_ms": busy,
        "span_ms": span,
        "idle_ms": gap_ms,
        "idle_before_kernel_ms": sorted(((v, k) for k, v in by_next.items()), reverse=True)[:12],
        "largest_gaps_us": [(round(g, 1), a, b) for g, a, b in sorted(gaps, reverse=True)[:12]],
        "blocking_runtime_calls": blocking,
        "launch_calls": {k: v for k, v in runtime.items() if "aunch" in k},
    }


def host_per_site(fn) -> dict:
    """perf_counter totals (ms) per fused-op wrapper over one forward."""
    totals, counts = defaultdict(float), Counter()
    saved = {name: getattr(lib, name) for name in FUSED_SITES}

    def timed(name, f):
        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                totals[name] += (time.perf_counter() - t) * 1e3
                counts[name] += 1

        return wrapper

    for name, f in saved.items():
        setattr(lib, name, timed(name, f))
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        total = (time.perf_counter() - t) * 1e3
        torch.cuda.synchronize()
    finally:
        for name, f in saved.items():
            setattr(lib, name, f)
    rows = [{"site": k, "calls": counts[k], "host_ms": totals[k], "us_per_call": 1e3 * totals[k] / counts[k]}
            for k in totals]
    return {"forward_host_ms": total, "sites": sorted(rows, key=lambda r: -r["host_ms"])}


def clocks_while(fn, seconds: float = 4.0) -> dict:
    """Median SM clock (MHz) and board power (W) sampled by nvidia-smi every 100 ms while ``fn``
    runs back to back for ``seconds`` (None where nvidia-smi is missing)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return {"sm_mhz": None, "power_w": None}
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    t = time.time()
    while time.time() - t < seconds:
        fn()
        torch.cuda.synchronize()
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    clocks = [float(a) for a, _ in samples[len(samples) // 4:]]  # skip the ramp-up
    power = [float(b) for _, b in samples[len(samples) // 4:]]
    return {"sm_mhz": statistics.median(clocks) if clocks else None,
            "power_w": statistics.median(power) if power else None, "samples": len(samples)}


@triton.jit
def _empty_kernel(a, b, c, n):
    pass


def launch_costs(reps: int = 300) -> list[dict]:
    """Host microseconds per call, on tiny tensors (the GPU keeps up): an empty Triton kernel,
    residual_gate_add's launcher alone (no gate), the public op (gate + launcher)."""
    from exactdit import ops
    from exactdit.ops.elementwise import RESIDUAL_GATE_ADD

    x = torch.randn(8, 1, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, 1, 64, device="cuda", dtype=torch.bfloat16)
    cases = {
        "empty triton kernel (4 args)": lambda: _empty_kernel[(1,)](x, x, x, 8),
        "residual_gate_add launcher": lambda: RESIDUAL_GATE_ADD.fused(x, x, g),
        "ops.residual_gate_add (gate + launcher)": lambda: ops.residual_gate_add(x, x, g),
        "torch.empty_like": lambda: torch.empty_like(x),
        "eager x + g * x": lambda: x + g * x,
    }
    rows = []
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        rows.append({"call": name, "host_us": (time.perf_counter() - t) / reps * 1e6})
        torch.cuda.synchronize()
    return rows


def main():
    t0 = time.time()
    model = build_transformer(CONFIG, seed=0, dtype=torch.bfloat16, device="cuda")
    kw = forward_inputs(model, latent_hw=latent_hw_for(HEIGHT, WIDTH), text_lens=[128], device="cuda")
    run = lambda: forward(model, kw)  # noqa: E731
    print(f"[{time.time() - t0:.0f}s] built {CONFIG}", flush=True)
    rows, details = [], {}
    ref = None
    for label in ("eager", "exactdit", "eager_again"):  # eager twice: clocks and caches drift
        (exactdit.patch if label == "exactdit" else exactdit.unpatch)(model)
        out = run()
        if ref is None:
            ref = out.clone()
        row = {"model": label, "equal": bool(torch.equal(out, ref))}
        row["wall_ms"] = median_ms(run)
        row["host_ms"] = host_median_ms(run)
        replay, static = graph_of(run)
        row["graph_ms"] = median_ms(replay)
        row["graph_equal"] = bool(torch.equal(static, ref))
        del replay, static
        row.update(clocks_while(run))
        prof = profile_once(run)
        row.update(kernels=prof["kernels"], kernel_ms=prof["kernel_ms"], idle_ms=prof["idle_ms"],
                   **{f"{k}_ms": prof["kernel_ms_by_kind"].get(k, 0.0) for k in ("gemm", "attention", "other")})
        details[label] = {"profile": prof}
        if label == "exactdit":
            details[label]["host"] = host_per_site(run)
        rows.append(row)
        print(f"[{time.time() - t0:.0f}s] {row}", flush=True)
    cols = ["model", "wall_ms", "host_ms", "graph_ms", "kernel_ms", "gemm_ms", "attention_ms", "other_ms", "idle_ms",
            "kernels", "sm_mhz", "power_w", "equal", "graph_equal"]
    env = environment()
    print(f"\nERNIE-Image {CONFIG} {HEIGHT}x{WIDTH} B=1 bf16, {env['gpu']}\n")
    print(table(rows, cols))
    for label, d in details.items():
        p = d["profile"]
        print(f"\n{label}: blocking runtime calls {p['blocking_runtime_calls']}; launches {p['launch_calls']}")
        print(f"{label}: idle before kernel (ms): {[(round(v, 2), k) for v, k in p['idle_before_kernel_ms']]}")
        print(f"{label}: largest gaps (us): {p['largest_gaps_us']}")
    eager_names = details["eager"]["profile"]["kernel_ms_by_name"]
    fused_names = details["exactdit"]["profile"]["kernel_ms_by_name"]
    diff = sorted(((fused_names.get(n, 0.0) - eager_names.get(n, 0.0), n) for n in set(eager_names) | set(fused_names)
                   if kind(n) != "other"), reverse=True)
    print("\nGEMM/attention kernels, exactdit minus eager (ms per forward):")
    for d, n in diff[:8] + diff[-4:]:
        print(f"  {d:+8.2f}  eager {eager_names.get(n, 0.0):7.2f}  {n}")
    host = details["exactdit"]["host"]
    print(f"\nexactdit host time to issue one forward: {host['forward_host_ms']:.1f} ms; per fused site:\n")
    print(table(host["sites"], ["site", "calls", "host_ms", "us_per_call"]))
    launches = launch_costs()
    print("\nhost cost of one call (tiny tensors):\n")
    print(table(launches, ["call", "host_us"]))
    path = write_json("profile_ernie.json", {"environment": env, "config": CONFIG, "rows": rows, "details": details,
                                             "launch_costs": launches})
    print(f"\nwrote {path} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
