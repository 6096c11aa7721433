"""Patch diffusers' ERNIE-Image transformer (``ErnieImageTransformer2DModel``) to use exactdit's
fused ops, computing exactly what diffusers computes.

What is replaced, per instance (module structure, parameters and state_dict are untouched):

- ``ErnieImageTransformer2DModel.forward``: diffusers' code, except that the six AdaLN modulation
  tensors are passed to the blocks as ``[1, B, D]`` views of the ``chunk``s instead of ``[S, B, D]``
  expanded ``.contiguous()`` copies, and RoPE ``cos``/``sin`` tables are computed once per
  forward instead of once per layer (both bit-neutral, see below).
- every ``ErnieImageSharedAdaLNBlock.forward``:
  ``rms_norm_modulate`` -> attention -> ``gated_rms_norm_modulate`` -> ``geglu`` between the
  MLP GEMMs -> ``residual_gate_add``.
- every ``ErnieImageSingleStreamAttnProcessor`` (its class is swapped for a subclass, the object
  and its attention-backend settings stay): ``qk_norm_rope`` between the q/k/v GEMMs and attention.
- ``ErnieImageAdaLNContinuous.forward`` (final norm): ``layer_norm_modulate``.

GEMMs (to_q/to_k/to_v/to_out, gate/up/fc2) and attention receive exactly the tensors eager gives
them (same shapes, strides, dtypes): q/k/v projections read the ``[B, S, D]`` permuted view of
the ``[S, B, D]`` activation and the attention output is permuted back, as in diffusers.

Why the removed copies change no bits: every op that reads a modulation tensor is elementwise
(``x * (1 + scale) + shift``, ``residual + gate * update``), so each output element is computed
from the same input values whether the operand is a materialised ``[S, B, D]`` copy or a
``[1, B, D]`` view broadcast through a zero stride; only intermediate layouts could differ, and
each op's output layout is eager's (the fused ops allocate with the reference's strides, and the
residual operand, which fixes the layout of eager's result, is a contiguous ``[S, B, D]`` tensor in
both cases). The RoPE tables are the same ``torch.cos(freqs).to(dtype)`` /
``torch.sin(freqs).to(dtype)`` on the same ``freqs`` that every layer computed.

The patched code runs only when it can reproduce eager; otherwise each site calls diffusers'
original code: with grad enabled (the fused ops have no backward; pipelines run under no_grad),
under autocast, or when norm weights and activations have different dtypes. Such calls show in
``exactdit.report()`` under ``ernie_image.*``. ``patch`` refuses (and changes nothing) when
diffusers' source differs from the version these forwards mirror, or when hooks that the
fused sites would bypass (accelerate / diffusers hooks on the norm modules) are present.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
import types

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers import transformer_ernie_image as ernie
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageAdaLNContinuous,
    ErnieImageSharedAdaLNBlock,
    ErnieImageSingleStreamAttnProcessor,
    ErnieImageTransformer2DModel,
    ErnieImageTransformer2DModelOutput,
)

from exactdit import gate
from exactdit.ops import library as lib

# sha256 (first 16 hex digits) of the diffusers code the patched forwards reproduce (0.42.1).
_MIRRORED_SOURCES = {
    "ErnieImageTransformer2DModel.forward": (ErnieImageTransformer2DModel.forward, "62f39de74f667a51"),
    "ErnieImageSharedAdaLNBlock.forward": (ErnieImageSharedAdaLNBlock.forward, "beabc2a09fc623e9"),
    "ErnieImageSingleStreamAttnProcessor.__call__": (ErnieImageSingleStreamAttnProcessor.__call__, "34d7624cb54fb271"),
    "ErnieImageAdaLNContinuous.forward": (ErnieImageAdaLNContinuous.forward, "222665a2a2bc567f"),
    "ErnieImageFeedForward.forward": (ernie.ErnieImageFeedForward.forward, "a15bb901cc94c664"),
    "RMSNorm.forward": (RMSNorm.forward, "25f4c6d067d464a9"),
}


def _source_hash(fn) -> str:
    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


def source_mismatches() -> list[str]:
    """The mirrored diffusers functions whose source differs from what this patch reproduces."""
    return [name for name, (fn, digest) in _MIRRORED_SOURCES.items() if _source_hash(fn) != digest]


# --- when the patched code must not run ------------------------------------------------------------


def _eager_reason(x: torch.Tensor) -> str | None:
    if torch.is_grad_enabled():
        return "grad enabled (fused ops have no backward)"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast enabled"
    return None


def _dtypes_differ(x: torch.Tensor, *weights) -> bool:
    return any(w is not None and w.dtype != x.dtype for w in weights)


def _count_eager(site: str, reason: str) -> None:
    """Show a call that ran diffusers' code in ``exactdit.report()`` (row ``ernie_image.<site>``)."""
    if not torch.compiler.is_compiling():
        gate.count_eager(f"ernie_image.{site}", reason)


