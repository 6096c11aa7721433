"""exactdit.patch on models: patch/unpatch and the report, blocks with graph breaks captured in
parts, recapture limits, diffusers' hooks and caches around captured blocks, group offloading."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

import exactdit
from exactdit.engine import coverage
from exactdit.harness import models
from tests.engine_helpers import engine_eager_reasons, flux_recording_reasons, graph_break_then, wrap_feed_forward
from tests.helpers import assert_bits_equal

aten = torch.ops.aten


def test_patch_unpatch_and_report_on_a_model():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        summary = exactdit.patch(tr)
        out = tr(**kw, return_dict=False)[0]
        assert summary["modules"]["FluxTransformerBlock"] == 1
        assert exactdit.unpatch(tr)["restored"]["FluxSingleTransformerBlock"] == 1
        again = tr(**kw, return_dict=False)[0]
    assert_bits_equal(out, ref) and assert_bits_equal(again, ref)
    assert all(m._compiled_call_impl is None for m in tr.modules())
    rep = exactdit.report(show=False)
    assert any(v["fused"] for k, v in rep.items() if k.startswith("FluxTransformer2DModel"))


def test_a_new_resolution_generates_no_new_kernel_source(monkeypatch):
    """A patched Flux at a second resolution and a second batch size: each forward equal to the
    unpatched one, and every kernel its new captures generate is one the first resolution generated
    already (per-row integers are arguments), so Triton compiles nothing new."""
    from exactdit.engine import runtime

    made: list[str] = []
    init = runtime.RegionOp.__init__
    monkeypatch.setattr(runtime.RegionOp, "__init__",
                        lambda op, region: (init(op, region), made.extend(k.source for k in region.kernels))[0])
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    sizes = [(1, 32, 32), (1, 48, 64), (2, 32, 48), (2, 64, 32)]
    kws = [models.forward_inputs("flux", tr, batch=b, height=h, width=w, seed=7) for b, h, w in sizes]
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in kws]
        exactdit.patch(tr)
        try:
            seen: list[set[str]] = []
            for kw, ref in zip(kws, refs):
                before = len(made)
                assert_bits_equal(tr(**kw, return_dict=False)[0], ref)
                seen.append(set(made[before:]))
        finally:
            exactdit.unpatch(tr)
    assert all(seen) and seen[1] <= seen[0] and seen[3] <= seen[2]  # (one batch row has no batch index)


FLUX_BLOCK = "FluxTransformer2DModel.FluxTransformerBlock"
FLUX_SINGLE_BLOCK = "FluxTransformer2DModel.FluxSingleTransformerBlock"


def _flux_with_feed_forward(wrap, seed: int):
    """A tiny Flux whose first double block's feed-forward runs ``wrap(ff, x)``, and its inputs."""
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=seed)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=seed + 1)
    wrap_feed_forward(tr.transformer_blocks[0], wrap)
    return tr, kw


def _patched_runs(tr, kws: list, dynamic: bool | None = False) -> tuple[list, list, list]:
    """(eager outputs, patched outputs, warnings) of one forward per inputs in ``kws``."""
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in kws]
        torch._dynamo.reset()
        exactdit.patch(tr, dynamic=dynamic)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [tr(**kw, return_dict=False)[0] for kw in kws]
        exactdit.unpatch(tr)
    return refs, outs, [str(w.message) for w in caught]


def _block_graphs(label: str) -> list:
    return [g for g in coverage.graphs() if g.name.startswith(label + "#")]


def test_a_block_with_a_graph_break_is_captured_in_parts():
    """A graph break inside a block (its feed-forward calls code Dynamo does not trace): the block
    runs as Dynamo's graphs around the break, each rewritten and fused; equal, listed in the
    report with the reason, nothing run eager, nothing captured again on a second call."""
    tr, kw = _flux_with_feed_forward(graph_break_then, seed=8)
    refs, outs, warned = _patched_runs(tr, [kw, kw])
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    assert "graph_break" in coverage.in_parts()[FLUX_BLOCK], coverage.in_parts()
    assert any("captured in parts" in w for w in warned), warned
    graphs = _block_graphs(FLUX_BLOCK)
    assert len([g for g in graphs if g.regions]) >= 2, [g.lines() for g in graphs]  # both sides of the break
    rep = exactdit.report(show=False)
    ran = {k.rsplit(".r", 1)[0] for k, v in rep.items() if FLUX_BLOCK + "#" in k and v["fused"]}
    assert len(ran) >= 2, ran
    assert engine_eager_reasons() == {}
    assert f"captured in parts (graph breaks): {FLUX_BLOCK}" in str(rep)
    # the second forward reused the graphs: each region ran once per forward
    assert all(v["fused"] == 2 for k, v in rep.items() if FLUX_BLOCK + "#" in k and v["fused"])


