"""Tiny offline pipeline components: word-level tokenizers made in code, 1-2 layer text encoders and
few-channel VAEs with random weights.

The text encoders keep the output width the transformer expects (e.g. 4096-d T5 features for Flux)
but shrink everything else (vocabulary, attention inner width, FFN), so even the components of a
"full" config cost a few MB. The VAEs have the production number of levels, hence the production
scale factor and latent shapes. Weights come from :func:`materialize` (seeded, independent
of library init code); dtypes are those ``from_pretrained(torch_dtype=...)`` leaves.
"""

from __future__ import annotations

from typing import Sequence

from .core import build_random

TINY_WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(ord("a") + i) for i in range(26)] + [
    "a", "cat", "dog", "red", "blue", "photo", "of", "the", "on", "in", "sky", "tree", "house",
]

#: Qwen chat-template markers, atomic like in the real tokenizers.
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

#: Splits like a BPE tokenizer at word granularity: each word, each punctuation mark and each newline
#: is one token. With it the Qwen-Image prompt template's prefix is 34 tokens, as with the real
#: tokenizer, so the pipeline's ``prompt_template_encode_start_idx`` drops exactly the template.
WORD_PATTERN = r"\n|\w+|[^\w\s]"


def build_word_tokenizer(*, model_max_length: int, add_bos: bool = False, add_eos: bool = False, chat: bool = False,
                         chat_template: str | None = None, whitespace: bool = False):
    """A word-level fast tokenizer made in code (nothing downloaded).

    ``add_bos`` / ``add_eos`` wrap every sequence like CLIP (``<s> .. </s>``) or T5 (``.. </s>``);
    ``chat`` adds the Qwen ``<|im_start|>`` / ``<|im_end|>`` markers as atomic special tokens and uses
    ``<|endoftext|>`` as padding, like the Qwen tokenizers. ``whitespace`` (ERNIE-Image's tiny
    tokenizer): split at whitespace and runs of punctuation, no newline token.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(TINY_WORDS) + ([] if whitespace else ["\n"]) + (list(CHAT_TOKENS) if chat else [])
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}  # a word repeated keeps its first id
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = (pre_tokenizers.Whitespace() if whitespace
                         else pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="removed", invert=True))
    if add_bos or add_eos:
        single = " ".join((["<s>"] if add_bos else []) + ["$A"] + (["</s>"] if add_eos else []))
        specials = ([("<s>", vocab["<s>"])] if add_bos else []) + ([("</s>", vocab["</s>"])] if add_eos else [])
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    extra = {"additional_special_tokens": list(CHAT_TOKENS[:2])} if chat else {}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None if chat else "<s>",
                                  eos_token="<|im_end|>" if chat else "</s>",
                                  pad_token="<|endoftext|>" if chat else "<pad>", unk_token="<unk>",
                                  model_max_length=model_max_length, **extra)
    if chat_template is not None:
        out.chat_template = chat_template
    return out


# Z-Image formats prompts with ``apply_chat_template(..., add_generation_prompt=True, enable_thinking=True)``;
# this minimal template renders the same turn structure as Qwen3's for a single user message.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _specials(tokenizer) -> dict:
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id
    return dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                bos_token_id=bos)


# ------------------------------------------------------------------------------------- text encoders


def clip_text_encoder(hidden: int, tokenizer, *, seed: int, dtype, device, layers: int = 1):
    """CLIPTextModel whose ``pooler_output`` is ``hidden`` wide (Flux's pooled projection input)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    cfg = CLIPTextConfig(hidden_size=hidden, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
                         max_position_embeddings=tokenizer.model_max_length, projection_dim=hidden,
                         **_specials(tokenizer))
    return build_random(lambda: CLIPTextModel(cfg), seed=seed, dtype=dtype, device=device)


def t5_encoder(d_model: int, tokenizer, *, seed: int, dtype, device, umt5: bool = False, layers: int = 1):
    """T5 (Flux, Chroma) or UMT5 (Wan) encoder with ``d_model``-wide output and a tiny inner width."""
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_cls, model_cls = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    specials = _specials(tokenizer)
    specials.pop("bos_token_id")
    cfg = config_cls(d_model=d_model, d_kv=16, d_ff=32, num_layers=layers, num_heads=2,
                     relative_attention_num_buckets=8, relative_attention_max_distance=32,
                     feed_forward_proj="gated-gelu", decoder_start_token_id=specials["pad_token_id"], **specials)
    return build_random(lambda: model_cls(cfg), seed=seed, dtype=dtype, device=device)


