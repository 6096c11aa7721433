"""ERNIE-Image transformers with random weights and inputs shaped like the pipeline's, for the GPU
equality proof and benchmark (no checkpoint needed).

ErnieImagePipeline maps an image of H x W pixels to latents of [B, 128, H / 16, W / 16] (Flux2 VAE,
scale factor 16, 2x2-patchified to 128 channels; the transformer's patch_size is 1), so 1024x1024
is 64 x 64 = 4096 image tokens, followed by the padded text tokens (CFG batches pad the shorter
prompt; padded text is masked out of attention).
"""

from __future__ import annotations

import hashlib
import math

import torch
from diffusers.models.transformers.transformer_ernie_image import ErnieImageTransformer2DModel
from diffusers.schedulers import FlowMatchEulerDiscreteScheduler

VAE_SCALE = 16
#: CPU only for a smoke run of the scripts (tiny config); the proofs are for the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CONFIGS = {
    # the released 8B model's shape; defaults otherwise (rope axes (32, 48, 48), patch_size 1)
    "full": dict(hidden_size=4096, num_attention_heads=32, num_layers=36, ffn_hidden_size=12288, text_in_dim=3072,
                 in_channels=128, out_channels=128),
    "small": dict(hidden_size=1536, num_attention_heads=12, num_layers=8, ffn_hidden_size=4608, text_in_dim=1024,
                  in_channels=128, out_channels=128),
    "tiny": dict(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=768, text_in_dim=128,
                 in_channels=128, out_channels=128),
}


def build(name: str, device=DEVICE, dtype=torch.bfloat16, seed: int = 0) -> ErnieImageTransformer2DModel:
    """Random weights (diffusers' init), with the zero-initialised AdaLN projection and final linear
    and the all-ones norm weights given random values at scales that keep activations sane."""
    cfg = CONFIGS[name]
    torch.manual_seed(seed)
    with torch.device(device):
        model = ErnieImageTransformer2DModel(**cfg)
    D = cfg["hidden_size"]
    g = torch.Generator(device).manual_seed(seed + 1)
    with torch.no_grad():
        ada = model.adaLN_modulation[-1]
        ada.weight.normal_(0, 0.5 / math.sqrt(D), generator=g)
        ada.bias.normal_(0, 0.1, generator=g)
        model.final_linear.weight.normal_(0, 1 / math.sqrt(D), generator=g)
        model.final_linear.bias.normal_(0, 0.01, generator=g)
        for pname, p in model.named_parameters():
            if pname.endswith(("adaLN_sa_ln.weight", "adaLN_mlp_ln.weight", "norm_q.weight", "norm_k.weight")):
                p.normal_(1, 0.1, generator=g)
    return model.to(dtype).eval()


def inputs(name: str, height: int, width: int, text_lens: list[int], device=DEVICE, dtype=torch.bfloat16, seed=0,
           sigma: float = 0.7) -> dict:
    """Transformer inputs as ErnieImagePipeline builds them for ``len(text_lens)`` images."""
    cfg = CONFIGS[name]
    B = len(text_lens)
    g = torch.Generator(device).manual_seed(seed)
    lens = torch.tensor(text_lens, device=device, dtype=torch.long)
    text = torch.zeros(B, max(text_lens), cfg["text_in_dim"], device=device, dtype=dtype)
    for i, n in enumerate(text_lens):  # _pad_text: zeros after each prompt
        text[i, :n] = torch.randn(n, cfg["text_in_dim"], device=device, generator=g).to(dtype)
    return dict(
        hidden_states=torch.randn(B, cfg["in_channels"], height // VAE_SCALE, width // VAE_SCALE, device=device,
                                  generator=g).to(dtype),
        timestep=torch.full((B,), 1000 * sigma, device=device, dtype=dtype),
        text_bth=text,
        text_lens=lens,
    )


@torch.no_grad()
def forward(model, kw) -> torch.Tensor:
    return model(**kw, return_dict=False)[0]


@torch.no_grad()
def sample(model, name: str, height: int, width: int, steps: int, text_lens=(96, 41), guidance=4.0, seed=0,
           device=DEVICE, dtype=torch.bfloat16) -> torch.Tensor:
    """ErnieImagePipeline's denoising loop (CFG: negative then positive prompt in one batch),
    FlowMatchEulerDiscreteScheduler, one image; returns the final latents."""
    cfg = CONFIGS[name]
    kw = inputs(name, height, width, list(text_lens), device=device, dtype=dtype, seed=seed)
    text_bth, lens = kw["text_bth"], kw["text_lens"]
    g = torch.Generator(device).manual_seed(seed + 7)
    latents = torch.randn(1, cfg["in_channels"], height // VAE_SCALE, width // VAE_SCALE, device=device,
                          generator=g).to(dtype)
    scheduler = FlowMatchEulerDiscreteScheduler()
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    scheduler.set_timesteps(sigmas=sigmas[:-1], device=device)
    for t in scheduler.timesteps:
        latent_model_input = torch.cat([latents, latents], dim=0)
        t_batch = torch.full((2,), t.item(), device=device, dtype=dtype)
        pred = model(hidden_states=latent_model_input, timestep=t_batch, text_bth=text_bth, text_lens=lens,
                     return_dict=False)[0]
        pred_uncond, pred_cond = pred.chunk(2, dim=0)
        pred = pred_uncond + guidance * (pred_cond - pred_uncond)
        latents = scheduler.step(pred, t, latents).prev_sample
    return latents


def md5(t: torch.Tensor) -> str:
    return hashlib.md5(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
