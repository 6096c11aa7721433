"""Malformed calls name the op that was called and the argument that is wrong, and the ways the
ops are stricter than eager (the README's op table lists them) raise instead of guessing."""

import pytest
import torch
import torch.nn.functional as F

import exactdit
from exactdit import ops, references

x = torch.randn(2, 3, 8)


# ------------------------------------------------------------------- messages name the right thing


def test_unpatch_of_something_else_names_unpatch():
    with pytest.raises(TypeError, match=r"^exactdit\.unpatch: .*NoneType"):
        exactdit.unpatch(None)
    with pytest.raises(TypeError, match=r"^exactdit\.patch: .*NoneType"):
        exactdit.patch(None)


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


def test_gated_rms_norm_modulate_names_itself():
    with pytest.raises(ValueError, match=r"^exactdit\.ops\.gated_rms_norm_modulate: scale of shape \(5,\)"):
        ops.gated_rms_norm_modulate(x, x, x, None, 1e-6, torch.ones(5))
    with pytest.raises(TypeError, match=r"^exactdit\.ops\.gated_rms_norm_modulate: weight must be a torch\.Tensor"):
        ops.gated_rms_norm_modulate(x, x, x, [1.0] * 8, 1e-6, x)
    with pytest.raises(TypeError, match=r"^exactdit\.ops\.rms_norm_modulate: weight must be a torch\.Tensor"):
        ops.rms_norm_modulate(x, 1.0, 1e-6, x)


def test_qk_norm_rope_names_itself_and_the_weight():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match=r"^exactdit\.ops\.qk_norm_rope: norm_q_weight of shape \(3,\) does not match"):
        ops.qk_norm_rope(q, q, torch.ones(3), None, 1e-6, torch.ones(1, 3, 1, 8))
    with pytest.raises(ValueError, match=r"^exactdit\.ops\.qk_norm_rope: norm_k_weight"):
        ops.qk_norm_rope(q, q, None, torch.ones(3), 1e-6, torch.ones(1, 3, 1, 8))
    with pytest.raises(ValueError, match=r"^exactdit\.ops\.qk_norm_rope: freqs must be"):
        ops.qk_norm_rope(q, q, None, None, 1e-6, (torch.ones(8),))
    with pytest.raises(ValueError, match=r"^exactdit\.ops\.head_rms_norm: weight of shape"):
        ops.head_rms_norm(q, torch.ones(3), 1e-6)


@pytest.mark.parametrize("call", [
    lambda: ops.modulate([1.0, 2.0], torch.ones(2)),
    lambda: ops.modulate(torch.ones(2), [1.0, 2.0]),
    lambda: ops.residual_gate_add(torch.ones(2), torch.ones(2), [1.0, 2.0]),
    lambda: ops.layer_norm({"x": 1}, 1e-6),
], ids=["modulate x", "modulate scale", "residual_gate_add gate", "layer_norm x"])
def test_an_unhashable_argument_gets_the_tensor_message(call):
    """Lists cannot be keys of the gate's plan cache: the op's own check must still speak first."""
    with pytest.raises(TypeError, match=r"^exactdit\.ops\.\w+: \w+ must be a torch\.Tensor, got (list|dict)$"):
        call()


# -------------------------------------------------------- stricter than eager (README's op table)


def test_python_number_scale_or_gate_raises_where_eager_accepts_it():
    assert references.modulate(x, 0.5, None).shape == x.shape  # eager takes a Python float
    with pytest.raises(TypeError, match="scale must be a torch.Tensor, got float"):
        ops.modulate(x, 0.5)
    with pytest.raises(TypeError, match="gate must be a torch.Tensor, got float"):
        ops.residual_gate_add(x, x, 0.5)
    with pytest.raises(TypeError, match="shift must be a torch.Tensor, got int"):
        ops.modulate(x, x, 1)


def test_an_operand_that_would_broadcast_the_output_up_raises():
    row = x[0, 0]  # [8]
    assert references.modulate(row, x, None).shape == x.shape  # eager returns the larger shape
    with pytest.raises(ValueError, match=r"scale of shape \(2, 3, 8\) does not broadcast to the activation shape \(8,\)"):
        ops.modulate(row, x)
    assert references.residual_gate_add(row, row, x).shape == x.shape
    with pytest.raises(ValueError, match=r"gate of shape \(2, 3, 8\) does not broadcast"):
        ops.residual_gate_add(row, row, x)


def test_layer_norm_takes_eps_second_not_the_normalized_shape():
    w = torch.randn(8)
    ref = F.layer_norm(x, (8,), w, None, 1e-5)
    assert torch.equal(ops.layer_norm(x, 1e-5, w), ref)  # exactdit's order: (x, eps, weight, bias)
    with pytest.raises(TypeError, match="eps must be a real number, got tuple"):
        ops.layer_norm(x, (8,), w, None)  # F.layer_norm's order
