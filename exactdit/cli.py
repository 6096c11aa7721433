"""exactdit command-line interface: ``demo``, ``generate``, ``compare``, ``coverage``, ``selfcheck``,
``tiny-pipeline``.

Heavy imports (torch, diffusers) happen inside the commands so ``exactdit --help`` is instant.
User errors print one ``Error: ...`` line and exit non-zero (1 for runtime errors, 2 for bad usage);
``demo`` and ``generate --ab`` exit 1 when patched and eager outputs differ.
"""

from __future__ import annotations

import contextlib
import math
import sys

import click

from exactdit.harness._api import version as _api_version  # imports nothing heavy

CONFIG_CHOICES = ("tiny", "small", "full", "diffusers_test")  # exactdit.harness.models CONFIG_NAMES
#: the registered models (exactdit.harness.models); listed here so `--help` needs no model imports
MODEL_CHOICES = ("ernie", "flux", "flux-schnell", "chroma", "qwen", "zimage", "wan", "wan-1.3b")
DTYPE_CHOICES = ("bf16", "fp16", "fp32")
DEVICE_CHOICES = ("auto", "cpu", "cuda")


class GuidanceScale(click.FloatRange):
    """A finite number >= 0 (nan and inf pass click's FloatRange; inf writes a black image)."""

    name = "finite float >= 0"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


GUIDANCE = GuidanceScale(min=0.0)
# torch generators take a seed of 0 to 2**64 - 1; checked here so a bad one names --seed
SEED = click.IntRange(min=0, max=2**64 - 1)


def _fail(exc: BaseException) -> click.ClickException:
    return click.ClickException(" ".join(str(exc).split()) or type(exc).__name__)


@contextlib.contextmanager
def _user_errors(*kinds: type[BaseException], oom=None):
    """``kinds`` (and the harness's own errors) as one ``Error: ...`` line; with ``oom`` (a callable
    naming the size), an allocation failure too."""
    from exactdit.harness.demo import HarnessError, out_of_memory

    try:
        yield
    except (HarnessError, *kinds) as exc:
        raise _fail(exc) from None
    except RuntimeError as exc:
        if oom is None or not out_of_memory(exc):
            raise
        raise _fail(HarnessError(f"out of memory at {oom()}: use a smaller size")) from None


# the options demo and generate share
_DEVICE = click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto", show_default=True)
_PROGRESS = click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on steps.")
_CUDA_GRAPHS = click.option("--cuda-graphs", is_flag=True, help="Patch with exactdit.patch(pipe, cuda_graphs=True).")


def _print_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(f"exactdit {_api_version()}")
        ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the exactdit version and exit.")
def main() -> None:
    """Faster diffusion transformers in diffusers, with outputs bit-identical to eager PyTorch.

    Start with `exactdit demo` (eager vs patched sampling of an embedded model, no downloads).
    `coverage` shows what the engine fuses in a model, `selfcheck` holds each fused op to its eager
    reference, `generate` runs a local ERNIE-Image pipeline folder (`tiny-pipeline` saves a tiny one
    to try it offline) and `compare` tabulates the timings of runs.
    """
    from exactdit.harness.quiet import quiet_third_party

    quiet_third_party()


@main.command()
def version() -> None:
    """Print the exactdit version."""
    click.echo(_api_version())


@main.command(short_help="Eager vs patched sampling of an embedded model: EQUAL?")
@click.option("--model", type=click.Choice(MODEL_CHOICES), default="ernie", show_default=True,
              help="Registered diffusers DiT (exactdit.harness.models).")
@click.option("--config", type=click.Choice(CONFIG_CHOICES), default=None,
              help="Embedded model size [default: tiny on CPU, small on CUDA].")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True, help="Sampling steps.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed for weights, noise and text features.")
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
              help="Model dtype [default: fp32 on CPU, bf16 on CUDA].")
@click.option("--out", type=click.Path(file_okay=False), default="runs/demo", show_default=True,
              help="Output folder for the latent preview PNG and perf JSONs.")
