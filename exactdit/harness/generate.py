"""``exactdit generate``: run a local ERNIE-Image (or ERNIE-Image-Turbo) diffusers folder, patched,
optionally A/B against eager, with per-stage timings."""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import _api, ab, metrics, perf
from .demo import (HarnessError, check_activation_memory, default_dtype, no_gpu_note, resolve_device, seeded_generator,
                   synchronize, timed_call)
from .outputs import StagedOutput, check_writable
from .models import dtype_from_name

PIPELINE_CLASSES = ("ErnieImagePipeline",)
# component -> (config file, needs weights)
REQUIRED = {"transformer": ("config.json", True), "vae": ("config.json", True), "text_encoder": ("config.json", True),
            "tokenizer": (None, False), "scheduler": ("scheduler_config.json", False)}
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDirError(HarnessError):
    pass


def validate_model_dir(path: str | Path) -> dict:
    """Check that ``path`` is a complete local ERNIE-Image diffusers folder; returns model_index.json."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelDirError(f"model folder not found: {p}")
    if not p.is_dir():
        raise ModelDirError(f"--model-path must be a folder, got a file: {p}")
    index_path = p / "model_index.json"
    if not index_path.is_file():
        raise ModelDirError(f"{p} is not a diffusers pipeline folder (no model_index.json)")
    index = _read_json_object(index_path)
    cls = index.get("_class_name")
    expected = ", ".join(PIPELINE_CLASSES)
    if not cls:
        raise ModelDirError(f"{index_path} names no pipeline class (_class_name); expected {expected}")
    if cls not in PIPELINE_CLASSES:
        raise ModelDirError(f"{p} holds a {cls} pipeline; expected {expected}")
    missing: list[str] = []
    for comp, (cfg_file, needs_weights) in REQUIRED.items():
        entry = index.get(comp)
        sub = p / comp
        if not entry or entry == [None, None]:
            missing.append(f"{comp} (not in model_index.json)")
            continue
        if not sub.is_dir():
            missing.append(f"{comp}/")
            continue
        if cfg_file and not (sub / cfg_file).is_file():
            missing.append(f"{comp}/{cfg_file}")
        if comp == "tokenizer" and not any((sub / f).is_file() for f in TOKENIZER_FILES):
            missing.append("tokenizer/tokenizer.json")
        if needs_weights and not any(any(sub.glob(pat)) for pat in WEIGHT_PATTERNS):
            missing.append(f"{comp} weights (*.safetensors)")
    if missing:
        raise ModelDirError(f"incomplete model folder {p}: missing " + ", ".join(missing))
    return index


def _read_json_object(path: Path) -> dict:
    """A JSON object from ``path``, or a one-line ModelDirError saying what is wrong with the file."""
    try:
        obj = json.loads(path.read_text())
    except UnicodeDecodeError:  # a binary file under a .json name
        raise ModelDirError(f"{path} is not valid JSON (not UTF-8 text)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ModelDirError(f"{path} must hold a JSON object, not a {type(obj).__name__}")
    return obj


def check_size(opts: GenerateOptions, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse, before the slow load, a size that is no multiple of the pipeline's ``vae_scale_factor``
    (2 ** len(block_out_channels) of vae/config.json, as ErnieImagePipeline works it out), or whose
    activations do not fit: the VAE decoder's last block holds a full-size input and output of
    ``block_out_channels[0]`` channels (a lower bound, what a huge size fails on first)."""
    cfg_path = Path(opts.model_path).expanduser() / "vae" / "config.json"
    channels = _read_json_object(cfg_path).get("block_out_channels")
    if not isinstance(channels, list) or not channels or not all(isinstance(c, int) and c > 0 for c in channels):
        raise ModelDirError(f"{cfg_path} has no block_out_channels list")
    multiple = 2 ** len(channels)
    if opts.height % multiple or opts.width % multiple:
        raise HarnessError(f"--height and --width must be multiples of {multiple} for this model "
                           f"(got {opts.height}x{opts.width})")
    check_activation_memory(opts.height * opts.width * channels[0] * dtype.itemsize * 2,
                            f"--height {opts.height} --width {opts.width}", device, "use a smaller --height / --width")


@dataclass
class GenerateOptions:
    model_path: str
    prompt: str
    negative_prompt: str = ""
    ab: bool = False
    seed: int = 0
    steps: int = 50
    guidance_scale: float = 4.0
    height: int = 1024
    width: int = 1024
    out: str = "runs/generate"
    use_pe: bool = False
    device: str = "auto"
    dtype: str | None = None
    warmup: bool | None = None
    progress: bool = True
    cuda_graphs: bool = False


