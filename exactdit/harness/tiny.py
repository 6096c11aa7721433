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
# "full" is the architecture diffusers registers by default for ErnieImageTransformer2DModel
# (hidden 3072, 24 heads of 128, 128 latent channels, 2560-d text features) at 1024x1024.
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
    "small": {
        "model": dict(
            hidden_size=1024,
            num_attention_heads=8,
            num_layers=4,
            ffn_hidden_size=2816,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=2560,
            rope_theta=256,
            rope_axes_dim=(32, 48, 48),
        ),
        "latent_hw": (32, 32),
        "text_len": 77,
        "neg_text_len": 9,
    },
    "full": {
        "model": dict(
            hidden_size=3072,
            num_attention_heads=24,
            num_layers=24,
            ffn_hidden_size=8192,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=2560,
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
    """Fill every parameter of ``model`` (already on ``device``, float32) from a seeded generator.

    Matrices / conv kernels: N(0, 1/fan_in) (keeps activations O(1) through the stack); 1-d weights
    (norm scales): 1 + N(0, 0.02); biases: N(0, 0.02). This re-initialises the layers diffusers leaves
    at zero (``adaLN_modulation[-1]``, ``final_linear``). Parameters are filled in name order, so the
    result depends only on (config, seed, device type).
    """
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.dim() >= 2:
            fan_in = math.prod(p.shape[1:])
            p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
        elif name.endswith(".weight"):  # 1-d weights are norm scales
            p.normal_(1.0, 0.02, generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)


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
    model = model.to_empty(device=device)
    init_random_weights(model, seed, device)
    # nn.Module.to: ModelMixin.to warns about fp32-kept modules, which this model has none of.
    model = torch.nn.Module.to(model, dtype=dtype).eval()
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
