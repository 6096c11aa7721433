"""Exact CUDA-graph mode: ``exactdit.patch(pipe, cuda_graphs=True)``.

The transformer's whole forward is recorded once per input signature into a CUDA graph and
replayed on later calls with the same signature, so the host no longer launches several thousand
kernels per step. A replay runs the very kernels the recorded call ran, with the same arguments,
so its bits are the eager forward's: the fused regions were verified (against their ATen nodes)
by the plain call that precedes each recording, and a region the gate has not verified records
its ATen nodes instead (the gate never syncs while a graph is recorded).

Per call: the signature is the tree of arguments (tensor shapes, dtypes, strides, devices; every
other argument by value), grad / inference / autocast mode and the library switches, and the
model's state a graph would freeze (the address of every parameter and buffer, the module tree,
attention processors, every module's plain attributes: :mod:`graph_watch`). A new signature runs
the model normally, then records it (on static buffers with the arguments' values, strides and
alignment); later calls copy their tensors into them, replay, and return clones of the static
outputs (a pipeline with true CFG keeps one output while computing the next).
Graphs of one model share one memory pool: replays are sequential, so one graph's intermediates
are dead when the next runs.

Block runs. Where the whole forward cannot be recorded (it creates or reads host tensors, as
Qwen-Image's and Chroma's do; or diffusers hooks wrap it: caches deciding per step), the forward
runs as Python and each call of a block the engine captured (``engine.EngineCall``: the repeated
blocks and final norms) is recorded by itself, the way torch.compile's CUDA-graph trees graph each
compiled region: per block and block signature, the first call runs normally (verifying), the
next is recorded and replayed, later ones replayed. A block graph's inputs and outputs are scratch
of the model's pool, not kept alive: a replay copies the call's tensors in and returns copies of
the outputs at once (their strides, offsets and views as recorded), so every block graph may
reuse the same memory (the pool holds about one block's activations, not one per block) and
nothing a caller holds is ever overwritten. Blocks under diffusers hooks (the first-block cache,
MagCache) are recorded beneath them: the hooks run as Python around the block's graph. Blocks not
recorded, with the reason: blocks captured in parts (Python at their graph breaks) or running
diffusers' code, blocks with hooks on their layers or torch forward hooks (traced into their
graph, which would freeze their Python), blocks that write into their inputs, blocks whose GGUF
weights are dequantized around their call, arguments that are not tensors or plain values.
Block graphs are kept where they time faster than the forward without them (:mod:`graph_timing`).

Calls run without any graph (counted, with the reason, in ``exactdit.report()``) when a graph could
not be exact or safe: CPU tensors among the arguments, autograd recording, hooks that move weights
(accelerate offloading, diffusers' group offloading and layerwise casting), context parallelism
(collectives in the blocks), peft adapters other than LoRA, global torch forward hooks. peft's LoRA
layers are graphed: what their forward reads as Python (active adapters, scales, merged) is part of
the state a graph is recorded for (:mod:`graph_watch`), so changing it records again.
``exactdit.report()`` says per model what is graphed: ``"whole forward"``, ``"block runs"`` or
``"nothing"``, and why.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.utils._pytree as pytree

from exactdit import gate
from exactdit.device import launch
from exactdit.patches import engine
from exactdit.patches import graph_watch
from exactdit.patches.graph_timing import BlockGraphTimer, cuda_clock
from exactdit.patches.graph_watch import _ModelWatch  # noqa: F401  (tests and benchmarks import it from here)
from exactdit.patches.engine import _first_line

logger = logging.getLogger("exactdit")

_PLAIN_LEAVES = (torch.Tensor, type(None), bool, int, float, str)
#: what a block call's arguments may hold to be recorded: tensors and values compared by value
_KEY_LEAVES = _PLAIN_LEAVES + (complex, torch.dtype, torch.device)

#: graphs kept per model (whole forwards) and per block (block graphs); the oldest is dropped beyond this
MAX_GRAPHS = 8

WHOLE, BLOCKS, NOTHING = "whole forward", "block runs", "nothing"
FIRST_CALL = "first call of an input signature (recorded after it ran)"
FIRST_BLOCK_CALL = "first call of a block signature (recorded at its next call)"
TIMING_CALL = "block runs timed: this call without the block graphs"


class _CudaGraphs:
    """How graphs are recorded and replayed on a CUDA device (tests put a stand-in that runs on
    the CPU in :data:`KIND`)."""

    #: the caching allocator's block alignment: a tensor's address modulo this is its view offset
    align = 512

    def unsupported(self, leaves: list) -> str | None:
        return _unsupported_arguments(leaves)

    def new_pool(self):
        # owned, not a bare handle: a handle's pool dies with its last graph, and once a failed
        # recording or dropped graphs leave it holding memory with no graph, recording into it again
        # trips the allocator's assert (use_count > 0); a MemPool keeps it alive while the model lives
        return torch.cuda.MemPool()

    def capture(self, pool, alloc, run, what: str):
        """``alloc()`` then ``run(alloc's result)`` recorded into a graph of ``pool``: (graph,
        alloc's result, run's result). ``what``: "forward" or "block"."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.id):
            made = alloc()
            out = run(made)
        return graph, made, out

    def failed(self, device) -> None:
        torch.cuda.synchronize(device)

    def clock(self, device):
        """What times forwards on ``device`` (:mod:`graph_timing`)."""
        return cuda_clock(device)

    def reserved(self, device) -> int:
        return torch.cuda.memory_reserved(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def unowned(self, t: torch.Tensor) -> torch.Tensor:
        """A view of ``t``'s memory that does not keep it allocated: the pool may give it to the
        next graph recorded (a block graph's inputs and outputs are scratch, see the module doc)."""
        storage = t.untyped_storage()
        view = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(view, t.storage_offset(), t.shape, t.stride())


#: the graph maker in use
KIND = _CudaGraphs()


@dataclasses.dataclass
class _Recorded:
    graph: object
    static_inputs: list[torch.Tensor]
    static_out: object  # the output tree; its tensors live in the graph's pool
    memory_bytes: int


@dataclasses.dataclass
class _Blocks:
    """A signature whose forward runs as Python with its block calls graphed; ``why`` the whole
    forward is not recorded; ``timer``: whether the block graphs pay (:mod:`graph_timing`)."""

    why: str
    timer: BlockGraphTimer | None = None


@dataclasses.dataclass
class _BlockGraph:
    graph: object
    #: (leaf index, static input without its broadcast dims, whether it has any): each tensor
    #: argument once (a tensor passed twice is copied once)
    copies: list[tuple[int, torch.Tensor, bool]]
    outputs: "_Outputs"  # unowned views of the pool: copied out right after each replay
    memory_bytes: int


class _Outputs:
    """A block graph's outputs, copied out of the pool after each replay as the recorded call
    returned them: each storage's span once (outputs that were views of one tensor stay views of
    one copy), every output with its strides, storage offset and address modulo the alignment, so
    that what follows (eager ATen, the next block's signature) meets the eager call's layouts."""

    def __init__(self, out, align: int):
        leaves, self.spec = pytree.tree_flatten(out)
        self.leaves = list(leaves)
        by_storage: dict[int, list[int]] = {}
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                by_storage.setdefault(x.untyped_storage().data_ptr(), []).append(i)
        self.groups = []  # (unowned byte span, lead bytes, [(leaf index, dtype, offset, shape, stride)])
        for members in by_storage.values():
            tensors = [leaves[i] for i in members]
            spans = [_byte_span(t) for t in tensors]
            start, end = min(a for a, _ in spans), max(b for _, b in spans)
            lead = start % align
            if end == start or any((lead + t.data_ptr() - start) % t.element_size() for t in tensors):
                for i in members:  # empty, or dtypes that cannot share one buffer: plain copies
                    self.groups.append((None, 0, [(i, None, None, None, None)]))
                continue
            base = tensors[0].untyped_storage().data_ptr()
            src = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(
                tensors[0].untyped_storage(), start - base, (end - start,), (1,))
            views = [(i, t.dtype, (lead + t.data_ptr() - start) // t.element_size(), tuple(t.shape), t.stride())
                     for i, t in zip(members, tensors)]
            self.groups.append((src, lead, views))

    def copy(self) -> object:
        leaves = list(self.leaves)
        for src, lead, views in self.groups:
            if src is None:
                i = views[0][0]
                leaves[i] = leaves[i].clone()
                continue
            buf = torch.empty(lead + src.numel(), dtype=torch.uint8, device=src.device)
            buf[lead:].copy_(src)
            storage = buf.untyped_storage()
            for i, dtype, offset, shape, stride in views:
                leaves[i] = torch.empty(0, dtype=dtype, device=src.device).set_(storage, offset, shape, stride)
        return pytree.tree_unflatten(leaves, self.spec)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses [first byte, past the last byte] ``t``'s elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


_SEEN = "seen"  # a block signature that ran normally once (verified): recorded at its next call


class GraphedCall:
    """The transformer's ``_compiled_call_impl`` in CUDA-graph mode (``nn.Module.__call__`` calls
    it instead of ``_call_impl``, as for ``nn.Module.compile``)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.name = f"cuda_graphs.{type(module).__name__}"
        self.blocks_name = f"{self.name}.blocks"
        self.graphs: dict[tuple, _Recorded | _Blocks] = {}  # signature -> recording, or block runs
        #: block call -> {block signature: _BlockGraph, _SEEN, or why it is not recorded}
        self.blocks: dict[engine.EngineCall, dict] = {}
        self.pool = None
        self.watch = _ModelWatch(module)
        self.state = None
        self.described = None
        self.capturing = False

    # --- the call ---------------------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        module = self.module
        leaves, spec = pytree.tree_flatten((args, kwargs))
        state, never, not_whole = self.watch.state()
        never = KIND.unsupported(leaves) or _records_grad(leaves) or never
        if never is not None:  # no graph: its regions need not wait for their kernels either
            self._describe(NOTHING, never)
            gate.count_eager(self.name, never)
            return module._call_impl(*args, **kwargs)
        with gate.waiting_for_kernels():  # a plain call verifies every region, so its recording has them all
            return self._call(leaves, spec, state, not_whole, args, kwargs)

    def _call(self, leaves, spec, state, not_whole, args, kwargs):
        module = self.module
        modes = graph_watch.modes()
        try:
            key = (spec, _leaf_key(leaves, KIND.align), modes, state)
            hash(key)
        except TypeError:
            why = "an argument that is neither a tensor nor hashable"
            self._describe(NOTHING, why)
            gate.count_eager(self.name, why)
            return module._call_impl(*args, **kwargs)
        if state != self.state:  # weights moved, modules or processors changed: old graphs are stale
            self.graphs.clear()
            self.blocks.clear()
            self.state = state
        recorded = self.graphs.get(key)
        if not_whole is not None:  # hooks around the forward: their Python runs, the blocks replay
            return self._run_blocks(modes, not_whole, args, kwargs)
        if isinstance(recorded, _Recorded):
            self._describe(WHOLE, None)
            return self._replay(recorded, leaves)
        if isinstance(recorded, _Blocks):
            return self._run_timed_blocks(modes, recorded, leaves, args, kwargs)
        # a new signature: the plain call verifies every region (and compiles), then it is recorded;
        # its block calls are noted as run (verified), should the whole forward not record
        out = self._with_runner(modes, False, args, kwargs)
        gate.count_eager(self.name, FIRST_CALL)
        self._record(key, leaves, spec)
        recorded = self.graphs.get(key)
        if isinstance(recorded, _Blocks):
            self._describe(BLOCKS, recorded.why)
        elif recorded is not None:
            self._describe(WHOLE, None)
        return out

    def _with_runner(self, modes: tuple, record: bool, args: tuple, kwargs: dict):
        runner = _BlockRunner(self, modes, record)
        previous = getattr(engine.block_calls, "runner", None)
        engine.block_calls.runner = runner
        try:
            return self.module._call_impl(*args, **kwargs)
        finally:
            engine.block_calls.runner = previous

    def _run_blocks(self, modes: tuple, why: str, args: tuple, kwargs: dict):
        self._describe(BLOCKS, why)
        gate.count_eager(self.name, f"block runs: {why}")
        return self._with_runner(modes, True, args, kwargs)

    def _run_timed_blocks(self, modes: tuple, blocks: _Blocks, leaves: list, args: tuple, kwargs: dict):
        """Block runs, or the forward without graphs where :mod:`graph_timing` found them slower."""
        if blocks.timer is None:
            device = next(x.device for x in leaves if isinstance(x, torch.Tensor))
            blocks.timer = BlockGraphTimer(KIND.clock and KIND.clock(device))
        graphed = blocks.timer.graphed()
        with blocks.timer.timing(graphed):
            if graphed:
                return self._run_blocks(modes, blocks.why, args, kwargs)
            why = TIMING_CALL if blocks.timer.choice is None else blocks.timer.why_not()
            if blocks.timer.choice is False:
                self._describe(NOTHING, why)
            gate.count_eager(self.name, why)
            return self.module._call_impl(*args, **kwargs)

    def _describe(self, graphed: str, why: str | None) -> None:
        if self.described != (graphed, why):
            self.described = (graphed, why)
            gate.describe(self.name, graphed=graphed, graphed_why=why)

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
            static_inputs = [_static_like(leaf, KIND.align) if isinstance(leaf, torch.Tensor) else leaf
                             for leaf in leaves]
        except RuntimeError as e:  # a layout whose memory cannot be written element by element
            self.graphs[key] = _Blocks(f"an argument's layout cannot be copied into: {_first_line(e)}")
            return
        device = next(x.device for x in static_inputs if isinstance(x, torch.Tensor))
        if self.pool is None:
            self.pool = KIND.new_pool()
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.pop(next(iter(self.graphs)))
        KIND.empty_cache()  # as recording does: what is reserved afterwards is the graph's
        before = KIND.reserved(device)

        def run(_):
            args, kwargs = pytree.tree_unflatten(static_inputs, spec)
            return module._call_impl(*args, **kwargs)

        try:
            graph, _, static_out = KIND.capture(self.pool, lambda: None, run, "forward")
        except Exception as e:  # noqa: BLE001 - a forward that cannot be recorded still runs
            KIND.failed(device)
            why = f"recording failed: {type(e).__name__}: {_first_line(e)}"
            self.graphs[key] = _Blocks(f"the whole forward cannot be recorded: {why}")
            logger.info("exactdit: %s: the whole forward is not recorded (%s); its blocks are",
                        type(module).__name__, why)
            return
        odd = [type(x).__name__ for x in pytree.tree_leaves(static_out) if not isinstance(x, _PLAIN_LEAVES)]
        if odd:  # a leaf that is not a tensor could alias state the next replay changes
            self.graphs[key] = _Blocks(f"the output holds {odd[0]} (a replay returns only tensors and plain values)")
            return
        tensors = [x for x in static_inputs if isinstance(x, torch.Tensor)]
        self.graphs[key] = _Recorded(graph, tensors, static_out, KIND.reserved(device) - before)
        logger.info("exactdit: recorded a CUDA graph of %s (%d in all, %.0f MiB reserved for this one)",
                    type(module).__name__, len(self.graphs), self.graphs[key].memory_bytes / 2**20)

    # --- block calls (see _BlockRunner) -----------------------------------------------------------

    def _record_block(self, table: dict, key: tuple, leaves: list, spec, run):
        """Record one block call and replay it for this call's values; None when it cannot be
        recorded (``table[key]`` then says why)."""
        tensors = {}  # id -> first leaf index (a tensor passed twice is one static buffer)
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                tensors.setdefault(id(x), i)
        index = sorted(tensors.values())
        device = leaves[index[0]].device
        if self.pool is None:
            self.pool = KIND.new_pool()

        def alloc():
            return {i: _empty_layout(leaves[i], KIND.align) for i in index}

        def call(statics):
            versions = [s._version for s in statics.values()]
            static_leaves = [statics[tensors[id(x)]] if isinstance(x, torch.Tensor) else x for x in leaves]
            it = iter(static_leaves)
            args, kwargs = _rebuild(spec[0], it), _rebuild(spec[1], it)
            out = run(*args, **kwargs)
            return out, versions != [s._version for s in statics.values()]

        KIND.empty_cache()  # as recording does: what is reserved afterwards is the graph's
        before = KIND.reserved(device)
        self.capturing = True
        try:
            graph, statics, (out, wrote) = KIND.capture(self.pool, alloc, call, "block")
        except Exception as e:  # noqa: BLE001 - a block that cannot be recorded still runs
            KIND.failed(device)
            table[key] = f"recording failed: {type(e).__name__}: {_first_line(e)}"
            return None
        finally:
            self.capturing = False
        odd = [type(x).__name__ for x in pytree.tree_leaves(out) if not isinstance(x, _PLAIN_LEAVES)]
        if odd:
            table[key] = f"the output holds {odd[0]} (a replay returns only tensors and plain values)"
            return None
        if wrote:  # the caller's tensors would not see the write
            table[key] = "the block writes into its inputs"
            return None
        copies = [(i, _written(KIND.unowned(statics[i])), _has_broadcast(statics[i])) for i in index]
        outputs = _Outputs(pytree.tree_map(lambda x: KIND.unowned(x) if isinstance(x, torch.Tensor) else x, out),
                           KIND.align)
        recorded = _BlockGraph(graph, copies, outputs, KIND.reserved(device) - before)
        del statics, out  # their memory goes back to the pool: the next block graph's scratch
        table[key] = recorded
        return recorded

    def _replay_block(self, recorded: _BlockGraph, leaves: list) -> object:
        for i, static, broadcast in recorded.copies:
            static.copy_(_written(leaves[i]) if broadcast else leaves[i])
        recorded.graph.replay()
        gate.count_fused(self.blocks_name)
        return recorded.outputs.copy()  # at once: the next block graph may use this memory

    # --- what the report shows --------------------------------------------------------------------

    def summary(self) -> dict:
        recorded = [r for r in self.graphs.values() if isinstance(r, _Recorded)]
        blocks = [r for table in self.blocks.values() for r in table.values() if isinstance(r, _BlockGraph)]
        failed = [r.why for r in self.graphs.values() if isinstance(r, _Blocks)]
        failed += [r for table in self.blocks.values() for r in table.values() if isinstance(r, str) and r != _SEEN]
        return {"graphed": self.described[0] if self.described else NOTHING,
                "why": self.described[1] if self.described else None,
                "graphs": len(recorded), "block_graphs": len(blocks),
                "memory_bytes": sum(r.memory_bytes for r in recorded) + sum(r.memory_bytes for r in blocks),
                "failed": failed}


class _BlockRunner:
    """Takes the engine's block calls during one forward of a graphed model (``engine.block_calls``):
    records or replays each call it may, runs the others through the engine (counted, with the
    reason). ``record``: False in a signature's first call, which only notes the block calls as run."""

    def __init__(self, owner: GraphedCall, modes: tuple, record: bool):
        self.owner, self.modes, self.record = owner, modes, record

    def __call__(self, call, compiled, parts, eager, args, kwargs):
        owner = self.owner
        if owner.capturing or id(call.module) not in owner.watch.module_ids:  # a nested call, another model
            return call.run_engine(compiled, parts, eager, *args, **kwargs)
        inner = compiled is not call.compiled  # beneath the block's diffusers hooks
        leaves = []
        spec = (_walk(args, leaves), _walk(kwargs, leaves))
        why = _engine_status(call) or owner.watch.block_reason(call.module, inner) or KIND.unsupported(leaves) \
            or _records_grad(leaves)
        if why is None:
            if not all(isinstance(x, _KEY_LEAVES) for x in leaves):  # (an object's state would be frozen)
                why = "an argument that is neither a tensor nor a plain value"
            else:
                key = (spec, _leaf_key(leaves, KIND.align), _aliases(leaves), inner, self.modes,
                       owner.watch.block_state(call.module))
        if why is not None:
            if self.record:
                gate.count_eager(owner.blocks_name, why)
            return call.run_engine(compiled, parts, eager, *args, **kwargs)
        table = owner.blocks.get(call)
        if table is None:
            table = owner.blocks[call] = {}
        entry = table.get(key)
        if isinstance(entry, _BlockGraph):
            return owner._replay_block(entry, leaves)
        if entry is None:  # runs normally (the gate verifies its regions), recorded at its next call
            if len(table) >= MAX_GRAPHS:
                table.pop(next(iter(table)))
            table[key] = _SEEN
            entry = FIRST_BLOCK_CALL
        elif entry == _SEEN and self.record:
            def run(*a, **k):
                return call.run_engine(compiled, parts, eager, *a, **k)

            recorded = owner._record_block(table, key, leaves, spec, run)
            if recorded is not None:
                return owner._replay_block(recorded, leaves)
            entry = table[key]
        if self.record:  # (a signature's first call is counted once, for the model)
            gate.count_eager(owner.blocks_name, entry)
        return call.run_engine(compiled, parts, eager, *args, **kwargs)


def _engine_status(call) -> str | None:
    """Why the engine does not run ``call``'s block as one captured graph, or None."""
    state = call.state
    failed = state.failed or (call.failed and call.failed[0])
    if failed:
        return f"the block runs diffusers' code ({failed})"
    in_parts = state.in_parts or (call.in_parts and call.in_parts[0])
    if in_parts:
        return f"the block is captured in parts: Python runs at its graph breaks ({in_parts})"
    return None


def _leaf_key(leaves: list, align: int = 512) -> tuple:
    return tuple(
        ("tensor", x.dtype, tuple(x.shape), x.stride(), x.device, x.requires_grad, x.data_ptr() % align)
        if isinstance(x, torch.Tensor) else x
        for x in leaves
    )


def _aliases(leaves: list) -> tuple:
    """For each tensor leaf, the index of the first leaf that is the same tensor."""
    first: dict = {}
    return tuple(first.setdefault(id(x), i) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))


def _static_like(t: torch.Tensor, align: int = 512) -> torch.Tensor:
    """A buffer with ``t``'s values, shape, strides and address modulo ``align``: the recorded
    forward meets the layout the plain call met (ATen and the gate may choose by layout)."""
    static = _empty_layout(t, align)
    _written(static).copy_(_written(t))
    return static


def _empty_layout(t: torch.Tensor, align: int = 512) -> torch.Tensor:
    """An uninitialised buffer with ``t``'s shape, strides and address modulo ``align``."""
    offset = (t.data_ptr() % align) // t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    base = torch.empty(offset + span, dtype=t.dtype, device=t.device)
    return base.as_strided(t.shape, t.stride(), offset)


def _walk(value, leaves: list):
    """A block call's arguments flattened: appends the leaves to ``leaves`` and returns the
    structure (plain tuples, lists and dicts; anything else is a leaf), hashable and cheap to
    compare (torch's pytree specs cost tens of microseconds per call to build and hash)."""
    kind = type(value)
    if kind is tuple or kind is list:
        return (kind, tuple([_walk(v, leaves) for v in value]))
    if kind is dict:
        return (dict, tuple([(k, _walk(v, leaves)) for k, v in value.items()]))
    leaves.append(value)
    return None


def _rebuild(structure, leaves):
    """The inverse of :func:`_walk`: ``structure`` filled from the iterator ``leaves``."""
    if structure is None:
        return next(leaves)
    kind, items = structure
    if kind is dict:
        return {k: _rebuild(v, leaves) for k, v in items}
    return kind(_rebuild(v, leaves) for v in items)


def _has_broadcast(t: torch.Tensor) -> bool:
    return any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _written(t: torch.Tensor) -> torch.Tensor:
    """``t`` without its broadcast dims (stride 0): each memory location once, so it can be copied
    into; an argument with the same key broadcasts the same dims, so nothing else differs."""
    for d, (n, st) in enumerate(zip(t.shape, t.stride())):
        if st == 0 and n > 1:
            t = t.narrow(d, 0, 1)
    return t


def _records_grad(leaves: list) -> str | None:
    """Why not, when autograd records the call: an argument that requires grad (gradient guidance
    on the latents) would get a replay's detached copies, or a graph's freed autograd state."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves):
        return "autograd is recording (an argument requires grad)"
    return None


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