def _original(module):
    """The forward diffusers' code had before patching (bound)."""
    return module.__dict__["_exactdit_original"]["value"]


def _raw_freqs(rope):
    """diffusers' rotary argument (the fp32 angle tensor) from what the patched transformer passes
    along: ``(freqs, cos, sin)``."""
    return rope[0] if isinstance(rope, tuple) else rope


# --- patched forwards ------------------------------------------------------------------------------


def transformer_forward(
    self: ErnieImageTransformer2DModel,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    text_bth: torch.Tensor,
    text_lens: torch.Tensor,
    return_dict: bool = True,
):
    """diffusers' ``ErnieImageTransformer2DModel.forward`` with modulation views and RoPE tables
    computed once (marked ``exactdit:``); everything else is diffusers' code line for line."""
    reason = _eager_reason(hidden_states)
    if reason is not None:
        _count_eager("transformer", reason)
        return _original(self)(hidden_states, timestep, text_bth, text_lens, return_dict)

    device, dtype = hidden_states.device, hidden_states.dtype
    B, C, H, W = hidden_states.shape
    p, Hp, Wp = self.patch_size, H // self.patch_size, W // self.patch_size
    N_img = Hp * Wp

    img_sbh = self.x_embedder(hidden_states).transpose(0, 1).contiguous()
    if self.text_proj is not None and text_bth.numel() > 0:
        text_bth = self.text_proj(text_bth)
    Tmax = text_bth.shape[1]
    text_sbh = text_bth.transpose(0, 1).contiguous()

    x = torch.cat([img_sbh, text_sbh], dim=0)

    text_ids = (
        torch.cat(
            [
                torch.arange(Tmax, device=device, dtype=torch.float32).view(1, Tmax, 1).expand(B, -1, -1),
                torch.zeros((B, Tmax, 2), device=device),
            ],
            dim=-1,
        )
        if Tmax > 0
        else torch.zeros((B, 0, 3), device=device)
    )
    grid_yx = torch.stack(
        torch.meshgrid(
            torch.arange(Hp, device=device, dtype=torch.float32),
            torch.arange(Wp, device=device, dtype=torch.float32),
            indexing="ij",
        ),
        dim=-1,
    ).reshape(-1, 2)
    image_ids = torch.cat(
        [text_lens.float().view(B, 1, 1).expand(-1, N_img, -1), grid_yx.view(1, N_img, 2).expand(B, -1, -1)],
        dim=-1,
    )
    rotary_pos_emb = self.pos_embed(torch.cat([image_ids, text_ids], dim=1))
    # exactdit: cos/sin once per forward (every layer computed the same tables from the same angles)
    rope = (rotary_pos_emb, *lib.rope_tables(rotary_pos_emb, x.dtype))

    valid_text = (
        torch.arange(Tmax, device=device).view(1, Tmax) < text_lens.view(B, 1)
        if Tmax > 0
        else torch.zeros((B, 0), device=device, dtype=torch.bool)
    )
    attention_mask = torch.cat([torch.ones((B, N_img), device=device, dtype=torch.bool), valid_text], dim=1)[
        :, None, None, :
    ]

    sample = self.time_proj(timestep)
    sample = sample.to(dtype=dtype)
    c = self.time_embedding(sample)
    # exactdit: [1, B, D] views instead of [S, B, D] expanded .contiguous() copies (elementwise
    # consumers read the same values through a zero stride)
    temb = [t.unsqueeze(0) for t in self.adaLN_modulation(c).chunk(6, dim=-1)]
    for layer in self.layers:
        x = layer(x, rope, temb, attention_mask)
    x = self.final_norm(x, c).type_as(x)
    patches = self.final_linear(x)[:N_img].transpose(0, 1).contiguous()
    output = (
        patches.view(B, Hp, Wp, p, p, self.out_channels)
        .permute(0, 5, 1, 3, 2, 4)
        .contiguous()
        .view(B, self.out_channels, H, W)
    )

    return ErnieImageTransformer2DModelOutput(sample=output) if return_dict else (output,)


