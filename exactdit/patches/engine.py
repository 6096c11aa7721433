"""``exactdit.patch`` for any diffusers transformer: its repeated blocks run through the engine.

diffusers lists each transformer's repeated block classes in ``_repeated_blocks`` (what its
own ``compile_repeated_blocks`` compiles); the members of the model's block lists (its
``nn.ModuleList``s of one class: SD3, PixArt, Sana, CogVideoX, Lumina2, ... list none, and
HunyuanVideo's token-replace blocks are not listed) are blocks too, a lone one included (1-layer
configs; :func:`repeated_blocks`). Each such block, and the final-norm modules listed in
:data:`EXTRA_MODULES`, gets a compiled call through the ``exactdit`` backend: Dynamo captures
the block class once (all instances share the graph), the engine rewrites it, and the block
runs the rewritten graph. Parameters, state_dict, hooks and the module tree are untouched: only
``module._compiled_call_impl`` is set (as ``nn.Module.compile`` does), and ``unpatch`` clears it.

A block carrying diffusers hooks (block-level group offloading, the first-block cache, MagCache,
SeaCache) keeps them as they are: its hooks run eagerly around it (their ``torch.compiler.disable``d parameter moves and cache
decisions included) and the block's own forward, innermost in the hook chain, runs the captured
graph (:class:`InnerCall`).

A block that computes shapes from a small integer CPU tensor's values (WanAnimate2's
``grid_sizes.tolist()``), which Dynamo cannot capture whole ("data-dependent expression"), is
handed those values as guarded constants (:class:`IntValues`) and captured whole.

Hooks on a block's layers that only move or cast their weights (layerwise casting's
``module.to``, leaf-level group offloading's onloads and prefetches) run for the whole block
around its call, and GGUF weights (which Dynamo does not unwrap as eager does) are dequantized
there (:class:`exactdit.patches.layer_hooks.hoisted_layer_hooks`), so such blocks are captured whole.

A block that cannot be captured as one graph (a graph break: code Dynamo does not trace, other
hooks on its layers such as TaylorSeer) is captured in parts: Dynamo's graphs
between the breaks go through the engine, the code at the breaks runs as Python; the reason is
warned once and listed in ``exactdit.report()``. Where the parts' shapes follow the data (a mixture
of experts routing by token counts) calls with input shapes a block has run capture again; after
``RECAPTURES_ALLOWED`` of those in a class its blocks run diffusers' code rather than capturing on
every step. A block Dynamo captures nothing of, even in parts, runs diffusers' code, counted with
the reason. When the class's own forward fails, this holds for all its blocks; when hooks set on a
block or its layers make it fail, for that block alone, until its hooks change.

With autograd recording the blocks run diffusers' code as well (the fused kernels have no
backward). By default (``patch(dynamic=False)``) each input shape of a block class is captured with
static sizes. With ``dynamic=True`` each block's first call is captured with its sizes symbolic
(``dynamic=None``: a class's second shape, the sizes that changed), and later shapes are made
from that graph without tracing the block's Python again (:mod:`exactdit.engine.specialize`: the
ATen graph a capture at those sizes gives). ``patch``
lets Dynamo keep ``RECOMPILE_LIMIT`` graphs per block (raising
``torch._dynamo.config.recompile_limit``, a process-wide setting, when it is lower); shapes beyond
that run diffusers' code, counted, while the shapes already captured stay fused (for a block in
parts, Dynamo runs such a part as Python, uncounted). ``patch`` also sets the process-wide
``torch._dynamo.config.skip_nnmodule_hook_guards = False``: a torch hook added to a layer after a
capture then captures again instead of being left out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import sys
import threading
import warnings

import torch

from exactdit import first_calls, gate
from exactdit.device import compile_workers, launch
from exactdit.engine import coverage
from exactdit.engine import capture
from exactdit.patches import diffusers_internals
from exactdit.patches.int_values import values_for_ints
from exactdit.patches import layer_hooks
from exactdit.patches.layer_hooks import hoisted_layer_hooks
from exactdit.state import STATE

logger = logging.getLogger("exactdit")

#: modules compiled besides the repeated blocks, by transformer class name: the final
#: AdaLN norms, one LayerNorm + modulation each
EXTRA_MODULES = {
    "ErnieImageTransformer2DModel": ("ErnieImageAdaLNContinuous",),
    "FluxTransformer2DModel": ("AdaLayerNormContinuous",),
    "ChromaTransformer2DModel": ("ChromaAdaLayerNormContinuousPruned",),
    "QwenImageTransformer2DModel": ("AdaLayerNormContinuous",),
    "WanTransformer3DModel": (),
    "ZImageTransformer2DModel": (),
}


@dataclasses.dataclass
class _ClassState:
    """Shared by every instance of one block class."""

    label: str
    #: why the class's forward cannot be captured as one graph (its blocks run in parts)
    in_parts: str | None = None
    #: one backend object per class: Dynamo reuses a captured graph only for the same backend
    backend: object = None
    failed: str | None = None
    warned: set = dataclasses.field(default_factory=set)
    #: the class's blocks read small integer CPU tensors' values (``.tolist()``) into shapes: calls
    #: pass those values (:class:`IntValues`) instead, Dynamo capturing them as guarded constants
    values_as_constants: bool = False
    graphs: int = 0  # graphs Dynamo captured for this class (whole or in parts), and signatures lowered
    runs: int = 0  # calls of those graphs
    signatures: set = dataclasses.field(default_factory=set)  # sizes and strides of those graphs' tensors
    recaptures: int = 0  # calls of its blocks in parts that captured anew for a signature the block had run

    def counting_backend(self, engine_backend):
        """``engine_backend``, counting the graphs it compiles and their calls (which show whether
        a block run in parts ran any graph at all)."""
        def backend(gm, example_inputs):
            self.graphs += 1
            compiled = engine_backend(gm, example_inputs)
            if hasattr(compiled, "on_new_signature"):  # symbolic: a signature it lowers may count as a graph
                lowered: dict = {}
                compiled.on_new_signature = lambda args, key: self._count_lowering(args, key, lowered)
            else:
                self.signatures.add(_tensor_signature(example_inputs))
            first = [True]

            def run(*args):
                self.runs += 1
                if first:  # the graph's first run: what its phases leave is the first call's "other"
                    first.clear()
                    with first_calls.phase("other", self.label):
                        return compiled(*args)
                return compiled(*args)

            run._boxed_call = getattr(compiled, "_boxed_call", False)
            return run

        self.backend = backend
        return self

    def _count_lowering(self, args, key, lowered: dict) -> None:
        """A symbolic graph lowered signature ``key``: a new graph where no graph of the class had its
        tensors' sizes, or where this graph had lowered those sizes with other values (a count read
        after a graph break). Not where another graph of the class served those sizes (Dynamo's
        newest graph takes the calls older ones served), nor for ``key`` dropped and lowered again.
        ``lowered``: this graph's tensor sizes -> the keys it lowered at them."""
        tensors = _tensor_signature(args)
        keys = lowered.setdefault(tensors, set())
        if tensors not in self.signatures or (keys and key not in keys):
            self.graphs += 1
        self.signatures.add(tensors)
        keys.add(key)


