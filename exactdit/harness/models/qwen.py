"""Qwen-Image: QwenImageTransformer2DModel / QwenImagePipeline.

The pipeline packs 2x2 patches of 8x VAE latents (16 pixels per token side), takes the last hidden
state of Qwen2.5-VL over a prompt template and drops the template's 34 prefix tokens, keeps each
prompt's real tokens (padding to the longest with a mask only when lengths differ), and runs true
CFG as two separate calls.
"""

from __future__ import annotations

import torch

from . import components as C
from .core import ComponentRequest, ForwardRequest, ModelSpec, Production, frozen, register

_COMMON = dict(patch_size=2, in_channels=64, out_channels=16, guidance_embeds=False)  # 16 VAE channels x 2x2
#: Qwen-Image's per-head shapes and text width: head_dim 128, RoPE axes, Qwen2.5-VL-7B features 3584-d
_PRODUCTION_WIDTHS = dict(attention_head_dim=128, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))

CONFIGS = {
    "tiny": dict(_COMMON, num_layers=2, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 axes_dims_rope=(4, 6, 6)),
    # diffusers' model tests (tests/models/transformers/test_models_transformer_qwenimage.py)
    "diffusers_test": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                           num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
                           axes_dims_rope=(8, 4, 4)),
    # 8 heads (hidden 1024), 4 blocks
    "small": dict(_COMMON, **_PRODUCTION_WIDTHS, num_layers=4, num_attention_heads=8),
    # Qwen-Image (20B): 60 blocks, 24 heads
    "full": dict(_COMMON, **_PRODUCTION_WIDTHS, num_layers=60, num_attention_heads=24),
}


def build_components(req: ComponentRequest) -> dict:
    # the pipeline tokenizes with max_length = 1024 + 34 itself; model_max_length only bounds warnings
    tokenizer = C.build_word_tokenizer(model_max_length=2048, chat=True)
    return dict(
        tokenizer=tokenizer,
        text_encoder=C.qwen25vl_text_encoder(req.config["joint_attention_dim"], tokenizer, **req.part(C.SEED_TEXT)),
        vae=C.wan_style_vae("AutoencoderKLQwenImage", req.config["out_channels"], **req.part(C.SEED_VAE)),
        scheduler=C.flow_match_scheduler(use_dynamic_shifting=True),
    )


def forward_inputs(req: ForwardRequest) -> dict:
    """Packed latents [B, (H/16)*(W/16), 64]; text [B, T, 3584] with T the longest prompt (at most
    max_text_len), zero-padded rows and a mask only when the lengths differ; img_shapes
    [[(1, H/16, W/16)]] per row; timestep / 1000 in the latents' dtype."""
    from diffusers import QwenImagePipeline

    cfg = req.transformer.config
    gen = req.generator()
    channels = cfg.in_channels // 4
    h, w = 2 * (req.height // 16), 2 * (req.width // 16)
    noise = req.randn(gen, req.batch, 1, channels, h, w)
    latents = QwenImagePipeline._pack_latents(noise, req.batch, channels, h, w)
    lens = [min(n, req.max_text_len) for n in req.text_lens]
    longest = max(lens)
    text = req.randn(gen, req.batch, longest, cfg.joint_attention_dim)
    mask = None
    if min(lens) != longest:
        mask = torch.zeros(req.batch, longest, dtype=torch.long, device=req.device)
        for i, n in enumerate(lens):
            mask[i, :n] = 1
        text = text * mask.unsqueeze(-1).to(text.dtype)
    return dict(hidden_states=latents, timestep=req.timestep(),
                guidance=req.guidance(req.spec.production.guidance_scale or 1.0) if cfg.guidance_embeds else None,
                encoder_hidden_states_mask=mask, encoder_hidden_states=text,
                img_shapes=[[(1, req.height // 16, req.width // 16)]] * req.batch, attention_kwargs={})


#: Qwen-Image-Edit-2511's transformer config on top of Qwen-Image's (same class): the condition
#: image's tokens are modulated with timestep 0's vectors, picked per token through ``where``
EDIT_CONFIG = dict(zero_cond_t=True)


def with_condition_image(kw: dict, *, seed: int = 0) -> dict:
    """Qwen-Image-Edit's forward inputs from Qwen-Image's ``kw``: each row's packed target latents
    followed by a condition image's (seeded random, the target's size), and both images' shapes in
    ``img_shapes`` -- the second image stream of QwenImageEditPlusPipeline's transformer calls."""
    latents = kw["hidden_states"]
    gen = torch.Generator("cpu").manual_seed(int(seed))
    condition = torch.randn(latents.shape, generator=gen, dtype=torch.float32).to(latents.device, latents.dtype)
    return {**kw, "hidden_states": torch.cat([latents, condition], dim=1),
            "img_shapes": [list(shapes) * 2 for shapes in kw["img_shapes"]]}


QWEN = register(ModelSpec(
    name="qwen", description="Qwen-Image (20B MMDiT, Qwen2.5-VL-7B text features, Wan-style VAE)",
    transformer_class="QwenImageTransformer2DModel", pipeline_class="QwenImagePipeline",
    configs=frozen(CONFIGS),
    # model card: 1328x1328 for 1:1, 50 steps, true CFG 4.0 with a one-space negative prompt (two calls)
    production=Production(height=1328, width=1328, steps=50, guidance_scale=None, max_text_len=512,
                          call_kwargs=frozen(dict(true_cfg_scale=4.0, negative_prompt=" "))),
    build_components=build_components, forward_inputs=forward_inputs,
    # full (60 blocks, 24x128 heads, 3584-d text, 64 -> 16 channels, patch 2) agrees with the class
    # defaults and independent ports; 1328x1328 / 50 steps / true CFG 4.0 / " " with the model card example
    unconfirmed=("full: axes_dims_rope (16, 56, 56) is the class default, not read from the released config",
                 "scheduler: diffusers defaults with dynamic shifting, not the released scheduler config"),
))
