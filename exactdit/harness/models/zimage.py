"""Z-Image (Turbo): ZImageTransformer2DModel / ZImagePipeline.

The transformer takes lists: one [C, 1, H/8, W/8] latent per image (it patchifies 2x2 itself) and one
[n_i, 2560] caption feature tensor per image (each prompt's real tokens, no padding). The pipeline's
timestep is ``(1000 - t) / 1000`` in float32; CFG, when on, runs [cond.., uncond..] in one call.
"""

from __future__ import annotations

import torch

from . import components as C
from .core import ComponentRequest, ForwardRequest, ModelSpec, Production, frozen, register

_COMMON = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, qk_norm=True, rope_theta=256.0,
               t_scale=1000.0, axes_lens=[1024, 512, 512])
#: Z-Image's per-head shapes and text width: head_dim 128 (RoPE axes 32/48/48), Qwen3-4B features 2560-d
_PRODUCTION_WIDTHS = dict(cap_feat_dim=2560, axes_dims=[32, 48, 48])

CONFIGS = {
    "tiny": dict(_COMMON, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                 axes_dims=[4, 6, 6]),
    # diffusers' model tests (tests/models/transformers/test_models_transformer_z_image.py)
    "diffusers_test": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16, n_layers=1,
                           n_refiner_layers=1, n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
                           rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]),
    # 8 heads (dim 1024), 4 + 1 refiner layers
    "small": dict(_COMMON, **_PRODUCTION_WIDTHS, dim=1024, n_layers=4, n_refiner_layers=1, n_heads=8, n_kv_heads=8),
    # Z-Image-Turbo (6B): dim 3840, 30 heads, 30 layers + 2 refiner layers
    "full": dict(_COMMON, **_PRODUCTION_WIDTHS, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                 norm_eps=1e-5),
}


def build_components(req: ComponentRequest) -> dict:
    tokenizer = C.build_word_tokenizer(model_max_length=512, chat=True, chat_template=C.QWEN3_CHAT_TEMPLATE)
    return dict(
        tokenizer=tokenizer,
        text_encoder=C.qwen3_text_encoder(req.config["cap_feat_dim"], tokenizer, **req.part(C.SEED_TEXT)),
        # the Flux VAE layout: 8x, 16 latent channels
        vae=C.autoencoder_kl(req.config["in_channels"], **req.part(C.SEED_VAE)),
        scheduler=C.flow_match_scheduler(shift=3.0),
    )


def forward_inputs(req: ForwardRequest) -> dict:
    """x: B latents [C, 1, H/8, W/8] (the pipeline draws them in float32, then casts to the transformer
    dtype); cap_feats: B tensors [min(n_i, max_text_len), cap_feat_dim]; t: float32 ``1 - sigma``.
    Rows are [cond.., uncond..] when CFG is batched."""
    cfg = req.transformer.config
    gen = req.generator()
    h, w = 2 * (req.height // 16), 2 * (req.width // 16)
    latents = req.randn(gen, req.batch, cfg.in_channels, h, w)
    caps = [req.randn(gen, min(n, req.max_text_len), cfg.cap_feat_dim) for n in req.text_lens]
    t = torch.full((req.batch,), 1000.0 * req.sigma, dtype=torch.float32, device=req.device)
    return dict(x=list(latents.unsqueeze(2).unbind(dim=0)), t=(1000 - t) / 1000, cap_feats=caps,
                joint_attention_kwargs=None)


ZIMAGE = register(ModelSpec(
    name="zimage", description="Z-Image-Turbo (6B single-stream DiT, Qwen3-4B text features, Flux VAE)",
    transformer_class="ZImageTransformer2DModel", pipeline_class="ZImagePipeline",
    configs=frozen(CONFIGS),
    # Turbo: 9 scheduler steps (8 transformer evaluations), no CFG
    production=Production(height=1024, width=1024, steps=9, guidance_scale=0.0, max_text_len=512,
                          cfg_rows="cond,uncond"),
    build_components=build_components, forward_inputs=forward_inputs,
    # dim 3840 / 30 heads / 30 layers + 2 refiner layers and 9 steps / guidance 0.0 / 1024x1024 agree with
    # public descriptions and diffusers' integration example; the rest are the class defaults
    unconfirmed=("full: norm_eps, axes_dims/axes_lens, rope_theta: ZImageTransformer2DModel's class defaults",
                 "scheduler shift 3.0 (released scheduler config not read)"),
))
