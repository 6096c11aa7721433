"""Benchmark one ERNIE-Image transformer forward (full 8B config, bf16, seeded random weights from
exactdit.harness.tiny.build_transformer) at 1024x1024, batch 1 and 2 (CFG, padded text;
exactdit.harness.sampling.forward_inputs):

- eager: diffusers unpatched;
- exactdit: ``exactdit.patch`` (EXACTDIT_TRUST not set: one warm-up forward verifies each new
  signature, later forwards run verified kernels without checks);
- regional compile: ``compile_repeated_blocks(fullgraph=True)`` of the unpatched model (Inductor,
  not bit-identical, shown for speed);
- exactdit + regional compile: the patched model under the same compile (exactdit ops are custom
  ops, opaque to Inductor);
- floor: GPU time of the GEMM and attention kernels alone (torch.profiler, eager forward).

Also a torch.profiler breakdown of the patched forward's non-GEMM, non-attention GPU time (top
kernels). CUDA-event medians after warm-up. Run from the repository root on a CUDA GPU:
``python benchmarks/bench_ernie.py``; prints Markdown and writes ``bench_ernie.json`` to $OUT.

ERNIE_BENCH_CONFIG (full/small/tiny) and ERNIE_BENCH_SIZE (HxW pixels) override the shape. Without a
CUDA GPU it is a smoke run of the script (default tiny at 256x256, wall-clock medians, no kernel
breakdown), not a benchmark.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, table, write_json  # noqa: E402
import exactdit  # noqa: E402
from exactdit.harness.sampling import forward, forward_inputs, latent_hw_for, synchronize  # noqa: E402
from exactdit.harness.tiny import build_transformer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = os.environ.get("ERNIE_BENCH_CONFIG", "full" if DEVICE == "cuda" else "tiny")
HEIGHT, WIDTH = (int(v) for v in os.environ.get("ERNIE_BENCH_SIZE", "1024x1024" if DEVICE == "cuda" else
                                                 "256x256").lower().split("x"))
T0 = time.time()
BUDGET_S = float(os.environ.get("ERNIE_BENCH_BUDGET_S", 240))
CASES = {1: [128], 2: [128, 77]}  # batch -> text lengths
GEMM_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "sm100_", "ampere_", "hopper_")
ATTN_WORDS = ("flash", "fmha", "attention", "cudnn", "sdpa", "mha")


def kind(kernel: str) -> str:
    k = kernel.lower()
    if any(w in k for w in ATTN_WORDS):
        return "attention"
    if any(w in k for w in GEMM_WORDS):
        return "gemm"
    return "other"


def inputs(model, text_lens):
    return forward_inputs(model, latent_hw=latent_hw_for(HEIGHT, WIDTH), text_lens=text_lens, device=DEVICE)


def median_ms(fn, warmup=2, reps=7) -> float:
    for _ in range(warmup):
        fn()
    synchronize(DEVICE)
    times = []
    if DEVICE != "cuda":  # CPU smoke run: wall clock
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_times(fn) -> dict[str, list[float]]:
    """GPU kernel durations (ms) of one call of ``fn``, by kernel name (none without a GPU)."""
    if DEVICE != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = defaultdict(list)
    for e in prof.events():
        if getattr(e, "device_type", None) == DeviceType.CUDA:
            out[e.name].append(e.time_range.elapsed_us() / 1e3)
    if not out:  # older/newer profiler without device events in events(): per-kernel averages
        for e in prof.key_averages():
            total = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
            if total and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset", "[")):
                out[e.key] = [total / 1e3 / e.count] * e.count
    return out


def split(times: dict[str, list[float]]) -> dict[str, float]:
    totals = defaultdict(float)
    for name, ts in times.items():
        totals[kind(name)] += sum(ts)
    return dict(totals)


def top_other(times, n=15) -> list[dict]:
    rows = [
        {"kernel": name[:90], "launches": len(ts), "total_ms": sum(ts)}
        for name, ts in times.items()
        if kind(name) == "other"
    ]
    return sorted(rows, key=lambda r: -r["total_ms"])[:n]


def uncompile(model):
    for block in model.layers:
        block._compiled_call_impl = None


def main():
    model = build_transformer(CONFIG, seed=0, dtype=torch.bfloat16, device=DEVICE)
    print(f"[{time.time() - T0:.0f}s] built {CONFIG} config", flush=True)
    lh, lw = latent_hw_for(HEIGHT, WIDTH)
    results, breakdowns, refs = [], {}, {}
    for B, lens in CASES.items():
        kw = inputs(model, lens)
        run = lambda: forward(model, kw)  # noqa: E731
        row = {"B": B, "S": lh * lw + max(lens)}

        exactdit.unpatch(model)
        ref = refs[B] = run()
        row["eager_ms"] = median_ms(run)
        eager_kernels = kernel_times(run)
        if eager_kernels:
            parts = split(eager_kernels)
            row["gemm_ms"], row["attention_ms"] = parts.get("gemm", 0.0), parts.get("attention", 0.0)
            row["floor_ms"] = row["gemm_ms"] + row["attention_ms"]
            row["eager_other_ms"] = parts.get("other", 0.0)

        exactdit.patch(model)
        exactdit.reset_report()
        row["exactdit_equal"] = bool(torch.equal(run(), ref))  # first call verifies the new signatures
        row["exactdit_ms"] = median_ms(run)
        patched_kernels = kernel_times(run)
        if patched_kernels:
            row["exactdit_other_ms"] = split(patched_kernels).get("other", 0.0)
        breakdowns[B] = top_other(patched_kernels)
        row["report"] = {k: dict(v) for k, v in exactdit.report(show=False).items()}
        print(f"[{time.time() - T0:.0f}s] B={B} eager {row['eager_ms']:.1f} ms exactdit {row['exactdit_ms']:.1f} ms "
              f"equal={row['exactdit_equal']}", flush=True)
        results.append(row)

    # regional compile of the unpatched, then of the patched model (compile time counts against the budget)
    for label, patched in (("compile", False), ("exactdit_compile", True)):
        if time.time() - T0 > BUDGET_S:
            print(f"skipping {label}: time guard")
            continue
        try:
            torch._dynamo.reset()
            uncompile(model)
            (exactdit.patch if patched else exactdit.unpatch)(model)
            model.compile_repeated_blocks(fullgraph=True)
            for row in results:
                kw = inputs(model, CASES[row["B"]])
                run = lambda: forward(model, kw)  # noqa: E731
                t = time.time()
                out = run()
                synchronize(DEVICE)
                row[f"{label}_first_call_s"] = time.time() - t
                row[f"{label}_equal"] = bool(torch.equal(out, refs[row["B"]]))
                row[f"{label}_ms"] = median_ms(run)
                print(f"[{time.time() - T0:.0f}s] B={row['B']} {label} {row[f'{label}_ms']:.1f} ms "
                      f"equal={row[f'{label}_equal']} (first call {row[f'{label}_first_call_s']:.0f} s)", flush=True)
        except Exception as e:
            traceback.print_exc()
            for row in results:
                row.setdefault(f"{label}_ms", f"failed: {type(e).__name__}")
    uncompile(model)

    print("\nexactdit.report() (last patched forwards):")
    exactdit.report()
    cols = ["B", "S", "eager_ms", "exactdit_ms", "compile_ms", "exactdit_compile_ms", "floor_ms", "gemm_ms",
            "attention_ms", "eager_other_ms", "exactdit_other_ms", "exactdit_equal", "compile_equal",
            "exactdit_compile_equal"]
    for r in results:
        for c in cols:
            r.setdefault(c, "n/a")
    env = environment() if DEVICE == "cuda" else {"gpu": "no GPU (cpu smoke run)"}
    print(f"\nERNIE-Image {CONFIG} config, {HEIGHT}x{WIDTH}, bf16, {env['gpu']}; ms per forward "
          f"({'CUDA-event' if DEVICE == 'cuda' else 'wall-clock'} median)\n")
    print(table(results, cols))
    for B, rows in breakdowns.items():
        if not rows:
            continue
        print(f"\nexactdit forward B={B}: top non-GEMM, non-attention kernels (one forward)\n")
        print(table(rows, ["kernel", "launches", "total_ms"]))
    path = write_json("bench_ernie.json", {"environment": env, "config": CONFIG, "size": f"{HEIGHT}x{WIDTH}",
                                           "results": results,
                                           "other_kernels": breakdowns, "seconds": time.time() - T0})
    print(f"\nwrote {path} ({time.time() - T0:.0f} s)")


if __name__ == "__main__":
    main()