def test_a_block_dynamo_captures_nothing_of_runs_eager_with_the_reason():
    """A block whose whole forward Dynamo must skip (here ``torch.compiler.disable``d): no graph
    runs even in parts, so it runs diffusers' code, counted with the reason, and is not captured
    again."""
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=8)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=9)
    block = tr.transformer_blocks[0]
    block.forward = torch.compiler.disable(block.forward)
    refs, outs, warned = _patched_runs(tr, [kw, kw])
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    assert any("runs diffusers' code" in w for w in warned), warned
    reasons = exactdit.report(show=False)[f"engine.{FLUX_BLOCK}"]["eager_reasons"]
    assert len(reasons) == 1 and next(iter(reasons)).startswith("not captured: "), reasons
    assert sum(reasons.values()) == 2  # both calls


def test_parts_captured_again_for_inputs_already_run_fall_back_to_eager():
    """A value read after a graph break that changes between calls (a routing count, here a
    setting) makes Dynamo capture the parts again for inputs the block has run: after
    RECAPTURES_ALLOWED such calls, rather than capturing on every step, the block runs diffusers'
    code from its next call on."""
    from exactdit.patches.engine import RECAPTURED_REASON, RECAPTURES_ALLOWED

    setting = {"k": 1}

    def reads_a_value(ff, x):
        torch._dynamo.graph_break()
        y = ff(x)
        k = setting["k"]
        return torch.cat([y[:, :k], y[:, k:]], dim=1)  # y, whatever k: the graph specialises on it

    tr, kw = _flux_with_feed_forward(reads_a_value, seed=8)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        torch._dynamo.reset()
        exactdit.patch(tr)
        outs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in range(1, RECAPTURES_ALLOWED + 4):
                setting["k"] = k
                outs.append(tr(**kw, return_dict=False)[0])
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    reasons = exactdit.report(show=False)[f"engine.{FLUX_BLOCK}"]["eager_reasons"]
    assert reasons == {RECAPTURED_REASON: 1}  # the last call; the one before still ran the graphs it captured


@pytest.mark.parametrize("dynamic", [None, True])
def test_a_block_in_parts_comes_back_to_resolutions_it_ran_and_stays_fused(dynamic):
    """A block with a graph break at five resolutions, a batch of three, then the five again: the
    graph symbolic in the batch too lowers the signatures earlier graphs served, which is not a
    capture for inputs the block has run (nothing falls back to diffusers' code, which a block
    found "captured again" more than RECAPTURES_ALLOWED times does from its next call); equal."""
    tr, _ = _flux_with_feed_forward(graph_break_then, seed=8)
    sizes = [(2, h) for h in (32, 48, 64, 80, 96)] + [(3, 32)] + [(2, h) for h in (32, 48, 64, 80, 96, 32)]
    kws = [models.forward_inputs("flux", tr, batch=b, height=h, width=h, seed=9) for b, h in sizes]
    refs, outs, _ = _patched_runs(tr, kws, dynamic)
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    assert engine_eager_reasons() == {}
    assert "graph_break" in coverage.in_parts()[FLUX_BLOCK]


def test_shapes_beyond_dynamos_recompile_limit_run_eager_and_the_captured_ones_stay_fused():
    from exactdit.patches.engine import RECOMPILE_LIMIT, RECOMPILE_LIMIT_REASON

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    calls = [models.forward_inputs("flux", tr, batch=1, height=h, width=32, seed=7) for h in (16, 32, 48)]
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in calls]
        torch._dynamo.reset()
        with torch._dynamo.config.patch(recompile_limit=8):
            exactdit.patch(tr, dynamic=False)  # every shape a capture (the default, stated)
            assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
        with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [tr(**kw, return_dict=False)[0] for kw in calls]
            runs = _graph_runs("FluxTransformerBlock")
            again = tr(**calls[0], return_dict=False)[0]
            assert _graph_runs("FluxTransformerBlock") == runs + 1  # the first shape's graph ran
        exactdit.unpatch(tr)
    for out, ref in zip(outs + [again], refs + refs[:1]):
        assert_bits_equal(out, ref)
    reasons = exactdit.report(show=False)["engine.FluxTransformer2DModel.FluxTransformerBlock"]["eager_reasons"]
    assert list(reasons) == [RECOMPILE_LIMIT_REASON]


def _graph_runs(block: str) -> int:
    """Calls of the first region of every captured graph of ``block``'s class."""
    rep = exactdit.report(show=False)
    return sum(v["fused"] + v["eager"] for k, v in rep.items() if f".{block}#" in k and k.endswith(".r0"))


def _hooks_hold_the_class_forward(blocks) -> bool:
    """Each block's diffusers hook chain ends in the block class's own forward (as before a patch)."""
    def innermost(ref):
        return ref.original_forward if ref.original_forward is not None else ref.forward

    return all(innermost(b._diffusers_hook._fn_refs[0]).__func__ is type(b).forward for b in blocks)


def _cached_flux(cache_config, seeds, layers=(2, 2)):
    """A tiny Flux with a diffusers cache enabled, one forward's inputs per seed, and ``denoise()``
    running them in order in one cache context (the cache's state reset first)."""
    from diffusers.hooks import HookRegistry

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": layers[0], "num_single_layers": layers[1]}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    calls = [models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=s) for s in seeds]
    tr.enable_cache(cache_config)

    def denoise():
        HookRegistry.check_if_exists_or_initialize(tr).reset_stateful_hooks(recurse=True)
        with torch.no_grad(), tr.cache_context("cond"):
            return [tr(**kw, return_dict=False)[0] for kw in calls]

    return tr, calls, denoise


