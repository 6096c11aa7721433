"""``exactdit demo``: eager vs patched sampling of an embedded ERNIE-Image transformer (no downloads)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import _api, metrics, perf
from .ab import latent_side_by_side
from .sampling import make_inputs, sample, warmup
from .tiny import build_transformer, dtype_from_name, dtype_name, estimate_bytes, get_config


class HarnessError(RuntimeError):
    """A user-facing error (the CLI prints its message on one line and exits non-zero)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda was requested but no CUDA GPU is available to PyTorch")
    if dev.type not in ("cpu", "cuda"):
        raise HarnessError(f"unsupported device {name!r} (use auto, cpu or cuda)")
    return dev


def default_config(device: torch.device) -> str:
    return "small" if device.type == "cuda" else "tiny"


def default_dtype(device: torch.device) -> str:
    return "bf16" if device.type == "cuda" else "fp32"


CPU_NOTE = (
    "No CUDA GPU: the fused Triton path needs a CUDA GPU, so here the patched run falls back to eager "
    "PyTorch op by op. This checks the harness and the fallback, not the kernels."
)
INTERPRETER_NOTE = (
    "No CUDA GPU, TRITON_INTERPRET=1: the fused Triton path needs a CUDA GPU for speed; here the patched run's "
    "fused kernels run in Triton's CPU interpreter (slow) and ops that reproduce a CUDA kernel's rounding run "
    "eager. This checks the kernels' results, not their speed."
)
#: Above this many parameters a CPU run is impractical (the full 8B config: minutes to build, hours to sample).
CPU_MAX_PARAMS = 1e9


def interpreting() -> bool:
    """Whether fused kernels run on CPU tensors in Triton's interpreter (what the gate decides by)."""
    from exactdit import gate

    return bool(gate.INTERPRET)


def no_gpu_note() -> str:
    """What runs where there is no CUDA GPU, said before the runs."""
    return INTERPRETER_NOTE if interpreting() else CPU_NOTE


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CUDA: mem_get_info; CPU: available physical pages), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(config: str, dtype: torch.dtype, device: torch.device) -> int:
    """Refuse (clearly) a config whose weights alone would not fit, instead of being killed for OOM;
    returns the bytes its weights need."""
    need = estimate_bytes(config, dtype)
    have = available_bytes(device)
    if have is not None and need * 1.1 > have:
        raise HarnessError(
            f"--config {config} needs about {need / 2**30:.1f} GiB for its weights in {dtype_name(dtype)} but only "
            f"{have / 2**30:.1f} GiB is free on {device.type}; use a smaller --config or a bigger device"
        )
    return need


@dataclass
class DemoOptions:
    config: str | None = None
    steps: int = 8
    seed: int = 0
    dtype: str | None = None
    out: str = "runs/demo"
    device: str = "auto"
    guidance_scale: float = 4.0
    warmup: int = 1
    progress: bool = True


