"""A short flow-matching sampling loop driving the bare ERNIE-Image transformer.

It mirrors what ``ErnieImagePipeline.__call__`` does between text encoding and VAE decoding: sigmas
``linspace(1, 0, steps + 1)[:-1]`` fed to diffusers' ``FlowMatchEulerDiscreteScheduler``, classifier-free
guidance by batching [uncond, cond] through one transformer call (text padded to the longest prompt,
``text_lens`` masking the padding), timesteps broadcast in the transformer's dtype, Euler steps.
Text embeddings are synthetic (seeded Gaussian features standing in for the text encoder output).

Also the inputs of a single transformer forward as the pipeline builds them for an image of a given
pixel size (:func:`latent_hw_for`, :func:`forward_inputs`, :func:`forward`), for equality proofs and
benchmarks. Only torch is imported here; diffusers is imported when a scheduler is made.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class SamplingInputs:
    latents: torch.Tensor  # [B, C, H, W] initial noise
    text_bth: torch.Tensor  # [2B or B, T, D] padded text features ([uncond..., cond...] with CFG)
    text_lens: torch.Tensor  # [2B or B]
    guidance_scale: float


@dataclass
class SamplingResult:
    latents: torch.Tensor
    step_times_s: list[float] = field(default_factory=list)
    total_s: float = 0.0


def pad_text(hiddens: list[torch.Tensor], dim: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([h.shape[0] for h in hiddens], dtype=torch.long)
    tmax = int(lens.max()) if len(hiddens) else 0
    out = torch.zeros((len(hiddens), tmax, dim), dtype=dtype)
    for i, h in enumerate(hiddens):
        out[i, : h.shape[0]] = h.to(dtype)
    return out.to(device), lens.to(device)


#: ErnieImagePipeline's pixels per latent cell: Flux2 VAE scale factor 8, then 2x2 patchified latents
#: (128 channels; the transformer's patch_size is 1). 1024x1024 pixels -> a 64x64 latent grid.
PIXELS_PER_LATENT = 16


def latent_hw_for(height: int, width: int) -> tuple[int, int]:
    """The latent grid ``(height // 16, width // 16)`` of an image of ``height`` x ``width`` pixels."""
    if height <= 0 or width <= 0 or height % PIXELS_PER_LATENT or width % PIXELS_PER_LATENT:
        raise ValueError(f"image size {height}x{width} must be positive multiples of {PIXELS_PER_LATENT}")
    return height // PIXELS_PER_LATENT, width // PIXELS_PER_LATENT


def forward_inputs(
    transformer,
    *,
    latent_hw: tuple[int, int],
    text_lens: list[int] | tuple[int, ...],
    seed: int = 0,
    sigma: float = 0.7,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Keyword arguments of one transformer forward on ``len(text_lens)`` images, as the pipeline builds
    them: seeded noise latents ``[B, C, h, w]``, synthetic text features padded with zeros to the longest
    prompt (``text_lens`` masks the padding), timestep ``1000 * sigma`` in the transformer's dtype.
    Generated on CPU, so device-independent."""
    cfg = transformer.config
    dtype = transformer.dtype
    text_lens = [int(n) for n in text_lens]
    if not text_lens or min(text_lens) < 1:
        raise ValueError(f"text_lens must be a non-empty list of positive lengths, got {text_lens}")
    gen = torch.Generator("cpu").manual_seed(int(seed))
    h, w = latent_hw
    b = len(text_lens)
    latents = torch.randn((b, cfg.in_channels, h, w), generator=gen, dtype=torch.float32)
    hiddens = [torch.randn((n, cfg.text_in_dim), generator=gen) for n in text_lens]
    text_bth, lens = pad_text(hiddens, cfg.text_in_dim, device, dtype)
    return dict(
        hidden_states=latents.to(device=device, dtype=dtype),
        timestep=torch.full((b,), 1000.0 * sigma, device=device, dtype=dtype),
        text_bth=text_bth,
        text_lens=lens,
    )


@torch.no_grad()
def forward(transformer, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One transformer forward on :func:`forward_inputs`; returns the prediction tensor."""
    return transformer(**inputs, return_dict=False)[0]


def make_inputs(
    transformer,
    *,
    latent_hw: tuple[int, int],
    text_len: int,
    neg_text_len: int,
    seed: int = 0,
    batch_size: int = 1,
    guidance_scale: float = 4.0,
    device: torch.device | str = "cpu",
) -> SamplingInputs:
    """Seeded noise latents and synthetic text features (generated on CPU, so device-independent)."""
    cfg = transformer.config
    dtype = transformer.dtype
    gen = torch.Generator("cpu").manual_seed(int(seed))
    h, w = latent_hw
    latents = torch.randn((batch_size, cfg.in_channels, h, w), generator=gen, dtype=torch.float32)
    cond = [torch.randn((text_len, cfg.text_in_dim), generator=gen) for _ in range(batch_size)]
    hiddens = cond
    if guidance_scale > 1.0:
        uncond = [torch.randn((neg_text_len, cfg.text_in_dim), generator=gen) for _ in range(batch_size)]
        hiddens = uncond + cond
    text_bth, text_lens = pad_text(hiddens, cfg.text_in_dim, device, dtype)
    return SamplingInputs(latents.to(device=device, dtype=dtype), text_bth, text_lens, float(guidance_scale))


def make_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler()


@torch.no_grad()
def denoise_step(transformer, scheduler, latents, t, inputs: SamplingInputs) -> torch.Tensor:
    cfg_on = inputs.guidance_scale > 1.0
    b = latents.shape[0]
    model_in = torch.cat([latents, latents], dim=0) if cfg_on else latents
    t_batch = torch.full((model_in.shape[0],), t.item(), device=latents.device, dtype=transformer.dtype)
    pred = transformer(
        hidden_states=model_in,
        timestep=t_batch,
        text_bth=inputs.text_bth,
        text_lens=inputs.text_lens,
        return_dict=False,
    )[0]
    if cfg_on:
        pred_uncond, pred_cond = pred.chunk(2, dim=0)
        pred = pred_uncond + inputs.guidance_scale * (pred_cond - pred_uncond)
    assert pred.shape[0] == b
    return scheduler.step(pred, t, latents).prev_sample


@torch.no_grad()
def sample(
    transformer,
    inputs: SamplingInputs,
    steps: int,
    *,
    on_step: Callable[[int, int], None] | None = None,
) -> SamplingResult:
    """Run ``steps`` Euler flow-matching steps from ``inputs.latents``; per-step wall times (synchronised)."""
    if steps < 1:
        raise ValueError("steps must be >= 1")
    device = inputs.latents.device
    scheduler = make_scheduler()
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    scheduler.set_timesteps(sigmas=sigmas[:-1].numpy(), device=device)
    latents = inputs.latents.clone()
    times: list[float] = []
    synchronize(device)
    start = time.perf_counter()
    for i, t in enumerate(scheduler.timesteps):
        t0 = time.perf_counter()
        latents = denoise_step(transformer, scheduler, latents, t, inputs)
        synchronize(device)
        times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(i, steps)
    total = time.perf_counter() - start
    return SamplingResult(latents=latents, step_times_s=times, total_s=total)


@torch.no_grad()
def warmup(transformer, inputs: SamplingInputs, forwards: int = 1) -> None:
    """Run the transformer on the sampling shapes (compiles / autotunes kernels before timing)."""
    if forwards <= 0:
        return
    scheduler = make_scheduler()
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, forwards + 1)[:-1].numpy(), device=inputs.latents.device)
    latents = inputs.latents.clone()
    for t in scheduler.timesteps:
        latents = denoise_step(transformer, scheduler, latents, t, inputs)
    synchronize(inputs.latents.device)