def test_first_block_cache_hooks_run_around_the_captured_blocks():
    from diffusers.hooks import FirstBlockCacheConfig

    # the second call repeats the first input: the cache skips the blocks after the first
    tr, calls, denoise = _cached_flux(FirstBlockCacheConfig(threshold=0.3), seeds=(7, 7, 8), layers=(3, 2))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    out = denoise()
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    # the cache's head block runs its graph on all three calls (inside the hook's compiler-disabled
    # new_forward), blocks 1 and 2 on the two calls the cache does not skip
    assert _graph_runs("FluxTransformerBlock") == 3 + 2 * 2
    assert _graph_runs("FluxSingleTransformerBlock") == 2 * 2
    exactdit.unpatch(tr)
    assert _hooks_hold_the_class_forward(list(tr.transformer_blocks) + list(tr.single_transformer_blocks))
    assert_bits_equal(denoise()[2], ref[2])  # unpatched, hooks as they were
    # hooks removed while patched: the blocks run their graphs without them
    exactdit.patch(tr)
    denoise()
    tr.disable_cache()
    runs = _graph_runs("FluxTransformerBlock")
    with torch.no_grad():
        assert_bits_equal(tr(**calls[2], return_dict=False)[0], ref[2])  # a call the cache computed in full
    exactdit.unpatch(tr)
    assert _graph_runs("FluxTransformerBlock") == runs + 3 and engine_eager_reasons() == {}
    assert all(type(b.forward).__name__ == "method" for b in tr.transformer_blocks)


def _group_offloaded_flux(offload_type: str, monkeypatch):
    """A tiny Flux under diffusers' group offloading on the CPU, its inputs, and the list each
    group's moves are logged to as (``"onload_"`` or ``"offload_"``, the group's id)."""
    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks.group_offloading import ModuleGroup

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": 2, "num_single_layers": 3}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    cpu = torch.device("cpu")
    apply_group_offloading(tr, onload_device=cpu, offload_device=cpu, offload_type=offload_type,
                           **({"num_blocks_per_group": 1} if offload_type == "block_level" else {}))
    moves = []
    for name in ("onload_", "offload_"):
        def logged(self, _move=getattr(ModuleGroup, name), _name=name):
            moves.append((_name, id(self)))
            return _move(self)
        monkeypatch.setattr(ModuleGroup, name, logged)
    return tr, kw, moves


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_keeps_working(offload_type, monkeypatch):
    """Group offloading (its hooks move parameters in torch.compiler.disable'd functions): with
    hooks on the blocks the blocks' forwards still run captured inside them; with hooks on the
    layers inside a block (leaf level) the hooks run for all the block's layers around its call and
    the block is captured whole. Either way each group is onloaded and offloaded once a call, as
    unpatched, and the hooks are back on their layers after each call."""
    tr, kw, moves = _group_offloaded_flux(offload_type, monkeypatch)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    unpatched, moves[:] = sorted(moves), []
    hooked = {n for n, m in tr.named_modules() if "forward" in m.__dict__}
    torch._dynamo.reset()
    exactdit.patch(tr)
    with torch.no_grad():
        outs = [tr(**kw, return_dict=False)[0] for _ in range(2)]
        exactdit.unpatch(tr)
        outs.append(tr(**kw, return_dict=False)[0])
    for out in outs:
        assert_bits_equal(out, ref)
    assert sorted(moves) == sorted(unpatched * 3) and unpatched
    assert {n for n, m in tr.named_modules() if "forward" in m.__dict__} == hooked
    assert engine_eager_reasons() == {}
    assert not coverage.in_parts()
    assert _graph_runs("FluxTransformerBlock") == 2 * 2 and _graph_runs("FluxSingleTransformerBlock") == 2 * 3
    if offload_type == "block_level":
        assert _hooks_hold_the_class_forward(list(tr.transformer_blocks) + list(tr.single_transformer_blocks))