def load_pipeline(model_path: str | Path, dtype: torch.dtype, device: torch.device):
    from diffusers import ErnieImagePipeline

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            pipe = ErnieImagePipeline.from_pretrained(str(model_path), torch_dtype=dtype, local_files_only=True)
    except Exception as exc:  # surfaced as a one-line CLI error
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelDirError(f"could not load the pipeline from {model_path}: {type(exc).__name__}: {first}") from exc
    return pipe.to(device)


def timed_run(pipe, opts: GenerateOptions, device: torch.device, label: str, steps: int | None = None) -> dict:
    """One pipeline call with a fixed-seed generator; returns images, final latents and perf timings."""
    text = {"s": 0.0, "end": None}
    orig_encode = pipe.encode_prompt

    def encode_prompt(*args, **kwargs):
        synchronize(device)
        t0 = time.perf_counter()
        res = orig_encode(*args, **kwargs)
        synchronize(device)
        text["end"] = time.perf_counter()
        text["s"] += text["end"] - t0
        return res

    pipe.__dict__["encode_prompt"] = encode_prompt
    pipe.set_progress_bar_config(desc=label, disable=not opts.progress, leave=False)
    perf.reset_peak_memory(device)
    call = dict(prompt=opts.prompt, negative_prompt=opts.negative_prompt, height=opts.height, width=opts.width,
                num_inference_steps=steps or opts.steps, guidance_scale=opts.guidance_scale,
                generator=seeded_generator(opts.seed), use_pe=opts.use_pe,
                callback_on_step_end_tensor_inputs=["latents"])
    try:
        out, start, marks, end, latents = timed_call(pipe, call, device)
    finally:
        pipe.__dict__.pop("encode_prompt", None)
    # text encoding runs before the first step: denoising is from its end to the last step's
    den_start = text["end"] if text["end"] is not None else start
    last = marks[-1] if marks else den_start
    return {"label": label, "images": list(out.images),
            "latents": latents.detach().clone() if latents is not None else None,
            "revised_prompts": getattr(out, "revised_prompts", None), "total_s": end - start,
            "stages": {"text_encoding_s": text["s"], "denoising_s": (last - den_start) if marks else 0.0,
                       "decoding_s": end - last},
            "steps_s": [b - a for a, b in zip([den_start] + marks[:-1], marks)], "peak": perf.peak_memory(device)}


#: what generate writes into --out (replaced as a set by the next generate there, --ab or not)
GENERATE_FILES = ("image_patched_*.png", "image_baseline_*.png", "perf_patched.json", "perf_baseline.json",
                  "perf_baseline_repeat.json", "ab_report.json", "ab_report.md", "ab_side_by_side_*.png",
                  "ab_latents_side_by_side.png")


def timing_notes(device: torch.device, warm: bool, runs: dict) -> list[str]:
    """What the timings above do not show (no speedup is claimed where none was measured)."""
    notes = []
    if device.type != "cuda":
        notes.append("NOTE: no CUDA GPU, so the timings are no speed measurement: the patched run's fused kernels "
                     "need a GPU, and on the CPU the times show one-time costs and the machine's load, not exactdit.")
    elif not warm and len(runs) > 1:
        notes.append("NOTE: --no-warmup: each run's time includes one-time costs (the first run's CUDA start-up, "
                     "the patched run's capture and kernel compilation); time with --warmup to compare runs.")
    return notes


