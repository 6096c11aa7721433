"""Model patches: ``exactdit.patch(obj)`` swaps the forwards of a diffusers pipeline's transformer
(or a bare transformer) for ones that call exactdit's fused ops and compute exactly what
diffusers computes; ``exactdit.unpatch(obj)`` restores diffusers' forwards.

Supported: ``ErnieImageTransformer2DModel`` (:mod:`exactdit.patches.ernie_image`).
"""

from __future__ import annotations

import warnings


def _transformer(obj):
    """The transformer of a pipeline (anything with ``.transformer``), of a torch.compile
    wrapper, or ``obj`` itself."""
    model = getattr(obj, "transformer", None)
    model = obj if model is None else model
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule


def _patcher(model):
    from diffusers.models.transformers.transformer_ernie_image import ErnieImageTransformer2DModel

    if isinstance(model, ErnieImageTransformer2DModel):
        from exactdit.patches import ernie_image

        return ernie_image
    raise TypeError(
        f"exactdit.patch: no patch for {type(model).__name__} (supported: ErnieImageTransformer2DModel, or a "
        "pipeline whose .transformer is one)"
    )


def patch(obj) -> dict:
    """Patch ``obj`` (a pipeline or a transformer) in place; idempotent. Returns a summary, e.g.
    ``{"patched": True, "blocks": 36, "attention_processors": 36, "final_norm": 1,
    "transformer_forward": 1}``, or ``{"patched": False, "reason": ...}`` (with a warning) when
    the model cannot be patched exactly; then it is left untouched and runs diffusers' code."""
    model = _transformer(obj)
    summary = _patcher(model).patch_transformer(model)
    if not summary["patched"]:
        warnings.warn(f"exactdit.patch: left {type(model).__name__} unpatched: {summary['reason']}", stacklevel=2)
    return summary


def unpatch(obj) -> dict:
    """Restore diffusers' forwards on ``obj`` (a pipeline or a transformer). Returns what was
    restored (zeros when nothing was patched)."""
    model = _transformer(obj)
    return _patcher(model).unpatch_transformer(model)


__all__ = ["patch", "unpatch"]
