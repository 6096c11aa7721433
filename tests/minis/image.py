"""Mini models of diffusers image transformers: tiny configs, one forward's inputs each.

Inputs follow what each class's diffusers pipeline passes to the transformer: timestep scale and
dtype, position-id layout and dtype, text masks where the pipeline builds one (the second row's
last two tokens padding). Text length 7 (odd on purpose).
"""

import torch

from tests.minis.core import TEXT_LEN as TXT, Grid, Production, mini, randn, text_mask, timesteps


def _diagonal_text_ids() -> torch.Tensor:
    """(TXT, 3) float ids (0, i, i), as LongCat- and Ovis-Image pipelines build them for text."""
    ids = torch.zeros(TXT, 3)
    ids[:, 1] = ids[:, 2] = torch.arange(TXT)
    return ids


def _packed_latents(model, batch: int, g: torch.Generator, dtype: torch.dtype, **ids) -> dict:
    """Flux-style inputs: 8x8 packed latents, text states, timestep in the latents' dtype / 1000, ``ids``."""
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, 8 * 8, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.joint_attention_dim, dtype=dtype),
        timestep=timesteps(g, batch).to(dtype) / 1000,
        **ids,
    )


def _grid_ids(h: int, w: int, *, lead: float = 0.0, start: int = 0) -> torch.Tensor:
    """(h*w, 3) float ids (lead, start + row, start + col), as Flux-style pipelines build them."""
    ids = torch.zeros(h, w, 3)
    ids[..., 0] = lead
    ids[..., 1] = torch.arange(h)[:, None] + start
    ids[..., 2] = torch.arange(w)[None, :] + start
    return ids.reshape(h * w, 3)


# --------------------------------------------------------------------------------------------------
# FLUX.2 [dev]: guidance embedding on, 4-axis RoPE (T, H, W, L) with theta 2000, SwiGLU, no biases
# --------------------------------------------------------------------------------------------------


# FLUX.2 [dev] is Flux2Transformer2DModel's default config (dim 6144 = 48 x 128, 8 double + 48
# single blocks, Mistral-3 text features of 15360); 1024x1024: 64x64 packed latents, 512 text tokens
_FLUX2_DEV = Production("FLUX.2-dev", {}, Grid(1, 64, 64, 512), "1024x1024")


@mini("flux2", "Flux2Transformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=24, timestep_guidance_channels=32, mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, guidance_embeds=True), production=_FLUX2_DEV)
def _flux2(model, batch, g, dtype, grid=None):
    # Flux2Pipeline: packed latents (B, H*W, C), timestep in the latents' dtype / 1000, guidance
    # float32, int64 ids from cartesian_prod: text (0, 0, 0, l), image (0, h, w, 0)
    cfg = model.config
    grid = grid or Grid(1, 8, 8, TXT)
    h, w = grid.height, grid.width
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(grid.text))
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    return dict(
        hidden_states=randn(g, batch, h * w, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, grid.text, cfg.joint_attention_dim, dtype=dtype),
        timestep=timesteps(g, batch).to(dtype) / 1000,
        guidance=torch.full((batch,), 4.0, dtype=torch.float32),
        txt_ids=txt_ids.unsqueeze(0).expand(batch, -1, -1),
        img_ids=img_ids.unsqueeze(0).expand(batch, -1, -1),
    )


# --------------------------------------------------------------------------------------------------
# HiDream-I1: MoE feed-forward (4 routed experts, top-2, + shared expert), per-block Llama-3 layers
# --------------------------------------------------------------------------------------------------

_HIDREAM_LLAMA_LAYERS = 3  # stacked Llama hidden states the pipeline passes (32 in the real model)


@mini("hidream", "HiDreamImageTransformer2DModel", dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, caption_channels=(24, 20), text_emb_dim=20, num_routed_experts=4,
    num_activated_experts=2, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16), llama_layers=(0, 1, 2, 2)),
    eager="its mixture-of-experts routes tokens by data-dependent counts (bincount().cpu()): captured in parts "
          "once, the parts' shapes follow the routing")
