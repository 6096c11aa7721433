"""The tiny saved ERNIE-Image pipeline of ``exactdit tiny-pipeline`` (and of the tests of
``exactdit generate``): diffusers' own ``ErnieImagePipeline`` around a transformer and components
from :mod:`exactdit.harness.models`, with seeded random weights; nothing downloads anything.
"""

from __future__ import annotations

import torch

from .models import ComponentRequest, build_transformer, ernie, get_spec

#: the tiny pipeline's transformer (4 VAE latent channels x 2x2 patchify in, 16-d text features)
TINY_TRANSFORMER = dict(hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=64, in_channels=16,
                        out_channels=16, patch_size=1, rope_theta=256, rope_axes_dim=(4, 6, 6), text_in_dim=16)
#: a 2-level VAE (scale factor 4) keeps test images small: 16x16 pixels are a 4x4 latent grid
TINY_VAE_CHANNELS = (8, 16)


def build_tiny_pipeline(seed: int = 0):
    """A complete ``ErnieImagePipeline`` small enough to run in well under a second on CPU."""
    from diffusers import ErnieImagePipeline

    transformer = build_transformer("ernie", TINY_TRANSFORMER, seed=seed)
    req = ComponentRequest(get_spec("ernie"), TINY_TRANSFORMER, seed, torch.float32, torch.device("cpu"))
    parts = ernie.build_components(req, vae_channels=TINY_VAE_CHANNELS)
    return ErnieImagePipeline(transformer=transformer, **parts)


#: what `exactdit tiny-pipeline` prints as the next step: the tiny VAE's 4x scale fits 32x32 pixels
TINY_SIZE = 32


def write_tiny_pipeline(path, seed: int = 0, force: bool = False) -> str:
    """``exactdit tiny-pipeline``: save the tiny pipeline to ``path`` only if ``path`` is new or empty
    (``force``: replace the pipeline already there: its model_index.json and component folders;
    other files are kept). Saved in a temporary folder first, so a failure leaves ``path`` as it was."""
    import json
    import tempfile
    from pathlib import Path

    from .demo import HarnessError
    from .outputs import check_writable, replace_in

    out = check_writable(path, option="DIR")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise HarnessError(f"DIR {out} is not empty; pass --force to replace the pipeline in it, or name a new folder")
    with tempfile.TemporaryDirectory(prefix="exactdit-tiny-") as stage:
        build_tiny_pipeline(seed=seed).save_pretrained(stage)
        new = sorted(Path(stage).iterdir())
        old = set()
        index = out / "model_index.json"
        if index.is_file():  # the earlier pipeline's components: plain names of folders in DIR only
            try:
                old = {k for k, v in json.loads(index.read_text()).items()
                       if isinstance(v, list) and k not in ("", "..") and Path(k).name == k}
            except (ValueError, UnicodeDecodeError, AttributeError):
                pass
        try:
            replace_in(out, new, [out / name for name in sorted(old)])
        except OSError as exc:
            raise HarnessError(f"DIR {out}: could not write the pipeline ({exc.strerror or exc})") from None
    return str(out)