def test_with_streams_a_blocks_offloads_wait_for_the_next_blocks_onloads(monkeypatch):
    """Leaf-level offloading with streams, hoisted: a block's offloads (each waits for the compute
    stream) run after the next block's onloads have queued its copies, so those copies overlap the
    block's compute (run one after the other, the copies waited for each block: 0.75x eager on
    Flux.1-dev, H200). The groups moved per call are the unpatched ones, every group is offloaded
    when the forward returns, and the bits are eager's. The side streams are stand-ins (the CPU
    has none); the prefetch chain is the one diffusers records on an unpatched first forward (the
    layers' order of execution, which hoisting does not keep)."""
    from types import SimpleNamespace as NS

    from diffusers.hooks.group_offloading import ModuleGroup

    tr, kw, moves = _group_offloaded_flux("leaf_level", monkeypatch)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    order = [g for move, g in moves if move == "onload_"]  # the order the layers ran in
    hooks = {id(m._diffusers_hook.hooks["group_offloading"].group): m._diffusers_hook.hooks["group_offloading"]
             for m in tr.modules() if getattr(m, "_diffusers_hook", None) is not None
             and "group_offloading" in m._diffusers_hook.hooks}
    chain = [hooks[g] for g in order]
    for hook, nxt in zip(chain, chain[1:]):  # what diffusers' lazy prefetch hook sets up with streams
        hook.next_group = nxt.group
        nxt.group.onload_self = False
    for hook in chain:
        hook.group.stream = NS(synchronize=lambda: None)
    monkeypatch.setattr(ModuleGroup, "_onload_from_memory", lambda self: None)  # (no CUDA copies)
    monkeypatch.setattr(ModuleGroup, "_offload_to_memory", lambda self: None)
    block_of = {id(hook.group): i for i, block in enumerate(list(tr.transformer_blocks) + list(tr.single_transformer_blocks))
                for m in block.modules() for hook in [hooks.get(id(getattr(m, "_diffusers_hook", None)
                                                                  and m._diffusers_hook.hooks.get("group_offloading")
                                                                  and m._diffusers_hook.hooks["group_offloading"].group))]
                if hook is not None}
    moves.clear()
    with torch.no_grad():
        assert_bits_equal(tr(**kw, return_dict=False)[0], ref)
    unpatched, moves[:] = list(moves), []
    exactdit.patch(tr)
    with torch.no_grad():
        outs = [tr(**kw, return_dict=False)[0] for _ in range(2)]
    patched = list(moves)
    exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    assert sorted(patched) == sorted(unpatched * 2)
    second = patched[len(unpatched):]  # (the first learns which layers the blocks hoist)
    onloaded = {g: i for i, (m, g) in enumerate(second) if m == "onload_"}
    offloaded = {g: i for i, (m, g) in enumerate(second) if m == "offload_"}
    assert set(offloaded) == set(onloaded)  # all offloaded before the forward returned
    blocks = sorted(set(block_of.values()))
    for k in blocks[:-1]:  # block k's offloads after block k + 1's onloads (its prefetches included)
        mine = [offloaded[g] for g, b in block_of.items() if b == k]
        theirs = [onloaded[g] for g, b in block_of.items() if b == k + 1]
        assert min(mine) > max(theirs)
    for k in blocks:  # unpatched: each layer is offloaded right after it ran, before the next block's first copy
        mine = [i for i, (m, g) in enumerate(unpatched) if m == "offload_" and block_of.get(g) == k]
        theirs = [i for i, (m, g) in enumerate(unpatched) if m == "onload_" and block_of.get(g) == k + 2]
        assert not theirs or max(mine) < min(theirs)
    assert engine_eager_reasons() == {} and not coverage.in_parts()
    for hook in chain:  # with record_stream an offload does not wait for compute: run at once, as unpatched
        hook.group.record_stream = True
    exactdit.patch(tr)
    moves.clear()
    with torch.no_grad():
        tr(**kw, return_dict=False), tr(**kw, return_dict=False)
    exactdit.unpatch(tr)
    second = moves[len(unpatched):]
    for k in blocks[:-1]:
        mine = [i for i, (m, g) in enumerate(second) if m == "offload_" and block_of.get(g) == k]
        theirs = [i for i, (m, g) in enumerate(second) if m == "onload_" and block_of.get(g) == k + 2]
        assert not theirs or max(mine) < min(theirs)


def _record_prefetch_order(tr) -> None:
    """What ``apply_group_offloading(..., use_stream=True)`` adds at leaf level: the hook that records
    the order the layers run in on the next forward and chains their prefetches in that order (the
    CPU has no streams, so each prefetched group is also copied when it runs: the moves stay
    visible)."""
    from diffusers.hooks.group_offloading import ModuleGroup, _apply_lazy_group_offloading_hook

    config = next(m._diffusers_hook.hooks["group_offloading"].config for m in tr.modules()
                  if "group_offloading" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}))
    root = ModuleGroup(modules=[], offload_device=config.offload_device, onload_device=config.onload_device,
                       offload_leader=tr, onload_leader=tr, parameters=None, buffers=None, non_blocking=False,
                       stream=None, record_stream=False, onload_self=True, group_id="root")
    _apply_lazy_group_offloading_hook(tr, root, config=config)


