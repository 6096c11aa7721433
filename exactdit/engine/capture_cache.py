"""AOTAutograd's inference graphs kept on disk, keyed by what they are computed from.

A capture is Dynamo's trace of a block (the guards and the Python graph) and AOTAutograd's
lowering of that graph to ATen ops, which runs the graph twice (once for its metadata, once to
trace): Flux.1-dev's warm first call captured in 2.7 s with the lowerings loaded, 3.2-4.2 s
without (H100, BENCHMARKS.md). The lowering is a
function of the Dynamo graph, its inputs' metadata, the grad and autocast state and this torch;
a process that meets a graph an earlier one lowered loads the ATen graph (with its fake-tensor
metadata) from ``$EXACTDIT_CACHE/captures`` and rewrites it as it would have rewritten a fresh
one. Dynamo still traces: its guards decide when a graph runs.

What is stored is what AOTAutograd would compile again, so a hit is exactly a miss, given:

- **the key** (:func:`key_for`) covers the Dynamo graph's code (every op, constant and the
  source line each came from), each input's type, dtype, device, sizes, strides, offset, grad
  flags, view and storage sharing, the grad / inference / deterministic modes, what picks a
  kernel or decomposition while AOTAutograd traces (:func:`_environment`), AOTAutograd's config,
  this torch and Python, and this module's format. Graphs are not stored (counted, with the
  reason) when they call something other than torch's ops and builtins and the Python functions
  of :data:`_PYTHON_FUNCTIONS` (a custom op, a higher-order op, a submodule, ``einsum``), hold
  tensor constants, take symbolic sizes or tensor subclasses, or run under autocast;
- **the wrapper is trivial**: AOTAutograd wraps the compiled graph in code that writes mutated
  inputs back, regenerates outputs that alias inputs, threads effect tokens and RNG state, and
  dedupes inputs. Only graphs that need none of it are stored (:func:`_plain`): no input
  mutated, no output aliasing an input or an intermediate base, one graph input per Dynamo input.
  What remains of the wrapper is that an inference graph runs with grad off, which :func:`runner`
  does.

``EXACTDIT_CAPTURE_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import types

import torch
import torch.fx as fx

from exactdit.engine import kernel_source
from exactdit.state import STATE

logger = logging.getLogger("exactdit")

_pending = threading.local()  # the key of the capture under way, for the inference compiler
_FORMAT = 1  # raise when what is stored, or how AOTAutograd is called (engine/backend.py), changes
_OP_NAMESPACES = ("aten", "prims")
_FUNCTION_MODULES = ("torch", "_operator", "operator", "builtins", "math")
_KEPT_META = ("val", "stack_trace")
#: torch's Python functions Dynamo leaves in its graphs that AOTAutograd may trace again: those
#: whose trace reads nothing but their arguments and what the key holds (LayerNorm's and
#: GroupNorm's cuDNN flag, autocast's default dtypes). Others (einsum reads opt_einsum's settings,
#: interpolate, ...) are not stored.
_PYTHON_FUNCTIONS = frozenset(
    [f"torch.nn.functional.{f}" for f in (
        "layer_norm", "group_norm", "rms_norm", "dropout", "silu", "mish", "relu", "leaky_relu", "elu",
        "hardswish", "hardsigmoid", "softplus", "softmax", "log_softmax", "pad", "normalize", "embedding")]
    + ["torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast"]
)


def _count(what: str, reason: str | None = None) -> None:
    """``STATE.captures``: {"loaded": n, "stored": n, "not stored": {reason: n}}."""
    if reason is None:
        STATE.captures[what] = STATE.captures.get(what, 0) + 1
    else:
        reasons = STATE.captures.setdefault(what, {})
        reasons[reason] = reasons.get(reason, 0) + 1


def lines() -> list[str]:
    """The report's line (none before a capture): graphs loaded and stored, and why the others were not."""
    c = STATE.captures
    if not c:
        return []
    line = f"lowered graphs: {c.get('loaded', 0)} loaded from the disk cache, {c.get('stored', 0)} stored"
    if c.get("not stored"):
        line += "; not stored: " + ", ".join(f"{r} ({n})" for r, n in sorted(c["not stored"].items()))
    return [line]


