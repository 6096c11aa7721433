"""Wan 2.1 text-to-video: WanTransformer3DModel / WanPipeline.

The pipeline draws float32 latents [B, 16, (F-1)/4+1, H/8, W/8] and casts them to the transformer's
dtype, pads UMT5 features with zeros to ``max_sequence_length`` (512), runs CFG as two calls, and
passes the scheduler's timestep as is (int64 with the released UniPC flow scheduler). This class
keeps ``_keep_in_fp32_modules`` (RoPE, time embedder, modulation tables, norms) in float32.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from . import components as C
from .core import ComponentRequest, ForwardRequest, ModelSpec, Production, frozen, register

_COMMON = dict(patch_size=(1, 2, 2), in_channels=16, out_channels=16, freq_dim=256, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6)

CONFIGS_14B = {
    "tiny": dict(_COMMON, num_attention_heads=2, attention_head_dim=16, text_dim=32, ffn_dim=64, num_layers=2),
    # diffusers' model tests (tests/models/transformers/test_models_transformer_wan.py)
    "diffusers_test": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                           out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                           qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    # production head_dim 128 / 4096-d text, 8 heads (dim 1024), 4 blocks
    "small": dict(_COMMON, num_attention_heads=8, attention_head_dim=128, text_dim=4096, ffn_dim=3072, num_layers=4),
    # Wan2.1-T2V-14B: dim 5120 (40 heads of 128), FFN 13824, 40 blocks, UMT5-XXL text 4096-d
    "full": dict(_COMMON, num_attention_heads=40, attention_head_dim=128, text_dim=4096, ffn_dim=13824,
                 num_layers=40),
    # Wan2.2-TI2V-5B's transformer: dim 3072 (24 heads of 128), FFN 14336, 30 blocks, the 48 latent
    # channels of Wan2.2's VAE (forward_inputs gives it that VAE's shapes and per-token timesteps)
    "ti2v-5b": dict(_COMMON, in_channels=48, out_channels=48, num_attention_heads=24, attention_head_dim=128,
                    text_dim=4096, ffn_dim=14336, num_layers=30),
}

# Wan2.1-T2V-1.3B: dim 1536 (12 heads of 128), FFN 8960, 30 blocks; the small test configs are shared.
CONFIGS_1_3B = dict(CONFIGS_14B, full=dict(_COMMON, num_attention_heads=12, attention_head_dim=128,
                                           text_dim=4096, ffn_dim=8960, num_layers=30))


def _components(req: ComponentRequest, flow_shift: float) -> dict:
    from diffusers import UniPCMultistepScheduler

    tokenizer = C.build_word_tokenizer(model_max_length=512, add_eos=True)
    return dict(
        tokenizer=tokenizer,
        text_encoder=C.t5_encoder(req.config["text_dim"], tokenizer, umt5=True, **req.part(C.SEED_TEXT)),
        vae=C.wan_style_vae("AutoencoderKLWan", req.config["in_channels"], **req.part(C.SEED_VAE)),
        # the released checkpoints' flow-matching UniPC solver
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                          num_train_timesteps=1000, flow_shift=flow_shift),
    )


def forward_inputs(req: ForwardRequest) -> dict:
    """hidden_states [B, 16, (F-1)/4+1, H/8, W/8]; text [B, max_text_len, 4096] with each row's real
    tokens then zeros; timestep int64 ``round(1000 * sigma)``.

    A 48-channel transformer (Wan2.2-TI2V-5B) gets what WanPipeline gives it with Wan2.2's VAE and
    ``expand_timesteps``: latents [B, 48, (F-1)/4+1, H/16, W/16] and one float32 timestep per token,
    ``(ones * t).flatten()`` expanded over the batch (stride 0)."""
    cfg = req.transformer.config
    gen = req.generator()
    frames = (req.num_frames - 1) // 4 + 1
    wan22 = cfg.in_channels == 48
    scale = 16 if wan22 else 8
    latents = req.randn(gen, req.batch, cfg.in_channels, frames, req.height // scale, req.width // scale)
    text = req.randn(gen, req.batch, req.max_text_len, cfg.text_dim)
    for i, n in enumerate(req.text_lens):
        text[i, n:] = 0
    t = round(1000 * req.sigma)
    if wan22:
        _, ph, pw = cfg.patch_size
        tokens = frames * (req.height // scale // ph) * (req.width // scale // pw)
        timestep = torch.full((tokens,), float(t), dtype=torch.float32, device=req.device).unsqueeze(0)
        timestep = timestep.expand(req.batch, -1)
    else:
        timestep = torch.full((req.batch,), t, dtype=torch.int64, device=req.device)
    return dict(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, attention_kwargs=None)


WAN = register(ModelSpec(
    name="wan", description="Wan2.1-T2V-14B (video DiT, UMT5-XXL text features, Wan VAE)",
    transformer_class="WanTransformer3DModel", pipeline_class="WanPipeline",
    configs=frozen(CONFIGS_14B),
    production=Production(height=720, width=1280, num_frames=81, steps=50, guidance_scale=5.0, max_text_len=512),
    build_components=lambda req: _components(req, flow_shift=5.0),
    forward_inputs=forward_inputs,
    video=True,
    # dim / FFN / heads / layers / 512 text tokens agree with the original Wan2.1 configs (t2v_14B, t2v_1_3B)
    unconfirmed=("full: rope_max_seq_len and the diffusers-only keys are WanTransformer3DModel's class defaults",
                 "production flow_shift 5.0 (720p) / 3.0 (480p), 50 steps, guidance 5.0 as in the diffusers docs' "
                 "example"),
))

WAN_1_3B = register(replace(
    WAN,
    name="wan-1.3b", description="Wan2.1-T2V-1.3B (video DiT, UMT5-XXL text features, Wan VAE)",
    configs=frozen(CONFIGS_1_3B),
    production=Production(height=480, width=832, num_frames=81, steps=50, guidance_scale=5.0, max_text_len=512),
    build_components=lambda req: _components(req, flow_shift=3.0),
))