def test_hoisted_layers_move_in_the_order_diffusers_recorded(monkeypatch):
    """Leaf-level offloading with streams chains each layer's prefetch to the next layer in the
    order the first forward ran them. Hoisted, a block's layers are onloaded in that order (in the
    module tree's order a layer came before the one that prefetches it: copied twice, the first
    time synchronously; Flux.1-dev on an H100 at 0.91x eager, 506 ms of copies against compile's
    435), and a block patched before the first forward runs diffusers' code while the order is
    recorded, so that the chain is the unpatched one (recorded in the tree's order, the unpatched
    model after ``unpatch`` left layers on the GPU)."""
    runs = {}
    for first in ("unpatched", "patched"):
        tr, kw, moves = _group_offloaded_flux("leaf_level", monkeypatch)
        with torch.no_grad():
            ref = tr(**kw, return_dict=False)[0]
        _record_prefetch_order(tr)
        groups = {id(m._diffusers_hook.hooks["group_offloading"].group): name for name, m in tr.named_modules()
                  if "group_offloading" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})}
        torch._dynamo.reset()
        if first == "patched":
            exactdit.patch(tr)
        with torch.no_grad():
            outs = [tr(**kw, return_dict=False)[0] for _ in range(2)]  # the first records the order
            moves.clear()
            outs.append(tr(**kw, return_dict=False)[0])
        for out in outs:
            assert_bits_equal(out, ref)
        chain, hook = [], tr._diffusers_hook.hooks["group_offloading"]
        while hook.next_group is not None:
            chain.append(groups[id(hook.next_group)])
            hook = hook.next_group.onload_leader._diffusers_hook.hooks["group_offloading"]
        runs[first] = chain, [groups.get(g, g) for m, g in moves if m == "onload_"]
        if first == "patched":
            exactdit.unpatch(tr)
            assert engine_eager_reasons() == flux_recording_reasons(double=2, single=3)
            assert _graph_runs("FluxTransformerBlock") == 2 * 2 and _graph_runs("FluxSingleTransformerBlock") == 2 * 3
    assert len(runs["unpatched"][0]) > 20
    assert runs["patched"] == runs["unpatched"]


@pytest.mark.parametrize("model", ["flux", "wan"])
def test_offloads_wait_for_the_next_block_from_the_forward_after_the_recording_one(model, monkeypatch):
    """Leaf-level offloading with streams, a model patched before its first forward: the recording
    forward runs diffusers' code, and the next one already holds each block's offloads until the
    next block's onloads are queued (the layers the recording forward saw count as hoisted; they
    waited from the third). Wan's blocks hold a group of their own (``scale_shift_table``, moved by
    a hook on the block): its offload waits too, and a prefetch into it counts (without, Wan's
    copies did not overlap compute: 0.87x eager on an H100)."""
    import re
    from types import SimpleNamespace as NS

    from diffusers.hooks import apply_group_offloading
    from diffusers.hooks.group_offloading import ModuleGroup

    cfg = {**models.get_spec(model).config("tiny"),
           **({"num_layers": 2, "num_single_layers": 3} if model == "flux" else {"num_layers": 4})}
    tr = models.build_transformer(model, cfg, dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs(model, tr, batch=1, height=32, width=32, seed=7,
                               **({"num_frames": 5} if model == "wan" else {}))
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    cpu = torch.device("cpu")
    apply_group_offloading(tr, onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    _record_prefetch_order(tr)
    names = {id(m._diffusers_hook.hooks["group_offloading"].group): name for name, m in tr.named_modules()
             if "group_offloading" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})}
    moves = []
    for move in ("onload_", "offload_"):
        def logged(self, _move=getattr(ModuleGroup, move), _name=move):
            moves.append((_name, names.get(id(self))))
            return _move(self)
        monkeypatch.setattr(ModuleGroup, move, logged)
    torch._dynamo.reset()
    exactdit.patch(tr)
    with torch.no_grad():
        outs = [tr(**kw, return_dict=False)[0]]  # records the order
        for m in tr.modules():  # stand-in side streams (the CPU has none; nothing to copy)
            hooks = getattr(getattr(m, "_diffusers_hook", None), "hooks", {})
            if "group_offloading" in hooks:
                hooks["group_offloading"].group.stream = NS(synchronize=lambda: None)
        monkeypatch.setattr(ModuleGroup, "_onload_from_memory", lambda self: None)
        monkeypatch.setattr(ModuleGroup, "_offload_to_memory", lambda self: None)
        moves.clear()
        outs.append(tr(**kw, return_dict=False)[0])
        second = list(moves)
        outs.append(tr(**kw, return_dict=False)[0])
    exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    in_block = [(m, re.match(r"(single_transformer_blocks|transformer_blocks|blocks)\.\d+", name or ""))
                for m, name in second]
    moves = [(m, found.group(0)) for m, found in in_block if found]  # (the rest move as unpatched)
    blocks = list(dict.fromkeys(block for _, block in moves))
    assert len(blocks) == (5 if model == "flux" else 4)
    for this, nxt in zip(blocks, blocks[1:]):
        offloads = [i for i, (m, block) in enumerate(moves) if m == "offload_" and block == this]
        onloads = [i for i, (m, block) in enumerate(moves) if m == "onload_" and block == nxt]
        assert offloads and onloads and min(offloads) > max(onloads), (this, nxt)
    offloaded = [name for m, name in second if m == "offload_"]  # each group offloaded once, none left
    assert sorted(offloaded) == sorted(set(offloaded)) == sorted({name for m, name in second if m == "onload_"})
    registry = [m._diffusers_hook for m in tr.modules() if getattr(m, "_diffusers_hook", None) is not None]
    for reg in registry:  # diffusers' own post_forwards are back in its chains
        for ref_, hook in zip(reg._fn_refs, (reg.hooks[n] for n in reg._hook_order)):
            assert ref_.post_forward == hook.post_forward
    if model == "flux":
        assert engine_eager_reasons() == flux_recording_reasons(double=2, single=3)