def mistral3_text_encoder(hidden: int, tokenizer, *, seed: int, dtype, device):
    """ERNIE-Image's Mistral3Model (2 layers: the pipeline takes ``hidden_states[-2]``)."""
    from transformers import Mistral3Config, Mistral3Model

    cfg = Mistral3Config(
        text_config=dict(model_type="mistral", hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
                         **_specials(tokenizer)),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, head_dim=8, image_size=28, patch_size=14),
    )
    return build_random(lambda: Mistral3Model(cfg), seed=seed, dtype=dtype, device=device)


def qwen25vl_text_encoder(hidden: int, tokenizer, *, seed: int, dtype, device):
    """Qwen-Image's Qwen2_5_VLForConditionalGeneration (last hidden state is ``hidden`` wide)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    specials = _specials(tokenizer)
    vocab = specials["vocab_size"]
    # this attention derives head_dim from hidden / heads: 16-wide heads (the M-RoPE sections split
    # its 8 frequencies over time, height, width), so q/o projections stay hidden x hidden
    cfg = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=hidden, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=hidden // 16, num_key_value_heads=1, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                         **specials),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden),
        # image/video placeholder ids outside the tiny vocabulary: text-only prompts never contain them
        image_token_id=vocab + 1, video_token_id=vocab + 2, vision_start_token_id=vocab + 3,
        vision_end_token_id=vocab + 4,
    )
    return build_random(lambda: Qwen2_5_VLForConditionalGeneration(cfg), seed=seed, dtype=dtype, device=device)


def qwen3_text_encoder(hidden: int, tokenizer, *, seed: int, dtype, device):
    """Z-Image's Qwen3Model (2 layers: the pipeline takes ``hidden_states[-2]``)."""
    from transformers import Qwen3Config, Qwen3Model

    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, **_specials(tokenizer))
    return build_random(lambda: Qwen3Model(cfg), seed=seed, dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------- VAEs


def autoencoder_kl(latent_channels: int, *, seed: int, dtype, device, levels: int = 4,
                   scaling_factor: float = 0.3611, shift_factor: float | None = 0.1159):
    """AutoencoderKL (the Flux VAE layout: no quant convs); ``levels`` 4 = scale factor 8."""
    from diffusers import AutoencoderKL

    return build_random(lambda: AutoencoderKL(
        block_out_channels=(8,) * levels, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, latent_channels=latent_channels, norm_num_groups=4,
        layers_per_block=1, sample_size=64, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False), seed=seed, dtype=dtype, device=device)


def autoencoder_kl_flux2(latent_channels: int, *, seed: int, dtype, device,
                         block_out_channels: Sequence[int] = (8, 8, 8, 8)):
    """ERNIE-Image's AutoencoderKLFlux2; the pipeline's scale factor is 2 ** len(block_out_channels)
    (16 with the production 4 levels: 8x VAE and 2x2 patchified latents)."""
    from diffusers import AutoencoderKLFlux2

    levels = len(block_out_channels)
    return build_random(lambda: AutoencoderKLFlux2(
        block_out_channels=tuple(block_out_channels), down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, latent_channels=latent_channels, norm_num_groups=4,
        layers_per_block=1, sample_size=32), seed=seed, dtype=dtype, device=device)


def wan_style_vae(class_name: str, z_dim: int, *, seed: int, dtype, device):
    """Wan's VAE layout (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``) with few channels."""
    import diffusers

    cls = getattr(diffusers, class_name)
    # dim_mult / temperal_downsample of the released VAEs: 3 spatial downsamplings (scale 8), the
    # last two also temporal (scale 4)
    return build_random(lambda: cls(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                    temperal_downsample=[False, True, True], latents_mean=[0.0] * z_dim,
                                    latents_std=[1.0] * z_dim), seed=seed, dtype=dtype, device=device)


def flow_match_scheduler(**config):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


#: per-component seed offsets, so a pipeline's parts do not share random streams
SEED_TEXT, SEED_TEXT_2, SEED_VAE = 1, 2, 3
