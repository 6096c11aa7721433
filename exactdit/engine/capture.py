"""Capturing a model's block graphs with their real inputs, and timing them op by op: what the
coverage numbers and the engine's tests and benchmarks are computed from."""

from __future__ import annotations

import statistics
import time
from typing import Iterable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd


def repeated_blocks(model: torch.nn.Module, listed: Sequence[str]) -> tuple[str, ...]:
    """The block classes the engine patches in ``model``: ``listed``, the classes the model lists
    itself (diffusers' ``_repeated_blocks``, which the caller reads:
    :func:`exactdit.patches.engine.repeated_blocks`), and the classes of its block lists: the
    ``nn.ModuleList``s whose members (one or more) are all of one class defined outside
    ``torch.nn`` (SD3's ``transformer_blocks``, PixArt's, Sana's, Lumina2's refiners and layers),
    outermost lists only, outside the listed blocks and holding none. A lone block counts (a model
    at a 1-layer config) where its list lies in no other list (a UNet's per-stage ``downsamplers``
    do), and so does a list of a class ``listed`` leaves out (HunyuanVideo's token-replace blocks,
    token refiners and text projections some classes do not list)."""
    listed = tuple(listed)
    found: list[str] = list(listed)
    inside: list[str] = []
    lists: list[str] = []  # every ModuleList seen
    for name, m in model.named_modules():
        if not name or any(name.startswith(p) for p in inside):
            continue
        if type(m).__name__ in listed:  # captured whole, lists inside it included
            inside.append(name + ".")
            continue
        if not isinstance(m, torch.nn.ModuleList):
            continue
        nested = any(name.startswith(p) for p in lists)
        lists.append(name + ".")
        if len(m) < (2 if nested else 1):
            continue
        classes = {type(c) for c in m}
        cls = classes.pop() if len(classes) == 1 else None
        if cls is None or cls.__module__.startswith("torch.nn"):
            continue
        if any(type(d).__name__ in listed for c in m for d in c.modules()):
            continue  # stages holding listed blocks: the blocks are captured
        if cls.__name__ not in found:
            found.append(cls.__name__)
        inside.append(name + ".")
    # a class found in a list that also lies inside another found class's modules elsewhere
    # (UNet3D's transformer_in) is captured with them: no block inside a block
    names = set(found)
    nested = {type(sub).__name__ for m in model.modules() if m is not model and type(m).__name__ in names
              for sub in m.modules() if sub is not m and type(sub).__name__ in names}
    return tuple(c for c in found if c not in nested or c in listed)


def capture_graphs(model: torch.nn.Module, kwargs: dict, blocks: Iterable[str]) -> list[tuple[str, fx.GraphModule, list]]:
    """The ATen inference graphs of ``model``'s blocks of the classes named in ``blocks`` (its
    repeated blocks: :func:`exactdit.patches.engine.repeated_blocks`; captured as
    ``compile_repeated_blocks`` captures them: one backend per block class) and the inputs of each
    graph's first call: [(block class, graph module, inputs)]; ``gm.meta["calls"]``: how many
    blocks of the forward ran that graph (a class is captured again where its inputs change
    layout: HunyuanVideo's first single block). The model runs one forward; nothing is rewritten."""
    captured: list = []

    def backend_for(label: str):
        def compiler(gm, example_inputs):
            entry = [label, gm, None]
            captured.append(entry)
            gm.meta["calls"] = 0

            def run(*args):
                if entry[2] is None:
                    entry[2] = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                gm.meta["calls"] += 1
                return gm(*args)

            return run

        return aot_autograd(fw_compiler=compiler)

    torch._dynamo.reset()
    backends: dict = {}
    names = set(blocks)
    modules = [m for m in model.modules() if type(m).__name__ in names]
    for m in modules:
        label = type(m).__name__
        backend = backends.setdefault(label, backend_for(label))
        m._compiled_call_impl = torch.compile(m._call_impl, backend=backend, fullgraph=True, dynamic=False)
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        for m in modules:
            m._compiled_call_impl = None
        torch._dynamo.reset()
    return [tuple(entry) for entry in captured]


class NodeTimer(fx.Interpreter):
    """Runs an ATen graph op by op with a CUDA event pair around every op (wall clock on the
    CPU); keeps every node's value (``values``) and its time in ms (median over the runs)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}
        self._events: dict[fx.Node, list] = {}
        self._cuda = False

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            out = super().run_node(n)
        elif self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = super().run_node(n)
            end.record()
            self._events.setdefault(n, []).append((start, end))
        else:
            start = time.perf_counter()
            out = super().run_node(n)
            self._events.setdefault(n, []).append((time.perf_counter() - start) * 1e3)
        self.values[n] = out
        return out

    def timed(self, inputs, runs: int = 3) -> dict[fx.Node, float]:
        self._cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
        with torch.no_grad():
            self.run(*inputs)  # warm-up
            self._events.clear()
            for _ in range(runs):
                self.run(*inputs)
        if not self._cuda:
            return {n: statistics.median(ev) for n, ev in self._events.items()}
        torch.cuda.synchronize()
        return {n: statistics.median(s.elapsed_time(e) for s, e in ev) for n, ev in self._events.items()}