def _poisoned_offloading_wan_run(patched: bool, scenario: str, monkeypatch) -> list:
    """A tiny Wan under first-block caching and leaf-level offloading with (stand-in) streams whose
    offloads poison the weights with NaN and whose onloads put them back: a layer that computes with
    offloaded weights shows. Outputs of a forward that records the order and three more (with
    ``scenario="exception"``, the second raises after the first block ran: no cache context)."""
    from types import SimpleNamespace as NS

    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, apply_group_offloading
    from diffusers.hooks.group_offloading import ModuleGroup
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    cfg = {**models.get_spec("wan").config("tiny"), "num_layers": 4}
    tr = models.build_transformer("wan", cfg, dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("wan", tr, batch=1, height=32, width=32, seed=7, num_frames=5)
    tr.enable_cache(FirstBlockCacheConfig(threshold=1e9))  # the blocks after the first skipped from the 2nd call
    cpu = torch.device("cpu")
    apply_group_offloading(tr, onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    _record_prefetch_order(tr)
    real = {}

    def tensors(group):
        return [t for m in group.modules for t in (*m.parameters(), *m.buffers())] + \
            list(group.parameters) + list(group.buffers)

    for m in tr.modules():
        hook = getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).get("group_offloading")
        if hook is not None:
            for t in tensors(hook.group):
                real.setdefault(t, t.data)

    def onload(self):
        for t in tensors(self):
            t.data = real[t]

    def offload(self):
        for t in tensors(self):
            t.data = torch.full_like(real[t], float("nan"))

    monkeypatch.setattr(ModuleGroup, "onload_", onload)  # (undone by the caller before the next model)
    monkeypatch.setattr(ModuleGroup, "offload_", offload)
    torch._dynamo.reset()
    if patched:
        exactdit.patch(tr)
    HookRegistry.check_if_exists_or_initialize(tr).reset_stateful_hooks(recurse=True)
    outs = []
    with torch.no_grad(), tr.cache_context("cond"):
        outs.append(tr(**kw, return_dict=False)[0])  # records the order
        for m in tr.modules():
            hook = getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).get("group_offloading")
            if hook is not None:
                hook.group.stream = NS(synchronize=lambda: None)
        for call in range(3):
            if scenario == "exception" and call == 0:
                _set_cache_context(tr, None)  # the first block's cache hook raises after the block ran
                with pytest.raises(ValueError, match="cache context"):
                    tr(**kw, return_dict=False)
                _set_cache_context(tr, CacheContext("cond"))
                continue
            outs.append(tr(**kw, return_dict=False)[0])
    if patched:
        exactdit.unpatch(tr)
    return outs


@pytest.mark.slow  # (two tiny Wans twice: the default run keeps within its 15 minutes)
@pytest.mark.parametrize("scenario", ["cache_skips_the_next_block", "exception"])
def test_offloads_waiting_for_a_block_that_does_not_come_run_before_the_next_onloads(scenario, monkeypatch):
    """A block's offloads wait for the next block's onloads; when that block does not run (a cache
    skips it) or the forward stops (an exception after the block), they run at the next block call
    before anything of it is onloaded. Run later (inside the next forward's first block, after its
    onloads), they offloaded its weights before it computed (NaN here; found by a review)."""
    with monkeypatch.context() as patching:
        ref = _poisoned_offloading_wan_run(False, scenario, patching)
    with monkeypatch.context() as patching:
        outs = _poisoned_offloading_wan_run(True, scenario, patching)
    assert len(outs) == len(ref) >= 3
    for out, expected in zip(outs, ref):
        assert not expected.isnan().any()
        assert_bits_equal(out, expected)
    from exactdit.patches import layer_hooks

    assert getattr(layer_hooks._waiting, "offloads", None) is None


def test_a_layer_that_did_not_run_while_the_order_was_recorded_leaves_its_block_fused(monkeypatch):
    """Diffusers removes the order tracker only from the layers that ran (an inactive LoRA
    adapter's keep theirs): the recording is over after the first forward all the same, and the
    block runs fused from the second (where a tracker alone meant recording, it ran diffusers' code
    on every call)."""
    from diffusers.hooks import apply_group_offloading

    from exactdit.patches import diffusers_internals

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": 2, "num_single_layers": 1}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    tr.transformer_blocks[0].unused = torch.nn.Linear(8, 8).to(torch.bfloat16)  # never called
    cpu = torch.device("cpu")
    apply_group_offloading(tr, onload_device=cpu, offload_device=cpu, offload_type="leaf_level")
    _record_prefetch_order(tr)
    torch._dynamo.reset()
    exactdit.patch(tr)
    with torch.no_grad():
        outs = [tr(**kw, return_dict=False)[0] for _ in range(3)]
    exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    unused = tr.transformer_blocks[0].unused
    assert diffusers_internals.TRACKER in unused._diffusers_hook.hooks  # (diffusers left it)
    assert not diffusers_internals.records_layer_order(unused)
    assert engine_eager_reasons() == flux_recording_reasons(double=2, single=1)
    assert _graph_runs("FluxTransformerBlock") == 2 * 2


