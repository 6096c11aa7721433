"""Everything exactdit reads or writes of diffusers' private internals, in one place, pinned to the
diffusers versions it was written and tested against (``SUPPORTED``, the range ``pyproject.toml``
admits). A new diffusers release that moves any of these is a change to this module only.

* the hook registry diffusers sets on a module (``module._diffusers_hook``: a ``HookRegistry``
  with ``hooks`` by name and ``_fn_refs``, the chain of forwards; each ref's innermost callable is
  ``original_forward`` when a hook replaced the forward, else ``forward``);
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
    """The refs of the module's diffusers hook chain, outermost first (empty without hooks)."""
    return tuple(getattr(hook_registry(module.__dict__), "_fn_refs", None) or ())


def innermost_attr(ref) -> str:
    """The attribute of a hook-chain ref that holds the callable it wraps."""
    return "original_forward" if getattr(ref, "original_forward", None) is not None else "forward"


def repeated_block_names(model) -> tuple[str, ...]:
    """The block classes ``model``'s class lists for ``compile_repeated_blocks``."""
    return tuple(getattr(model, "_repeated_blocks", None) or ())


def context_parallel_plan(model):
    """``model``'s class's own context-parallel plan, or None."""
    return getattr(model, "_cp_plan", None)