def _tensor_signature(args) -> tuple:
    return tuple((tuple(a.shape), a.stride()) for a in args if isinstance(a, torch.Tensor))


#: block class -> its capture state (kept in the process state: exactdit.state.reset() clears it)
_states: dict[str, _ClassState] = STATE.block_classes

#: Dynamo keeps this many graphs per block (one per input shape) unless the user allows more;
#: ``patch`` raises a lower ``torch._dynamo.config.recompile_limit`` to it (resolution buckets)
RECOMPILE_LIMIT = 64
RECOMPILE_LIMIT_REASON = "Dynamo's recompile limit reached: this new shape runs diffusers' code"
#: calls of a class's blocks run in parts that may capture new graphs for input signatures the
#: block has run (once Dynamo's recompile limit stops it capturing a part, that part runs as Python)
RECAPTURES_ALLOWED = 4
RECAPTURED_REASON = ("not captured: its graph breaks leave shapes that follow the data (captured again "
                     f"for input shapes it had run, more than {RECAPTURES_ALLOWED} times)")
_lock = threading.Lock()
#: ``block_calls.runner``, set by :mod:`exactdit.patches.cuda_graphs` on this thread while a model
#: whose blocks it graphs runs its forward: ``runner(call, compiled, parts, eager, args, kwargs)``
#: then takes every block call (it records or replays it, or calls ``call.run_engine``)
block_calls = threading.local()