def test_a_prefetch_still_copying_a_layer_of_the_block_is_waited_for():
    """Leaf-level offloading with streams prefetches the next group in the order its first forward
    ran the layers: after a block's hoisted onloads, the last prefetch may still be copying. Only
    one that copies a group of this block is waited for (a prefetch recorded by a forward that ran
    the layers in another order); the next block's first layer keeps overlapping with compute."""
    from types import SimpleNamespace as NS

    from exactdit.patches.diffusers_internals import prefetches_in_flight

    stream = object()
    a, b, nxt = (NS(stream=stream) for _ in range(3))
    ha, hb = NS(group=a, next_group=b), NS(group=b, next_group=nxt)
    assert prefetches_in_flight([ha, hb]) == []  # the next block's layer: overlapped
    hb.next_group = a
    assert prefetches_in_flight([ha, hb]) == [stream]  # a layer of this block: waited for
    assert prefetches_in_flight([NS(group=a, next_group=None)]) == []
    synchronous = NS(stream=None)
    assert prefetches_in_flight([NS(group=synchronous, next_group=synchronous)]) == []  # no stream: copied already
    assert prefetches_in_flight([]) == []


@pytest.mark.parametrize("cache", ["pyramid_attention_broadcast", "mag_cache", "sea_cache"])
def test_caches_on_blocks_run_with_the_blocks_captured(cache):
    from diffusers.hooks import MagCacheConfig, PyramidAttentionBroadcastConfig, SeaCacheConfig

    steps = 4
    config = {
        "pyramid_attention_broadcast": lambda: PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
            current_timestep_callback=lambda: 500),
        "mag_cache": lambda: MagCacheConfig(num_inference_steps=steps, mag_ratios=[1.0] * steps, threshold=0.5),
        "sea_cache": lambda: SeaCacheConfig(),
    }[cache]
    tr, _, denoise = _cached_flux(config(), seeds=range(10, 10 + steps))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    out = denoise()
    exactdit.unpatch(tr)
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    assert _graph_runs("FluxTransformerBlock") > 0 and _graph_runs("FluxSingleTransformerBlock") > 0


def test_hooks_inside_blocks_capture_those_blocks_in_parts_until_removed():
    """TaylorSeer hooks each block's attention layer (a compiler-disabled forward inside the
    block): those blocks are captured in parts around it, until the cache is disabled; another
    model of the same classes is captured whole."""
    from diffusers.hooks import TaylorSeerCacheConfig

    tr, calls, denoise = _cached_flux(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
                                      seeds=range(10, 14))
    ref = denoise()
    torch._dynamo.reset()
    exactdit.patch(tr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "captured in parts"
        out = denoise()
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert engine_eager_reasons() == {}
    assert set(coverage.in_parts()) == {FLUX_BLOCK, FLUX_SINGLE_BLOCK}
    in_parts = _graph_runs("FluxTransformerBlock")
    assert in_parts > 0

    other = models.build_transformer("flux", {**models.get_spec("flux").config("tiny"), "num_layers": 2,
                                              "num_single_layers": 2}, dtype=torch.bfloat16, seed=7)
    exactdit.patch(other)
    with torch.no_grad():
        other(**calls[0], return_dict=False)
    whole = _graph_runs("FluxTransformerBlock") - in_parts
    assert whole == 2  # the classes are not marked as running in parts: one graph per block

    tr.disable_cache()
    with torch.no_grad():
        plain = tr(**calls[0], return_dict=False)[0]
    exactdit.unpatch(tr)
    exactdit.unpatch(other)
    # hooks gone: tr's blocks run the whole graph too
    assert _graph_runs("FluxTransformerBlock") - in_parts == whole + len(tr.transformer_blocks)
    with torch.no_grad():
        assert_bits_equal(plain, tr(**calls[0], return_dict=False)[0])


@pytest.mark.parametrize("when", ["pre_forward", "post_forward"])
def test_a_layer_hook_that_fails_around_the_block_leaves_every_hook_in_place(monkeypatch, when):
    """A weight hook run for the block's layers that raises before or after the block (an onload
    out of memory, say): the call raises that error, every layer has its hooked forward back, and
    the next call is equal."""
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    hooked = {n for n, m in tr.named_modules() if "forward" in m.__dict__}
    failing = tr.transformer_blocks[0].attn.to_v
    (ref_,) = failing._diffusers_hook._fn_refs  # the hook's pre_forward as its chained forward calls it
    hook, failed = getattr(ref_, when), []

    def fails_once(module, *args, **kwargs):
        if not failed:
            failed.append(module)
            raise RuntimeError("CUDA out of memory (stand-in)")
        return hook(module, *args, **kwargs)

    monkeypatch.setattr(ref_, when, fails_once)
    torch._dynamo.reset()
    exactdit.patch(tr)
    try:
        with torch.no_grad():
            with pytest.raises(RuntimeError, match="out of memory"):
                tr(**kw, return_dict=False)
            assert {n for n, m in tr.named_modules() if "forward" in m.__dict__} == hooked
            assert when == "post_forward" or all(p.dtype == torch.float8_e4m3fn for p in failing.parameters())
            out = tr(**kw, return_dict=False)[0]
    finally:
        exactdit.unpatch(tr)
    assert_bits_equal(out, ref)


def _tiny_flux(layers=(2, 2)):
    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": layers[0], "num_single_layers": layers[1]}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, seed=6)
    return tr, models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)