@_DEVICE
@click.option("--guidance-scale", type=GUIDANCE, default=None,
              help="Guidance scale [default: the model's production setting].")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
              help="Untimed one-step pipeline calls before each timed run (capture, kernel compilation).")
@_PROGRESS
@_CUDA_GRAPHS
def demo(**options) -> None:
    """Eager vs patched sampling through diffusers' own pipeline of an embedded model (random weights,
    tiny offline text encoders and VAE, no downloads).

    Exits 1 when the final latents of the two runs are not bit-identical.
    """
    from exactdit.harness import _api
    from exactdit.harness.demo import DemoOptions, run_demo

    with _user_errors(_api.ExactditAPIError, ValueError, OSError):
        code = run_demo(DemoOptions(**options), echo=click.echo)
    sys.exit(code)


@main.command(short_help="Run a local ERNIE-Image pipeline folder, patched.")
@click.option("--model-path", type=click.Path(), required=True,
              help="Local diffusers ERNIE-Image / ERNIE-Image-Turbo folder (loaded with local_files_only).")
@click.option("--prompt", required=True, help="Text prompt.")
@click.option("--negative-prompt", default="", show_default=True, help="Negative prompt (used when CFG > 1).")
@click.option("--ab", is_flag=True, help="Also run eager (twice) and write an A/B report.")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True,
              help="Denoising steps (ERNIE-Image-Turbo: 8).")
@click.option("--guidance-scale", type=GUIDANCE, default=4.0, show_default=True,
              help="CFG scale (ERNIE-Image-Turbo: 1).")
@click.option("--height", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--width", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="runs/generate", show_default=True)
@click.option("--use-pe/--no-use-pe", default=False, show_default=True,
              help="Prompt enhancement (sampled text rewriting; off for reproducibility).")
@_DEVICE
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default=None,
              help="Load dtype [default: fp32 on CPU, bf16 on CUDA].")
@click.option("--warmup/--no-warmup", default=None,
              help="Untimed 1-step generation before each timed run [default: on for CUDA, off on CPU].")
@_PROGRESS
@_CUDA_GRAPHS
def generate(**options) -> None:
    """Run a local ERNIE-Image pipeline patched by exactdit (optionally A/B against eager)."""
    from exactdit.harness import _api
    from exactdit.harness.generate import GenerateOptions, run_generate

    opts = GenerateOptions(**options)
    # the folder is checked first (run_generate), the size before the load
    with _user_errors(_api.ExactditAPIError, ValueError, OSError,
                      oom=lambda: f"--height {opts.height} --width {opts.width}"):
        code = run_generate(opts, echo=click.echo)
    sys.exit(code)


