"""Video mini models: diffusers video transformers at tiny configs, inputs shaped as their pipelines pass them.

Common shape: 3 latent frames of 8x8 latents, 7 text tokens, 2 heads of 16 channels. Where a pipeline passes a
text attention mask, the second row's last two tokens are padding; where a pipeline zero-pads text instead of
masking (Wan-family UMT5 embeddings), those two tokens are zeros.
"""

import math

import torch

from tests.minis.core import TEXT_LEN as TEXT, Grid, Production, mini, randn, text_mask, timesteps

FRAMES, HEIGHT, WIDTH = 3, 8, 8
TINY = Grid(FRAMES, HEIGHT, WIDTH, TEXT)


def _zero_padded_text(g, batch: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """UMT5 features as Wan-family pipelines pass them: real tokens then zeros (row 1 ends in two)."""
    text = randn(g, batch, TEXT, dim, dtype=dtype)
    return text * text_mask(batch, dtype)[..., None]


# --------------------------------------------------------------------------------------------------
# HunyuanVideo (guidance-distilled, dual + single stream blocks, token refiner, qk RMSNorm)
# --------------------------------------------------------------------------------------------------


@mini("hunyuan-video", "HunyuanVideoTransformer3DModel", dict(
    in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
    num_single_layers=2, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
    guidance_embeds=True, text_embed_dim=24, pooled_projection_dim=20, rope_theta=256.0,
    rope_axes_dim=(4, 6, 6), image_condition_type=None), video=True, production=Production(
    # HunyuanVideo (13B) is the class's default config; 480x848, 33 frames: 9 latent frames of 60x106
    "HunyuanVideo", {}, Grid(9, 60, 106, 256), "480x848, 33 frames"))
def _hunyuan_video(model, batch, g, dtype, grid=None):
    # HunyuanVideoPipeline: latents and text in the transformer dtype, the Llama mask cast to that dtype, the
    # scheduler's float32 timestep, embedded guidance = guidance_scale (6.0) * 1000 in the transformer dtype
    cfg = model.config
    grid = grid or TINY
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, grid.frames, grid.height, grid.width, dtype=dtype),
        timestep=timesteps(g, batch),
        encoder_hidden_states=randn(g, batch, grid.text, cfg.text_embed_dim, dtype=dtype),
        encoder_attention_mask=text_mask(batch, dtype, length=grid.text),
        pooled_projections=randn(g, batch, cfg.pooled_projection_dim, dtype=dtype),
        guidance=torch.full((batch,), 6.0, dtype=dtype) * 1000.0,
    )


# --------------------------------------------------------------------------------------------------
# HunyuanVideo 1.5 (t2v: zero image condition, MLLM + ByT5 text, qk RMSNorm)
# --------------------------------------------------------------------------------------------------

_HV15_LATENT, _HV15_BYT5, _HV15_IMAGE_TOKENS = 4, 5, 3


@mini("hunyuan-video-1.5", "HunyuanVideo15Transformer3DModel", dict(
    in_channels=2 * _HV15_LATENT + 1, out_channels=_HV15_LATENT, num_attention_heads=2, attention_head_dim=16,
    num_layers=2, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1, qk_norm="rms_norm",
    text_embed_dim=24, text_embed_2_dim=20, image_embed_dim=16, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
    target_size=480, task_type="t2v", use_meanflow=False), video=True)
