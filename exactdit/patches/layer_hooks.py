"""Layer hooks hoisted to the block, so that a block whose layers carry diffusers hooks that only
move or cast their weights is captured whole.

Diffusers' hooks that move or cast a layer's weights run for every such layer of the block before
the block's call (each ``pre_forward``, outermost first) and after it (each ``post_forward``),
inside the block's own hooks (a block-level onload first, as unpatched; a block a cache skips
moves none of its layers), and the layers run their own forwards in between, so Dynamo captures
the block whole instead of breaking its graph at each layer (``module.to`` and the hooks'
``torch.compiler.disable``d moves cannot be traced). Each layer sees the weights it sees under its
hooks:

* layerwise casting (``enable_layerwise_casting``): the storage -> compute cast is exact and the
  way back gives the stored bits again;
* leaf-level group offloading: the same onloads, prefetches and stream waits, one block's layers
  at a time, in the order of the prefetch chain diffusers recorded on the first forward (the
  order the layers ran in: :func:`diffusers_internals.in_prefetch_order`; while it records, the
  block runs diffusers' code, so that the chain is the unpatched one); a prefetch that could still
  be copying one of the block's own layers is waited for
  (:func:`diffusers_internals.prefetches_in_flight`);
* GGUF weights are dequantized as each layer's forward would
  (:func:`diffusers_internals.dequantized_gguf_layers`).

Offloads wait for the next block's onloads (leaf-level group offloading with streams, without
``record_stream``). Each onload waits on the host for the side stream's earlier copies, and each
offload for the compute stream. Unpatched, that overlaps every layer's compute with the next
layer's copy. Hoisted, a block's compute would overlap only one layer's copy and the copies would
wait for it. So when the prefetch chain goes on from a block's layers into a layer some block
hoisted, the block's ``post_forward``s run after the next block's ``pre_forward``s have queued its
copies, and those copies overlap this block's compute. That holds two blocks' weights on the
device instead of one (:func:`flush_offloads` runs what is still waiting; ``unpatch`` calls it).
A block's own group (the parameters it holds outside its layers, Wan's ``scale_shift_table``),
moved by diffusers' hook on the block itself, is part of the chain: its offload waits with the
layers' (:class:`_OffloadLater`), and a prefetch into it counts as one into a hoisted block.
Offloads waiting for a block that does not come (a cache skipped it, an exception stopped the
forward) run at the next block call, before anything of it is onloaded (:func:`flush_stale_offloads`).

The hoisted hooks cost one block's weights on the device (or in the compute dtype) while the block
runs, instead of one layer's.
"""

from __future__ import annotations

import sys
import threading
import weakref

import torch

from exactdit.patches import diffusers_internals

#: layer -> the block that hoists its hooks (a block's own group: block -> block): a prefetch into
#: one of them starts that block's onloads
_HOISTED: "weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Module]" = weakref.WeakKeyDictionary()
#: .offloads: (the blocks the prefetch chain goes on into, [(layer, hook chain)]): post_forwards that
#: wait for one of those blocks' onloads
_waiting = threading.local()


def hoisted_layers(module: torch.nn.Module) -> tuple[list, list]:
    """((layer, hook chain) of the layers below ``module`` whose diffusers hooks only move or cast
    their weights (:func:`diffusers_internals.hoistable_hook_chain`), in the order of the module
    tree; the GGUF layers dequantized there, :func:`diffusers_internals.dequantized_gguf_layers`).
    One walk of the tree by its ``_modules`` (``modules()`` costs ten times more; this runs on every
    call of every block)."""
    hooked, gguf = [], []
    stack = list(reversed(module._modules.values()))
    while stack:
        m = stack.pop()
        stack.extend(reversed(m._modules.values()))
        if diffusers_internals.hook_registry(m.__dict__) is not None:
            chain = diffusers_internals.hoistable_hook_chain(m)
            if chain:
                hooked.append((m, chain))
        if diffusers_internals.holds_gguf_weight(m):
            gguf.append(m)
    return hooked, diffusers_internals.dequantized_gguf_layers(gguf)


RECORDING_ORDER = ("group offloading with streams records the order its layers run in (this forward only): "
                   "the block runs diffusers' code")


def _post_forwards(layers: list) -> None:
    for layer, chain in layers:
        for ref in chain:  # innermost first
            ref.post_forward(layer, None)


def flush_offloads() -> None:
    """Run the ``post_forward``s still waiting for the next block's onloads (this thread's)."""
    waiting = getattr(_waiting, "offloads", None)
    if waiting:
        _waiting.offloads = None
        _post_forwards(waiting[1])


