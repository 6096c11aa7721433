"""What a CUDA graph recorded from a model freezes, and the hooks it cannot hold: checked on every
call of a graphed model (:mod:`exactdit.patches.cuda_graphs`). A graph replays fixed kernels on
fixed addresses, so moved weights, a changed module tree or processors, train/eval, and hooks that
run Python or move weights between kernels decide whether (and what) may be recorded; the
process-wide settings a recording freezes are :func:`modes`."""

from __future__ import annotations

import enum
import operator

import torch
from torch.nn.modules import module as _nn_module

from exactdit.patches import diffusers_internals


#: bumped whenever any module registers a parameter, buffer or submodule (adapters loaded, layers
#: replaced): the cached views of a watched model are rebuilt then
_registrations = 0


def _registered(*_args):
    global _registrations
    _registrations += 1


#: diffusers hooks that move or cast weights on every call: a graph would read stale addresses
WEIGHT_HOOKS = ("group_offloading", "lazy_prefetch_group_offloading", "layerwise_casting")


class _ModelWatch:
    """What a recorded graph freezes about a model, cheap enough to check on every call: the
    addresses of parameters, buffers and tensor attributes (``.to()``, loading with ``assign``;
    inside tensor subclasses too), the module tree (the global registration counter, and each
    module's attribute and submodule counts: ``delattr`` fires no hook), every module's plain
    attributes (train/eval, ``fused_projections``, a chunk size), attention processors and their
    settings (backend, IP-Adapter scale: :func:`_settings`), and whether hooks that a graph cannot
    hold are set (accelerate offloading, diffusers' caches and context parallelism, torch forward
    hooks, peft adapters other than LoRA). peft's LoRA layers are watched too: what their forward
    reads as Python (:func:`_lora_state`) is part of the state, so ``set_adapters``, fusing,
    disabling or deleting adapters records again; a hot-swap that copies into the tensors a graph
    reads needs no new recording."""

    _hooks_installed = False

    def __init__(self, module: torch.nn.Module):
        if not _ModelWatch._hooks_installed:
            _nn_module.register_module_module_registration_hook(_registered)
            _nn_module.register_module_parameter_registration_hook(_registered)
            _nn_module.register_module_buffer_registration_hook(_registered)
            _ModelWatch._hooks_installed = True
        self.module = module
        self.generation = None
        self.snapshot, self.epoch = None, 0
        self.hooked = False
        self.block_reasons: dict = {}

    def _rebuild(self) -> None:
        modules = list(self.module.modules())
        self.attrs = [m.__dict__ for m in modules]  # not getattr: nn.Module.__getattr__ is slow on a miss
        self.children = [m._modules for m in modules]
        self.sizes = self._sizes()
        # plain attributes a forward reads as Python (train/eval, fused_projections, a chunk size):
        # one C-level itemgetter per module that has any
        self.plain_attrs = [(operator.itemgetter(*keys), d) for d in self.attrs
                            if (keys := [k for k, v in d.items() if _is_plain(v)])]
        self.tensors = [t for m in modules for t in m._parameters.values() if t is not None]
        # tensor subclasses that wrap others (torchao's quantized weights) have no address of their own
        self.wrappers = [t for t in self.tensors if hasattr(t, "__tensor_flatten__")]
        self.plain = [t for t in self.tensors if not hasattr(t, "__tensor_flatten__")]
        # buffers are read where they are at each call: .to() / .float() replace a buffer in its dict
        # (a parameter keeps its object and gets new data), which fires no registration hook; so are
        # tensors kept as plain attributes (a rotary cache)
        self.buffers = [m._buffers for m in modules if m._buffers]
        self.tensor_attrs = [(d, k) for d in self.attrs for k, v in d.items() if isinstance(v, torch.Tensor)]
        self.with_processor = [d for d in self.attrs if "processor" in d]
        self.hook_dicts = [d[k] for d in self.attrs for k in ("_forward_hooks", "_forward_pre_hooks")]
        peft = [m for m in modules if type(m).__module__.startswith("peft.")]
        self.lora = [m.__dict__ for m in peft if _is_lora_layer(m)]
        self.other_adapters = sorted({type(m).__name__ for m in peft if not _is_lora_layer(m)})
        self.module_ids = {id(m) for m in modules}
        self.block_lora: dict[int, list[dict]] = {}  # see block_state
        self.gguf = diffusers_internals.dequantizes_gguf(self.module)  # see block_reason
        self.generation = _registrations

    def state(self) -> tuple[tuple, str | None, str | None]:
        """(the model's state as a small hashable key, why no graph may be recorded or None, why
        the whole forward may not be recorded (its blocks may) or None). The key changes when
        anything a graph froze changed since the previous call."""
        if self.generation != _registrations or self._sizes() != self.sizes:  # a deleted submodule, a new attribute
            self._rebuild()
        # C-level list builds and compares: this runs before every replay
        snapshot = ([t.data_ptr() for t in self.plain], [_addresses(t) for d in self.buffers for t in d.values()],
                    [_addresses(d.get(k)) for d, k in self.tensor_attrs],
                    [_addresses(t) for t in self.wrappers],
                    [get(d) for get, d in self.plain_attrs], [id(d["processor"]) for d in self.with_processor],
                    [_settings(d["processor"]) for d in self.with_processor],
                    diffusers_internals.default_attention_backend(), [_lora_state(d) for d in self.lora])
        if snapshot != self.snapshot:
            self.snapshot, self.epoch = snapshot, self.epoch + 1
        never, not_whole = self._cannot_hold()
        if never is None and torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors):  # (parameters)
            never = "autograd is recording"
        return (self.generation, self.epoch), never, not_whole

    def _sizes(self) -> tuple[list[int], list[int]]:
        """How many attributes and submodules each module has: ``delattr`` fires no registration hook."""
        return list(map(len, self.attrs)), list(map(len, self.children))

    def _cannot_hold(self) -> tuple[str | None, str | None]:
        """(why no graph at all, why no whole-forward graph)."""
        if self.other_adapters:
            return (f"peft layers other than LoRA's ({', '.join(self.other_adapters)}): their Python state "
                    "is not watched"), None
        if getattr(self.module, "_parallel_config", None) is not None:
            return "context parallelism (collectives in the blocks are not recorded)", None
        self.block_reasons = {}
        self.hooked = bool(any(self.hook_dicts) or any(["forward" in d for d in self.attrs]))
        if not (self.hooked or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks):
            return None, None
        if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
            return "global torch forward hooks run Python between kernels", None
        not_whole = None
        for d in self.attrs:
            never, reason = _hook_a_graph_cannot_hold(d)
            if never is not None:
                return never, None
            not_whole = not_whole or reason
        return None, not_whole

    def block_state(self, block: torch.nn.Module) -> tuple:
        """What a graph of one ``block`` call freezes that can change inside the model's forward:
        its LoRA layers' state, which diffusers' ``apply_lora_scale`` scales for the length of a
        forward called with ``attention_kwargs={"scale": s}`` (after :meth:`state` was read)."""
        if not self.lora:
            return ()
        layers = self.block_lora.get(id(block))
        if layers is None:
            layers = self.block_lora[id(block)] = [m.__dict__ for m in block.modules() if _is_lora_layer(m)]
        return tuple([_lora_state(d) for d in layers])

    def block_reason(self, block: torch.nn.Module, inner: bool) -> str | None:
        """Why a call of ``block`` may not be recorded for the hooks on it or its layers (or GGUF
        weights dequantized around it), or None; ``inner``: the call is the block's own forward
        beneath its diffusers hooks (which run as Python around the graph). None at once without
        any hook or GGUF layer in the model."""
        if not (self.hooked or self.gguf):
            return None
        key = (id(block), inner)
        if key not in self.block_reasons:
            self.block_reasons[key] = _block_hooks(block, inner)
        return self.block_reasons[key]


