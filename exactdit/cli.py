"""exactdit command-line interface: ``demo``, ``generate`` and ``compare``.

Heavy imports (torch, diffusers) happen inside the commands so ``exactdit --help`` is instant.
User errors print one ``Error: ...`` line and exit non-zero (1 for runtime errors, 2 for bad usage);
``demo`` and ``generate --ab`` exit 1 when patched and eager outputs differ.
"""

from __future__ import annotations

import sys

import click

CONFIG_CHOICES = ("tiny", "small", "full", "diffusers_test")  # exactdit.harness.models CONFIG_NAMES
#: the registered models (exactdit.harness.models); listed here so `--help` needs no model imports
MODEL_CHOICES = ("ernie", "flux", "flux-schnell", "chroma", "qwen", "zimage", "wan", "wan-1.3b")
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# torch generators take a seed of 0 to 2**64 - 1; checked here so a bad one names --seed
SEED = click.IntRange(min=0, max=2**64 - 1)


def _version() -> str:
    from exactdit.harness._api import version

    return version()


def _fail(exc: BaseException) -> click.ClickException:
    msg = " ".join(str(exc).split()) or type(exc).__name__
    return click.ClickException(msg)


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"exactdit {_version()}")
        ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the exactdit version and exit.")
def main() -> None:
    """Bit-exact fused Triton kernels for diffusers' ERNIE-Image: demo, generate and compare."""


@main.command()
def version() -> None:
    """Print the exactdit version."""
    click.echo(_version())


@main.command()
@click.option("--model", type=click.Choice(MODEL_CHOICES), default="ernie", show_default=True,
              help="Registered diffusers DiT (exactdit.harness.models).")
@click.option("--config", type=click.Choice(CONFIG_CHOICES), default=None,
              help="Embedded model size [default: tiny on CPU, small on CUDA].")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True, help="Sampling steps.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for weights, noise and text features.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
              help="Model dtype [default: fp32 on CPU, bf16 on CUDA].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/demo", show_default=True,
              help="Output folder for the latent preview PNG and perf JSONs.")
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
@click.option("--guidance-scale", type=click.FloatRange(min=0.0), default=None,
              help="Guidance scale [default: the model's production setting].")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed one-step pipeline calls before each timed run (capture, kernel compilation).")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on steps.")
@click.option("--cuda-graphs", is_flag=True, help="Patch with exactdit.patch(pipe, cuda_graphs=True).")
def demo(model, config, steps, seed, dtype, out_dir, device, guidance_scale, warmup, progress, cuda_graphs) -> None:
    """Eager vs patched sampling through diffusers' own pipeline of an embedded model (random weights,
    tiny offline text encoders and VAE, no downloads).

    Exits 1 when the final latents of the two runs are not bit-identical.
    """
    from exactdit.harness import _api
    from exactdit.harness.demo import DemoOptions, HarnessError, run_demo

    opts = DemoOptions(model=model, config=config, steps=steps, seed=seed, dtype=dtype, out=out_dir, device=device,
                       guidance_scale=guidance_scale, warmup=warmup, progress=progress, cuda_graphs=cuda_graphs)
    try:
        _, code = run_demo(opts, echo=click.echo)
    except (HarnessError, _api.ExactditAPIError, ValueError, OSError) as exc:
        raise _fail(exc) from None
    sys.exit(code)


@main.command()
@click.option("--model-path", type=click.Path(), required=True,
              help="Local diffusers ERNIE-Image / ERNIE-Image-Turbo folder (loaded with local_files_only).")
@click.option("--prompt", required=True, help="Text prompt.")
@click.option("--negative-prompt", default="", show_default=True, help="Negative prompt (used when CFG > 1).")
@click.option("--ab", is_flag=True, help="Also run eager (twice) and write an A/B report.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True,
              help="Denoising steps (ERNIE-Image-Turbo: 8).")
@click.option("--guidance-scale", type=click.FloatRange(min=0.0), default=4.0, show_default=True,
              help="CFG scale (ERNIE-Image-Turbo: 1).")
@click.option("--height", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--width", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="runs/generate", show_default=True)
@click.option("--use-pe/--no-use-pe", default=False, show_default=True,
              help="Prompt enhancement (sampled text rewriting; off for reproducibility).")
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
              help="Load dtype [default: fp32 on CPU, bf16 on CUDA].")