class EngineCall:
    """A module's compiled call (set as ``_compiled_call_impl``), falling back to the module's
    own call where the engine cannot run."""

    def __init__(self, module: torch.nn.Module, label: str, dynamic: bool | None = False):
        from exactdit.engine import make_backend

        self.module, self.dynamic = module, dynamic
        #: why this block alone cannot be captured whole / at all, with the hooks it had then (see _run)
        self.in_parts: tuple[str, tuple] | None = None
        self.failed: tuple[str, tuple] | None = None
        self.seen: set = set()  # input signatures this block ran in parts
        #: ``dynamic=True``: this block's first call has its sizes marked symbolic (see run_engine)
        self.unmarked = dynamic is True
        with _lock:
            if label not in _states:
                _states[label] = _ClassState(label).counting_backend(make_backend(label))
            self.state = _states[label]
        self.compiled, self.parts = _compiled(module._call_impl, self.state.backend, dynamic)

    def __call__(self, *args, **kwargs):
        layer_hooks.flush_stale_offloads(self.module)
        if _capture_inside_hooks(self):
            return self.module._call_impl(*args, **kwargs)  # hooks eager, the forward inside them captured
        hoisted = hoisted_layer_hooks(self.module)
        if hoisted.recording:
            return self._recording(self.module._call_impl, *args, **kwargs)
        with hoisted:
            return self._run(self.compiled, self.parts, self.module._call_impl, *args, **kwargs)

    def _recording(self, eager, *args, **kwargs):
        """Diffusers' code, its layers' hooks at each layer: group offloading records their order."""
        layer_hooks.flush_offloads()
        gate.count_eager(f"engine.{self.state.label}", layer_hooks.RECORDING_ORDER)
        return eager(*args, **kwargs)

    def _run(self, compiled, parts, eager, *args, **kwargs):
        runner = getattr(block_calls, "runner", None)
        if runner is not None:  # a CUDA-graphed model's forward: the runner records or replays the call
            return runner(self, compiled, parts, eager, args, kwargs)
        return self.run_engine(compiled, parts, eager, *args, **kwargs)

    def run_engine(self, compiled, parts, eager, *args, **kwargs):
        """``compiled(...)`` (one graph); where Dynamo cannot capture the block whole, ``parts(...)``
        (graphs between graph breaks); where neither can run, ``eager(...)`` (counted, with the reason)."""
        module, state = self.module, self.state
        failed, in_parts = state.failed, state.in_parts
        if self.failed is not None or self.in_parts is not None:  # this block's own, under its hooks then
            if (self.failed or self.in_parts)[1] != _instance_forwards(module):
                self.failed = self.in_parts = None  # its hooks changed since: capture again
            failed = failed or (self.failed and self.failed[0])
            in_parts = in_parts or (self.in_parts and self.in_parts[0])
        if failed is not None:
            gate.count_eager(f"engine.{state.label}", failed)
            return eager(*args, **kwargs)
        if _global_module_hooks():
            gate.count_eager(f"engine.{state.label}", GLOBAL_HOOKS)
            return eager(*args, **kwargs)
        numpy = sys.modules.get("numpy")
        if numpy is not None and any(isinstance(v, numpy.ndarray) for v in (*args, *kwargs.values())):
            gate.count_eager(f"engine.{state.label}", NUMPY_ARGUMENT)  # (eager raises its own error)
            return eager(*args, **kwargs)
        if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
            gate.count_eager(f"engine.{state.label}", "autograd is recording (fused kernels have no backward)")
            return eager(*args, **kwargs)
        if in_parts is not None:
            return self._run_in_parts(parts, eager, *args, **kwargs)
        # every block's first call, not only the class's: blocks of one class meet other layouts in
        # one forward (HunyuanVideo's first single block takes the double blocks' output, the rest a
        # slice), and a layout captured static there is captured again at the next resolution
        marks = _sizes_symbolic((args, kwargs)) if self.unmarked else contextlib.nullcontext()
        self.unmarked = False
        # the retry and the capture in parts under the marks too: each is this block's first capture
        with marks:
            return self._captured_or_parts(compiled, parts, eager, *args, **kwargs)

    def _captured_or_parts(self, compiled, parts, eager, *args, **kwargs):
        state = self.state
        try:
            if state.values_as_constants:
                return compiled(*values_for_ints(args), **values_for_ints(kwargs))
            return compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a block the engine cannot capture whole still runs
            if isinstance(e, torch.OutOfMemoryError):  # this call's, not the block's: eager runs it (or fails)
                gate.count_eager(f"engine.{state.label}", OUT_OF_MEMORY)
                return eager(*args, **kwargs)
            if type(e).__name__ == "FailOnRecompileLimitHit":
                # one more shape than Dynamo keeps graphs for: the shapes already captured stay fused
                self._warn_once(f"exactdit: {state.label}: {RECOMPILE_LIMIT_REASON}; raise "
                                "torch._dynamo.config.recompile_limit to capture more")
                gate.count_eager(f"engine.{state.label}", RECOMPILE_LIMIT_REASON)
                return eager(*args, **kwargs)
            why = f"{type(e).__name__}: {_first_line(e)}"
            call = (args, kwargs)
            if not state.values_as_constants and "data-dependent" in why and values_for_ints(call) is not call:
                try:  # shapes computed from a small integer tensor's values: capture those values as constants
                    out = compiled(*values_for_ints(args), **values_for_ints(kwargs))
                except Exception:  # noqa: BLE001 - not that: the first reason stands
                    pass
                else:
                    state.values_as_constants = True
                    return out
        return self._run_in_parts(parts, eager, *args, first_why=why, **kwargs)

    def _run_in_parts(self, parts, eager, *args, first_why: str | None = None, **kwargs):
        """``parts(...)``; ``first_why``: why the block was just found not to capture whole."""
        state, key = self.state, _signature(args, kwargs)
        graphs, runs = state.graphs, state.runs
        try:
            out = parts(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a block the engine cannot capture still runs
            out = eager(*args, **kwargs)  # eager's own error if the call is wrong (nothing recorded)
            if isinstance(e, torch.OutOfMemoryError):
                gate.count_eager(f"engine.{state.label}", OUT_OF_MEMORY)
                return out
            self._fail(f"not captured: {type(e).__name__}: {_first_line(e)}")
            return out
        if state.runs == runs:  # Dynamo gave up on every part: the call ran as Python
            self._fail(f"not captured: {first_why or 'Dynamo ran none of its graphs'}")
            return out
        if first_why is not None:
            self._mark("in_parts", first_why)
            self._warn_once(f"exactdit: {state.label} is captured in parts (graph breaks): {first_why}")
        elif state.graphs != graphs and key in self.seen:
            # captured again for inputs it has run: a few times for the states of what runs at the
            # breaks (a cache hook computing or predicting); beyond that the parts' shapes follow
            # the data and every step would capture anew (this call's output is the graphs' own)
            state.recaptures += 1
            if state.recaptures > RECAPTURES_ALLOWED:
                self._fail(RECAPTURED_REASON, ran_eager=False)
        self.seen.add(key)
        return out

    def _mark(self, attr: str, why: str) -> None:
        """Record ``why`` as this block's ``attr`` ("in_parts" or "failed"): with forwards set on
        the block or its layers (hooks: offloading, caches) for this block and these hooks only,
        else (the class's own code) for all blocks of the class."""
        hooks = _instance_forwards(self.module)
        if hooks:
            setattr(self, attr, (why, hooks))
        else:
            setattr(self.state, attr, why)
        if attr == "in_parts":
            coverage.note_in_parts(self.state.label, f"(blocks with hooks on their layers) {why}" if hooks else why)

    def _fail(self, why: str, ran_eager: bool = True) -> None:
        """From now on the block runs diffusers' code; ``ran_eager``: this call did too (counted)."""
        self._mark("failed", why)
        self._warn_once(f"exactdit: {self.state.label} runs diffusers' code: {why}")
        if ran_eager:
            gate.count_eager(f"engine.{self.state.label}", why)

    def _warn_once(self, message: str) -> None:
        if message not in self.state.warned:
            self.state.warned.add(message)
            logger.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)


