"""``exactdit demo``: eager vs patched sampling through diffusers' own pipeline of a registered model
(``exactdit.harness.models``: embedded configs, seeded random weights, tiny offline text encoders
and VAE; no downloads)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from exactdit import gate, reporting
from exactdit.engine import coverage

from . import _api, metrics, models, perf
from .ab import latent_side_by_side
from .models import build_pipeline, dtype_from_name, dtype_name
from .outputs import HarnessError, StagedOutput, check_writable  # HarnessError: imported from here too


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise HarnessError("--device cuda was requested but no CUDA GPU is available to PyTorch")
    if dev.type not in ("cpu", "cuda"):
        raise HarnessError(f"unsupported device {name!r} (use auto, cpu or cuda)")
    return dev


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


def no_gpu_note() -> str:
    """What runs where there is no CUDA GPU, said before the runs (the gate decides by INTERPRET)."""
    return INTERPRETER_NOTE if gate.INTERPRET else CPU_NOTE


def available_bytes(device: torch.device) -> int | None:
    """Free memory on the device (CUDA: mem_get_info; CPU: available physical pages), None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(model: str, config: str, dtype: torch.dtype, device: torch.device) -> int:
    """Refuse (clearly) a config whose weights alone would not fit, instead of being killed for OOM;
    returns the bytes its transformer weights need."""
    need = models.estimate_bytes(model, config, dtype)
    have = available_bytes(device)
    if have is not None and need * 1.1 > have:
        raise HarnessError(f"--config {config} needs about {gib(need)} for its weights in {dtype_name(dtype)} but "
                           f"only {gib(have)} is free on {device.type}; use a smaller --config or a bigger device")
    return need