def _hidream(model, batch, g, dtype):
    # HiDreamImagePipeline: square (B, C, H, W) latents (the model patchifies and builds img_ids itself),
    # raw scheduler timesteps (float32, 0..1000), T5 embeds, stacked Llama hidden states
    # (layers, B, L, D), pooled CLIP-L + CLIP-G embeds
    cfg = model.config
    t5_dim, llama_dim = cfg.caption_channels
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 16, 16, dtype=dtype),
        timesteps=timesteps(g, batch),
        encoder_hidden_states_t5=randn(g, batch, TXT, t5_dim, dtype=dtype),
        encoder_hidden_states_llama3=randn(g, _HIDREAM_LLAMA_LAYERS, batch, TXT, llama_dim, dtype=dtype),
        pooled_embeds=randn(g, batch, cfg.text_emb_dim, dtype=dtype),
    )


# --------------------------------------------------------------------------------------------------
# AuraFlow: MMDiT + single DiT blocks, learned positional embedding (centre crop), register tokens
# --------------------------------------------------------------------------------------------------


@mini("auraflow", "AuraFlowTransformer2DModel", dict(
    sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=32,
    out_channels=4, pos_embed_max_size=144))
def _auraflow(model, batch, g, dtype):
    # AuraFlowPipeline: (B, C, H, W) latents, timestep t / 1000 in the latents' dtype
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 16, 16, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.joint_attention_dim, dtype=dtype),
        timestep=(timesteps(g, batch) / 1000).to(dtype),
    )


# --------------------------------------------------------------------------------------------------
# LongCat-Image: Flux-style double/single blocks, 3-axis RoPE (modality, row, col)
# --------------------------------------------------------------------------------------------------


@mini("longcat-image", "LongCatImageTransformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6)))
def _longcat_image(model, batch, g, dtype):
    # LongCatImagePipeline: packed latents, timestep in the latents' dtype / 1000, float32 2D ids:
    # text (0, i, i); image (1, 512 + row, 512 + col) (start = tokenizer_max_length = 512)
    return _packed_latents(model, batch, g, dtype, txt_ids=_diagonal_text_ids(), img_ids=_grid_ids(8, 8, lead=1.0, start=512))


# --------------------------------------------------------------------------------------------------
# Ovis-Image: Flux-style blocks, RMSNorm on the text embeddings, 3-axis RoPE
# --------------------------------------------------------------------------------------------------


@mini("ovis-image", "OvisImageTransformer2DModel", dict(
    patch_size=1, in_channels=16, out_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)))
def _ovis_image(model, batch, g, dtype):
    # OvisImagePipeline: packed latents, timestep in the latents' dtype / 1000, 2D ids in the model
    # dtype: text (0, i, i), image (0, row, col)
    return _packed_latents(model, batch, g, dtype, txt_ids=_diagonal_text_ids().to(dtype), img_ids=_grid_ids(8, 8).to(dtype))


# --------------------------------------------------------------------------------------------------
# Bria 3.x: Flux-like without pooled or guidance embeddings, zero text ids
# --------------------------------------------------------------------------------------------------


@mini("bria", "BriaTransformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=24, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    rope_theta=10000, time_theta=10000))
def _bria(model, batch, g, dtype):
    # BriaPipeline: packed latents, raw float32 timesteps (0..1000), 3D ids: text zeros (float32),
    # image (0, row, col) in the latents' dtype
    cfg = model.config
    h = w = 8
    return dict(
        hidden_states=randn(g, batch, h * w, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.joint_attention_dim, dtype=dtype),
        timestep=timesteps(g, batch),
        txt_ids=torch.zeros(batch, TXT, 3),
        img_ids=_grid_ids(h, w).to(dtype).unsqueeze(0).repeat(batch, 1, 1),
    )


# --------------------------------------------------------------------------------------------------
# CogView4: single-stream blocks over [text, image], 2D RoPE on image tokens, SDXL-style size conds
# --------------------------------------------------------------------------------------------------


@mini("cogview4", "CogView4Transformer2DModel", dict(
    patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    text_embed_dim=24, time_embed_dim=32, condition_dim=16, pos_embed_max_size=16, sample_size=16,
    rope_axes_dim=(256, 256)))
def _cogview4(model, batch, g, dtype):
    # CogView4Pipeline: (B, C, H, W) latents, raw float32 timesteps, original/target size and crop
    # coords in the text embeds' dtype (pixels: 16x16 latents * 8). The pipeline passes no text mask
    # (it left-pads prompts with pad tokens to a multiple of 16 instead).
    cfg = model.config
    h = w = 16
    size = torch.tensor([[h * 8, w * 8]], dtype=dtype).repeat(batch, 1)
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, h, w, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.text_embed_dim, dtype=dtype),
        timestep=timesteps(g, batch),
        original_size=size,
        target_size=size.clone(),
        crop_coords=torch.zeros(batch, 2, dtype=dtype),
    )