NUMPY_ARGUMENT = "a numpy array among its arguments (Dynamo would convert it to a tensor)"
#: Dynamo guards these by type only: a graph captured without them would run on without them
GLOBAL_HOOKS = "hooks for every module are registered (register_module_forward_hook, ...)"


def _global_module_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


#: a block call that ran out of memory runs eager once; the block stays captured for the next
OUT_OF_MEMORY = "out of memory in the captured call (this call ran diffusers' code)"


def _compiled(fn, backend, dynamic: bool | None) -> tuple:
    """``fn`` compiled as one graph, and in parts (graph breaks allowed). ``dynamic`` (``patch``'s):
    False, each input shape captured static; None, Dynamo's automatic dynamic shapes (a block's
    second input shape captures it with the sizes that changed symbolic, and that graph serves
    every later shape, made concrete per shape by :mod:`exactdit.engine.specialize`); True, the
    same from each block's first call (:func:`_sizes_symbolic`)."""
    return tuple(torch.compile(fn, backend=backend, fullgraph=whole, dynamic=False if dynamic is False else None)
                 for whole in (True, False))


#: what ``maybe_mark_dynamic`` sets on a tensor
_MARKS = ("_dynamo_weak_dynamic_indices", "_has_dynamo_dim_marking")


@contextlib.contextmanager
def _sizes_symbolic(values):
    """Within: Dynamo is asked to capture every size of each plain tensor in ``values`` (nested) as a
    symbol, where the block allows (``maybe_mark_dynamic``: a size the block's code or weights fix,
    such as a feature size, stays a constant; sizes 0 and 1 always do). The marks are the caller's
    tensors' attributes: each tensor's own are put back after (a user's compile must not see them)."""
    saved, seen = [], set()
    for value in torch.utils._pytree.tree_leaves(values):
        if type(value) is torch.Tensor and id(value) not in seen:  # a tensor passed twice: its own marks once
            seen.add(id(value))
            before = {k: value.__dict__[k] for k in _MARKS if k in value.__dict__}
            saved.append((value, before))
            if "_dynamo_weak_dynamic_indices" in before:  # marked by its owner: add to a copy
                value._dynamo_weak_dynamic_indices = set(before["_dynamo_weak_dynamic_indices"])
            for dim in range(value.dim()):
                if value.shape[dim] > 1:
                    torch._dynamo.maybe_mark_dynamic(value, dim)
    try:
        yield
    finally:
        for value, before in saved:
            for k in _MARKS:
                if k in before:
                    setattr(value, k, before[k])
                else:
                    value.__dict__.pop(k, None)