def _hunyuan_video_15(model, batch, g, dtype):
    # HunyuanVideo15Pipeline (t2v): latents ++ zero condition latents ++ zero mask on channels, the timestep in
    # the transformer dtype, masks cast to the transformer dtype, an all-zero SigLIP image embedding (t2v).
    # ByT5 glyph text as for a prompt with quoted text: row 0 has 4 valid tokens, row 1 has 2.
    cfg = model.config
    latents = randn(g, batch, _HV15_LATENT, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    cond = torch.zeros(batch, _HV15_LATENT, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    cond_mask = torch.zeros(batch, 1, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    byt5_mask = torch.zeros(batch, _HV15_BYT5, dtype=dtype)
    for row in range(batch):
        byt5_mask[row, : (4 if row % 2 == 0 else 2)] = 1
    return dict(
        hidden_states=torch.cat([latents, cond, cond_mask], dim=1),
        timestep=timesteps(g, batch).to(dtype),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.text_embed_dim, dtype=dtype),
        encoder_attention_mask=text_mask(batch, dtype),
        encoder_hidden_states_2=randn(g, batch, _HV15_BYT5, cfg.text_embed_2_dim, dtype=dtype),
        encoder_attention_mask_2=byt5_mask,
        image_embeds=torch.zeros(batch, _HV15_IMAGE_TOKENS, cfg.image_embed_dim, dtype=dtype),
    )


# --------------------------------------------------------------------------------------------------
# LTX-Video (packed tokens, qk RMSNorm across heads, rope interpolation scale)
# --------------------------------------------------------------------------------------------------


@mini("ltx-video", "LTXVideoTransformer3DModel", dict(
    in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=16,
    cross_attention_dim=32, num_layers=2, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=24, attention_bias=True,
    attention_out_bias=True), video=True, production=Production(
    # LTX-Video 2B is the class's default config; 704x1280, 81 frames: 11 latent frames of 22x40
    "LTX-Video 2B", {}, Grid(11, 22, 40, 128), "704x1280, 81 frames"))
def _ltx_video(model, batch, g, dtype, grid=None):
    # LTXPipeline: packed latents [B, F*H*W, C] in the text dtype, a bool T5 mask, the scheduler's float32
    # timestep, latent grid sizes, rope_interpolation_scale = (temporal ratio 8 / frame_rate 25, 32, 32)
    cfg = model.config
    grid = grid or TINY
    return dict(
        hidden_states=randn(g, batch, grid.frames * grid.height * grid.width, cfg.in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, grid.text, cfg.caption_channels, dtype=dtype),
        timestep=timesteps(g, batch),
        encoder_attention_mask=text_mask(batch, torch.bool, length=grid.text),
        num_frames=grid.frames, height=grid.height, width=grid.width,
        rope_interpolation_scale=(8 / 25.0, 32, 32),
    )


# --------------------------------------------------------------------------------------------------
# LTX-2 (audio + video; the LTX-2.3 flags: gated attention, cross-attention AdaLN, split RoPE, STG processor)
# --------------------------------------------------------------------------------------------------

_LTX2_FPS = 24.0
# pixel frames (F-1)*8+1 = 17 at 24 fps; 16000 Hz / hop 160 / 4 = 25 audio latents per second
_LTX2_AUDIO_FRAMES = round(((FRAMES - 1) * 8 + 1) / _LTX2_FPS * 25)


@mini("ltx2-video", "LTX2VideoTransformer3DModel", dict(
    in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=16,
    cross_attention_dim=32, vae_scale_factors=(8, 32, 32), pos_embed_max_pos=20, base_height=2048, base_width=2048,
    gated_attn=True, cross_attn_mod=True,
    audio_in_channels=8, audio_out_channels=8, audio_patch_size=1, audio_patch_size_t=1,
    audio_num_attention_heads=2, audio_attention_head_dim=16, audio_cross_attention_dim=32, audio_scale_factor=4,
    audio_pos_embed_max_pos=20, audio_sampling_rate=16000, audio_hop_length=160, audio_gated_attn=True,
    audio_cross_attn_mod=True,
    num_layers=2, activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads", norm_elementwise_affine=False,
    norm_eps=1e-6, caption_channels=24, attention_bias=True, attention_out_bias=True, rope_theta=10000.0,
    rope_double_precision=True, causal_offset=1, timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000, rope_type="split", use_prompt_embeddings=False,
    perturbed_attn=True), video=True)
def _ltx2_video(model, batch, g, dtype):
    # LTX2Pipeline: packed video and audio latents in the text dtype, connector outputs (already at the
    # cross-attention widths, LTX-2.3 has no caption projection) with an int64 binary mask, the float32
    # timestep also passed as sigma, coordinates precomputed by the model's rope helpers, use_cross_timestep
    cfg = model.config
    mask = text_mask(batch, torch.int64)
    t = timesteps(g, batch)
    return dict(
        hidden_states=randn(g, batch, FRAMES * HEIGHT * WIDTH, cfg.in_channels, dtype=dtype),
        audio_hidden_states=randn(g, batch, _LTX2_AUDIO_FRAMES, cfg.audio_in_channels, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.cross_attention_dim, dtype=dtype),
        audio_encoder_hidden_states=randn(g, batch, TEXT, cfg.audio_cross_attention_dim, dtype=dtype),
        timestep=t,
        sigma=t,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=_LTX2_FPS, audio_num_frames=_LTX2_AUDIO_FRAMES,
        video_coords=model.rope.prepare_video_coords(batch, FRAMES, HEIGHT, WIDTH, "cpu", fps=_LTX2_FPS),
        audio_coords=model.audio_rope.prepare_audio_coords(batch, _LTX2_AUDIO_FRAMES, "cpu"),
        isolate_modalities=False,
        spatio_temporal_guidance_blocks=None,
        perturbation_mask=None,
        use_cross_timestep=True,
    )


# --------------------------------------------------------------------------------------------------
# CogVideoX (the 5B layout: 3D RoPE instead of sinusoidal position embeddings)
# --------------------------------------------------------------------------------------------------


def _cogvideox_rope(cfg, frames: int, height: int, width: int):
    """CogVideoXPipeline._prepare_rotary_positional_embeddings for CogVideoX 1.0 (no temporal patch)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    p = cfg.patch_size
    grid_h, grid_w = height // p, width // p
    base_w, base_h = cfg.sample_width // p, cfg.sample_height // p
    # get_resize_crop_region_for_grid((grid_h, grid_w), base_w, base_h)
    if grid_h / grid_w > base_h / base_w:
        resize_h, resize_w = base_h, int(round(base_h / grid_h * grid_w))
    else:
        resize_w, resize_h = base_w, int(round(base_w / grid_w * grid_h))
    top, left = int(round((base_h - resize_h) / 2.0)), int(round((base_w - resize_w) / 2.0))
    crops = ((top, left), (top + resize_h, left + resize_w))
    return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=crops, grid_size=(grid_h, grid_w),
                                   temporal_size=frames, device=torch.device("cpu"))


@mini("cogvideox", "CogVideoXTransformer3DModel", dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, flip_sin_to_cos=True, freq_shift=0,
    time_embed_dim=32, ofs_embed_dim=None, text_embed_dim=24, num_layers=2, dropout=0.0, attention_bias=True,
    sample_width=WIDTH, sample_height=HEIGHT, sample_frames=(FRAMES - 1) * 4 + 1, patch_size=2, patch_size_t=None,
    temporal_compression_ratio=4, max_text_seq_length=TEXT, activation_fn="gelu-approximate",
    timestep_activation_fn="silu", norm_elementwise_affine=True, norm_eps=1e-5, spatial_interpolation_scale=1.875,
    temporal_interpolation_scale=1.0, use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False,
    patch_bias=True), video=True, production=Production(
    # CogVideoX-5B: dim 3072 = 48 x 64, 42 blocks, 3D RoPE; 480x720, 49 frames: 13 latent frames of 60x90
    "CogVideoX-5B", dict(num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
    Grid(13, 60, 90, 226), "480x720, 49 frames"))
def _cogvideox(model, batch, g, dtype, grid=None):
    # CogVideoXPipeline: latents [B, F, C, H, W] in the text dtype, T5 text without a mask, the DDIM scheduler's
    # int64 timestep, float32 (cos, sin) RoPE tables from the pipeline
    cfg = model.config
    grid = grid or TINY
    return dict(
        hidden_states=randn(g, batch, grid.frames, cfg.in_channels, grid.height, grid.width, dtype=dtype),
        encoder_hidden_states=randn(g, batch, grid.text, cfg.text_embed_dim, dtype=dtype),
        timestep=timesteps(g, batch).long(),
        image_rotary_emb=_cogvideox_rope(cfg, grid.frames, grid.height, grid.width),
    )


# --------------------------------------------------------------------------------------------------
# Mochi (asymmetric context stream, attention-pooled caption, learned RoPE frequencies, last block context-pre-only)
# --------------------------------------------------------------------------------------------------


@mini("mochi", "MochiTransformer3DModel", dict(
    patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=3, pooled_projection_dim=16,
    in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=32, time_embed_dim=32,
    activation_fn="swiglu", max_sequence_length=TEXT), video=True)
def _mochi(model, batch, g, dtype):
    # MochiPipeline: latents and the timestep in the text dtype, a bool T5 mask (the attention drops padded
    # tokens per row). 3 layers: two regular blocks and the context-pre-only last block.
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, FRAMES, HEIGHT, WIDTH, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.text_embed_dim, dtype=dtype),
        timestep=timesteps(g, batch).to(dtype),
        encoder_attention_mask=text_mask(batch, torch.bool),
    )


# --------------------------------------------------------------------------------------------------
# SkyReels-V2 (diffusion forcing with per-frame timesteps, as the DF-14B checkpoints: no fps embedding)
# --------------------------------------------------------------------------------------------------


@mini("skyreels-v2", "SkyReelsV2Transformer3DModel", dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=24,
    freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
    image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024, pos_embed_seq_len=None, inject_sample_info=False,
    num_frame_per_block=1), video=True)
def _skyreels_v2(model, batch, g, dtype):
    # SkyReelsV2DiffusionForcingPipeline (t2v): latents in the transformer dtype, zero-padded UMT5 text, one int64
    # UniPC timestep per latent frame (asynchronous: earlier frames further denoised), fps 24 -> index 1 (the
    # pipeline passes it; only inject_sample_info models (DF-1.3B) use it, and diffusers 0.42's fps path with
    # diffusion forcing only broadcasts at batch 1, so the mini follows the DF-14B config)
    cfg = model.config
    per_frame = torch.sort(torch.rand(batch, FRAMES, generator=g) * 1000.0, dim=1).values.long()
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, FRAMES, HEIGHT, WIDTH, dtype=dtype),
        timestep=per_frame,
        encoder_hidden_states=_zero_padded_text(g, batch, cfg.text_dim, dtype),
        enable_diffusion_forcing=True,
        fps=[1] * batch,
    )


# --------------------------------------------------------------------------------------------------
# Wan VACE (control branch: VACE blocks every other layer, like the 1.3B checkpoint)
# --------------------------------------------------------------------------------------------------

_VACE_LATENT = 4
_VACE_MASK = 8 * 8  # the pixel mask, unshuffled by the VAE's 8x8 spatial factor


@mini("wan-vace", "WanVACETransformer3DModel", dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=_VACE_LATENT,
    out_channels=_VACE_LATENT, text_dim=24, freq_dim=32, ffn_dim=64, num_layers=4, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
    pos_embed_seq_len=None, vace_layers=[0, 2], vace_in_channels=2 * _VACE_LATENT + _VACE_MASK), video=True)
def _wan_vace(model, batch, g, dtype):
    # WanVACEPipeline: latents in the transformer dtype, zero-padded UMT5 text, the int64 UniPC timestep,
    # control = [inactive latents, reactive latents, binary mask (64 unshuffled channels)] in the transformer
    # dtype, conditioning_scale 1.0 per VACE layer as a transformer-dtype tensor
    cfg = model.config
    inactive = randn(g, batch, _VACE_LATENT, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    reactive = randn(g, batch, _VACE_LATENT, FRAMES, HEIGHT, WIDTH, dtype=dtype)
    # regenerate the centre of every frame: the pixel mask is 1 inside, 0 outside
    pixel = torch.zeros(FRAMES, HEIGHT * 8, WIDTH * 8)
    pixel[:, HEIGHT * 2: HEIGHT * 6, WIDTH * 2: WIDTH * 6] = 1.0
    mask = pixel.view(FRAMES, HEIGHT, 8, WIDTH, 8).permute(2, 4, 0, 1, 3).flatten(0, 1)  # [64, F, H, W]
    mask = mask.unsqueeze(0).expand(batch, -1, -1, -1, -1).to(dtype)
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, FRAMES, HEIGHT, WIDTH, dtype=dtype),
        timestep=timesteps(g, batch).long(),
        encoder_hidden_states=_zero_padded_text(g, batch, cfg.text_dim, dtype),
        control_hidden_states=torch.cat([inactive, reactive, mask], dim=1),
        control_hidden_states_scale=torch.ones(len(cfg.vace_layers), dtype=dtype),
    )


# --------------------------------------------------------------------------------------------------
# Kandinsky 5 (text encoder blocks + visual decoder blocks, visual_cond input as the released T2V Lite)
# --------------------------------------------------------------------------------------------------


@mini("kandinsky5", "Kandinsky5Transformer3DModel", dict(
    in_visual_dim=4, in_text_dim=24, in_text_dim2=20, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
    model_dim=32, ff_dim=128, num_text_blocks=2, num_visual_blocks=2, axes_dims=(4, 6, 6), visual_cond=True,
    attention_type="regular"), video=True)
def _kandinsky5(model, batch, g, dtype):
    # Kandinsky5T2VPipeline: channels-last latents [B, F, H, W, C] ++ zero visual condition ++ zero mask (t2v),
    # Qwen text padded to the longest prompt (no mask), CLIP pooled text, the timestep in the transformer dtype,
    # RoPE positions as index tensors, scale_factor (1, 2, 2) for 480p, no sparse attention (regular)
    cfg = model.config
    c = cfg.in_visual_dim
    latents = randn(g, batch, FRAMES, HEIGHT, WIDTH, c, dtype=dtype)
    zeros = torch.zeros(batch, FRAMES, HEIGHT, WIDTH, c + 1, dtype=dtype)
    p = cfg.patch_size
    return dict(
        hidden_states=torch.cat([latents, zeros], dim=-1),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.in_text_dim, dtype=dtype),
        timestep=timesteps(g, batch).to(dtype),
        pooled_projections=randn(g, batch, cfg.in_text_dim2, dtype=dtype),
        visual_rope_pos=[torch.arange(FRAMES // p[0]), torch.arange(HEIGHT // p[1]), torch.arange(WIDTH // p[2])],
        text_rope_pos=torch.arange(TEXT),
        scale_factor=(1, 2, 2),
        sparse_params=None,
    )


# --------------------------------------------------------------------------------------------------
# Cosmos-1.0 text2world (video; AdaLN-LoRA, qk RMSNorm, 3-axis RoPE with fps, learnable pos embed kept fp32)
# --------------------------------------------------------------------------------------------------
# NOTE: real checkpoints have concat_padding_mask=True, whose forward resizes `padding_mask` with torchvision,
# which this environment lacks. Every Cosmos pipeline passes an all-zero padding mask, so this config turns the
# flag off and widens in_channels by the one mask channel (in 4 + 1, out 4), and the inputs append that zero
# channel themselves: the same patch embedding, weights and arithmetic as the real model on the pipeline's input.


@mini("cosmos", "CosmosTransformer3DModel", dict(
    in_channels=5, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=2, mlp_ratio=4.0,
    text_embed_dim=32, adaln_lora_dim=16, max_size=(8, 32, 32), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0),
    concat_padding_mask=False, extra_pos_embed_type="learnable"), video=True)
def _cosmos(model, batch, g, dtype):
    # CosmosTextToWorldPipeline: 3 latent frames of 8x8, T5 embeds with the padded positions zeroed (no mask is
    # passed), EDM timestep 0.25 * log(sigma) in the transformer dtype, fps=30
    cfg = model.config
    latent_channels = cfg.out_channels
    latents = randn(g, batch, latent_channels, 3, 8, 8, dtype=dtype)
    text = randn(g, batch, TEXT, cfg.text_embed_dim)
    text = text * text_mask(batch, torch.float32).unsqueeze(-1)
    sigma = torch.exp(torch.rand(batch, generator=g) * (math.log(80.0) - math.log(0.002)) + math.log(0.002))
    kw = dict(
        timestep=(0.25 * torch.log(sigma)).to(dtype),
        encoder_hidden_states=text.to(dtype),
        fps=30,
    )
    padding_mask = torch.zeros(1, 1, 8, 8, dtype=dtype)
    if cfg.concat_padding_mask:
        kw.update(hidden_states=latents, padding_mask=padding_mask)
    else:
        pad_channel = padding_mask.unsqueeze(2).repeat(batch, 1, latents.shape[2], 1, 1)
        kw.update(hidden_states=torch.cat([latents, pad_channel], dim=1))
    return kw




# --------------------------------------------------------------------------------------------------
# Cosmos3 (Omni: packed text + vision sequence, understanding and generation pathways per layer)
# --------------------------------------------------------------------------------------------------


@mini("cosmos3", "Cosmos3OmniTransformer", dict(
    # diffusers' own test configuration (Nemotron RMSNorm, relu2 MLP, grouped-query attention)
    head_dim=6, hidden_act="relu2", hidden_size=12, intermediate_size=24, latent_channel=2, latent_patch_size=1,
    num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1, patch_latent_dim=2, qk_norm_for_text=False,
    rms_norm_eps=1e-5, rope_axes_dim=(1, 1, 1), rope_theta=1e8, vocab_size=32), video=True)
def _cosmos3(model, batch, g, dtype):
    # one packed sequence (the model has no batch axis): two text tokens, then one vision token of one 1x1
    # latent frame, as diffusers' tests pass it; a generation pathway of one token gives the attention
    # and rotary operands the size-1 dims whose strides eager keeps (issue 35, item 15)
    cfg = model.config
    length = 3
    vision = torch.arange(2, length)
    return dict(
        input_ids=torch.tensor([1, 2]), text_indexes=torch.tensor([0, 1]),
        position_ids=torch.zeros((3, length), dtype=torch.long), und_len=2, sequence_length=length,
        vision_tokens=[randn(g, 1, cfg.latent_channel, 1, 1, 1, dtype=dtype)], vision_token_shapes=[(1, 1, 1)],
        vision_sequence_indexes=vision, vision_mse_loss_indexes=vision, vision_timesteps=torch.ones(1),
        vision_noisy_frame_indexes=[torch.tensor([0])],
    )


# --------------------------------------------------------------------------------------------------
# Wan-Animate-2 (in-context reference: the reference pass writes each block's K/V into a cache)
# --------------------------------------------------------------------------------------------------


@mini("wan-animate-2", "WanAnimate2Transformer3DModel", dict(
    # diffusers' own test configuration (its image embedding is 1280 wide: MLPProj hardcodes CLIP's width)
    patch_size=(1, 2, 2), text_len=16, in_dim=16 + 20, dim=128, ffn_dim=256, freq_dim=64, text_dim=32, out_dim=16,
    num_heads=4, num_layers=2, cross_attn_norm=True, use_img_emb=True), video=True)
def _wan_animate_2(model, batch, g, dtype):
    # WanAnimate2Pipeline's reference pass (kv_cache_mode="extract"), as diffusers' tests run it: per sample two
    # latent frames of 4x4 with 20 conditioning channels, 8 text tokens of 32, 4 CLIP tokens; the blocks read
    # the patch grid from a (1, 3) integer tensor with .tolist() (issue 35 item 18)
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

    frames, size = 2, 4
    return dict(
        hidden_states=[randn(g, 16, frames, size, size, dtype=dtype) for _ in range(batch)],
        timestep=torch.ones(batch, dtype=dtype),
        encoder_hidden_states=[randn(g, 8, model.config.text_dim, dtype=dtype) for _ in range(batch)],
        condition_latents=[randn(g, 20, frames, size, size, dtype=dtype) for _ in range(batch)],
        encoder_hidden_states_image=randn(g, batch, 4, 1280, dtype=dtype),
        kv_cache=WanAnimate2KVCache(model.config.num_layers), kv_cache_mode="extract",
        seq_len=frames * (size // 2) ** 2, offset_grid_sizes=torch.tensor([[frames, size // 2, size // 2]]),
    )


# --------------------------------------------------------------------------------------------------
# Latte (spatial and temporal BasicTransformerBlocks alternating), Allegro, TransformerTemporal
# --------------------------------------------------------------------------------------------------


@mini("latte", "LatteTransformer3DModel", dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, cross_attention_dim=32,
    sample_size=8, patch_size=2, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
    norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=32,
    video_length=FRAMES), video=True)
def _latte(model, batch, g, dtype):
    # LattePipeline: (B, C, F, H, W) latents, T5 embeds, a float timestep per row
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, FRAMES, HEIGHT, WIDTH, dtype=dtype),
        timestep=timesteps(g, batch),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.caption_channels, dtype=dtype),
        enable_temporal_attentions=True,
    )


@mini("allegro", "AllegroTransformer3DModel", dict(
    patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
    num_layers=2, cross_attention_dim=32, sample_height=HEIGHT, sample_width=WIDTH, sample_frames=FRAMES,
    caption_channels=24), video=True)
def _allegro(model, batch, g, dtype):
    # AllegroPipeline: (B, C, F, H, W) latents, T5 embeds with their attention mask, a timestep per row
    cfg = model.config
    return dict(
        hidden_states=randn(g, batch, cfg.in_channels, FRAMES, HEIGHT, WIDTH, dtype=dtype),
        encoder_hidden_states=randn(g, batch, TEXT, cfg.caption_channels, dtype=dtype),
        timestep=timesteps(g, batch),
        encoder_attention_mask=text_mask(batch, dtype),
    )


@mini("transformer-temporal", "TransformerTemporalModel", dict(
    num_attention_heads=2, attention_head_dim=16, in_channels=32, num_layers=2, norm_num_groups=32,
    activation_fn="geglu"), video=True)
def _transformer_temporal(model, batch, g, dtype):
    # a UNet's temporal layer (text-to-video UNets): frames stacked in the batch, num_frames given
    return dict(hidden_states=randn(g, batch * FRAMES, model.config.in_channels, 4, 4, dtype=dtype), num_frames=FRAMES)