def enabled() -> bool:
    return os.environ.get("EXACTDIT_CAPTURE_CACHE", "1") != "0"


def cache_dir() -> str:
    return kernel_source.cache_dir("captures")


def key_for(gm: fx.GraphModule, example_inputs) -> str | None:
    """The key of the ATen graph AOTAutograd lowers ``gm`` (a Dynamo graph) to with
    ``example_inputs``; None where that graph is not stored (the reason counted in ``STATE.captures``)."""
    reason = _not_storable(gm) or _not_storable_inputs(example_inputs) or _not_storable_state()
    if reason:
        _count("not stored", reason)
        return None
    parts = [_environment(example_inputs), gm.code, *map(_describe, example_inputs, _storage_indices(example_inputs))]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _not_storable(gm: fx.GraphModule) -> str | None:
    for node in gm.graph.nodes:
        if node.op in ("call_module", "get_attr"):
            return f"the graph has a {node.op} node"
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return f"the graph calls the higher-order op {target.name()}"
        if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            namespace = target.namespace if isinstance(target, torch._ops.OpOverload) else target._qualified_op_name.split("::")[0]
            if namespace not in _OP_NAMESPACES:
                return f"the graph calls the custom op {namespace}::"
            continue
        module = getattr(target, "__module__", None) or ""
        name = f"{module}.{getattr(target, '__name__', target)}"
        if module.split(".")[0] not in _FUNCTION_MODULES:
            return f"the graph calls {name}"
        if isinstance(target, types.FunctionType) and name not in _PYTHON_FUNCTIONS:
            return f"the graph calls {name}"  # (its trace may read state the key does not hold)
    return None


def _not_storable_inputs(example_inputs) -> str | None:
    for a in example_inputs:
        if isinstance(a, torch.Tensor):
            if type(a) not in (torch.Tensor, torch.nn.Parameter):
                return f"an input is a {type(a).__name__}"
        elif isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return "an input is a symbolic size"
        elif type(a) not in (int, float, bool):
            return f"an input is a {type(a).__name__}"
    return None


def _not_storable_state() -> str | None:
    if torch._C._is_any_autocast_enabled():
        return "autocast is on"
    return None


def _environment(example_inputs) -> str:
    """What the lowering reads beside the graph and its inputs: AOTAutograd's config, the modes,
    what picks an op's decomposition or kernel at trace time (scaled_dot_product_attention's
    backend: its flags, priority order, cuDNN and the card; the math path's fp16 / bf16 reduction;
    LayerNorm's cuDNN flag; the default autocast dtypes an ``autocast`` inside a block reads), this
    torch and this module's format."""
    fc = torch._functorch.config
    config = sorted((k, repr(v)) for k, v in fc.get_config_copy().items() if not callable(v))
    cuda = torch.backends.cuda
    sdpa = [_read(f) for f in (cuda.flash_sdp_enabled, cuda.mem_efficient_sdp_enabled, cuda.math_sdp_enabled,
                               getattr(cuda, "cudnn_sdp_enabled", None),
                               getattr(cuda, "fp16_bf16_reduction_math_sdp_allowed", None),
                               getattr(torch._C, "_get_overrideable_sdp_enabled", None),
                               getattr(torch._C, "_get_sdp_priority_order", None))]
    devices = sorted({str(a.device) for a in example_inputs if isinstance(a, torch.Tensor)})
    cards = [(torch.cuda.get_device_name(d), torch.cuda.get_device_capability(d)) for d in devices if d.startswith("cuda")]
    current = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    autocast = [(d, torch.get_autocast_dtype(d)) for d in _read(getattr(torch._C, "_autocast_supported_devices", None)) or ()]
    return repr((
        _FORMAT, torch.__version__, torch.version.git_version, torch.version.cuda, sys.version_info[:2],
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.are_deterministic_algorithms_enabled(),
        torch.get_default_dtype(), torch.get_float32_matmul_precision(), torch.backends.cudnn.enabled,
        torch.backends.cudnn.version(), torch.backends.mkldnn.enabled, sdpa, cards, current, autocast,
        torch.is_autocast_cache_enabled(), torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack(),
        config,
    ))


def _read(getter):
    return None if getter is None else getter()


