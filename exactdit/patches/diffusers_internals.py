"""Everything exactdit reads or writes of diffusers' private internals, in one place, pinned to the
diffusers versions it was written and tested against (``SUPPORTED``, the range ``pyproject.toml``
admits). A new diffusers release that moves any of these is a change to this module only.

* the hook registry diffusers sets on a module (``module._diffusers_hook``: a ``HookRegistry``
  with ``hooks`` by name and ``_fn_refs``, the chain of forwards; each ref's innermost callable is
  ``original_forward`` when a hook replaced the forward, else ``forward``);
* which hooks only move or cast a layer's weights (layerwise casting, group offloading and its
  execution-order tracker), and group offloading's groups, their prefetch chain and side streams
  (:func:`prefetches_in_flight`);
* diffusers' ``GGUFLinear`` layers and whether their forward dequantizes (no GGUF CUDA kernels);
* diffusers' process-wide attention backend (each processor's own is one of its attributes);
* the block classes a transformer lists for ``compile_repeated_blocks`` (``_repeated_blocks``;
  the engine's capture is handed them: :func:`exactdit.patches.engine.repeated_blocks`);
* a transformer class's context-parallel plan (``_cp_plan``).
"""

from __future__ import annotations

#: the diffusers releases these internals were checked against
SUPPORTED = (">=0.42.1", "<0.44")

HOOK_REGISTRY = "_diffusers_hook"
INNER_ATTRS = ("forward", "original_forward")


def hook_registry(module_dict: dict):
    """The module's diffusers ``HookRegistry`` (from its ``__dict__``), or None."""
    return module_dict.get(HOOK_REGISTRY)


def hook_names(module_dict: dict) -> list[str]:
    """The names of the diffusers hooks on a module (from its ``__dict__``), empty when none."""
    registry = hook_registry(module_dict)
    return list(registry.hooks) if registry is not None and registry.hooks else []


def hook_chain(module) -> tuple:
    """The refs of the module's diffusers hook chain, innermost first (the first registered hook,
    whose ref holds the module's own forward; empty without hooks)."""
    return tuple(getattr(hook_registry(module.__dict__), "_fn_refs", None) or ())


TRACKER = "layer_execution_tracker"  # group offloading's recorder of the order layers run in
#: diffusers hooks that only move or cast a layer's weights, or note the order layers run in (by
#: registry name: class name): exactdit runs them for all of a block's layers around its call
HOISTABLE_HOOKS = {"layerwise_casting": "LayerwiseCastingHook", "group_offloading": "GroupOffloadingHook",
                TRACKER: "LayerExecutionTrackerHook"}


def hoistable_hook_chain(module) -> tuple:
    """The module's hook chain (innermost first) when every hook on it is one of
    :data:`HOISTABLE_HOOKS` and the innermost calls the module's own class forward; else empty."""
    d = module.__dict__
    registry, chain = hook_registry(d), hook_chain(module)
    if "forward" not in d or not chain or len(chain) != len(registry.hooks):
        return ()
    if any(type(hook).__name__ != HOISTABLE_HOOKS.get(name) for name, hook in registry.hooks.items()):
        return ()
    inner = chain[0].forward
    if getattr(inner, "__self__", None) is not module or getattr(inner, "__func__", None) is not type(module).forward:
        return ()
    outer = d["forward"]  # diffusers' own wrapper of the outermost hook, nothing (accelerate's) around it
    cells = getattr(getattr(outer, "func", None), "__closure__", None) or ()
    if getattr(outer, "args", None) != (module,) or not any(c.cell_contents is chain[-1] for c in cells):
        return ()
    return chain


def onload_hook(module):
    """The group-offloading hook whose group ``module`` onloads (its ``pre_forward`` moves the
    group's weights in and starts the next group's prefetch), or None."""
    registry = hook_registry(module.__dict__)
    hook = registry.hooks.get("group_offloading") if registry is not None else None
    return hook if hook is not None and hook.group.onload_leader is module else None


def own_offload_hook(module) -> tuple:
    """(hook, ref) of the group-offloading hook by which ``module`` onloads and offloads a group of
    its own, or (). Leaf-level offloading puts the parameters a block holds outside its layers (Wan's
    ``scale_shift_table``) in such a group, moved by a hook on the block around the block's call."""
    hook = onload_hook(module)
    if hook is None or hook.group.offload_leader is not module:
        return ()
    registry = hook_registry(module.__dict__)
    return hook, registry._fn_refs[registry._hook_order.index("group_offloading")]