def block_forward(self: ErnieImageSharedAdaLNBlock, x, rotary_pos_emb, temb, attention_mask=None):
    """diffusers' ``ErnieImageSharedAdaLNBlock.forward`` with each elementwise/norm chain fused."""
    sa_ln, mlp_ln, mlp = self.adaLN_sa_ln, self.adaLN_mlp_ln, self.mlp
    reason = _eager_reason(x) or ("norm weight dtype differs from activations" if _dtypes_differ(x, sa_ln.weight, mlp_ln.weight) else None)
    if reason is not None:
        _count_eager("block", reason)
        return _original(self)(x, _raw_freqs(rotary_pos_emb), temb, attention_mask)

    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = temb
    residual = x
    x = lib.rms_norm_modulate(x, sa_ln.weight, sa_ln.eps, scale_msa, shift_msa, upcast=True)
    attn_out = self.self_attention(x.permute(1, 0, 2), attention_mask=attention_mask, image_rotary_emb=rotary_pos_emb)
    x, residual = lib.gated_rms_norm_modulate(
        residual, attn_out.permute(1, 0, 2), gate_msa, mlp_ln.weight, mlp_ln.eps, scale_mlp, shift_mlp, upcast=True
    )
    up = mlp.up_proj(x)  # diffusers evaluates up_proj before gate_proj
    mlp_out = mlp.linear_fc2(lib.geglu(mlp.gate_proj(x), up))
    return lib.residual_gate_add(residual, mlp_out, gate_mlp)


class ExactditErnieImageAttnProcessor(ErnieImageSingleStreamAttnProcessor):
    """diffusers' ``ErnieImageSingleStreamAttnProcessor`` with the per-head QK RMSNorm and RoPE
    fused. Accepts diffusers' fp32 angle tensor or the patched transformer's ``(freqs, cos, sin)``."""

    def __call__(self, attn, hidden_states, attention_mask=None, freqs_cis=None):
        norm_q, norm_k = attn.norm_q, attn.norm_k
        reason = _eager_reason(hidden_states)
        if reason is None and freqs_cis is None:
            reason = "no rotary embedding"
        if reason is None and _dtypes_differ(hidden_states, norm_q.weight, norm_k.weight):
            reason = "qk-norm weight dtype differs from activations"
        if reason is not None:
            _count_eager("attention", reason)
            return super().__call__(attn, hidden_states, attention_mask, _raw_freqs(freqs_cis))

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)

        query = query.unflatten(-1, (attn.heads, -1))
        key = key.unflatten(-1, (attn.heads, -1))
        value = value.unflatten(-1, (attn.heads, -1))

        freqs, cos, sin = freqs_cis if isinstance(freqs_cis, tuple) else (freqs_cis, None, None)
        if cos is None or cos.dtype != query.dtype:
            cos, sin = lib.rope_tables(freqs, query.dtype)
        query, key = lib.qk_norm_rope(query, key, norm_q.weight, norm_k.weight, norm_q.eps, cos, sin)

        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]

        hidden_states = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)
        return attn.to_out[0](hidden_states)


def final_norm_forward(self: ErnieImageAdaLNContinuous, x, conditioning):
    """diffusers' ``ErnieImageAdaLNContinuous.forward``: LayerNorm (no affine) then the native
    ``x * (1 + scale) + shift`` chain, fused."""
    reason = _eager_reason(x)
    if reason is not None:
        _count_eager("final_norm", reason)
        return _original(self)(x, conditioning)
    scale, shift = self.linear(conditioning).chunk(2, dim=-1)
    norm = self.norm
    return lib.layer_norm_modulate(x, norm.eps, scale.unsqueeze(0), shift.unsqueeze(0), norm.weight, norm.bias)


# --- installing and removing -----------------------------------------------------------------------


def _forward_slot(module) -> str:
    """Where a module's forward lives: accelerate's hooks move it to ``_old_forward``."""
    return "_old_forward" if hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__ else "forward"


def _is_patched(module) -> bool:
    return "_exactdit_original" in module.__dict__


def _install(module, fn) -> None:
    if _is_patched(module):
        return
    slot = _forward_slot(module)
    module.__dict__["_exactdit_original"] = {"slot": slot, "value": getattr(module, slot)}
    module.__dict__[slot] = types.MethodType(fn, module)


def _remove(module) -> bool:
    saved = module.__dict__.pop("_exactdit_original", None)
    if saved is None:
        return False
    # the patched method may have moved to _old_forward since (accelerate hook added after patch)
    for slot in ("forward", "_old_forward"):
        current = module.__dict__.get(slot)
        if isinstance(current, types.MethodType) and current.__func__ in _PATCHED_FUNCTIONS:
            value = saved["value"]
            class_forward = isinstance(value, types.MethodType) and value.__func__ is type(module).forward
            if slot == "forward" and class_forward:
                del module.__dict__[slot]  # the class's forward again
            else:
                module.__dict__[slot] = value
    return True