# --------------------------------------------------------------------------------------------------
# Bria FIBO: per-block text-encoder layers (half the text width), qk RMSNorm, key-padding text mask
# --------------------------------------------------------------------------------------------------


@mini("bria-fibo", "BriaFiboTransformer2DModel", dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    rope_theta=10000, time_theta=10000, text_encoder_dim=16))
def _bria_fibo(model, batch, g, dtype):
    # BriaFiboPipeline (no patching): latents (B, H*W, C), raw timesteps in the latents' dtype,
    # prompt embeds = [last, second-to-last] text-encoder layers (2 * text_encoder_dim), one
    # text-encoder layer per block, 2D ids (text zeros, image (0, row, col)) in the model dtype, and a
    # bool key-padding mask (B, 1, 1, text + image) passed through joint_attention_kwargs
    cfg = model.config
    h = w = 8
    n_blocks = cfg.num_layers + cfg.num_single_layers
    valid = torch.ones(batch, TXT, dtype=torch.bool)
    if batch > 1:
        valid[1, TXT - 2:] = False  # second prompt is 2 tokens shorter: right padding
    mask = torch.cat([valid, torch.ones(batch, h * w, dtype=torch.bool)], dim=1)
    return dict(
        hidden_states=randn(g, batch, h * w, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.joint_attention_dim, dtype=dtype),
        text_encoder_layers=[randn(g, batch, TXT, cfg.text_encoder_dim, dtype=dtype) for _ in range(n_blocks)],
        timestep=timesteps(g, batch).to(dtype),
        txt_ids=torch.zeros(TXT, 3, dtype=dtype),
        img_ids=_grid_ids(h, w).to(dtype),
        joint_attention_kwargs={"attention_mask": mask[:, None, None, :]},
    )


# --------------------------------------------------------------------------------------------------
# Stable Diffusion 3.5: MMDiT, qk RMSNorm, a dual-attention first block
# --------------------------------------------------------------------------------------------------


# Stable Diffusion 3.5 Large: dim 2432 = 38 x 64, 38 blocks, qk RMSNorm, no dual attention;
# 1024x1024: 128x128 latents, CLIP 77 + T5 256 text tokens
_SD35_LARGE = Production("Stable Diffusion 3.5 Large", dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
    joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192, qk_norm="rms_norm"), Grid(1, 128, 128, 77 + 256), "1024x1024")


@mini("sd3", "SD3Transformer2DModel", dict(
    sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=20, out_channels=4,
    pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm"), production=_SD35_LARGE)
def _sd3(model, batch, g, dtype, grid=None):
    # SD3.5 (qk RMSNorm, a dual-attention first block in the tiny config): 16x16 latents, 7 text tokens
    cfg = model.config
    grid = grid or Grid(1, 16, 16, 7)
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, grid.height, grid.width, dtype=dtype),
        encoder_hidden_states=randn(g, batch, grid.text, cfg.joint_attention_dim, dtype=dtype),
        pooled_projections=randn(g, batch, cfg.pooled_projection_dim, dtype=dtype),
        timestep=timesteps(g, batch),
    )


# --------------------------------------------------------------------------------------------------
# Sana (1.5-style: qk RMSNorm across heads, linear self-attention, GLUMBConv, 32-channel DC-AE latents)
# --------------------------------------------------------------------------------------------------


@mini("sana", "SanaTransformer2DModel", dict(
    in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32, num_layers=2,
    num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=24,
    mlp_ratio=2.5, dropout=0.0, attention_bias=False, sample_size=8, patch_size=1, norm_elementwise_affine=False,
    norm_eps=1e-6, interpolation_scale=None, guidance_embeds=False, qk_norm="rms_norm_across_heads",
    timestep_scale=1.0))
