"""GPU profiling helpers the benchmarks share: kernel time by kind (GEMM, attention, other), idle gaps
between kernels, SM clock and board power while a forward runs back to back."""

from __future__ import annotations

import statistics
import time
from collections import Counter, defaultdict

import torch

GEMM_WORDS = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "sm90_", "sm100_", "ampere_", "hopper_")
ATTN_WORDS = ("flash", "fmha", "attention", "cudnn", "sdpa", "mha")


def kind(kernel: str) -> str:
    k = kernel.lower()
    if any(w in k for w in ATTN_WORDS):
        return "attention"
    if any(w in k for w in GEMM_WORDS):
        return "gemm"
    return "other"


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



def _energy_mj():
    """The board's energy counter (mJ since the driver loaded; NVML), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(pynvml.nvmlDeviceGetHandleByIndex(index))
    except Exception:  # noqa: BLE001 - no NVML (nvidia-ml-py) or a device without the counter
        return None


def clocks_while(fn, seconds: float = 4.0, synchronize_each: bool = True) -> dict:
    """Median SM clock (MHz) and board power (W) sampled by nvidia-smi every 100 ms while ``fn``
    runs back to back for ``seconds`` (None where nvidia-smi is missing), and the energy of one
    call: the board's energy counter over the calls after the first quarter, divided by their
    number (J; None without NVML). At the power cap, energy per call is what fusion must lower.
    ``synchronize_each=False`` queues calls without waiting between them (short kernels: no idle gaps)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return {"sm_mhz": None, "power_w": None, "energy_j": None}
    energy = _energy_mj()
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "100"], stdout=subprocess.PIPE, text=True)
    t = time.time()
    calls, mark = 0, None
    while time.time() - t < seconds:
        if mark is None and time.time() - t >= seconds / 4:  # after the ramp-up, as the samples
            torch.cuda.synchronize()
            mark, calls = (energy() if energy else None), 0
        fn()
        calls += 1
        if synchronize_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    energy_j = (energy() - mark) / 1e3 / calls if energy and mark is not None and calls else None
    smi.terminate()
    samples = [line.split(",") for line in smi.communicate()[0].splitlines() if "," in line]
    clocks = [float(a) for a, _ in samples[len(samples) // 4:]]  # skip the ramp-up
    power = [float(b) for _, b in samples[len(samples) // 4:]]
    return {"sm_mhz": statistics.median(clocks) if clocks else None,
            "power_w": statistics.median(power) if power else None, "samples": len(samples),
            "energy_j": energy_j}