def records_layer_order(module) -> bool:
    """Whether diffusers' group offloading with streams is recording, on this forward, the order
    the module's layer runs in (its prefetch chain follows that order from the next forward). A
    layer that did not run while the order was recorded (an inactive LoRA adapter's) keeps its
    tracker for good: recording is over once the first layer recorded has lost its own."""
    registry = hook_registry(module.__dict__)
    tracker = registry.hooks.get(TRACKER) if registry is not None else None
    if tracker is None:
        return False
    cells = getattr(getattr(tracker, "execution_order_update_callback", None), "__closure__", None) or ()
    recorders = [c.cell_contents for c in cells if hasattr(c.cell_contents, "execution_order")]
    if not recorders:
        return True  # (another diffusers: run diffusers' code, exact either way)
    order = recorders[0].execution_order
    return not order or TRACKER in hook_names(order[0][1].__dict__)


def in_prefetch_order(layers: list) -> list:
    """``layers`` ([(layer, ...)], in the order of the module tree) reordered so that each layer
    whose group another one prefetches (``next_group``) comes right after it: the order the
    layers ran in when diffusers recorded the chain. Run in tree order, a layer's ``pre_forward``
    can come before its group was prefetched (diffusers then copies it synchronously, and its
    predecessor copies it again). Layers outside the chain keep their place."""
    hooks = [onload_hook(entry[0]) for entry in layers]
    at = {id(h.group): i for i, h in enumerate(hooks) if h is not None}
    after = {i: at[id(h.next_group)] for i, h in enumerate(hooks)
             if h is not None and h.next_group is not None and at.get(id(h.next_group), i) != i}
    if not after:
        return layers
    preceded, order, seen = set(after.values()), [], set()
    for i in range(len(layers)):
        if i in preceded:
            continue  # reached from the layer before it
        while i is not None and i not in seen:
            order.append(i)
            seen.add(i)
            i = after.get(i)
    order += [i for i in range(len(layers)) if i not in seen]  # a cycle (layers that ran twice): tree order
    return [layers[i] for i in order]


def prefetches_in_flight(hooks: list) -> list:
    """The side streams that may still be copying the weights of these group-offloading hooks'
    groups (hooks in the order their ``pre_forward`` ran, none since). Each onload first waits for
    its stream's earlier copies, so only the prefetch the last one started can still run: fine
    when it is a later group's (diffusers overlaps it with compute), not when the prefetch chain,
    recorded while another forward ran the layers one by one, names one of these groups."""
    groups = {id(h.group) for h in hooks}
    return [h.next_group.stream for h in hooks[-1:]
            if h.next_group is not None and id(h.next_group) in groups and h.next_group.stream is not None]


def chain_exits(hooks: list) -> list:
    """The groups the prefetch chain goes on to from these group-offloading hooks' groups (the
    next group of each, where it is not one of theirs) that a side stream copies."""
    groups = {id(h.group) for h in hooks}
    return [h.next_group for h in hooks
            if h.next_group is not None and id(h.next_group) not in groups and h.next_group.stream is not None]


def holds_gguf_weight(module) -> bool:
    """Whether ``module`` is diffusers' ``GGUFLinear`` holding a GGUF-quantized weight."""
    return type(module).__name__ == "GGUFLinear" and hasattr(module._parameters.get("weight"), "quant_type")


def dequantized_gguf_layers(found: list) -> list:
    """Of ``found`` (diffusers' ``GGUFLinear`` layers), those that dequantize their weight in their
    forward (``forward_native``: no GGUF CUDA kernels loaded): exactdit dequantizes those weights
    before the block's call, as each forward would (``dequantize_gguf_tensor``, then the compute
    dtype), and gives them back after. Dynamo does not follow ``GGUFParameter``'s unwrapping
    (``as_tensor``): traced, the subclass spreads to the activations and the block fails."""
    if found:
        import diffusers.quantizers.gguf.utils as gguf_utils

        if getattr(gguf_utils, "ops", None) is not None:  # forward_cuda reads the quantized weight: left as is
            return []
    return found


def dequantizes_gguf(block) -> bool:
    """Whether ``block`` has GGUF layers whose weights exactdit dequantizes around its call
    (:func:`dequantized_gguf_layers`). Decided by the layer class: inside the call the weights are
    already the dequantized copies."""
    return bool(dequantized_gguf_layers([m for m in block.modules() if type(m).__name__ == "GGUFLinear"]))


def default_attention_backend():
    """diffusers' process-wide attention backend (``set_attention_backend`` sets it too), or None
    where this diffusers has no registry."""
    try:
        from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    except ImportError:
        return None
    return getattr(_AttentionBackendRegistry, "_active_backend", None)


def innermost_attr(ref) -> str:
    """The attribute of a hook-chain ref that holds the callable it wraps."""
    return "original_forward" if getattr(ref, "original_forward", None) is not None else "forward"


def repeated_block_names(model) -> tuple[str, ...]:
    """The block classes ``model``'s class lists for ``compile_repeated_blocks``."""
    return tuple(getattr(model, "_repeated_blocks", None) or ())


def context_parallel_plan(model):
    """``model``'s class's own context-parallel plan, or None."""
    return getattr(model, "_cp_plan", None)