@main.command("tiny-pipeline", short_help="Save a tiny offline ERNIE-Image pipeline to try generate.")
@click.argument("out_dir", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace the pipeline in a non-empty DIR (its other files are kept).")
def tiny_pipeline(out_dir, seed, force) -> None:
    """Save a tiny random-weight ERNIE-Image pipeline (about 1 MB) to DIR, a new or empty folder, and print
    the `generate` command that runs it offline in seconds."""
    import shlex

    from exactdit.harness.tiny import TINY_SIZE, write_tiny_pipeline

    with _user_errors(OSError):
        path = write_tiny_pipeline(out_dir, seed=seed, force=force)
    click.echo(f"wrote     {path}")
    click.echo(f"next      exactdit generate --model-path {shlex.quote(path)} --prompt 'a red cat' "
               f"--height {TINY_SIZE} --width {TINY_SIZE} --steps 4 --device cpu")


@main.command("coverage", short_help="What the engine fuses in a model, and the time it replaces.")
@click.option("--model", type=click.Choice(MODEL_CHOICES), default="flux", show_default=True)
@click.option("--config", type=click.Choice(CONFIG_CHOICES), default=None,
              help="Embedded model size [default: tiny on CPU, full on CUDA].")
@click.option("--height", type=click.IntRange(min=1), default=None, help="[default: 64 for tiny, else production]")
@click.option("--width", type=click.IntRange(min=1), default=None)
@click.option("--frames", type=click.IntRange(min=1), default=None, help="Video models' frames.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@_DEVICE
def coverage_command(model, config, height, width, frames, batch, device) -> None:
    """What the engine fuses in a model: per captured block graph its regions, the ATen ops left and
    why, and the share of eager's non-GEMM / non-attention time the regions replace (every op timed
    eagerly, one by one: CUDA events on a GPU, wall clock on the CPU)."""
    import torch

    from exactdit.engine import coverage, timing
    from exactdit.patches.engine import repeated_blocks
    from exactdit.harness import models
    from exactdit.harness.demo import (check_activation_memory, check_memory, latent_tokens, resolve_device,
                                       widest_linear)
    from exactdit.harness.perf import device_info

    spec = models.get_spec(model)
    if frames is not None and not spec.video:
        raise click.BadParameter(f"{model} is an image model; --frames applies to video models only",
                                 param_hint="'--frames'")
    if frames is not None and (frames - 1) % 4:
        raise click.BadParameter(f"{model} takes 4k+1 frames (1, 5, 9, ...), got {frames}", param_hint="'--frames'")
    for name, value in (("--height", height), ("--width", width)):
        if value is not None and value % spec.pixel_multiple:
            raise click.BadParameter(f"{model} needs a multiple of {spec.pixel_multiple}, got {value}",
                                     param_hint=f"'{name}'")
    dtype = torch.bfloat16
    with _user_errors(ValueError, oom=lambda: f"{size}, batch {batch} on {dev.type}"):
        dev = resolve_device(device)
        config = config or ("full" if dev.type == "cuda" else "tiny")
        small = config in ("tiny", "diffusers_test")
        prod = spec.production
        height = height or (64 if small else prod.height)
        width = width or (64 if small else prod.width)
        frames = (frames or (5 if small else prod.num_frames)) if spec.video else None
        weights = check_memory(model, config, dtype, dev)
        size = f"{height}x{width}" + (f"x{frames} frames" if frames else "")
        # a lower bound: four values as wide as the widest linear layer over every token alive at once
        # (measured: flux tiny at 1024x1024 holds about five)
        need = latent_tokens(model, height, width, frames, batch) * widest_linear(model, config) * dtype.itemsize * 4
        check_activation_memory(need, f"--height {height} --width {width}" + (f" --frames {frames}" if frames else "")
                                + (f" --batch {batch}" if batch > 1 else ""), dev,
                                "use a smaller --height / --width" + (" / --frames" if frames else ""))
        click.echo(f"exactdit coverage: {model} config={config} ({weights // dtype.itemsize / 1e6:.2f}M params), "
                   f"bf16, {size}, batch {batch}, {dev.type} ({device_info(dev).get('name')})")
        tr = models.build_transformer(model, config, dtype=dtype, device=dev)
        kw = models.forward_inputs(model, tr, height=height, width=width, num_frames=frames, batch=batch)
        measured = timing.measure(tr, kw, repeated_blocks(tr))
    for graph, timer, partition in measured:
        click.echo("\n".join(coverage.GraphReport.of(graph.name, timer.module, partition).lines()))
    click.echo("\n".join(timing.summary_lines([g for g, _, _ in measured])))


@main.command(short_help="Tiny models patched against eager diffusers, bit for bit.")
def selfcheck() -> None:
    """Tiny models patched against eager diffusers, bit for bit, with the report; exit 1 on a difference."""
    from exactdit.harness.selfcheck import main as run_selfcheck

    sys.exit(run_selfcheck(echo=click.echo))


@main.command(short_help="Tabulate the timings of perf JSONs (first = baseline).")
@click.argument("files", nargs=-1, required=True, type=click.Path())
@click.option("--force", is_flag=True,
              help="Compare runs that differ in kind, model, size, steps, dtype or device (refused otherwise).")
def compare(files, force) -> None:
    """Markdown table of end-to-end and per-stage deltas between perf JSONs (first = baseline)."""
    from exactdit.harness.perf import PerfFileError
    from exactdit.harness.perf import compare as compare_files

    try:
        click.echo(compare_files(files, force=force), nl=False)
    except PerfFileError as exc:
        raise _fail(exc) from None


if __name__ == "__main__":  # pragma: no cover
    main()