def _addresses(t: torch.Tensor):
    """The addresses of the tensors a wrapper subclass holds (its ``__tensor_flatten__`` names),
    nested: what a graph reads of it (``data_ptr`` of the wrapper itself is 0)."""
    if not isinstance(t, torch.Tensor):
        return None
    if not hasattr(t, "__tensor_flatten__"):
        return t.data_ptr()
    names, _ = t.__tensor_flatten__()
    return tuple(_addresses(getattr(t, name, None)) for name in names)


_PLAIN = (bool, int, float, str, type(None))


def _is_plain(value) -> bool:
    return isinstance(value, _PLAIN + (enum.Enum,))


def _settings(obj) -> tuple:
    """The plain values an object holds (numbers, strings, enums, None, and lists or tuples of
    them): what an attention processor's call reads as Python and a graph would freeze (its
    backend, ``set_attention_backend``; an IP-Adapter's ``scale``, ``set_ip_adapter_scale``)."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in getattr(obj, "__dict__", {}).items()
                 if isinstance(v, _PLAIN) or (isinstance(v, (list, tuple)) and all(isinstance(x, _PLAIN) for x in v)))


def _is_lora_layer(module) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _lora_state(attrs: dict) -> tuple:
    """What a peft LoRA layer's forward reads as Python state (from its ``__dict__``), which a graph
    would freeze: the active adapters, whether adapters are disabled, the merged ones, each
    adapter's scale (a number; a tensor, as hot-swap makes them, by identity: the graph reads its
    memory), variants (DoRA, ...) and the input cast switch."""
    active = attrs.get("_active_adapter")
    scales = tuple((k, v if isinstance(v, (int, float)) else id(v)) for k, v in attrs.get("scaling", {}).items())
    return (active if isinstance(active, str) else tuple(active or ()), attrs.get("_disable_adapters"),
            tuple(attrs.get("merged_adapters", ())), scales, tuple(attrs.get("lora_variant", ())),
            attrs.get("cast_input_dtype_enabled"))


def _hook_a_graph_cannot_hold(attrs: dict) -> tuple[str | None, str | None]:
    """(why no graph at all, why no whole-forward graph) for one module's hooks."""
    if attrs.get("_hf_hook") is not None:
        return "an accelerate hook (offloading) moves weights between calls", None
    hooks = diffusers_internals.hook_names(attrs)
    if hooks:
        moving = [name for name in hooks if name in WEIGHT_HOOKS]
        if moving:
            return f"diffusers hooks ({', '.join(moving)}) move or cast weights between calls", None
        return None, f"diffusers hooks ({', '.join(hooks)}) run Python between kernels"
    if "forward" in attrs:
        return None, "a forward replaced on an instance (a hook) runs Python between kernels"
    if attrs["_forward_hooks"] or attrs["_forward_pre_hooks"]:
        return None, "torch forward hooks run Python between kernels"
    return None, None


