"""Flux.1 (dev, schnell) and Chroma: FluxTransformer2DModel / FluxPipeline, ChromaTransformer2DModel /
ChromaPipeline.

Both pipelines pack 2x2 patches of 8x VAE latents into tokens (16 pixels per token side), feed T5
features padded to ``max_sequence_length`` and ``timestep / 1000`` in the latents' dtype, and run
guidance either distilled (Flux: a ``guidance`` input) or as two separate calls (Chroma CFG).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import components as C
from .core import ComponentRequest, ForwardRequest, ModelSpec, Production, frozen, register

_COMMON = dict(patch_size=1, in_channels=64, guidance_embeds=True)  # 16 VAE channels x 2x2 packing
#: FLUX.1's per-head shapes and text widths: head_dim 128, RoPE axes, T5-XXL 4096-d, CLIP-L pooled 768-d
_PRODUCTION_WIDTHS = dict(attention_head_dim=128, joint_attention_dim=4096, pooled_projection_dim=768,
                          axes_dims_rope=(16, 56, 56))

FLUX_CONFIGS = {
    "tiny": dict(_COMMON, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    # diffusers' model tests (tests/models/transformers/test_models_transformer_flux.py)
    "diffusers_test": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                           num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                           axes_dims_rope=(4, 4, 8)),
    # 8 heads (hidden 1024), 2 double + 4 single blocks
    "small": dict(_COMMON, **_PRODUCTION_WIDTHS, num_layers=2, num_single_layers=4, num_attention_heads=8),
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads
    "full": dict(_COMMON, **_PRODUCTION_WIDTHS, num_layers=19, num_single_layers=38, num_attention_heads=24),
}

# FLUX.1-schnell: the same transformer without the guidance embedder.
SCHNELL_CONFIGS = {name: dict(cfg, guidance_embeds=False) for name, cfg in FLUX_CONFIGS.items()}

_NO_POOLED = ("pooled_projection_dim", "guidance_embeds")
CHROMA_CONFIGS = {
    name: {k: v for k, v in cfg.items() if k not in _NO_POOLED} for name, cfg in FLUX_CONFIGS.items()
}
# The distilled-guidance approximator replaces Flux's per-block modulation linears. Its input width
# (approximator_num_channels 64: timestep, guidance and block-index embeddings) is fixed by design.
CHROMA_CONFIGS["tiny"].update(approximator_num_channels=64, approximator_hidden_dim=32, approximator_layers=1)
CHROMA_CONFIGS["small"].update(approximator_num_channels=64, approximator_hidden_dim=1024, approximator_layers=2)
# Chroma1-HD: the class defaults (19 + 38 blocks, 24x128 heads, T5 4096-d, approximator 64 -> 5120, 5 layers)
CHROMA_CONFIGS["full"].update(approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5)
# diffusers' model tests (tests/models/transformers/test_models_transformer_chroma.py) set no approximator
# sizes, so that config keeps the class defaults (64 -> 5120, 5 layers: about 130M parameters)

#: FLUX.1-dev's scheduler settings (resolution-dependent shift, mu from the token count).
FLUX_DEV_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                          base_image_seq_len=256, max_image_seq_len=4096)


def _t5(req: ComponentRequest, max_len: int, seed_offset: int = C.SEED_TEXT_2):
    tokenizer = C.build_word_tokenizer(model_max_length=max_len, add_eos=True)
    encoder = C.t5_encoder(req.config["joint_attention_dim"], tokenizer, **req.part(seed_offset))
    return tokenizer, encoder


def _vae(req: ComponentRequest):
    return C.autoencoder_kl(req.config["in_channels"] // 4, **req.part(C.SEED_VAE))


def flux_components(req: ComponentRequest, scheduler: dict) -> dict:
    clip_tok = C.build_word_tokenizer(model_max_length=77, add_bos=True, add_eos=True)
    clip = C.clip_text_encoder(req.config["pooled_projection_dim"], clip_tok, **req.part(C.SEED_TEXT))
    t5_tok, t5 = _t5(req, 512)
    return dict(tokenizer=clip_tok, text_encoder=clip, tokenizer_2=t5_tok, text_encoder_2=t5, vae=_vae(req),
                scheduler=C.flow_match_scheduler(**scheduler))


def chroma_components(req: ComponentRequest) -> dict:
    t5_tok, t5 = _t5(req, 512, C.SEED_TEXT)
    return dict(tokenizer=t5_tok, text_encoder=t5, vae=_vae(req),
                scheduler=C.flow_match_scheduler(**FLUX_DEV_SCHEDULER))


def _packed_latents(req: ForwardRequest, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise packed as the pipeline packs it, [B, (H/16)*(W/16), in_channels], and the image ids."""
    from diffusers import FluxPipeline

    channels = req.transformer.config.in_channels // 4
    h, w = 2 * (req.height // 16), 2 * (req.width // 16)
    noise = req.randn(gen, req.batch, channels, h, w)
    latents = FluxPipeline._pack_latents(noise, req.batch, channels, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(req.batch, h // 2, w // 2, req.device, req.dtype)
    return latents, img_ids


def _shared_inputs(req: ForwardRequest) -> tuple[torch.Generator, dict]:
    """Flux's and Chroma's: packed latents, T5 features [B, max_text_len, 4096] (every prompt padded to
    max_sequence_length), txt_ids zeros [T, 3], img_ids [(H/16)*(W/16), 3]; and the generator drawn from."""
    gen = req.generator()
    latents, img_ids = _packed_latents(req, gen)
    text = req.randn(gen, req.batch, req.max_text_len, req.transformer.config.joint_attention_dim)
    return gen, dict(hidden_states=latents, timestep=req.timestep(), encoder_hidden_states=text,
                     txt_ids=torch.zeros(req.max_text_len, 3, device=req.device, dtype=req.dtype), img_ids=img_ids,
                     joint_attention_kwargs={})


def flux_forward_inputs(req: ForwardRequest) -> dict:
    """The shared inputs (no mask), CLIP pooled [B, 768], guidance float32 when the model embeds it."""
    cfg = req.transformer.config
    gen, kw = _shared_inputs(req)
    return dict(kw, pooled_projections=req.randn(gen, req.batch, cfg.pooled_projection_dim),
                guidance=req.guidance(req.spec.production.guidance_scale) if cfg.guidance_embeds else None)


def chroma_forward_inputs(req: ForwardRequest) -> dict:
    """The shared inputs and the attention mask: the prompt's tokens and the first padding token of each
    row, then every image token."""
    from diffusers import ChromaPipeline

    _, kw = _shared_inputs(req)
    real = torch.tensor([min(n, req.max_text_len) for n in req.text_lens], device=req.device)
    positions = torch.arange(req.max_text_len, device=req.device).unsqueeze(0).expand(req.batch, -1)
    text_mask = (positions <= real.unsqueeze(1)).to(dtype=req.dtype)
    # the pipeline's own helper (it does not use the pipeline instance)
    mask = ChromaPipeline._prepare_attention_mask(None, batch_size=req.batch, dtype=req.dtype,
                                                  sequence_length=kw["hidden_states"].shape[1],
                                                  attention_mask=text_mask)
    return dict(kw, attention_mask=mask)


FLUX = register(ModelSpec(
    name="flux", description="FLUX.1-dev (12B MMDiT, guidance-distilled; T5-XXL + CLIP-L)",
    transformer_class="FluxTransformer2DModel", pipeline_class="FluxPipeline",
    configs=frozen(FLUX_CONFIGS),
    production=Production(height=1024, width=1024, steps=50, guidance_scale=3.5, max_text_len=512),
    build_components=lambda req: flux_components(req, FLUX_DEV_SCHEDULER),
    forward_inputs=flux_forward_inputs,
    unconfirmed=("scheduler shift settings (FLUX_DEV_SCHEDULER) from memory of the released scheduler config",),
))

FLUX_SCHNELL = register(replace(
    FLUX,
    name="flux-schnell", description="FLUX.1-schnell (FLUX.1 without guidance embedding; 4 steps, 256 text tokens)",
    configs=frozen(SCHNELL_CONFIGS),
    production=Production(height=1024, width=1024, steps=4, guidance_scale=0.0, max_text_len=256,
                          call_kwargs=frozen(dict(max_sequence_length=256))),
    build_components=lambda req: flux_components(req, dict(shift=1.0, use_dynamic_shifting=False)),
    unconfirmed=("scheduler: shift 1.0 without dynamic shifting",),
))

CHROMA = register(ModelSpec(
    name="chroma", description="Chroma1-HD (Flux-derived 8.9B, T5 only, real CFG, approximator modulation)",
    transformer_class="ChromaTransformer2DModel", pipeline_class="ChromaPipeline",
    configs=frozen(CHROMA_CONFIGS),
    # the Chroma1-HD demo's settings: 1024x1024, 40 steps, CFG 3.0 (two calls) with a negative prompt
    production=Production(height=1024, width=1024, steps=40, guidance_scale=3.0, max_text_len=512,
                          call_kwargs=frozen(dict(negative_prompt="low quality, blurry"))),
    build_components=chroma_components, forward_inputs=chroma_forward_inputs,
    unconfirmed=("full: ChromaTransformer2DModel's class defaults taken as the Chroma1-HD config",
                 "production 40 steps / CFG 3.0 from the Chroma1-HD demo Space, not the model card",
                 "scheduler settings copied from FLUX.1-dev"),
))
