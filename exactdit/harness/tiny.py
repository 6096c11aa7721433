"""Embedded ERNIE-Image transformer configs and a seeded random-weight builder.

Nothing here downloads anything: the transformer is diffusers' own ``ErnieImageTransformer2DModel``
built from an embedded config, with every parameter filled from a seeded generator. diffusers
zero-initialises ``adaLN_modulation[-1]`` and ``final_linear``; with zero weights there the blocks'
gates and the model output would be identically zero, so those layers are re-initialised like every
other layer and the sampling loop produces non-trivial latents.

Also provides :func:`build_tiny_pipeline` / :func:`save_tiny_pipeline`: a complete, tiny
``ErnieImagePipeline`` (tiny transformer, tiny Flux2 VAE, tiny Mistral3 text encoder and a word-level
tokenizer made in code) for offline tests of ``exactdit generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# Transformer configs. ``latent_hw`` is the (packed) latent grid the demo samples at; ``text_len`` is
# the synthetic prompt length (the negative prompt is shorter, so padding/masking is exercised).
# "full" is the released ERNIE-Image / ERNIE-Image-Turbo transformer shape (about 8B parameters: hidden 4096,
# 32 heads of 128, 36 layers, 3072-d Mistral3 text features) at 1024x1024; "small" keeps the per-head
# shapes (head_dim 128, RoPE axes 32/48/48, 128 latent channels, 3072-d text) with fewer, narrower layers.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "model": dict(
            hidden_size=64,
            num_attention_heads=4,
            num_layers=2,
            ffn_hidden_size=176,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=96,
            rope_theta=256,
            rope_axes_dim=(4, 6, 6),
        ),
        "latent_hw": (16, 16),
        "text_len": 24,
        "neg_text_len": 7,
    },
    # the configuration diffusers' own ERNIE-Image model tests use (tests/models/transformers/
    # test_models_transformer_ernie_image.py): one layer, one 16-wide head, 16x16 latent, 16 text tokens
    "diffusers_test": {
        "model": dict(
            hidden_size=16,
            num_attention_heads=1,
            num_layers=1,
            ffn_hidden_size=16,
            in_channels=16,
            out_channels=16,
            patch_size=1,
            text_in_dim=16,
            rope_theta=256,
            rope_axes_dim=(8, 4, 4),
            eps=1e-6,
            qk_layernorm=True,
        ),
        "latent_hw": (16, 16),
        "text_len": 16,
        "neg_text_len": 5,
    },
    "small": {
        "model": dict(
            hidden_size=1024,
            num_attention_heads=8,
            num_layers=4,
            ffn_hidden_size=3072,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=3072,
            rope_theta=256,
            rope_axes_dim=(32, 48, 48),
        ),
        "latent_hw": (32, 32),
        "text_len": 77,
        "neg_text_len": 9,
    },
    "full": {
        "model": dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_layers=36,
            ffn_hidden_size=12288,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=3072,
            rope_theta=256,
            rope_axes_dim=(32, 48, 48),
        ),
        "latent_hw": (64, 64),
        "text_len": 128,
        "neg_text_len": 12,
    },
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    return str(dtype).replace("torch.", "")


def get_config(name: str) -> dict[str, Any]:
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; choose one of {', '.join(CONFIGS)}") from None


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int, device: torch.device | str) -> None:
    """Fill every parameter of ``model`` (already on ``device``) from a seeded generator.

    Matrices / conv kernels: N(0, 1/fan_in) (keeps activations O(1) through the stack); 1-d weights
    (norm scales): 1 + N(0, 0.02); biases: N(0, 0.02). This re-initialises the layers diffusers leaves
    at zero (``adaLN_modulation[-1]``, ``final_linear``). Values are drawn in float32 one parameter at a
    time, in name order, then rounded to the parameter's dtype, so the result depends only on
    (config, seed, device type, dtype) and the peak memory is the model plus one float32 parameter.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        tmp = torch.empty(p.shape, dtype=torch.float32, device=device)
        if p.dim() >= 2:
            fan_in = math.prod(p.shape[1:])
            tmp.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif name.endswith(".weight"):  # 1-d weights are norm scales
            tmp.normal_(1.0, 0.02, generator=gen)
        else:
            tmp.normal_(0.0, 0.02, generator=gen)
        p.copy_(tmp)
        del tmp


def estimate_bytes(config: str | dict, dtype: torch.dtype) -> int:
    """Parameter memory of a config in ``dtype`` (built on the meta device, nothing allocated)."""
    from diffusers import ErnieImageTransformer2DModel

    model_cfg = get_config(config)["model"] if isinstance(config, str) else dict(config)
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**model_cfg)
    return count_params(model) * torch.empty((), dtype=dtype).element_size()


def build_transformer(
    config: str | dict = "tiny",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
):
    """Build diffusers' ``ErnieImageTransformer2DModel`` with an embedded config and seeded weights."""
    from diffusers import ErnieImageTransformer2DModel

    model_cfg = get_config(config)["model"] if isinstance(config, str) else dict(config)
    with torch.device("meta"):
        model = ErnieImageTransformer2DModel(**model_cfg)
    # nn.Module.to, not ModelMixin.to (which warns about fp32-kept modules; this model has none).
    model = torch.nn.Module.to(model, dtype=dtype).to_empty(device=device)
    init_random_weights(model, seed, device)
    model.eval()
    model.requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------------
# Tiny complete pipeline (tests of `exactdit generate`)
# --------------------------------------------------------------------------------------------------

TINY_WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(ord("a") + i) for i in range(26)] + [
    "a", "cat", "dog", "red", "blue", "photo", "of", "the", "on", "in", "sky", "tree", "house",
]


@dataclass
class TinyPipelineSpec:
    text_hidden: int = 16
    transformer: dict = field(
        default_factory=lambda: dict(
            hidden_size=32,
            num_attention_heads=2,
            num_layers=2,
            ffn_hidden_size=64,
            in_channels=16,  # 4 VAE latent channels x 2x2 patchify
            out_channels=16,
            patch_size=1,
            rope_theta=256,
            rope_axes_dim=(4, 6, 6),
        )
    )


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for w in TINY_WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=64,
    )


def build_tiny_pipeline(seed: int = 0, spec: TinyPipelineSpec | None = None):
    """A complete ``ErnieImagePipeline`` small enough to run in well under a second on CPU."""
    from diffusers import AutoencoderKLFlux2, ErnieImagePipeline, FlowMatchEulerDiscreteScheduler
    from transformers import Mistral3Config, Mistral3Model

    spec = spec or TinyPipelineSpec()
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    te_cfg = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=spec.text_hidden,
            intermediate_size=2 * spec.text_hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=spec.text_hidden // 2,
            max_position_embeddings=128,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            head_dim=8,
            image_size=28,
            patch_size=14,
        ),
    )
    text_encoder = Mistral3Model(te_cfg).eval()
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=4,
        layers_per_block=1,
        sample_size=32,
    ).eval()
    transformer = build_transformer(dict(spec.transformer, text_in_dim=spec.text_hidden), seed=seed)
    return ErnieImagePipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def save_tiny_pipeline(path, seed: int = 0) -> str:
    """Build the tiny pipeline and ``save_pretrained`` it to ``path``; returns the path."""
    pipe = build_tiny_pipeline(seed=seed)
    pipe.save_pretrained(str(path))
    return str(path)