def _signature(args: tuple, kwargs: dict) -> tuple:
    """What Dynamo's guards on a call's inputs mostly see: each tensor's shape, strides, dtype and
    device, other values by type (and value, for numbers, strings and None)."""
    def leaf(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype, v.device)
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return type(v).__name__

    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    return (str(spec),) + tuple(leaf(v) for v in leaves)


def _instance_forwards(module: torch.nn.Module) -> tuple:
    """The forwards set on ``module`` or its submodules (hooks), by name and identity."""
    return tuple((name, id(m.__dict__["forward"])) for name, m in module.named_modules() if "forward" in m.__dict__)


class InnerCall:
    """The innermost callable of a block's diffusers hook chain, the block class's own forward,
    replaced by its captured graph: the hooks (``HookRegistry``: each one's pre_forward, its
    ``new_forward`` if it has one, post_forward) run eagerly around it and call it as they would
    call the forward. Outside an exactdit-patched module (unpatched, or a hook removed) it is the
    forward again."""

    def __init__(self, owner: EngineCall, forward):
        self.owner, self.forward, self.dynamic = owner, forward, owner.dynamic
        self.compiled, self.parts = _compiled(forward, owner.state.backend, owner.dynamic)

    def __call__(self, *args, **kwargs):
        if getattr(self.owner.module, "_compiled_call_impl", None) is not self.owner:
            return self.forward(*args, **kwargs)
        if self.dynamic is not self.owner.dynamic:  # patched again with another ``dynamic``
            self.dynamic = self.owner.dynamic
            self.compiled, self.parts = _compiled(self.forward, self.owner.state.backend, self.dynamic)
        hoisted = hoisted_layer_hooks(self.owner.module, inside_hooks=True)
        if hoisted.recording:
            return self.owner._recording(self.forward, *args, **kwargs)
        with hoisted:  # inside the block's own hooks, as unpatched
            return self.owner._run(self.compiled, self.parts, self.forward, *args, **kwargs)


