"""Malformed calls name the function that was called; ``unpatch`` has one result shape."""

import pytest
import torch

import exactdit


def test_unpatch_of_something_else_names_unpatch():
    with pytest.raises(TypeError, match=r"^exactdit\.unpatch: .*NoneType"):
        exactdit.unpatch(None)
    with pytest.raises(TypeError, match=r"^exactdit\.patch: .*NoneType"):
        exactdit.patch(None)


def test_unpatch_of_an_unpatched_model_says_nothing_was_restored():
    assert exactdit.unpatch(torch.nn.Linear(2, 2)) == {"restored": {}}


def test_patch_of_a_pipeline_without_a_transformer_says_what_is_missing():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    from exactdit.harness.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    pipe.transformer = None
    for call in (exactdit.patch, exactdit.unpatch):
        with pytest.raises(TypeError, match=rf"^exactdit\.{call.__name__}: ErnieImagePipeline has no transformer to "
                                            rf"{call.__name__} \(its transformer is None\)$"):
            call(pipe)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), norm_num_groups=8,
                       layers_per_block=1, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    ddpm = DDPMPipeline(unet=unet, scheduler=DDPMScheduler())
    with pytest.raises(TypeError, match=r"^exactdit\.patch: DDPMPipeline has no transformer to patch \(its denoiser "
                                        r"is a UNet, pipe\.unet; exactdit patches diffusion transformers\)$"):
        exactdit.patch(ddpm)
