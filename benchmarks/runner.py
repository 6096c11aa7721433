"""Shared benchmark plumbing: CUDA-event medians, the copy-bandwidth floor, JSON output."""

from __future__ import annotations

import functools
import json
import os
import platform
import statistics
import time

import torch

from exactdit.harness.metrics import outputs_equal  # noqa: F401  (the benchmarks' equality)

#: ERNIE-Image's production shapes at 1024x1024: tokens, hidden size, heads, head dim, FFN width.
S, D, HEADS, HEAD_DIM, FFN = 4224, 4096, 32, 128, 12288


def median_ms(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median time of ``fn`` in ms (CUDA events, L2 flushed between runs, after warm-up)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_median_ms(fn, rep_ms: float = 200) -> float:
    """Median GPU time of ``fn`` in ms, replayed from a CUDA graph so that Python and launch
    overhead are excluded (the time a GPU-bound model sees)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def forward_ms(tr, kw, repeat: int) -> tuple[float, torch.Tensor]:
    """Median ms of ``repeat`` transformer forwards after one (CUDA events; wall clock on the CPU),
    and the last output: with every kernel compiled (:func:`kernels_ready_s`), so the untimed
    forward verifies every region and the timed ones run them fused."""
    cuda = kw_device(kw) == "cuda"
    kernels_ready_s()
    with torch.no_grad():
        out = tr(**kw, return_dict=False)[0]
        _sync()
        times = []
        for _ in range(repeat):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = tr(**kw, return_dict=False)[0]
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                out = tr(**kw, return_dict=False)[0]
                times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), torch.utils._pytree.tree_map(
        lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)  # (Z-Image returns a list)


def kw_device(kw: dict) -> str:
    return next(v.device.type for v in kw.values() if isinstance(v, torch.Tensor))


def fused_from_the_first_call() -> None:
    """Regions of this process wait for kernels still compiling in exactdit's compile workers
    instead of running eager meanwhile: for tools that check, profile or tune the first patched
    calls (their verdict must cover the fused kernels)."""
    os.environ["EXACTDIT_WAIT_FOR_KERNELS"] = "1"


def kernels_ready_s() -> float:
    """Seconds until every kernel sent to exactdit's compile workers is compiled (0.0 when none
    is pending): a first call does not wait for them, its regions run eager meanwhile."""
    from exactdit.device import compile_workers

    t = time.perf_counter()
    compile_workers.wait_all()
    return time.perf_counter() - t


def first_call_s(tr, kw, outputs: list | None = None) -> float:
    """Wall seconds of one call (as a user's call: regions whose kernels are still compiling run eager);
    its output appended to ``outputs`` where given."""
    _sync()
    t = time.perf_counter()
    with torch.no_grad():
        out = tr(**kw, return_dict=False)
    _sync()
    seconds = time.perf_counter() - t
    if outputs is not None:
        outputs.append(out)
    return seconds


def settle_graphs(tr, kw) -> None:
    """The calls a model patched with ``cuda_graphs=True`` makes before its steady state: the first
    (runs normally), the second (records), and, where its blocks are graphed, the calls that time
    the forward with and without their graphs (``exactdit.patches.graph_timing``)."""
    from exactdit.patches import graph_timing

    for _ in range(2 + 2 * graph_timing.SAMPLES + 1):
        first_call_s(tr, kw)


def add_model_args(ap) -> None:
    """The command-line arguments that pick a registered model and one forward's geometry."""
    ap.add_argument("--model", default="flux", help="a name of exactdit.harness.models")
    ap.add_argument("--config", default="full")
    ap.add_argument("--height", type=int, default=None)
    ap.add_argument("--width", type=int, default=None)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--mini", default=None,
                    help="instead of --model: a mini model of tests.minis with a production config, "
                         "run as its released model at its typical size (sd3, flux2, hunyuan-video, ...)")


def model_and_inputs(args, dtype=torch.bfloat16, device="cuda"):
    """(transformer, kwargs of one forward) for :func:`add_model_args`'s arguments."""
    from exactdit.harness import models
    from tests import minis

    if args.mini:
        tr = minis.build(args.mini, dtype=dtype, device=device, production=True)
        return tr, minis.forward_inputs(args.mini, tr, batch=args.batch, device=device,
                                        grid=minis.production_of(args.mini).grid)
    tr = models.build_transformer(args.model, args.config, dtype=dtype, device=device)
    kw = models.forward_inputs(args.model, tr, height=args.height, width=args.width, num_frames=args.frames,
                               batch=args.batch)
    return tr, kw


def model_label(args) -> tuple[str, str]:
    """(model, shape) of :func:`add_model_args`'s arguments, as the results file names them."""
    if args.mini:
        from tests import minis

        production = minis.production_of(args.mini)
        return f"{production.model} transformer forward", f"{production.pixels} B={args.batch}"
    frames = f"x{args.frames}" if args.frames else ""
    return f"{args.model} transformer forward ({args.config})", f"{args.height}x{args.width}{frames} B={args.batch}"


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), measured now."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    ms = median_ms(functools.partial(torch.empty_like(src).copy_, src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU only ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }


def write_json(name: str, payload: dict) -> str:
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    return path


#: fields of a row of benchmarks/results.jsonl (one JSON object per line; extra fields allowed)
RESULT_FIELDS = ("model_or_op", "shape", "dtype", "path", "ms", "ratio", "ratio_kind", "equal", "gpu", "torch",
                 "triton", "commit", "date", "source")


def append_results(rows: list[dict], source: str) -> str:
    """Append measurement rows to ``$OUT/results.jsonl`` in the results file's schema (the rows
    are copied into benchmarks/results.jsonl after a device session)."""
    import datetime
    import subprocess

    # EXACTDIT_COMMIT first: the device machine's copy of the tree carries a stale .git (its HEAD
    # named d55337c for every commit run there on 2026-12-05)
    commit = os.environ.get("EXACTDIT_COMMIT") or None
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                          cwd=os.path.dirname(__file__)).stdout.strip() or None
    except OSError:
        commit = None
    env = environment()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "results.jsonl")
    with open(path, "a") as f:
        for row in rows:
            full = {"gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"], "commit": commit,
                    "date": datetime.date.today().isoformat(), "source": source, **row}
            f.write(json.dumps({k: full.get(k) for k in RESULT_FIELDS} | {k: v for k, v in full.items()
                                                                          if k not in RESULT_FIELDS}) + "\n")
    return path


def table(rows: list[dict], columns: list[str]) -> str:
    """A Markdown table of ``rows``."""
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    return "\n".join(lines)