def check_activation_memory(need: int, what: str, device: torch.device, fix: str) -> None:
    """Refuse, before anything is allocated, a run whose activations alone (``need`` bytes, a lower
    bound) exceed the free memory of ``device``, instead of a failed allocation or the OOM killer."""
    have = available_bytes(device)
    if have is not None and need > have:
        raise HarnessError(f"{what} needs at least {gib(need)} for its activations but only {gib(have)} is free "
                           f"on {device.type}; {fix}")


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CUDA OOM, or the CPU allocator's refusal)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def latent_tokens(model: str, height: int, width: int, num_frames: int | None, batch: int = 1) -> int:
    """Transformer tokens of one forward at this geometry (video: 4x temporal compression)."""
    spec = models.get_spec(model)
    m = spec.pixel_multiple
    frames = (num_frames - 1) // 4 + 1 if spec.video and num_frames else 1
    return batch * max(1, height // m) * max(1, width // m) * frames


def widest_linear(model: str, config: str) -> int:
    """The largest in/out width of the transformer's linear layers (built on the meta device)."""
    from .models.core import on_meta

    tr = on_meta(model, config)
    return max((max(m.in_features, m.out_features) for m in tr.modules() if isinstance(m, torch.nn.Linear)),
               default=1)


#: image (video) size the demo samples per config; "full" uses the model's production size
DEMO_SIZES = {"tiny": (64, 64, 5), "diffusers_test": (32, 32, 5), "small": (512, 512, 9)}


@dataclass
class DemoOptions:
    model: str = "ernie"
    config: str | None = None
    steps: int = 8
    seed: int = 0
    dtype: str | None = None
    out: str = "runs/demo"
    device: str = "auto"
    guidance_scale: float | None = None
    warmup: int = 1
    progress: bool = True
    cuda_graphs: bool = False


def set_guidance(call: dict, scale: float, model: str) -> None:
    """``--guidance-scale`` into a pipeline call: true CFG's scale where the pipeline takes one
    (Qwen-Image), else its guidance scale; a pipeline with neither refuses the option."""
    key = next((k for k in ("true_cfg_scale", "guidance_scale") if k in call), None)
    if key is None:
        raise HarnessError(f"--guidance-scale: {model}'s pipeline takes no guidance scale")
    call[key] = scale


def _fmt_reasons(reasons: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


#: what the demo writes into --out (replaced as a set by the next demo there)
DEMO_FILES = ("demo_latents.png", "perf_eager.json", "perf_patched.json")


def run_demo(opts: DemoOptions, echo: Callable[[str], None] = print) -> int:
    """Run the demo; returns the exit code: 0 equal, 1 different."""
    ex = _api.api()  # fail early and clearly if the patching API is unavailable
    device = resolve_device(opts.device)
    spec = models.get_spec(opts.model)
    config = opts.config or ("small" if device.type == "cuda" else "tiny")
    dtname = opts.dtype or default_dtype(device)
    dtype = dtype_from_name(dtname)
    if opts.steps < 1:
        raise HarnessError("--steps must be >= 1")
    weight_bytes = check_memory(opts.model, config, dtype, device)
    n_params = weight_bytes // dtype.itemsize
    check_writable(opts.out)
    with StagedOutput(opts.out, DEMO_FILES) as out:
        prod = spec.production
        height, width, frames = DEMO_SIZES.get(config, (prod.height, prod.width, prod.num_frames))
        call = models.pipeline_call_kwargs(opts.model, height=height, width=width, num_frames=frames,
                                           steps=opts.steps, seed=opts.seed)
        if opts.guidance_scale is not None:
            set_guidance(call, opts.guidance_scale, opts.model)
        size = f"{height}x{width}" + (f"x{frames} frames" if spec.video else "")
        echo(f"exactdit demo: {opts.model} config={config} ({n_params / 1e6:.2f}M params) through diffusers' "
             f"{spec.pipeline_cls.__name__}, {size}, {opts.steps} steps, {dtname}, seed {opts.seed}"
             + "".join(f", {what} {call[key]:g}" for key, what in (("guidance_scale", "guidance"),
                                                                       ("true_cfg_scale", "true CFG")) if key in call))
        dev_info = perf.device_info(device)
        echo(f"device: {device.type} ({dev_info.get('name')}, torch threads {dev_info.get('torch_threads')})")
        if device.type != "cuda":
            echo("NOTE: " + no_gpu_note())
            if n_params > CPU_MAX_PARAMS:
                # it fits in memory, but would keep the CPU busy for hours: say so before the long silence
                echo(f"WARNING: --config {config} ({n_params / 1e9:.1f}B params) is impractical on CPU: building "
                     f"its weights takes minutes and sampling hours. Use --config tiny or small here, or a CUDA GPU.")

        # the slow phases (weights, warmup) each announce themselves, so a long run is never silent
        size_text = gib(weight_bytes) if weight_bytes >= 2**30 else f"{weight_bytes / 2**20:.1f} MiB"
        echo(f"building weights: {size_text} in {dtname} on {device.type} ...")
        t0 = time.perf_counter()
        pipe = build_pipeline(opts.model, config, seed=opts.seed, dtype=dtype, device=device)
        echo(f"built in {time.perf_counter() - t0:.1f}s")

        runs: dict[str, dict] = {}
        patch_summary = None
        try:
            for label in ("eager", "patched"):
                if label == "patched":
                    patch_summary = ex.patch(pipe, cuda_graphs=opts.cuda_graphs)
                if opts.warmup:
                    echo(f"{label}: {opts.warmup} untimed warmup call{'s' if opts.warmup > 1 else ''} ...")
                    t0 = time.perf_counter()
                    for _ in range(opts.warmup):
                        sample_pipeline(pipe, dict(call, num_inference_steps=1, generator=seeded_generator(opts.seed)),
                                        device)
                    echo(f"{label}: warmup done in {time.perf_counter() - t0:.1f}s")
                ex.reset_report()
                perf.reset_peak_memory(device)
                latents, total_s, steps_s = sample_pipeline(pipe, dict(call, generator=seeded_generator(opts.seed)),
                                                            device, progress=label if opts.progress else None)
                runs[label] = dict(latents=latents, total_s=total_s, steps_s=steps_s, peak=perf.peak_memory(device),
                                   report=_api.normalize_report(ex.report(show=False)) if label == "patched" else {},
                                   md5=metrics.md5_tensor(latents))
        finally:
            if patch_summary is not None:
                ex.unpatch(pipe)

        eager, patched = runs["eager"], runs["patched"]
        equal = bool(torch.equal(eager["latents"], patched["latents"]))
        verdict = "EQUAL" if equal else "DIFFERENT"
        max_abs = metrics.max_abs(eager["latents"], patched["latents"])

        latent_side_by_side(image_latents(pipe, eager["latents"], height, width),
                            image_latents(pipe, patched["latents"], height, width)).save(out.path(DEMO_FILES[0]))
        args = {"model": opts.model, "config": config, "steps": opts.steps, "seed": opts.seed, "dtype": dtname,
                "device": str(device), "warmup": opts.warmup,
                "guidance_scale": call.get("true_cfg_scale", call.get("guidance_scale")),
                "params": n_params, "height": height, "width": width, "num_frames": frames if spec.video else None,
                "model_config": dict(spec.config(config))}
        perf_paths = {}
        for label, run in runs.items():
            outputs = {"latents_md5": run["md5"], "latents_shape": list(run["latents"].shape)}
            if label == "patched":
                outputs.update(verdict=verdict, max_abs_vs_eager=max_abs, patch_summary=patch_summary)
            perf_paths[label] = perf.write_record(
                out, label=label, kind="demo", device=device, total_s=run["total_s"], steps_s=run["steps_s"],
                stages={"denoising_s": run["total_s"]}, args=args, report=run["report"], outputs=outputs,
                peak_gpu_memory_bytes=run["peak"])
        out.commit()
    preview = out.final(DEMO_FILES[0])

    echo("")
    echo(f"{'run':<9} {'step ms(med)':>12} {'total s':>11}   latents md5")
    for label, r in runs.items():
        echo(f"{label:<9} {statistics.median(r['steps_s']) * 1e3:>12.2f} {r['total_s']:>11.3f}   {r['md5']}")
    on_gpu = device.type == "cuda"
    if on_gpu:  # a speedup means something only where the patched run used the GPU
        speedup = eager["total_s"] / patched["total_s"] if patched["total_s"] else float("inf")
        echo(f"{'speedup':<9} {speedup:>12.2f}x")
    if equal:
        echo("result    EQUAL: final latents are bit-identical")
    else:
        echo(f"result    DIFFERENT: final latents differ (max_abs {max_abs:.3g})")
    fused, fell_back, reasons = _api.summarize_report(patched["report"])
    echo(f"fused     {fused} fused op calls ran, {fell_back} fell back to eager ({_fmt_reasons(reasons)})")
    for op, e in sorted(reporting.grouped(patched["report"]).items()):
        regions = f" ({e['regions']} regions)" if e["regions"] else ""
        echo(f"  {op + regions:<22} fused {e['fused']:>6}  eager {e['eager']:>6}  {_fmt_reasons(e['eager_reasons'])}")
    graphs = coverage.graphs()
    if graphs:
        echo("plan      the regions the engine made of each captured block graph (the counts above say how "
             "many of their calls ran fused):")
    for graph in graphs:
        for line in graph.lines():
            echo(f"  {line}")
    if not patched["report"]:
        echo("  (exactdit.report() listed no ops)")
    if not on_gpu:
        ran = (f"{fused} op calls ran fused in Triton's CPU interpreter, {fell_back} eager" if fused
               else "both runs used eager PyTorch")
        echo(f"NOTE: no CUDA GPU, so no speedup is shown: {ran}.")
    echo(f"wrote     {preview} (eager | patched | diff: the latent channels projected to RGB, "
         f"no VAE, so not a picture), {perf_paths['eager']}, {perf_paths['patched']}")
    echo(f"compare   exactdit compare {perf_paths['eager']} {perf_paths['patched']}")
    return 0 if equal else 1


def seeded_generator(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(int(seed))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(pipe, call: dict, device: torch.device, bar=None):
    """``pipe(**call)`` without grad, the clock read in step with the device at its start, at the end of
    each step and at its end; returns (output, start, step ends, end, the last step's latents)."""
    marks, last = [], {}

    def on_step(_pipe, i, t, kwargs):
        synchronize(device)
        marks.append(time.perf_counter())
        last["latents"] = kwargs.get("latents")
        if bar is not None:
            bar.update(1)
        return kwargs

    with torch.no_grad():
        synchronize(device)
        start = time.perf_counter()
        result = pipe(**call, callback_on_step_end=on_step)
        synchronize(device)
    return result, start, marks, time.perf_counter(), last.get("latents")


def sample_pipeline(pipe, call: dict, device: torch.device, progress: str | None = None):
    """One run of diffusers' pipeline to its final latents; returns (latents, total s, per-step s)."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=call["num_inference_steps"], desc=progress, leave=False, unit="step")
    try:
        result, start, marks, end, _ = timed_call(pipe, call, device, bar)
    finally:
        if bar is not None:
            bar.close()
    images = pipeline_output(result)
    latents = images if isinstance(images, torch.Tensor) else torch.stack([torch.as_tensor(x) for x in images])
    return latents, end - start, [b - a for a, b in zip([start] + marks[:-1], marks)]


def pipeline_output(result):
    """What a diffusers pipeline returned: ``.images`` (image pipelines) or ``.frames`` (video pipelines
    such as Wan's), or the first element of a tuple."""
    for name in ("images", "frames"):
        if hasattr(result, name):
            return getattr(result, name)
    if isinstance(result, (tuple, list)) and result:
        return result[0]
    raise HarnessError(f"{type(result).__name__} holds neither images nor frames")


def image_latents(pipe, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, C, H, W] latents for the preview: packed token latents unpacked as the pipeline does,
    the first frame of video latents."""
    if latents.dim() == 3 and hasattr(pipe, "_unpack_latents"):
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
    if latents.dim() == 5:
        latents = latents[:, :, 0]
    return latents if latents.dim() == 4 else latents.reshape(latents.shape[0], -1, 1, latents.shape[-1])