GGUF_WEIGHTS = ("its layers' GGUF weights are dequantized around its call (a graph would go on reading the "
                "copies made when it was recorded)")


def _block_hooks(block: torch.nn.Module, inner: bool) -> str | None:
    if diffusers_internals.dequantizes_gguf(block):
        return GGUF_WEIGHTS
    for m in block.modules():
        d = m.__dict__
        if m is block and inner:
            continue  # its hooks run as Python around the graph of its own forward
        where = "the block" if m is block else "its layers"
        hooks = diffusers_internals.hook_names(d)
        if hooks:
            return f"diffusers hooks on {where} ({', '.join(hooks)}) run Python inside its graph"
        if "forward" in d:
            return f"a forward replaced on {where} (a hook) runs Python inside its graph"
        if d["_forward_hooks"] or d["_forward_pre_hooks"]:
            return f"torch forward hooks on {where} run Python inside its graph"
    return None


def modes() -> tuple:
    """The process-wide settings a recording freezes: grad and inference mode, the default dtype
    (tensors a forward creates), autocast, and the switches that pick the library kernels eager
    would run (TF32 through either of PyTorch's two APIs, reduced-precision reductions of cuBLAS
    and of SDPA's math kernel, cuDNN's, SDPA's backends and their priority, deterministic
    algorithms, the BLAS library): a call under other settings is another signature."""
    cuda, cudnn = torch.backends.cuda, torch.backends.cudnn
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
            *map(_setting, _SETTINGS), cuda.matmul.allow_bf16_reduced_precision_reduction,
            cuda.matmul.allow_fp16_reduced_precision_reduction, getattr(cuda.matmul, "allow_fp16_accumulation", None),
            cudnn.enabled, cudnn.benchmark, cudnn.deterministic,
            cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(),
            cuda.cudnn_sdp_enabled(), _setting(cuda.fp16_bf16_reduction_math_sdp_allowed),
            _setting(lambda: tuple(torch._C._get_sdp_priority_order())),
            torch.are_deterministic_algorithms_enabled(), cuda.preferred_blas_library())


#: TF32 settings: the legacy flags and PyTorch's ``fp32_precision`` ones (once a process sets the
#: new ones, reading a legacy flag raises; a version without them reads None)
_SETTINGS = (
    lambda: torch.backends.cuda.matmul.allow_tf32, lambda: torch.backends.cudnn.allow_tf32,
    torch.get_float32_matmul_precision, lambda: torch.backends.fp32_precision,
    lambda: torch.backends.cuda.matmul.fp32_precision, lambda: torch.backends.cudnn.fp32_precision,
    lambda: torch.backends.cudnn.conv.fp32_precision, lambda: torch.backends.cudnn.rnn.fp32_precision,
)


def _setting(read):
    """``read()``, or what stands in for a setting this PyTorch lacks or will not read back."""
    try:
        return read()
    except (AttributeError, RuntimeError) as e:
        return type(e).__name__