def _patched_equals_unpatched(tr, kw, calls=2):
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        torch._dynamo.reset()
        exactdit.patch(tr)
        try:
            outs = [tr(**kw, return_dict=False)[0] for _ in range(calls)]
        finally:
            exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)


def test_layer_hooks_under_another_wrapper_are_left_on_their_layers():
    """Layerwise casting, then accelerate's CPU offload (its hook wraps each layer's forward
    outside diffusers' chain): taking the chain off the layer dropped accelerate's wrapper and the
    layers ran on meta weights. Such layers keep their hooks (the blocks run in parts)."""
    from accelerate import cpu_offload

    tr, kw = _tiny_flux((1, 1))
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    cpu_offload(tr, execution_device=torch.device("cpu"))
    _patched_equals_unpatched(tr, kw)


def test_layer_casting_runs_after_the_blocks_own_onload():
    """fp8 layerwise casting on the layers, block-level group offloading to disk on the blocks:
    as unpatched, the block's onload (fp8 weights from disk) comes first and the layers' casts after
    it; run the other way round, the onload overwrote the upcast weights (a dtype error)."""
    from diffusers.hooks import apply_group_offloading

    tr, kw = _tiny_flux()
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as disk:
        apply_group_offloading(tr, onload_device="cpu", offload_device="cpu", offload_type="block_level",
                               num_blocks_per_group=1, offload_to_disk_path=disk)
        _patched_equals_unpatched(tr, kw)


def test_blocks_skipped_by_a_cache_cast_none_of_their_layers():
    """First-block cache with layerwise casting: the layers of blocks the cache skips are neither
    cast nor moved, patched as unpatched (the layers' hooks run inside the block's own hooks)."""
    from diffusers.hooks import FirstBlockCacheConfig
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    tr, _, denoise = _cached_flux(FirstBlockCacheConfig(threshold=0.3), seeds=(7, 7, 7), layers=(3, 2))
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    casts = []
    original = LayerwiseCastingHook.pre_forward

    def counted(self, module, *args, **kwargs):
        casts.append(module)
        return original(self, module, *args, **kwargs)

    for m in tr.modules():
        registry = getattr(m, "_diffusers_hook", None)
        if registry is not None and "layerwise_casting" in registry.hooks:
            hook = registry.hooks["layerwise_casting"]
            hook.fn_ref.pre_forward = counted.__get__(hook)
    ref = denoise()
    unpatched = len(casts)
    casts.clear()
    torch._dynamo.reset()
    exactdit.patch(tr)
    try:
        out = denoise()
    finally:
        exactdit.unpatch(tr)
    for o, r in zip(out, ref):
        assert_bits_equal(o, r)
    assert len(casts) == unpatched


def test_a_block_call_that_runs_out_of_memory_runs_eager_once():
    """An out-of-memory error in one captured call (memory another tensor held then): that call
    runs diffusers' code, counted; the block class is not given up, the next call is captured."""
    from exactdit.patches import engine

    tr, kw = _tiny_flux((1, 1))
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
    torch._dynamo.reset()
    exactdit.patch(tr)
    block = tr.transformer_blocks[0]
    call = block._compiled_call_impl
    compiled, runs = call.compiled, []

    def out_of_memory_once(*args, **kwargs):
        runs.append(1)
        if len(runs) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return compiled(*args, **kwargs)

    call.compiled = out_of_memory_once
    try:
        with torch.no_grad():
            outs = [tr(**kw, return_dict=False)[0] for _ in range(2)]
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    assert len(runs) == 2  # the second call went through the captured graph again
    assert engine_eager_reasons() == {"engine.FluxTransformer2DModel.FluxTransformerBlock": {engine.OUT_OF_MEMORY: 1}}


def test_small_integer_tensors_are_read_as_values_through_containers():
    """A call's small integer CPU tensors become IntValues wherever they sit (tuples, namedtuples,
    lists, dicts); containers with nothing to replace are the call's own objects."""
    import collections

    from exactdit.patches.int_values import IntValues, values_for_ints

    Grid = collections.namedtuple("Grid", "sizes scale")
    sizes = torch.tensor([[2, 3, 4]])
    x = torch.zeros(3)
    call = ((Grid(sizes, 0.5), [x]), {"grid": [sizes], "x": x})
    (grid, kept), kwargs = values_for_ints(call)
    assert type(grid) is Grid and isinstance(grid.sizes, IntValues) and grid.sizes.tolist() == [[2, 3, 4]]
    assert kept is call[0][1] and kwargs["x"] is x and isinstance(kwargs["grid"][0], IntValues)
    plain = ((x,), {"x": x})
    assert values_for_ints(plain) is plain
