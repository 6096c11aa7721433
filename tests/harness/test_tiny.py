import torch

from exactdit.harness.tiny import build_tiny_pipeline


def test_cli_offers_every_embedded_config():
    from exactdit.cli import CONFIG_CHOICES
    from exactdit.harness import models

    assert set(CONFIG_CHOICES) == set(models.CONFIG_NAMES)


def test_tiny_pipeline_keeps_its_small_vae():
    pipe = build_tiny_pipeline(seed=0)
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.in_channels == 16
    out = pipe(prompt="a red cat", num_inference_steps=1, height=16, width=16, output_type="latent",
               generator=torch.Generator("cpu").manual_seed(0)).images
    assert out.shape == (1, 16, 4, 4) and torch.isfinite(out).all()
