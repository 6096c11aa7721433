"""Malformed calls name the function that was called; ``unpatch`` has one result shape."""

import pytest
import torch

import exactdit
from exactdit.harness import models


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


def test_the_cuda_graph_switch_is_a_bool_and_turns_the_mode_off_too():
    from exactdit.patches import cuda_graphs

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=1)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 'no'"):
        exactdit.patch(tr, cuda_graphs="no")
    try:
        assert exactdit.patch(tr, cuda_graphs=True)["cuda_graphs"] is True and cuda_graphs.graphed(tr)
        assert exactdit.patch(tr)["cuda_graphs"] is False and cuda_graphs.graphed(tr) is None
    finally:
        exactdit.unpatch(tr)


def test_context_parallelism_takes_a_pipeline_or_says_what_it_needs():
    from types import SimpleNamespace

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=1)
    seen = []
    tr.enable_parallelism = lambda config, cp_plan: seen.append((config, cp_plan))
    exactdit.enable_context_parallel(SimpleNamespace(transformer=tr), "config")
    assert seen and seen[0][0] == "config" and seen[0][1]
    with pytest.raises(TypeError, match="expected a diffusers transformer or pipeline, got object"):
        exactdit.enable_context_parallel(object(), "config")