def _capture_inside_hooks(call: EngineCall) -> bool:
    """Whether ``call.module`` has diffusers hooks whose chain ends in the block class's own
    forward; if so, ``call``'s :class:`InnerCall` is installed there. False when the module has no
    diffusers hooks or its forward was replaced by something else."""
    module = call.module
    if isinstance(module.__dict__.get("forward"), InnerCall):  # its hook was removed since
        module.forward = module.__dict__["forward"].forward  # what diffusers puts back without exactdit
    refs = diffusers_internals.hook_chain(module)
    if "forward" not in module.__dict__ or not refs:
        return False
    first = refs[0]
    attr = diffusers_internals.innermost_attr(first)
    inner = getattr(first, attr, None)
    if isinstance(inner, InnerCall):
        if inner.owner is call:
            return True
        inner = inner.forward  # installed by an earlier patch
    if getattr(inner, "__func__", None) is not type(module).forward or getattr(inner, "__self__", None) is not module:
        return False
    setattr(first, attr, InnerCall(call, inner))
    return True


def _remove_inner_calls(module: torch.nn.Module) -> None:
    """Put the class forward back where an :class:`InnerCall` holds it (the hook chain, or the
    module itself after a hook was removed)."""
    for ref in diffusers_internals.hook_chain(module):
        for attr in diffusers_internals.INNER_ATTRS:
            if isinstance(getattr(ref, attr, None), InnerCall):
                setattr(ref, attr, getattr(ref, attr).forward)
    if isinstance(module.__dict__.get("forward"), InnerCall):
        module.forward = module.__dict__["forward"].forward


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def repeated_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """The block classes the engine patches in ``model``: those its class lists for diffusers'
    ``compile_repeated_blocks`` and the classes of its block lists
    (:func:`exactdit.engine.capture.repeated_blocks`)."""
    return capture.repeated_blocks(model, diffusers_internals.repeated_block_names(model))


def targets(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(class name, module) of every module the engine compiles in ``model``."""
    names = set(repeated_blocks(model)) | set(EXTRA_MODULES.get(type(model).__name__, ()))
    return [(type(m).__name__, m) for m in model.modules() if type(m).__name__ in names]


def why_not(model: torch.nn.Module) -> str | None:
    if not repeated_blocks(model):
        return f"{type(model).__name__} has no repeated blocks (no _repeated_blocks, no list of like modules)"
    return None


def patch_transformer(model: torch.nn.Module, dynamic: bool | None = False) -> dict:
    reason = why_not(model)
    if reason is not None:
        return {"patched": False, "reason": reason}
    counts: dict[str, int] = {}
    model_name = type(model).__name__
    if torch._dynamo.config.recompile_limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    # a hook added to a layer after its block's capture is a guard failure (a capture with it), not
    # a graph that leaves it out; read when a capture builds its guards, so set before any
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    compiled = set()
    for cls, module in targets(model):
        current = getattr(module, "_compiled_call_impl", None)
        if isinstance(current, EngineCall) and current.dynamic is not dynamic:
            current.dynamic, current.unmarked = dynamic, dynamic is True
            current.compiled, current.parts = _compiled(module._call_impl, current.state.backend, dynamic)
        elif not isinstance(current, EngineCall):
            module._compiled_call_impl = EngineCall(module, f"{model_name}.{cls}", dynamic)
            module._compiled_call_impl.previous = current  # (unpatch gives a user's compile back)
            if current is not None:
                compiled.add(cls)
        counts[cls] = counts.get(cls, 0) + 1
    if compiled:
        warnings.warn(f"exactdit.patch: {', '.join(sorted(compiled))} blocks were compiled (compile_repeated_blocks, "
                      "Module.compile): exactdit's engine runs them now; unpatch gives their compile back",
                      stacklevel=3)
    if any(p.is_cuda for p in itertools.islice(model.parameters(), 1)) and launch.supported(torch.device("cuda")):
        compile_workers.start()  # they start up while the first call captures its blocks
    return {"patched": True, "engine": True, "modules": counts}


def unpatch_transformer(model: torch.nn.Module) -> dict:
    layer_hooks.flush_offloads()  # a block's offloads waiting for the next block's onloads
    counts: dict[str, int] = {}
    for cls, module in targets(model):
        call = getattr(module, "_compiled_call_impl", None)
        if isinstance(call, EngineCall):
            module._compiled_call_impl = getattr(call, "previous", None)
            _remove_inner_calls(module)
            counts[cls] = counts.get(cls, 0) + 1
    return {"restored": counts}