def _storage_indices(example_inputs) -> list:
    """Per input, the index of the first input sharing its storage (None for non-tensors)."""
    first: dict = {}
    out = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.Tensor):
            ref = (a.device, a.untyped_storage().data_ptr()) if a.device.type != "meta" else ("meta", i)
            out.append(first.setdefault(ref, i))
        else:
            out.append(None)
    return out


def _describe(a, storage_index) -> str:
    if not isinstance(a, torch.Tensor):
        return repr((type(a).__name__, a))
    return repr((
        type(a).__name__, a.dtype, a.device, a.layout, tuple(a.shape), a.stride(), a.storage_offset(),
        a.requires_grad, a.is_leaf, a._is_view(), a.is_inference(), a.is_conj(), a.is_neg(), storage_index,
    ))


def _path(key: str) -> str:
    return os.path.join(cache_dir(), f"aten_{key}.pkl")


def load(key: str) -> fx.GraphModule | None:
    """The ATen graph stored under ``key``, its values fake tensors of the capture's fake mode."""
    try:
        with open(_path(key), "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        from torch.fx._graph_pickler import GraphPickler

        fake_mode = torch._guards.TracingContext.get().fake_mode
        gm = GraphPickler.loads(data, fake_mode)
        gm.recompile()
    except Exception as e:  # noqa: BLE001 - a stale or foreign file: lowered again, and stored over
        _count("not stored", f"loading failed: {type(e).__name__}")
        logger.debug("exactdit: capture %s not loaded: %s", key, e)
        return None
    _count("loaded")
    return gm


def pending(key: str | None, inputs: int = 0) -> None:
    """Mark ``key`` as the capture under way on this thread, of a Dynamo graph with ``inputs``
    inputs (None: nothing to store)."""
    _pending.key = (key, inputs) if key else None


def store_pending(gm: fx.GraphModule) -> None:
    """Store ``gm``, the inference graph AOTAutograd just lowered for the pending key, where its
    wrapper is trivial. Called by the inference compiler before it rewrites ``gm``."""
    pending_key, _pending.key = getattr(_pending, "key", None), None
    if pending_key is None:
        return
    key, inputs = pending_key
    reason = _plain(gm, inputs)
    if reason:
        _count("not stored", reason)
        return
    try:
        from torch.fx._graph_pickler import GraphPickler, Options

        options = Options(ops_filter=None, node_metadata_key_filter=lambda k: k in _KEPT_META)
        data = GraphPickler.dumps(gm, options)
        kernel_source.write_atomically(_path(key), data)
    except Exception as e:  # noqa: BLE001 - not stored: the next process lowers it again
        _count("not stored", f"storing failed: {type(e).__name__}")
        logger.debug("exactdit: capture %s not stored: %s", key, e)
        return
    _count("stored")


def _plain(gm: fx.GraphModule, inputs: int) -> str | None:
    """Why AOTAutograd's wrapper around ``gm`` does more than run it with grad off (None: it does not)."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is None:
        return "AOTAutograd's metadata is not at hand"
    if any(i.mutates_data or i.mutates_metadata or getattr(i, "mutates_storage_metadata", False)
           for i in meta.input_info):
        return "the graph mutates an input"
    if meta.num_outputs_aliased or meta.num_intermediate_bases:
        return "an output aliases an input or an intermediate"
    if meta.tokens or getattr(meta, "is_rng_op_functionalized", False) or meta.grad_enabled_mutation is not None:
        return "the graph threads effect tokens, RNG state or a grad-mode change"
    if any(type(m).__name__ == "SubclassCreationMeta"
           for m in (*meta.subclass_inp_meta, *getattr(meta, "subclass_fw_graph_out_meta", ()))):
        return "an input or output is a tensor subclass"
    placeholders = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    if placeholders != inputs:
        return "AOTAutograd changed the graph's inputs"
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    if len(output.args[0]) != meta.num_outputs:
        return "AOTAutograd changed the graph's outputs"
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            return f"the ATen graph calls the higher-order op {node.target.name()}"
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace not in _OP_NAMESPACES:
            return f"the ATen graph calls {node.target.namespace}::"
    return None


def runner(compiled):
    """What AOTAutograd's wrapper does around ``compiled`` (a boxed inference graph) when
    :func:`_plain` holds: run it with grad off."""

    def run(*args):
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            return compiled(list(args))
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    return run

