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


#: a pipeline's transformers (Wan 2.2 A14B's second one runs the low-noise steps)
TRANSFORMERS = ("transformer", "transformer_2")


def _transformers(obj, caller: str = "patch") -> list:
    """The transformers of a pipeline (``transformer`` and ``transformer_2``, those not None), of
    a torch.compile wrapper, or ``obj`` itself."""
    import torch

    found = [m for m in (getattr(obj, name, None) for name in TRANSFORMERS) if m is not None] or [obj]
    found = [getattr(m, "_orig_mod", m) for m in found]  # torch.compile's OptimizedModule
    if not all(isinstance(m, torch.nn.Module) for m in found):
        if isinstance(getattr(obj, "components", None), dict):  # a diffusers pipeline without a transformer
            raise TypeError(f"exactdit.{caller}: {type(obj).__name__} has no transformer to {caller}"
                            + _what_it_has(obj))
        raise TypeError(
            f"exactdit.{caller}: expected a diffusers pipeline or transformer, got {type(obj).__name__}"
        )
    return found


def _what_it_has(pipe) -> str:
    if "transformer" in pipe.components or hasattr(pipe, "transformer"):
        return " (its transformer is None)"
    import torch

    models = [k for k, v in pipe.components.items() if isinstance(v, torch.nn.Module)]
    if "unet" in models:
        return " (its denoiser is a UNet, pipe.unet; exactdit patches diffusion transformers)"
    return f" (its models: {', '.join(models)})" if models else " (it holds no model)"


def patch(obj, *, cuda_graphs: bool = False, dynamic: bool | None = False) -> dict:
    """Patch ``obj`` (a pipeline or a transformer) in place; idempotent. Returns a summary, e.g.
    ``{"patched": True, "engine": True, "modules": {"FluxTransformerBlock": 19, ...}}``, or
    ``{"patched": False, "reason": ...}`` (with a warning) when nothing can be patched; the
    model then runs diffusers' code. A pipeline with two transformers (Wan 2.2's ``transformer``
    and ``transformer_2``) has both patched: the summary counts both, ``summary["models"]`` holds
    each one's.
    ``cuda_graphs=True``: also record the transformer's forward into a CUDA graph per input
    signature and replay it (:mod:`exactdit.patches.cuda_graphs`); ``False`` turns that mode off
    on a model patched with it; ``summary["cuda_graphs"]`` says whether the mode is on.
    ``dynamic``, as torch.compile's: False (default), each new input shape (a new resolution) is
    captured again; True, the blocks are captured with symbolic sizes from the first call and every
    new shape is lowered from that capture without tracing the model's Python again (a slower first
    call, fast new resolutions: for a service that changes sizes); None, the same from a block
    class's second input shape on (that shape pays the symbolic capture). BENCHMARKS.md has the
    H200's seconds for each.
    The bits are the same in all three."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"exactdit.patch: cuda_graphs must be True or False, got {cuda_graphs!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"exactdit.patch: dynamic must be None, True or False, got {dynamic!r}")
    summaries = [_patch_one(model, cuda_graphs, dynamic) for model in _transformers(obj)]
    if len(summaries) == 1:
        return summaries[0]
    modules: dict[str, int] = {}
    for one in summaries:
        for cls, n in one.get("modules", {}).items():
            modules[cls] = modules.get(cls, 0) + n
    return {**summaries[0], "patched": all(one["patched"] for one in summaries), "modules": modules,
            "models": dict(zip(TRANSFORMERS, summaries))}


def _patch_one(model, cuda_graphs: bool, dynamic: bool | None) -> dict:
    summary = engine.patch_transformer(model, dynamic)
    if not summary["patched"]:
        warnings.warn(f"exactdit.patch: left {type(model).__name__} unpatched: {summary['reason']}", stacklevel=3)
    if cuda_graphs:
        summary["cuda_graphs"] = graphs.enable(model)
        if not summary["cuda_graphs"]:
            warnings.warn(f"exactdit.patch: no CUDA graphs for {type(model).__name__}: its call is already "
                          "redirected (nn.Module.compile)", stacklevel=3)
    else:
        graphs.disable(model)
        summary["cuda_graphs"] = False
    return summary


def unpatch(obj) -> dict:
    """Restore diffusers' behaviour on ``obj`` (a pipeline, both its transformers, or a
    transformer). Returns what was restored: ``{"restored": {block class: count}}`` (empty when
    nothing was patched)."""
    restored: dict[str, int] = {}
    for model in _transformers(obj, "unpatch"):
        graphs.disable(model)
        for cls, n in engine.unpatch_transformer(model)["restored"].items():
            restored[cls] = restored.get(cls, 0) + n
    return {"restored": restored}


__all__ = ["patch", "unpatch"]