def _fmt_reasons(reasons: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def run_demo(opts: DemoOptions, echo: Callable[[str], None] = print) -> tuple[dict, int]:
    """Run the demo; returns (summary dict, exit code: 0 equal, 1 different)."""
    ex = _api.api()  # fail early and clearly if the patching API is unavailable
    device = resolve_device(opts.device)
    config = opts.config or default_config(device)
    cfg = get_config(config)
    dtname = opts.dtype or default_dtype(device)
    dtype = dtype_from_name(dtname)
    if opts.steps < 1:
        raise HarnessError("--steps must be >= 1")
    weight_bytes = check_memory(config, dtype, device)
    n_params = weight_bytes // dtype.itemsize
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)

    h, w = cfg["latent_hw"]
    echo(
        f"exactdit demo: config={config} ({n_params / 1e6:.2f}M params, {h}x{w} latents, "
        f"text {cfg['text_len']}/{cfg['neg_text_len']} tokens), {opts.steps} steps, {dtname}, seed {opts.seed}, "
        f"CFG {opts.guidance_scale:g}"
    )
    dev_info = perf.device_info(device)
    echo(f"device: {device.type} ({dev_info.get('name')}, torch threads {dev_info.get('torch_threads')})")
    if device.type != "cuda":
        echo("NOTE: " + no_gpu_note())
        if n_params > CPU_MAX_PARAMS:
            # it fits in memory, but would keep the CPU busy for hours: say so before the long silence
            echo(f"WARNING: --config {config} ({n_params / 1e9:.1f}B params) is impractical on CPU: building its "
                 f"weights takes minutes and sampling hours. Use --config tiny or small here, or a CUDA GPU.")

    # the slow phases (weights, warmup) each announce themselves, so a long run is never silent
    size = f"{weight_bytes / 2**30:.1f} GiB" if weight_bytes >= 2**30 else f"{weight_bytes / 2**20:.1f} MiB"
    echo(f"building weights: {size} in {dtname} on {device.type} ...")
    t0 = time.perf_counter()
    transformer = build_transformer(config, seed=opts.seed, dtype=dtype, device=device)
    echo(f"built in {time.perf_counter() - t0:.1f}s")
    inputs = make_inputs(
        transformer,
        latent_hw=cfg["latent_hw"],
        text_len=cfg["text_len"],
        neg_text_len=cfg["neg_text_len"],
        seed=opts.seed,
        guidance_scale=opts.guidance_scale,
        device=device,
    )

    args = {
        "config": config, "steps": opts.steps, "seed": opts.seed, "dtype": dtname, "device": str(device),
        "guidance_scale": opts.guidance_scale, "warmup": opts.warmup, "params": n_params,
        "latent_hw": list(cfg["latent_hw"]), "model_config": dict(cfg["model"]),
    }

    def progress(label):
        if not opts.progress:
            return None, None
        from tqdm.auto import tqdm

        bar = tqdm(total=opts.steps, desc=label, leave=False, unit="step")
        return bar, (lambda i, n: bar.update(1))

    runs = {}
    patch_summary = None
    try:
        for label in ("eager", "patched"):
            if label == "patched":
                patch_summary = ex.patch(transformer)
            if opts.warmup:
                echo(f"{label}: {opts.warmup} untimed warmup call{'s' if opts.warmup > 1 else ''} ...")
                t0 = time.perf_counter()
                warmup(transformer, inputs, opts.warmup)
                echo(f"{label}: warmup done in {time.perf_counter() - t0:.1f}s")
            ex.reset_report()
            perf.reset_peak_memory(device)
            bar, cb = progress(label)
            try:
                res = sample(transformer, inputs, opts.steps, on_step=cb)
            finally:
                if bar is not None:
                    bar.close()
            report = _api.normalize_report(ex.report(show=False)) if label == "patched" else {}
            runs[label] = {
                "result": res,
                "report": report,
                "peak": perf.peak_memory(device),
                "md5": metrics.md5_tensor(res.latents),
            }
    finally:
        if patch_summary is not None:
            ex.unpatch(transformer)

    eager, patched = runs["eager"], runs["patched"]
    equal = bool(torch.equal(eager["result"].latents, patched["result"].latents))
    verdict = "EQUAL" if equal else "DIFFERENT"
    max_abs = metrics.max_abs(eager["result"].latents, patched["result"].latents)

    # files
    preview = out / "demo_latents.png"
    latent_side_by_side(eager["result"].latents, patched["result"].latents).save(preview)
    perf_paths = {}
    for label, run in runs.items():
        res = run["result"]
        rec = perf.make_record(
            label=label,
            kind="demo",
            device=device,
            total_s=res.total_s,
            steps_s=res.step_times_s,
            stages={"denoising_s": res.total_s},
            args=args,
            report=run["report"],
            outputs={"latents_md5": run["md5"], "latents_shape": list(res.latents.shape)},
            peak_gpu_memory_bytes=run["peak"],
        )
        if label == "patched":
            rec["outputs"].update(verdict=verdict, max_abs_vs_eager=max_abs, patch_summary=patch_summary)
        perf_paths[label] = perf.write_json(out / f"perf_{label}.json", rec)

    # table
    def row(label):
        r = runs[label]["result"]
        per_step = statistics.median(r.step_times_s) * 1e3
        return f"{label:<9} {per_step:>12.2f} {r.total_s:>11.3f}   {runs[label]['md5']}"

    # a speedup means something only where the patched run used the GPU
    on_gpu = device.type == "cuda"
    speedup = None
    if on_gpu:
        speedup = eager["result"].total_s / patched["result"].total_s if patched["result"].total_s else float("inf")
    echo("")
    echo(f"{'run':<9} {'step ms(med)':>12} {'total s':>11}   latents md5")
    echo(row("eager"))
    echo(row("patched"))
    if speedup is not None:
        echo(f"{'speedup':<9} {speedup:>12.2f}x")
    if equal:
        echo("result    EQUAL: final latents are bit-identical")
    else:
        echo(f"result    DIFFERENT: final latents differ (max_abs {max_abs:.3g})")
    fused, fell_back, reasons = _api.summarize_report(patched["report"])
    echo(f"fused     {fused} fused op calls ran, {fell_back} fell back to eager ({_fmt_reasons(reasons)})")
    for op, e in sorted(patched["report"].items()):
        echo(f"  {op:<22} fused {e['fused']:>6}  eager {e['eager']:>6}  {_fmt_reasons(e['eager_reasons'])}")
    if not patched["report"]:
        echo("  (exactdit.report() listed no ops)")
    if not on_gpu:
        ran = (f"{fused} op calls ran fused in Triton's CPU interpreter, {fell_back} eager" if fused
               else "both runs used eager PyTorch")
        echo(f"NOTE: no CUDA GPU, so no speedup is shown: {ran}.")
    echo(f"wrote     {preview} (eager | patched | diff: the latent channels projected to RGB, "
         f"no VAE, so not a picture), {perf_paths['eager']}, {perf_paths['patched']}")
    echo(f"compare   exactdit compare {perf_paths['eager']} {perf_paths['patched']}")

    summary = {
        "verdict": verdict,
        "equal": equal,
        "max_abs": max_abs,
        "speedup": speedup,
        "md5": {k: v["md5"] for k, v in runs.items()},
        "report": patched["report"],
        "files": [str(preview), str(perf_paths["eager"]), str(perf_paths["patched"])],
        "device": device.type,
        "config": config,
        "dtype": dtname,
    }
    return summary, (0 if equal else 1)