_PATCHED_FUNCTIONS = (transformer_forward, block_forward, final_norm_forward)


def _why_not(model: ErnieImageTransformer2DModel) -> str | None:
    """Why this model cannot be patched exactly, or None."""
    mismatches = source_mismatches()
    if mismatches:
        return f"diffusers source differs from the version this patch mirrors: {', '.join(mismatches)}"
    from diffusers.utils import is_torch_npu_available

    if is_torch_npu_available():
        return "torch_npu present (diffusers' RMSNorm takes its NPU kernel)"
    for i, block in enumerate(model.layers):
        if not isinstance(block, ErnieImageSharedAdaLNBlock):
            return f"layers.{i} is a {type(block).__name__}"
        attn = block.self_attention
        for name, norm in (("adaLN_sa_ln", block.adaLN_sa_ln), ("adaLN_mlp_ln", block.adaLN_mlp_ln)):
            if type(norm) is not RMSNorm or norm.bias is not None:
                return f"layers.{i}.{name} is not a bias-free diffusers RMSNorm"
        if type(attn.norm_q) is not torch.nn.RMSNorm or type(attn.norm_k) is not torch.nn.RMSNorm:
            return f"layers.{i} qk norms are not torch.nn.RMSNorm"
        if attn.norm_q.eps != attn.norm_k.eps or attn.norm_q.normalized_shape != attn.norm_k.normalized_shape:
            return f"layers.{i} norm_q and norm_k differ in eps or shape"
        if type(attn.processor) not in (ErnieImageSingleStreamAttnProcessor, ExactditErnieImageAttnProcessor):
            return f"layers.{i} uses attention processor {type(attn.processor).__name__}"
    final = model.final_norm
    if not isinstance(final, ErnieImageAdaLNContinuous) or type(final.norm) is not torch.nn.LayerNorm:
        return "final_norm is not ErnieImageAdaLNContinuous with a LayerNorm"
    if tuple(final.norm.normalized_shape) != (model.hidden_size,):
        return "final_norm.norm does not normalise over the hidden size"
    # hooks (accelerate, diffusers) on modules whose forward the fused code bypasses would be
    # skipped; diffusers hooks on modules whose forward is replaced would be overwritten
    bypassed = [model.final_norm.norm]
    for block in model.layers:
        attn = block.self_attention
        bypassed += [block.adaLN_sa_ln, block.adaLN_mlp_ln, block.mlp, attn.norm_q, attn.norm_k]
    for module in bypassed + [model, model.final_norm, *model.layers]:
        if getattr(module, "_diffusers_hook", None) is not None:
            return f"a {type(module).__name__} carries a diffusers hook (layerwise casting, group offload, caching?)"
    for module in bypassed:
        if hasattr(module, "_hf_hook"):
            return f"a {type(module).__name__} carries an accelerate hook (sequential CPU offload?)"
    return None


def patch_transformer(model: ErnieImageTransformer2DModel) -> dict:
    """Patch ``model`` in place (idempotent). Returns what was patched, or why nothing was."""
    reason = _why_not(model)
    if reason is not None:
        return {"patched": False, "reason": reason}
    already = _is_patched(model)
    for block in model.layers:
        _install(block, block_forward)
        block.self_attention.processor.__class__ = ExactditErnieImageAttnProcessor
    _install(model.final_norm, final_norm_forward)
    _install(model, transformer_forward)
    n = len(model.layers)
    return {
        "patched": True,
        "already_patched": already,
        "blocks": n,
        "attention_processors": n,
        "final_norm": 1,
        "transformer_forward": 1,
    }


def unpatch_transformer(model: ErnieImageTransformer2DModel) -> dict:
    """Restore diffusers' forwards and processor classes. Returns what was restored."""
    restored = {"blocks": 0, "attention_processors": 0, "final_norm": 0, "transformer_forward": 0}
    for block in model.layers:
        restored["blocks"] += _remove(block)
        processor = getattr(block.self_attention, "processor", None)
        if type(processor) is ExactditErnieImageAttnProcessor:
            processor.__class__ = ErnieImageSingleStreamAttnProcessor
            restored["attention_processors"] += 1
    restored["final_norm"] += _remove(model.final_norm)
    restored["transformer_forward"] += _remove(model)
    return restored