def flush_stale_offloads(block: torch.nn.Module) -> None:
    """Before anything of ``block`` is onloaded (its own hooks included): run the offloads still
    waiting unless the prefetch chain goes on from them into ``block``. Those were left by a forward
    that stopped before the block they wait for (a cache skipped the blocks after, an exception);
    run later, they would offload weights this forward has onloaded."""
    waiting = getattr(_waiting, "offloads", None)
    if waiting and block not in waiting[0]:
        flush_offloads()


class _OffloadLater:
    """A block's own group-offloading ``post_forward`` (:func:`diffusers_internals.own_offload_hook`)
    taken out of diffusers' hook chain for one call: the hook's wrapper, right after the block's
    call, finds a stand-in that only puts the hook back, and the offload runs with the block's
    layers' (:func:`_post_forwards`, once the next block's onloads are queued)."""

    def __init__(self, ref):
        earlier = getattr(ref.post_forward, "__self__", None)
        if isinstance(earlier, _OffloadLater):  # (left by a call another thread made: its hook goes back)
            earlier._restore()
        self.ref, self.offload = ref, ref.post_forward
        ref.post_forward = self._skip

    def _skip(self, module, output):
        self._restore()
        return output

    def _restore(self) -> None:
        if self.ref.post_forward == self._skip:
            self.ref.post_forward = self.offload

    def post_forward(self, module, output):
        self._restore()
        return self.offload(module, output)


class hoisted_layer_hooks:
    """The hooks of ``module``'s layers run around its call (the module doc)."""

    def __init__(self, module: torch.nn.Module, inside_hooks: bool = False):
        layers, self.gguf = hoisted_layers(module)
        self.layers = diffusers_internals.in_prefetch_order(layers)
        self.module = module
        #: the block's own group, where its layers are offloaded by groups of their own (leaf level)
        #: and the block's hooks run around this call (``inside_hooks``: its ``post_forward`` comes after)
        self.own = diffusers_internals.own_offload_hook(module) if inside_hooks and \
            any(diffusers_internals.onload_hook(layer) is not None for layer, _ in layers) else ()
        #: diffusers records the order the layers run in on this forward: the block must run them
        #: one by one (its own code, :data:`RECORDING_ORDER`), or the chain follows the hoisted order
        self.recording = any(diffusers_internals.records_layer_order(layer) for layer, _ in layers)
        if self.recording:  # hoisted from the next forward on: a prefetch into them then defers offloads
            self._mark_hoisted()  # (from the forward after that, otherwise)
        self.forwards: list = []
        self.weights: list = []
        self.defer: set = set()  # the blocks this block's offloads wait for (the next one's onloads)

    def __enter__(self):
        try:
            self._enter()
        except BaseException:  # (an onload that runs out of memory, say): the hooks go back on their layers
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _mark_hoisted(self) -> None:
        for layer, _ in self.layers:
            _HOISTED[layer] = self.module
        if self.own:
            _HOISTED[self.module] = self.module

    def _enter(self) -> None:
        self._mark_hoisted()
        offload_hooks = [self.own[0]] if self.own else []
        for layer, chain in self.layers:
            self.forwards.append(layer.__dict__.pop("forward"))
            for ref in reversed(chain):  # outermost first, as the chained forward runs them
                ref.pre_forward(layer)
            hook = diffusers_internals.onload_hook(layer)
            if hook is not None:
                offload_hooks.append(hook)
        for stream in diffusers_internals.prefetches_in_flight(offload_hooks):
            stream.synchronize()
        flush_offloads()  # the previous block's, now that this block's copies are queued
        # (with record_stream an offload does not wait for the compute stream: nothing to overlap)
        if any(not h.group.record_stream for h in offload_hooks):
            exits = diffusers_internals.chain_exits(offload_hooks)
            self.defer = {_HOISTED[g.onload_leader] for g in exits if g.onload_leader in _HOISTED}
        if self.gguf:
            from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

            for layer in self.gguf:
                weight = layer._parameters["weight"]
                self.weights.append(weight)
                layer._parameters["weight"] = torch.nn.Parameter(
                    dequantize_gguf_tensor(weight).to(layer.compute_dtype), requires_grad=False)

    def __exit__(self, *exc):
        for layer, weight in zip(self.gguf, self.weights):  # before the offloads move the layers
            layer._parameters["weight"] = weight
        ran = [(layer, chain) for (layer, chain), _ in zip(self.layers, self.forwards)]
        for (layer, _), forward in zip(self.layers, self.forwards):
            layer.forward = forward
        if self.defer and exc[0] is None:
            _waiting.offloads = (self.defer,
                                 ran + ([(self.module, (_OffloadLater(self.own[1]),))] if self.own else []))
            return False
        flush_offloads()  # (an exception: nothing waits)
        _post_forwards(ran)
        return False
