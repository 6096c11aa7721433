"""ERNIE-Image: ErnieImageTransformer2DModel / ErnieImagePipeline."""

from __future__ import annotations

from typing import Sequence

import torch

from . import components as C
from .core import ComponentRequest, ForwardRequest, ModelSpec, Production, frozen, register

# "full" is the released ERNIE-Image / ERNIE-Image-Turbo transformer (about 8B parameters: hidden 4096,
# 32 heads of 128, 36 layers, 3072-d Mistral3 text features); "small" keeps the per-head shapes (head_dim
# 128, RoPE axes 32/48/48, 128 latent channels, 3072-d text) with fewer, narrower layers.
_COMMON = dict(in_channels=128, out_channels=128, patch_size=1, rope_theta=256)
#: the released per-head shapes and text width: head_dim 128, RoPE axes 32/48/48, 3072-d text
_PRODUCTION_WIDTHS = dict(text_in_dim=3072, rope_axes_dim=(32, 48, 48))

CONFIGS = {
    "tiny": dict(_COMMON, hidden_size=64, num_attention_heads=4, num_layers=2, ffn_hidden_size=176, text_in_dim=96,
                 rope_axes_dim=(4, 6, 6)),
    # diffusers' own model tests (tests/models/transformers/test_models_transformer_ernie_image.py):
    # one layer, one 16-wide head
    "diffusers_test": dict(hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16, in_channels=16,
                           out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
                           eps=1e-6, qk_layernorm=True),
    "small": dict(_COMMON, **_PRODUCTION_WIDTHS, hidden_size=1024, num_attention_heads=8, num_layers=4,
                  ffn_hidden_size=3072),
    "full": dict(_COMMON, **_PRODUCTION_WIDTHS, hidden_size=4096, num_attention_heads=32, num_layers=36,
                 ffn_hidden_size=12288),
}

#: The production VAE (Flux2 layout) has 4 levels: the pipeline's scale factor 2**4 = 16 pixels per
#: latent cell (8x VAE, then 2x2 patchified latents).
PRODUCTION_VAE_CHANNELS = (8, 8, 8, 8)


def build_components(req: ComponentRequest, vae_channels: Sequence[int] = PRODUCTION_VAE_CHANNELS) -> dict:
    tokenizer = C.build_word_tokenizer(model_max_length=64, whitespace=True)
    return dict(
        tokenizer=tokenizer,
        text_encoder=C.mistral3_text_encoder(req.config["text_in_dim"], tokenizer, **req.part(C.SEED_TEXT)),
        # the transformer sees 2x2-patchified VAE latents
        vae=C.autoencoder_kl_flux2(req.config["in_channels"] // 4, block_out_channels=vae_channels,
                                   **req.part(C.SEED_VAE)),
        scheduler=C.flow_match_scheduler(),
    )


def forward_inputs(req: ForwardRequest) -> dict:
    """[uncond.., cond..] rows in one call with CFG; latents [B, C, H/16, W/16]; text features of each
    row padded with zeros to the longest, ``text_lens`` masking the padding; timestep ``1000 * sigma``
    in the model dtype. Drawn in float32 from a CPU generator (device-independent), then cast."""
    cfg = req.transformer.config
    gen = req.generator()
    latents = torch.randn((req.batch, cfg.in_channels, req.height // 16, req.width // 16), generator=gen)
    text = torch.zeros((req.batch, max(req.text_lens), cfg.text_in_dim), dtype=req.dtype)
    for i, n in enumerate(req.text_lens):
        text[i, :n] = torch.randn((n, cfg.text_in_dim), generator=gen).to(req.dtype)
    return dict(hidden_states=latents.to(device=req.device, dtype=req.dtype),
                timestep=torch.full((req.batch,), 1000.0 * req.sigma, device=req.device, dtype=req.dtype),
                text_bth=text.to(req.device),
                text_lens=torch.tensor(req.text_lens, dtype=torch.long, device=req.device))


ERNIE = register(ModelSpec(
    name="ernie", description="ERNIE-Image (8B single-stream DiT, Mistral3 text features, Flux2 VAE)",
    transformer_class="ErnieImageTransformer2DModel", pipeline_class="ErnieImagePipeline",
    configs=frozen(CONFIGS),
    # ErnieImagePipeline's defaults; CFG batches [uncond, cond]; the empty negative prompt is one
    # token (BOS) with the Mistral tokenizer (assumed, not checked against the released tokenizer).
    production=Production(height=1024, width=1024, steps=50, guidance_scale=4.0, max_text_len=1024,
                          prompt_len=128, negative_prompt_len=1, cfg_rows="uncond,cond"),
    build_components=build_components, forward_inputs=forward_inputs,
    unconfirmed=("negative_prompt_len=1 (BOS of the empty negative prompt)",
                 "max_text_len: the pipeline truncates only at the tokenizer's model_max_length"),
))
