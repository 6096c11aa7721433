"""ERNIE-Image entry points of the model registry (:mod:`exactdit.harness.models`), kept for the demo,
``exactdit generate`` tests and benchmarks.

Nothing here downloads anything: the transformer is diffusers' own ``ErnieImageTransformer2DModel``
built from an embedded config with every parameter filled from a seeded generator (including the
layers diffusers zero-initialises, so the sampling loop produces non-trivial latents). The configs,
weight builder and pipeline components live in :mod:`exactdit.harness.models`; this module adds the
demo's sampling shapes and the tiny saved pipeline of ``exactdit tiny-pipeline``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .models import DTYPES, count_params, dtype_from_name, dtype_name, init_random_weights  # noqa: F401
from .models import build_transformer as _build_model_transformer
from .models import estimate_bytes as _estimate_model_bytes
from .models import get_spec
from .models.components import TINY_WORDS, build_tiny_tokenizer  # noqa: F401
from .models.ernie import ernie_components

# The demo's sampling shapes per config: ``latent_hw`` is the (packed) latent grid it samples at,
# ``text_len`` the synthetic prompt length (the negative prompt is shorter, so padding/masking is
# exercised). "full" samples at 1024x1024.
_DEMO_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(latent_hw=(16, 16), text_len=24, neg_text_len=7),
    "diffusers_test": dict(latent_hw=(16, 16), text_len=16, neg_text_len=5),
    "small": dict(latent_hw=(32, 32), text_len=77, neg_text_len=9),
    "full": dict(latent_hw=(64, 64), text_len=128, neg_text_len=12),
}

#: ``{name: {"model": transformer kwargs, "latent_hw": .., "text_len": .., "neg_text_len": ..}}``
CONFIGS: dict[str, dict[str, Any]] = {
    name: {"model": get_spec("ernie").config(name), **shapes} for name, shapes in _DEMO_SHAPES.items()
}


def get_config(name: str) -> dict[str, Any]:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose one of {', '.join(CONFIGS)}") from None


def _model_config(config: str | dict) -> dict:
    return get_config(config)["model"] if isinstance(config, str) else dict(config)


def estimate_bytes(config: str | dict, dtype: torch.dtype) -> int:
    """Parameter memory of a config in ``dtype`` (built on the meta device, nothing allocated)."""
    return _estimate_model_bytes("ernie", _model_config(config), dtype)


def build_transformer(
    config: str | dict = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
):
    """Build diffusers' ``ErnieImageTransformer2DModel`` with an embedded config and seeded weights."""
    return _build_model_transformer("ernie", _model_config(config), seed=seed, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------
# Tiny complete pipeline (tests of `exactdit generate`)
# --------------------------------------------------------------------------------------------------


@dataclass
class TinyPipelineSpec:
    text_hidden: int = 16
    #: a 2-level VAE (scale factor 4) keeps test images small: 16x16 pixels are a 4x4 latent grid
    vae_channels: tuple[int, ...] = (8, 16)
    transformer: dict = field(
        default_factory=lambda: dict(
            hidden_size=32,
            num_attention_heads=2,
            num_layers=2,
            ffn_hidden_size=64,
            in_channels=16,  # 4 VAE latent channels x 2x2 patchify
            out_channels=16,
            patch_size=1,
            rope_theta=256,
            rope_axes_dim=(4, 6, 6),
        )
    )


def build_tiny_pipeline(seed: int = 0, spec: TinyPipelineSpec | None = None):
    """A complete ``ErnieImagePipeline`` small enough to run in well under a second on CPU."""
    from diffusers import ErnieImagePipeline

    spec = spec or TinyPipelineSpec()
    config = dict(spec.transformer, text_in_dim=spec.text_hidden)
    transformer = build_transformer(config, seed=seed)
    parts = ernie_components(config, seed=seed, dtype=torch.float32, device="cpu", vae_channels=spec.vae_channels)
    return ErnieImagePipeline(transformer=transformer, **parts)


def save_tiny_pipeline(path, seed: int = 0) -> str:
    """Build the tiny pipeline and ``save_pretrained`` it to ``path``; returns the path."""
    pipe = build_tiny_pipeline(seed=seed)
    pipe.save_pretrained(str(path))
    return str(path)


#: what `exactdit tiny-pipeline` prints as the next step: the tiny VAE's 4x scale fits 32x32 pixels
TINY_SIZE = 32


def write_tiny_pipeline(path, seed: int = 0, force: bool = False) -> str:
    """``exactdit tiny-pipeline``: save the tiny pipeline to ``path`` only if ``path`` is new or empty
    (``force``: replace the pipeline already there: its model_index.json and component folders;
    other files are kept). Saved in a temporary folder first, so a failure leaves ``path`` as it was."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from .demo import HarnessError
    from .outputs import check_writable

    out = check_writable(path, option="DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HarnessError(f"DIR {out} is not empty; pass --force to replace the pipeline in it, or name a new folder")
    with tempfile.TemporaryDirectory(prefix="exactdit-tiny-") as stage:
        build_tiny_pipeline(seed=seed).save_pretrained(stage)
        new = sorted(Path(stage).iterdir())
        try:
            out.mkdir(parents=True, exist_ok=True)
            old = {p.name for p in new}
            index = out / "model_index.json"
            if index.is_file():
                try:
                    old |= {k for k, v in json.loads(index.read_text()).items() if isinstance(v, list)}
                except (ValueError, UnicodeDecodeError, AttributeError):
                    pass
            for name in sorted(old):
                p = out / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.exists() or p.is_symlink():
                    p.unlink()
            for p in new:
                shutil.move(str(p), str(out / p.name))
        except OSError as exc:
            raise HarnessError(f"DIR {out}: could not write the pipeline ({exc.strerror or exc})") from None
    return str(out)