def _sana(model, batch, g, dtype):
    # SanaPipeline: 8x8 latents, Gemma-2 prompt embeds with the tokenizer's (right-padded) int64 mask;
    # flow timesteps in [0, 1000) float32, times config.timestep_scale
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 8, 8, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.caption_channels, dtype=dtype),
        encoder_attention_mask=text_mask(batch),
        timestep=timesteps(g, batch) * cfg.timestep_scale,
    )


# --------------------------------------------------------------------------------------------------
# PixArt-Sigma (ada_norm_single, T5 captions with mask, no resolution / aspect-ratio conditions)
# --------------------------------------------------------------------------------------------------


@mini("pixart-sigma", "PixArtTransformer2DModel", dict(
    num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8, num_layers=2, dropout=0.0,
    norm_num_groups=32, cross_attention_dim=64, attention_bias=True, sample_size=16, patch_size=2,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, upcast_attention=False,
    norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, interpolation_scale=2,
    use_additional_conditions=False, caption_channels=32, attention_type="default"))
def _pixart_sigma(model, batch, g, dtype):
    # PixArtSigmaPipeline: 16x16 latents (8x8 patches), T5 embeds with their int64 mask, DPM-Solver integer
    # timesteps (int64), added_cond_kwargs with None resolution / aspect ratio
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 16, 16, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.caption_channels, dtype=dtype),
        encoder_attention_mask=text_mask(batch),
        timestep=timesteps(g, batch).long(),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )


# --------------------------------------------------------------------------------------------------
# Lumina-Image 2.0 (GQA, qk RMSNorm, sandwich norms, refiners, 3-axis RoPE, per-row caption lengths)
# --------------------------------------------------------------------------------------------------


@mini("lumina2", "Lumina2Transformer2DModel", dict(
    sample_size=16, patch_size=2, in_channels=16, out_channels=None, hidden_size=64, num_layers=2,
    num_refiner_layers=2, num_attention_heads=2, num_kv_heads=1, multiple_of=256, ffn_dim_multiplier=None,
    norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(8, 12, 12), axes_lens=(300, 512, 512), cap_feat_dim=32))
def _lumina2(model, batch, g, dtype):
    # Lumina2Pipeline: 16x16 latents, Gemma-2 embeds with the right-padded int64 mask (the mask sets each row's
    # caption length, so rows differ and the joint blocks get a mask); timestep 1 - t/1000 in [0, 1], float32
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 16, 16, dtype=dtype),
        timestep=1.0 - timesteps(g, batch) / 1000.0,
        encoder_hidden_states=randn(g, batch, TXT, cfg.cap_feat_dim, dtype=dtype),
        encoder_attention_mask=text_mask(batch),
    )


# --------------------------------------------------------------------------------------------------
# HunyuanImage-2.1 (distilled: guidance embeds + meanflow; ByT5 glyph stream; dual + single stream blocks)
# --------------------------------------------------------------------------------------------------


@mini("hunyuan-image", "HunyuanImageTransformer2DModel", dict(
    in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=32, num_layers=2,
    num_single_layers=2, num_refiner_layers=2, mlp_ratio=4.0, patch_size=(1, 1), qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=32, text_embed_2_dim=24, rope_theta=256.0, rope_axes_dim=(16, 16),
    use_meanflow=True))
def _hunyuan_image(model, batch, g, dtype):
    # HunyuanImagePipeline: 8x8 latents (patch 1); Qwen2.5-VL embeds with the right-padded int64 mask; ByT5 glyph
    # embeds (5 tokens here) with their int64 mask: row 0 has 3 glyph tokens, the others none (the pipeline's zeros
    # embeds and all-zero mask when a prompt has no quoted text). Timestep, meanflow timestep_r (the next, smaller
    # step) and guidance (scale * 1000) all in the latents' dtype.
    cfg = model.config
    t = timesteps(g, batch)
    glyph_len = 5
    glyph = randn(g, batch, glyph_len, cfg.text_embed_2_dim)
    glyph_mask = torch.zeros(batch, glyph_len, dtype=torch.long)
    glyph_mask[0, :3] = 1
    glyph = glyph * glyph_mask.unsqueeze(-1)
    glyph[0, 3:] = randn(g, glyph_len - 3, cfg.text_embed_2_dim)  # the text encoder's output at padded positions
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 8, 8, dtype=dtype),
        timestep=t.to(dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.text_embed_dim, dtype=dtype),
        encoder_attention_mask=text_mask(batch),
        timestep_r=(t * 0.75).to(dtype),
        encoder_hidden_states_2=glyph.to(dtype),
        encoder_attention_mask_2=glyph_mask,
        guidance=torch.full((batch,), 3.25 * 1000.0).to(dtype),
    )


