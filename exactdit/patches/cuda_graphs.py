"""Exact CUDA-graph mode: ``exactdit.patch(pipe, cuda_graphs=True)``.

The transformer's whole forward is recorded once per input signature into a CUDA graph and
replayed on later calls with the same signature, so the host no longer launches several thousand
kernels per step. A replay runs the very kernels the recorded call ran, with the same arguments,
so its bits are the eager forward's: the fused regions were verified (against their ATen nodes)
by the plain call that precedes each recording, and a region the gate has not verified records
its ATen nodes instead (the gate never syncs while a graph is recorded).

Per call: the signature is the tree of arguments (tensor shapes, dtypes, strides, devices; every
other argument by value), grad / inference / autocast mode, and the model's state a graph would
freeze (the address of every parameter and buffer, the module tree, attention processors,
train/eval). A new signature runs the model normally, then records it (on static buffers with the
arguments' values, strides and alignment); later calls copy their tensors into them, replay, and return
clones of the static outputs (a pipeline with true CFG keeps one output while computing the next).
Graphs of one model share one memory pool: replays are sequential, so one graph's intermediates
are dead when the next runs.

Calls run without a graph (counted, with the reason, in ``exactdit.report()``) when a graph could
not be exact or safe: CPU tensors among the arguments, autograd recording, hooks that move weights
or keep state between calls (accelerate offloading, diffusers' caches, context parallelism),
LoRA adapters (their scales are Python state a graph would freeze), or a recording that failed.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.utils._pytree as pytree
from torch.nn.modules import module as _nn_module

from exactdit import gate
from exactdit.patches import diffusers_internals
from exactdit.patches.engine import _first_line

logger = logging.getLogger("exactdit")

_PLAIN_LEAVES = (torch.Tensor, type(None), bool, int, float, str)

#: graphs kept per model; the oldest is dropped beyond this (each holds static inputs and outputs)
MAX_GRAPHS = 8


@dataclasses.dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    static_inputs: list[torch.Tensor]
    static_out: object  # the output tree; its tensors live in the graph's pool
    memory_bytes: int


class GraphedCall:
    """The transformer's ``_compiled_call_impl`` in CUDA-graph mode (``nn.Module.__call__`` calls
    it instead of ``_call_impl``, as for ``nn.Module.compile``)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.name = f"cuda_graphs.{type(module).__name__}"
        self.graphs: dict[tuple, _Recorded | str] = {}  # signature -> recording, or why it failed
        self.pool = None
        self.watch = _ModelWatch(module)
        self.state = None

    # --- the call ---------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        module = self.module
        leaves, spec = pytree.tree_flatten((args, kwargs))
        state, reason = self.watch.state()
        reason = _unsupported_arguments(leaves) or reason
        if reason is not None:
            gate.count_eager(self.name, reason)
            return module._call_impl(*args, **kwargs)
        try:
            key = (spec, _leaf_key(leaves), _modes(), state)
            hash(key)
        except TypeError:
            gate.count_eager(self.name, "an argument that is neither a tensor nor hashable")
            return module._call_impl(*args, **kwargs)
        if state != self.state:  # weights moved, modules or processors changed: old graphs are stale
            self.graphs.clear()
            self.state = state
        recorded = self.graphs.get(key)
        if isinstance(recorded, _Recorded):
            return self._replay(recorded, leaves)
        if isinstance(recorded, str):
            gate.count_eager(self.name, recorded)
            return module._call_impl(*args, **kwargs)
        # a new signature: the plain call verifies every region (and compiles), then it is recorded
        out = module._call_impl(*args, **kwargs)
        gate.count_eager(self.name, "first call of an input signature (recorded after it ran)")
        self._record(key, leaves, spec)
        return out

    def _replay(self, recorded: _Recorded, leaves: list) -> object:
        for static, leaf in zip(recorded.static_inputs, (x for x in leaves if isinstance(x, torch.Tensor))):
            _written(static).copy_(_written(leaf))
        recorded.graph.replay()
        gate.count_fused(self.name)
        # clones: the next replay rewrites the static outputs (a true-CFG pipeline keeps this one)
        return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, recorded.static_out)

    def _record(self, key: tuple, leaves: list, spec) -> None:
        module = self.module
        try:
            static_inputs = [_static_like(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        except RuntimeError as e:  # a layout whose memory cannot be written element by element
            self.graphs[key] = f"an argument's layout cannot be copied into: {_first_line(e)}"
            return
        args, kwargs = pytree.tree_unflatten(static_inputs, spec)
        device = next(x.device for x in static_inputs if isinstance(x, torch.Tensor))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.empty_cache()  # as recording does: what is reserved afterwards is the graph's
        before = torch.cuda.memory_reserved(device)
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_out = module._call_impl(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a forward that cannot be recorded still runs
            torch.cuda.synchronize(device)
            why = f"recording failed: {type(e).__name__}: {_first_line(e)}"
            self.graphs[key] = why
            logger.warning("exactdit: %s runs without a CUDA graph for this input: %s", type(module).__name__, why)
            return
        odd = [type(x).__name__ for x in pytree.tree_leaves(static_out) if not isinstance(x, _PLAIN_LEAVES)]
        if odd:  # a leaf that is not a tensor could alias state the next replay changes
            self.graphs[key] = f"the output holds {odd[0]} (only tensors and plain values are returned by a replay)"
            return
        tensors = [x for x in static_inputs if isinstance(x, torch.Tensor)]
        self.graphs[key] = _Recorded(graph, tensors, static_out, torch.cuda.memory_reserved(device) - before)
        logger.info("exactdit: recorded a CUDA graph of %s (%d in all, %.0f MiB reserved for this one)",
                    type(module).__name__, len(self.graphs), self.graphs[key].memory_bytes / 2**20)

    # --- what the report shows --------------------------------------------------------------------

    def summary(self) -> dict:
        recorded = [r for r in self.graphs.values() if isinstance(r, _Recorded)]
        return {"graphs": len(recorded), "memory_bytes": sum(r.memory_bytes for r in recorded),
                "failed": [r for r in self.graphs.values() if isinstance(r, str)]}


#: the caching allocator's block alignment: a tensor's address modulo this is its view offset
_ALIGN = 512


def _leaf_key(leaves: list) -> tuple:
    return tuple(
        ("tensor", x.dtype, tuple(x.shape), x.stride(), x.device, x.requires_grad, x.data_ptr() % _ALIGN)
        if isinstance(x, torch.Tensor) else x
        for x in leaves
    )


def _static_like(t: torch.Tensor) -> torch.Tensor:
    """A buffer with ``t``'s values, shape, strides and address modulo ``_ALIGN``: the recorded
    forward meets the layout the plain call met (ATen and the gate may choose by layout)."""
    offset = (t.data_ptr() % _ALIGN) // t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(offset + span, dtype=t.dtype, device=t.device)
    static = base.as_strided(t.shape, t.stride(), offset)
    _written(static).copy_(_written(t))
    return static


def _written(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dims (stride 0): each memory location once, so it can be copied
    into; an argument with the same key broadcasts the same dims, so nothing else differs."""
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        if st == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


def _modes() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def _unsupported_arguments(leaves: list) -> str | None:
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if not tensors:
        return "no tensor arguments"
    if any(t.device.type != "cuda" for t in tensors):
        return "a tensor argument not on a CUDA device"
    if len({t.device for t in tensors}) > 1:
        return "tensor arguments on several devices"
    if torch.cuda.is_current_stream_capturing():
        return "called while a CUDA graph is being recorded"
    return None


#: bumped whenever any module registers a parameter, buffer or submodule (adapters loaded, layers
#: replaced): the cached views of a watched model are rebuilt then
_registrations = 0


def _registered(*_args):
    global _registrations
    _registrations += 1


class _ModelWatch:
    """What a recorded graph freezes about a model, cheap enough to check on every call: parameter
    and buffer addresses (``.to()``, loading with ``assign``), the module tree (through the global
    registration counter), attention processors, train/eval, and whether hooks that a graph
    cannot hold are set (accelerate offloading, diffusers' caches and context parallelism, torch
    forward hooks, LoRA adapters)."""

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

    def _rebuild(self) -> None:
        modules = list(self.module.modules())
        self.attrs = [m.__dict__ for m in modules]  # not getattr: nn.Module.__getattr__ is slow on a miss
        self.tensors = [t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        self.with_processor = [d for d in self.attrs if "processor" in d]
        self.hook_dicts = [d[k] for d in self.attrs for k in ("_forward_hooks", "_forward_pre_hooks")]
        self.adapters = any(type(m).__module__.startswith("peft") for m in modules)
        self.generation = _registrations

    def state(self) -> tuple[tuple, str | None]:
        """(the model's state as a small hashable key, why no graph may be recorded or None). The
        key changes when anything a graph froze changed since the previous call."""
        if self.generation != _registrations:
            self._rebuild()
        # C-level list builds and compares: this runs before every replay
        snapshot = ([t.data_ptr() for t in self.tensors], [d["training"] for d in self.attrs],
                    [id(d["processor"]) for d in self.with_processor])
        if snapshot != self.snapshot:
            self.snapshot, self.epoch = snapshot, self.epoch + 1
        reason = self._cannot_hold()
        if reason is None and torch.is_grad_enabled() and any(t.requires_grad for t in self.tensors):
            reason = "autograd is recording"
        return (self.generation, self.epoch), reason

    def _cannot_hold(self) -> str | None:
        if self.adapters:
            return "LoRA adapters (their scales are Python state a graph would freeze)"
        if not (any(self.hook_dicts) or any(["forward" in d for d in self.attrs])
                or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks):
            return None
        if _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks:
            return "global torch forward hooks run Python between kernels"
        for d in self.attrs:
            reason = _hook_a_graph_cannot_hold(d)
            if reason is not None:
                return reason
        return None


def _hook_a_graph_cannot_hold(attrs: dict) -> str | None:
    if attrs.get("_hf_hook") is not None:
        return "an accelerate hook (offloading) moves weights between calls"
    hooks = diffusers_internals.hook_names(attrs)
    if hooks:
        return f"diffusers hooks ({', '.join(hooks)}) run Python between kernels"
    if "forward" in attrs:
        return "a forward replaced on an instance (a hook) runs Python between kernels"
    if attrs["_forward_hooks"] or attrs["_forward_pre_hooks"]:
        return "torch forward hooks run Python between kernels"
    return None


def enable(module: torch.nn.Module) -> bool:
    """Record ``module``'s forwards into CUDA graphs; False when its call is already redirected
    (``nn.Module.compile``)."""
    current = getattr(module, "_compiled_call_impl", None)
    if isinstance(current, GraphedCall):
        return True
    if current is not None:
        return False
    module._compiled_call_impl = GraphedCall(module)
    return True


def disable(module: torch.nn.Module) -> bool:
    if isinstance(getattr(module, "_compiled_call_impl", None), GraphedCall):
        module._compiled_call_impl = None
        return True
    return False


def graphed(module: torch.nn.Module) -> GraphedCall | None:
    call = getattr(module, "_compiled_call_impl", None)
    return call if isinstance(call, GraphedCall) else None