def run_generate(opts: GenerateOptions, echo: Callable[[str], None] = print) -> int:
    """Returns the exit code: 1 when ``--ab`` finds the patched images/latents different."""
    # every check of the arguments comes before the (slow) pipeline load
    index = validate_model_dir(opts.model_path)
    ex = _api.api()
    device = resolve_device(opts.device)
    dtname = opts.dtype or default_dtype(device)
    dtype = dtype_from_name(dtname)
    check_size(opts, dtype, device)
    warm = opts.warmup if opts.warmup is not None else device.type == "cuda"
    check_writable(opts.out)
    if opts.use_pe and index.get("pe") in (None, [None, None]):
        echo("note: --use-pe given but this folder has no prompt-enhancer (pe) component; prompt used as is")
    with StagedOutput(opts.out, GENERATE_FILES) as out:
        t0 = time.perf_counter()
        pipe = load_pipeline(opts.model_path, dtype, device)
        load_s = time.perf_counter() - t0
        echo(f"exactdit generate: {opts.model_path} on {device.type} ({perf.device_info(device).get('name')}), "
             f"{dtname}, {opts.height}x{opts.width}, {opts.steps} steps, CFG {opts.guidance_scale:g}, seed {opts.seed}"
             f", loaded in {load_s:.1f}s")
        if device.type != "cuda":
            echo("NOTE: " + no_gpu_note())

        args = dict(vars(opts), device=str(device), dtype=dtname, warmup=warm, load_s=load_s)
        runs: dict[str, dict] = {}
        if opts.ab:
            if warm:
                timed_run(pipe, opts, device, "warmup eager", steps=1)
            runs["baseline"] = timed_run(pipe, opts, device, "baseline (eager)")
            runs["baseline_repeat"] = timed_run(pipe, opts, device, "baseline repeat")
        patch_summary = ex.patch(pipe, cuda_graphs=opts.cuda_graphs)
        try:
            if warm:
                timed_run(pipe, opts, device, "warmup patched", steps=1)
            ex.reset_report()
            runs["patched"] = timed_run(pipe, opts, device, "patched")
            runs["patched"]["report"] = _api.normalize_report(ex.report(show=False))
        finally:
            ex.unpatch(pipe)

        written: list[str] = []
        for label, run in runs.items():
            run["md5s"] = [metrics.md5_image(im) for im in run["images"]]
            for i, im in enumerate(run["images"] if label != "baseline_repeat" else []):
                im.save(out.path(f"image_{label}_{i}.png"))
                written.append(str(out.final(f"image_{label}_{i}.png")))
            outputs = {"image_md5": run["md5s"],
                       "latents_md5": metrics.md5_tensor(run["latents"]) if run["latents"] is not None else None,
                       "revised_prompts": run["revised_prompts"]}
            if label == "patched":
                outputs["patch_summary"] = patch_summary
            written.append(str(perf.write_record(
                out, label=label, kind="generate", device=device, total_s=run["total_s"], steps_s=run["steps_s"],
                stages=run["stages"], args=args, report=run.get("report", {}), outputs=outputs,
                peak_gpu_memory_bytes=run["peak"])))

        pr = runs["patched"]
        echo("")
        echo(f"{'run':<16} {'total s':>8} {'text s':>7} {'denoise s':>9} {'decode s':>8} {'step ms(mean)':>13}"
             "  image md5")
        for label, run in runs.items():
            st = run["stages"]
            mean_step = sum(run["steps_s"]) / max(1, len(run["steps_s"])) * 1e3
            echo(f"{label:<16} {run['total_s']:>8.3f} {st['text_encoding_s']:>7.3f} {st['denoising_s']:>9.3f} "
                 f"{st['decoding_s']:>8.3f} {mean_step:>13.2f}  {run['md5s'][0] if run['md5s'] else '-'}")
        fused, fell_back, reasons = _api.summarize_report(pr["report"])
        echo(f"fused: {fused} op calls ran fused, {fell_back} fell back to eager"
             + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(reasons.items()))})" if reasons else ""))
        for line in timing_notes(device, warm, runs):
            echo(line)

        code = 0
        if opts.ab:
            meta = {"model_path": str(opts.model_path), "prompt": opts.prompt, "seed": opts.seed, "steps": opts.steps,
                    "size": f"{opts.height}x{opts.width}", "dtype": dtname, "device": device.type}
            rep = ab.write_report(out.stage, runs["baseline"], pr, runs["baseline_repeat"], meta=meta)
            written += [str(out.final(f)) for f in rep["files"]]
            det = "yes" if rep.get("baseline_deterministic") else "NO (eager itself is not reproducible here)"
            echo(f"A/B: {rep['verdict']} (patched vs eager); eager deterministic across repeats: {det}")
            cmp = rep["patched_vs_baseline"]
            if "latents" in cmp:
                echo(f"     latents max_abs {cmp['latents']['max_abs']:.3g}")
            for i, c in enumerate(cmp.get("images", [])):
                echo(f"     image {i}: max_abs {c['max_abs']:g}, PSNR {ab.fmt(c['psnr_db'])} dB, "
                     f"SSIM {ab.fmt(c['ssim'])}")
            code = 0 if rep["verdict"] == "EQUAL" else 1
        out.commit()
        echo("wrote: " + ", ".join(written))
        return code
