"""Offline builders of diffusers' own DiT transformers and pipelines, one registered spec per model.

Every model is described by a :class:`ModelSpec` (transformer / pipeline class names, embedded
transformer configs "tiny" / "small" / "full" / "diffusers_test", production settings, how to build
tiny offline components and the inputs of one transformer forward), so demos, tests and benchmarks
run any model through the same calls::

    from exactdit.harness import models

    pipe = models.build_pipeline("flux", "tiny", seed=0)
    latents = pipe(prompt="a cat", num_inference_steps=2, height=64, width=64,
                   generator=torch.Generator("cpu").manual_seed(0), output_type="latent").images

    tr = models.build_transformer("flux", "full", dtype=torch.bfloat16, device="cuda")
    kw = models.forward_inputs("flux", tr)          # production shapes: 1024x1024, 512 text tokens
    out = tr(**kw, return_dict=False)[0]

Registered (in order): ernie, flux, flux-schnell, chroma, qwen, zimage, wan, wan-1.3b.
"""

from .core import (CONFIG_NAMES, DTYPES, ComponentRequest, ForwardRequest, ModelSpec, Production, build_pipeline,
                   build_random, build_transformer, dtype_from_name, dtype_name, estimate_bytes, forward_inputs,
                   get_spec, model_names, pipeline_call_kwargs, register, run_forward)

# registration order = priority order
from . import ernie, flux, qwen, zimage, wan  # noqa: E402,F401  isort: skip

__all__ = ["CONFIG_NAMES", "DTYPES", "ComponentRequest", "ForwardRequest", "ModelSpec", "Production", "build_pipeline",
           "build_random", "build_transformer", "dtype_from_name", "dtype_name", "estimate_bytes", "forward_inputs",
           "get_spec", "model_names", "pipeline_call_kwargs", "register", "run_forward"]