# --------------------------------------------------------------------------------------------------
# Qwen-Image 2.1 (single stream, shared modulation, block-causal attention, causal_condition t=0 modulation)
# --------------------------------------------------------------------------------------------------


@mini("qwen-image-2.1", "QwenImage21Transformer2DModel", dict(
    patch_size=1, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
    context_in_dim=32, mlp_ratio=3, axes_dims_rope=(8, 12, 12), eps=1e-6, causal_condition=True))
def _qwen_image_21(model, batch, g, dtype):
    # QwenImage21Pipeline, text-to-image, without the KV cache (use_kv_cache=False: every step a full prefill;
    # the output covers the whole joint sequence, 7 text + 64 image tokens, the pipeline keeps the last 64):
    # 8x8 unpatched latents as 64 tokens; Qwen-VL embeds whose padded rows are zeros, the int64 valid-token mask;
    # img_mask: no image slots in the text, then one slot per 2x2 group of target latents (bool);
    # timestep t / 1000 in the latents' dtype
    cfg = model.config
    mask = text_mask(batch)
    text = randn(g, batch, TXT, cfg.context_in_dim) * mask.unsqueeze(-1)
    h = w = 8
    img_mask = torch.cat([torch.zeros(batch, TXT, dtype=torch.bool),
                          torch.ones(batch, h * w // 4, dtype=torch.bool)], dim=1)
    return dict(
        hidden_states=randn(g, batch, h * w, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=text.to(dtype),
        timestep=(timesteps(g, batch) / 1000.0).to(dtype),
        img_shapes=[[(1, h, w)]] * batch,
        img_mask=img_mask,
        encoder_hidden_states_mask=mask,
    )


# --------------------------------------------------------------------------------------------------
# GLM-Image (MMDiT with glyph text stream, prior VQ token embedding, SDXL-like size conditions)
# --------------------------------------------------------------------------------------------------


@mini("glm-image", "GlmImageTransformer2DModel", dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2,
    text_embed_dim=24, time_embed_dim=32, condition_dim=16, prior_vq_quantizer_codebook_size=64))
def _glm_image(model, batch, g, dtype):
    # GlmImagePipeline, text-to-image: 16x16 latents (8x8 patches); glyph embeds left-padded with zeros (no mask is
    # passed); one prior token id per patch (int64), none dropped (the conditional pass); timestep t - 1 float32;
    # target_size (pixels) and crop coords in the prompt dtype
    cfg = model.config
    h = w = 16
    tokens = (h // cfg.patch_size) * (w // cfg.patch_size)
    glyph = randn(g, batch, TXT, cfg.text_embed_dim)
    if batch > 1:
        glyph[1, :2] = 0.0
    prior = torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (batch, tokens), generator=g)
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, h, w, dtype=dtype),
        encoder_hidden_states=glyph.to(dtype),
        prior_token_id=prior,
        prior_token_drop=torch.zeros(batch, tokens, dtype=torch.bool),
        timestep=timesteps(g, batch, 999.0),
        target_size=torch.tensor([[h * 8, w * 8]] * batch).to(dtype),
        crop_coords=torch.zeros(batch, 2).to(dtype),
    )


# --------------------------------------------------------------------------------------------------
# HunyuanDiT v1.2 (long skips in the second half, qk LayerNorm, BERT + T5 text with masks, 2D RoPE)
# 6 blocks: 4 plain, 2 taking a long skip. The forward pushes skips from blocks < L//2 - 1 and pops them in blocks
# > L//2, so only an even num_layers balances; 6 is the least with two skip blocks.
# --------------------------------------------------------------------------------------------------


@mini("hunyuan-dit", "HunyuanDiT2DModel", dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, patch_size=2, activation_fn="gelu-approximate",
    sample_size=16, hidden_size=32, num_layers=6, mlp_ratio=4.3637, learn_sigma=True, cross_attention_dim=32,
    norm_type="layer_norm", cross_attention_dim_t5=32, pooled_projection_dim=16, text_len=TXT,
    text_len_t5=TXT, use_style_cond_and_image_meta_size=False))