@click.option("--warmup/--no-warmup", default=None,
              help="Untimed 1-step generation before each timed run [default: on for CUDA, off on CPU].")
@click.option("--cuda-graphs", is_flag=True, help="Patch with exactdit.patch(pipe, cuda_graphs=True).")
def generate(model_path, prompt, negative_prompt, ab, seed, steps, guidance_scale, height, width, out_dir,
             use_pe, device, dtype, warmup, cuda_graphs) -> None:
    """Run a local ERNIE-Image pipeline patched by exactdit (optionally A/B against eager)."""
    from exactdit.harness import _api
    from exactdit.harness.demo import HarnessError
    from exactdit.harness.generate import GenerateOptions, ModelDirError, run_generate, validate_model_dir

    try:
        validate_model_dir(model_path)
    except ModelDirError as exc:
        raise _fail(exc) from None
    opts = GenerateOptions(model_path=model_path, prompt=prompt, negative_prompt=negative_prompt, ab=ab,
                           seed=seed, steps=steps, guidance_scale=guidance_scale, height=height, width=width,
                           out=out_dir, use_pe=use_pe, device=device, dtype=dtype, warmup=warmup,
                           cuda_graphs=cuda_graphs)
    try:
        _, code = run_generate(opts, echo=click.echo)
    except (HarnessError, ModelDirError, _api.ExactditAPIError, ValueError, OSError) as exc:
        raise _fail(exc) from None
    sys.exit(code)


@main.command("tiny-pipeline")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--seed", type=SEED, default=0, show_default=True)
def tiny_pipeline(out_dir, seed) -> None:
    """Save a tiny random-weight ERNIE-Image pipeline folder: try `generate` offline (use 16 or 32 px sizes)."""
    from exactdit.harness.tiny import save_tiny_pipeline

    try:
        click.echo(save_tiny_pipeline(out_dir, seed=seed))
    except OSError as exc:
        raise _fail(exc) from None


@main.command("coverage")
@click.option("--model", type=click.Choice(MODEL_CHOICES), default="flux", show_default=True)
@click.option("--config", type=click.Choice(CONFIG_CHOICES), default=None,
              help="Embedded model size [default: tiny on CPU, full on CUDA].")
@click.option("--height", type=click.IntRange(min=1), default=None, help="[default: 64 for tiny, else production]")
@click.option("--width", type=click.IntRange(min=1), default=None)
@click.option("--frames", type=click.IntRange(min=1), default=None, help="Video models' frames.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
def coverage_command(model, config, height, width, frames, batch, device) -> None:
    """What the engine fuses in a model: per captured block graph its regions, the ATen ops left and
    why, and the share of eager's non-GEMM / non-attention time the regions replace (every op timed
    eagerly, one by one: CUDA events on a GPU, wall clock on the CPU)."""
    import torch

    from exactdit.engine import coverage, timing
    from exactdit.harness import models
    from exactdit.harness.demo import HarnessError, resolve_device

    try:
        dev = resolve_device(device)
        config = config or ("full" if dev.type == "cuda" else "tiny")
        small = config in ("tiny", "diffusers_test")
        video = models.get_spec(model).video
        tr = models.build_transformer(model, config, dtype=torch.bfloat16, device=dev)
        kw = models.forward_inputs(model, tr, height=height or (64 if small else None),
                                   width=width or (64 if small else None),
                                   num_frames=frames or (5 if video and small else None), batch=batch)
    except (HarnessError, ValueError) as exc:
        raise _fail(exc) from None
    measured = timing.measure(tr, kw)
    for graph, timer, partition in measured:
        click.echo("\n".join(coverage.GraphReport.of(graph.name, timer.module, partition).lines()))
    click.echo("\n".join(timing.summary_lines([g for g, _, _ in measured])))


@main.command()
def selfcheck() -> None:
    """Tiny models patched against eager diffusers, bit for bit, with the report; exit 1 on a difference."""
    from exactdit.harness.selfcheck import main as run_selfcheck

    sys.exit(run_selfcheck(echo=click.echo))


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path())
def compare(files) -> None:
    """Markdown table of end-to-end and per-stage deltas between perf JSONs (first = baseline)."""
    from exactdit.harness.perf import PerfFileError
    from exactdit.harness.perf import compare as compare_files

    try:
        click.echo(compare_files(files), nl=False)
    except PerfFileError as exc:
        raise _fail(exc) from None


if __name__ == "__main__":  # pragma: no cover
    main()
