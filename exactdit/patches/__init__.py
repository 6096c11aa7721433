"""Model patches: ``exactdit.patch(obj)`` makes a diffusers pipeline's transformer (or a bare
transformer) compute through exactdit's fused kernels, with exactly the bits diffusers computes;
``exactdit.unpatch(obj)`` restores diffusers' behaviour.

Any transformer with repeated blocks goes through the engine (:mod:`exactdit.patches.engine`):
its blocks are captured once per class and their ATen graphs rewritten. ``cuda_graphs=True``
records the whole transformer forward into CUDA graphs, or where it cannot be recorded its block
calls (:mod:`exactdit.patches.cuda_graphs`).
"""

from __future__ import annotations

import warnings

from exactdit.patches import cuda_graphs as graphs
from exactdit.patches import engine


def _transformer(obj, caller: str = "patch"):
    """The transformer of a pipeline (anything with ``.transformer``), of a torch.compile
    wrapper, or ``obj`` itself."""
    import torch

    model = getattr(obj, "transformer", None)
    model = obj if model is None else model
    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if not isinstance(model, torch.nn.Module):
        if isinstance(getattr(obj, "components", None), dict):  # a diffusers pipeline without a transformer
            raise TypeError(f"exactdit.{caller}: {type(obj).__name__} has no transformer to {caller}"
                            + _what_it_has(obj))
        raise TypeError(
            f"exactdit.{caller}: expected a diffusers pipeline or transformer, got {type(obj).__name__}"
        )
    return model


def _what_it_has(pipe) -> str:
    if "transformer" in pipe.components or hasattr(pipe, "transformer"):
        return " (its transformer is None)"
    import torch

    models = [k for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)]
    if "unet" in models:
        return " (its denoiser is a UNet, pipe.unet; exactdit patches diffusion transformers)"
    return f" (its models: {', '.join(models)})" if models else " (it holds no model)"


def patch(obj, *, cuda_graphs: bool = False) -> dict:
    """Patch ``obj`` (a pipeline or a transformer) in place; idempotent. Returns a summary, e.g.
    ``{"patched": True, "engine": True, "modules": {"FluxTransformerBlock": 19, ...}}``, or
    ``{"patched": False, "reason": ...}`` (with a warning) when nothing can be patched; the
    model then runs diffusers' code.
    ``cuda_graphs=True``: also record the transformer's forward into a CUDA graph per input
    signature and replay it (:mod:`exactdit.patches.cuda_graphs`); ``False`` turns that mode off
    on a model patched with it; ``summary["cuda_graphs"]`` says whether the mode is on."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"exactdit.patch: cuda_graphs must be True or False, got {cuda_graphs!r}")
    model = _transformer(obj)
    summary = engine.patch_transformer(model)
    if not summary["patched"]:
        warnings.warn(f"exactdit.patch: left {type(model).__name__} unpatched: {summary['reason']}", stacklevel=2)
    if cuda_graphs:
        summary["cuda_graphs"] = graphs.enable(model)
        if not summary["cuda_graphs"]:
            warnings.warn(f"exactdit.patch: no CUDA graphs for {type(model).__name__}: its call is already "
                          "redirected (nn.Module.compile)", stacklevel=2)
    else:
        graphs.disable(model)
        summary["cuda_graphs"] = False
    return summary


def unpatch(obj) -> dict:
    """Restore diffusers' behaviour on ``obj`` (a pipeline or a transformer). Returns what was
    restored: ``{"restored": {block class: count}}`` (empty when nothing was patched)."""
    model = _transformer(obj, "unpatch")
    graphs.disable(model)
    return engine.unpatch_transformer(model)


__all__ = ["patch", "unpatch"]