def _hunyuan_dit(model, batch, g, dtype):
    # HunyuanDiTPipeline: 16x16 latents (8x8 patches, i.e. 128x128 px); BERT and mT5 embeds with their int64
    # masks (both padded to the config's text lengths); DDPM integer timesteps cast to the latents' dtype; the
    # pipeline's 2D RoPE (crop region of the 32-patch base grid), meta sizes and style (unused by v1.2 configs)
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid

    cfg = model.config
    grid = 16 // cfg.patch_size
    base = 512 // 8 // cfg.patch_size
    rope = get_2d_rotary_pos_embed(cfg.attention_head_dim, get_resize_crop_region_for_grid((grid, grid), base),
                                   (grid, grid), output_type="pt")
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, 16, 16, dtype=dtype),
        timestep=timesteps(g, batch).floor().to(dtype),
        encoder_hidden_states=randn(g, batch, cfg.text_len, cfg.cross_attention_dim, dtype=dtype),
        text_embedding_mask=text_mask(batch, length=cfg.text_len),
        encoder_hidden_states_t5=randn(g, batch, cfg.text_len_t5, cfg.cross_attention_dim_t5, dtype=dtype),
        text_embedding_mask_t5=text_mask(batch, length=cfg.text_len_t5, pad=1),
        image_meta_size=torch.tensor([[1024, 1024, 128, 128, 0, 0]] * batch).to(dtype),
        style=torch.zeros(batch, dtype=torch.long),
        image_rotary_emb=rope,
    )


# --------------------------------------------------------------------------------------------------
# Krea 2 (single stream, GQA + gated attention, zero-centred fp32 RMSNorms, layer-stack text fusion)
# --------------------------------------------------------------------------------------------------


@mini("krea2", "Krea2Transformer2DModel", dict(
    in_channels=16, num_layers=2, attention_head_dim=32, num_attention_heads=2, num_key_value_heads=1,
    intermediate_size=128, timestep_embed_dim=32, text_hidden_dim=32, num_text_layers=3,
    text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
    num_layerwise_text_blocks=2, num_refiner_text_blocks=2, axes_dims_rope=(8, 12, 12), rope_theta=1000.0,
    norm_eps=1e-5))
def _krea2(model, batch, g, dtype):
    # Krea2Pipeline: 16x16 latents packed into 2x2 patches (64 tokens of 4*4 channels); the tapped text-encoder
    # layers stacked per token with a bool mask. Krea 2 pads in the middle of its template
    # ([prompt | PAD | suffix]), so row 1's two padded tokens sit before the last two (suffix) tokens. Position ids
    # float32: zeros for text, (0, h, w) for the 8x8 image grid. Timestep t / 1000 in the latents' dtype.
    cfg = model.config
    gh = gw = 8
    mask = torch.ones(batch, TXT, dtype=torch.bool)
    if batch > 1:
        mask[1, TXT - 4:TXT - 2] = False
    image_ids = torch.zeros(gh, gw, 3)
    image_ids[..., 1] = torch.arange(gh)[:, None]
    image_ids[..., 2] = torch.arange(gw)[None, :]
    position_ids = torch.cat([torch.zeros(TXT, 3), image_ids.reshape(gh * gw, 3)], dim=0)
    return dict(
        hidden_states=randn(g, batch, gh * gw, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TXT, cfg.num_text_layers, cfg.text_hidden_dim, dtype=dtype),
        timestep=(timesteps(g, batch) / 1000.0).to(dtype),
        position_ids=position_ids,
        encoder_attention_mask=mask,
    )


# --------------------------------------------------------------------------------------------------
# DiT (class-conditional, AdaLN-Zero BasicTransformerBlocks)
# --------------------------------------------------------------------------------------------------


@mini("dit", "DiTTransformer2DModel", dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, norm_num_groups=32,
    sample_size=8, patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
    norm_type="ada_norm_zero", norm_elementwise_affine=False))
def _dit(model, batch, g, dtype):
    # DiTPipeline: 8x8 latents in the transformer dtype, integer timesteps and class labels
    return dict(
        hidden_states=randn(g, batch, model.config.in_channels, 8, 8, dtype=dtype),
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        class_labels=torch.randint(0, 1000, (batch,), generator=g),
    )
