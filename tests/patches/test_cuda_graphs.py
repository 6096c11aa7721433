"""CUDA-graph mode, what the CPU can check: when a call may not be replayed from a graph and why,
and that such calls run the model unchanged (replays themselves: tests/patches/test_gpu_cuda_graphs.py)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import exactdit
from exactdit.harness import models
from exactdit.patches import cuda_graphs, engine
from exactdit.patches.cuda_graphs import _ModelWatch
from tests.helpers import assert_bits_equal


@pytest.fixture
def flux():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=3)
    return tr, models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=4)


def test_cpu_calls_run_the_model_and_say_why(flux):
    tr, kw = flux
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        summary = exactdit.patch(tr, cuda_graphs=True)
        out = tr(**kw, return_dict=False)[0]
        assert cuda_graphs.graphed(tr) is not None
        exactdit.unpatch(tr)
    assert summary["cuda_graphs"] and cuda_graphs.graphed(tr) is None
    assert_bits_equal(out, ref)
    reasons = exactdit.report(show=False)["cuda_graphs.FluxTransformer2DModel"]["eager_reasons"]
    assert list(reasons) == ["a tensor argument not on a CUDA device"]


def test_a_compiled_model_keeps_its_compile(flux):
    tr, _ = flux
    tr.compile(backend="eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summary = exactdit.patch(tr, cuda_graphs=True)
    exactdit.unpatch(tr)
    assert summary["cuda_graphs"] is False and any("no CUDA graphs" in str(w.message) for w in caught)
    assert tr._compiled_call_impl is not None and cuda_graphs.graphed(tr) is None


def test_the_state_key_follows_what_a_graph_freezes(flux):
    tr, _ = flux
    watch = _ModelWatch(tr)
    with torch.no_grad():
        key, reason, not_whole = watch.state()
        assert reason is None and not_whole is None and watch.state()[0] == key
        tr.proj_out.weight.mul_(2)  # in place: a replay reads it
        assert watch.state()[0] == key
        tr.proj_out.weight.data = tr.proj_out.weight.data.clone()  # moved
        moved = watch.state()[0]
        assert moved != key
        states = [moved]
        changes = [lambda: tr.train(), lambda: tr.eval(),
                   lambda: tr.transformer_blocks[0].attn.set_processor(type(tr.transformer_blocks[0].attn.processor)()),
                   lambda: setattr(tr.transformer_blocks[0].norm1, "extra", torch.nn.Identity()),  # a new module
                   lambda: delattr(tr.transformer_blocks[0].norm1, "extra"),  # no registration hook fires
                   lambda: setattr(tr.transformer_blocks[0].attn, "fused_projections", True),  # a plain attribute
                   lambda: setattr(tr.transformer_blocks[0], "_chunk_size", 2),  # a new one
                   lambda: tr.pos_embed.register_buffer("extra", torch.zeros(2)),
                   lambda: tr.pos_embed.double(),  # the buffer replaced in its dict, no hook either
                   lambda: setattr(tr.pos_embed, "cache", torch.zeros(3)),  # a tensor kept as a plain attribute
                   lambda: setattr(tr.pos_embed, "cache", torch.zeros(3))]  # ... replaced
        for change in changes:
            change()
            states.append(watch.state()[0])
            assert states[-1] != states[-2] and watch.state()[0] == states[-1]
    tr.proj_out.weight.requires_grad_(True)
    assert watch.state()[1] == "autograd is recording"
    with torch.no_grad():
        assert watch.state()[1] is None


def test_unfusing_qkv_projections_records_again(stand_in):
    """``unfuse_qkv_projections`` deletes the fused layers (``delattr``: no registration hook) and
    sets a plain attribute the attention reads: graphs recorded fused must not replay."""
    kind = stand_in()
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=3)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=4)
    tr.fuse_qkv_projections()
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with torch.no_grad():
            [models.run_forward(tr, kw) for _ in range(2)]
            tr.unfuse_qkv_projections()
            for block in tr.transformer_blocks:
                block.attn.to_q.weight.mul_(2)  # only the unfused layers see it
            outs = [models.run_forward(tr, kw) for _ in range(2)]
    finally:
        exactdit.unpatch(tr)
    ref = models.run_forward(tr, kw)
    for out in outs:
        assert_bits_equal(out, ref)
    assert kind.captures == ["forward"] * 2


def _hook_reason(tr):
    """Why no graph at all, or else why not the whole forward (its blocks may be graphed)."""
    with torch.no_grad():
        _, never, not_whole = _ModelWatch(tr).state()
        return never or not_whole


def test_hooks_a_graph_cannot_hold_are_named(flux):
    from accelerate.hooks import ModelHook, add_hook_to_module
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    tr, _ = flux
    handle = tr.transformer_blocks[0].register_forward_hook(lambda *a: None)
    assert _hook_reason(tr) == "torch forward hooks run Python between kernels"
    handle.remove()
    assert _hook_reason(tr) is None
    add_hook_to_module(tr.proj_out, ModelHook())
    assert "accelerate" in _hook_reason(tr)
    tr2 = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=3)
    apply_first_block_cache(tr2, FirstBlockCacheConfig(threshold=0.3))
    assert "diffusers hooks" in _hook_reason(tr2)


def test_lora_adapters_are_held_and_other_peft_adapters_named(flux):
    from peft import LoHaConfig, LoraConfig

    tr, _ = flux
    tr.add_adapter(LoraConfig(r=4, target_modules=["to_q"]))
    with torch.no_grad():
        assert _hook_reason(tr) is None
    tr.add_adapter(LoHaConfig(r=4, target_modules=["to_k"]), adapter_name="loha")
    with torch.no_grad():
        assert "peft layers other than LoRA's (Linear)" in _hook_reason(tr)


def test_what_lora_layers_read_as_python_is_part_of_the_state(flux):
    """The state a graph is recorded for changes with what a LoRA layer's forward reads as Python
    (active adapters, their weights, disabled, merged), and not when a hot-swap copies new values
    into the scale tensors a graph reads."""
    from tests.ecosystem import lora_state_dict

    tr, _ = flux
    tr.load_lora_adapter(lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    tr.load_lora_adapter(lora_state_dict(tr, 2, rank=4), adapter_name="b", prefix=None)
    watch = _ModelWatch(tr)

    def key():
        with torch.no_grad():
            return watch.state()[0]

    keys = [key()]
    for change in (lambda: tr.set_adapters(["a", "b"], weights=[0.7, 0.4]),
                   lambda: tr.set_adapters(["a", "b"], weights=[0.7, 0.5]),
                   lambda: tr.set_adapters("a"),
                   tr.disable_lora, tr.enable_lora,
                   lambda: tr.fuse_lora(lora_scale=0.8), tr.unfuse_lora):
        change()
        keys.append(key())
        assert keys[-1] != keys[-2], len(keys)
    assert key() == keys[-1]  # nothing changed: the same state


@pytest.mark.parametrize("make", [
    lambda b: b[1:, ::2],                    # a gapped view at an offset
    lambda b: b[:, :1].expand(6, 4),         # broadcast: one memory location per row
    lambda b: b.t(),                         # transposed
    lambda b: b[0, 3],                       # a 0-dim element
], ids=["gapped", "expanded", "transposed", "scalar"])
def test_static_buffers_keep_the_argument_layout_and_alignment(make):
    from exactdit.patches.cuda_graphs import _static_like, _written

    t = make(torch.randn(6, 8))
    static = _static_like(t)
    assert static.stride() == t.stride() and static.shape == t.shape
    assert static.data_ptr() % 64 == t.data_ptr() % 64  # (CUDA blocks: 512; CPU: 64)
    assert torch.equal(static, t)
    fresh = make(torch.randn(6, 8))  # the next call's argument, same key
    _written(static).copy_(_written(fresh))
    assert torch.equal(static, fresh)


# --- block runs: the recording decisions, with a stand-in for CUDA graphs on the CPU ------------------


class _StandInGraph:
    """Replays by running the recorded call again on its static inputs and writing the results
    into its static outputs (what a CUDA graph's replay does to its memory)."""

    def __init__(self, rerun, out):
        self.rerun, self.out = rerun, out

    def replay(self):
        for static, new in zip(pytree.tree_leaves(self.out), pytree.tree_leaves(self.rerun())):
            if isinstance(static, torch.Tensor):
                static.copy_(new)


class StandInGraphs(cuda_graphs._CudaGraphs):
    """CPU tensors accepted; ``fail``: what a capture raises, by what is recorded ("forward", "block")."""

    align = 64  # the CPU allocator's
    clock = None  # nothing timed: block graphs are always kept

    def __init__(self, fail=None):
        self.fail = fail or {}
        self.captures = []

    def unsupported(self, leaves):
        return None if any(isinstance(x, torch.Tensor) for x in leaves) else "no tensor arguments"

    def new_pool(self):
        return "pool"

    def capture(self, pool, alloc, run, what):
        if what in self.fail:
            raise RuntimeError(self.fail[what])
        made = alloc()
        out = run(made)
        self.captures.append(what)
        return _StandInGraph(lambda: run(made), out), made, out

    def failed(self, device):
        pass

    def reserved(self, device):
        return 0

    def empty_cache(self):
        pass

    def unowned(self, t):
        return t


HOST_COPY = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


class ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16, elementwise_affine=False)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, temb, scale=1.0):
        return x + self.proj(self.norm(x) * (1 + temb)) * scale


class ToyModel(torch.nn.Module):
    """Blocks between host work (a mask made on the host each call, as Chroma's forward does)."""

    _repeated_blocks = ["ToyBlock"]

    def __init__(self, blocks=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList([ToyBlock() for _ in range(blocks)])
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x, temb):
        keep = torch.tensor([1.0] * x.shape[0], dtype=x.dtype).view(-1, 1, 1)  # host work
        for block in self.blocks:
            x = block(x, temb)
        return self.out(x * keep)


@pytest.fixture
def stand_in(monkeypatch):
    def make(**fail):
        kind = StandInGraphs(fail)
        monkeypatch.setattr(cuda_graphs, "KIND", kind)
        return kind

    return make


def _toy(seed=0, blocks=3):
    torch.manual_seed(seed)
    return ToyModel(blocks).to(torch.bfloat16).eval()


def _toy_inputs(seed, tokens=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, tokens, 16, generator=g).to(torch.bfloat16),
            torch.randn(2, 1, 16, generator=g).to(torch.bfloat16))


def _entry(name="ToyModel"):
    return exactdit.report(show=False).get(f"cuda_graphs.{name}", {})


def _blocks(name="ToyModel"):
    return exactdit.report(show=False).get(f"cuda_graphs.{name}.blocks", {"fused": 0, "eager": 0, "eager_reasons": {}})


@torch.no_grad()
def _calls(tr, inputs):
    return [tr(*a) for a in inputs]


def _assert_graphed_calls_equal(tr, inputs) -> None:
    """The calls of ``tr`` patched with graphs give the unpatched calls' bits (unpatched after)."""
    refs = _calls(tr, inputs)
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, inputs)
    finally:
        exactdit.unpatch(tr)
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)


def test_a_forward_that_cannot_be_recorded_whole_records_its_blocks(stand_in):
    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    inputs = [_toy_inputs(s) for s in range(4)]
    _assert_graphed_calls_equal(tr, inputs)
    # call 1 runs normally, the whole forward's recording fails; call 2 records each block; 3, 4 replay
    assert kind.captures == ["block"] * 3
    e = _entry()
    assert e["graphed"] == "block runs" and HOST_COPY in e["graphed_why"], e
    assert e["eager_reasons"] == {cuda_graphs.FIRST_CALL: 1, f"block runs: {e['graphed_why']}": 3}
    b = _blocks()
    assert b["fused"] == 9 and b["eager"] == 0, b
    shown = str(exactdit.report(show=False))
    assert "CUDA graphs of ToyModel: block runs (the whole forward cannot be recorded" in shown


def test_a_recordable_forward_is_recorded_whole(stand_in):
    kind = stand_in()
    tr = _toy()
    inputs = [_toy_inputs(s) for s in range(3)]
    _assert_graphed_calls_equal(tr, inputs)
    assert kind.captures == ["forward"]
    assert _entry()["graphed"] == "whole forward" and _entry()["fused"] == 2
    assert _blocks()["fused"] == _blocks()["eager"] == 0


def test_block_graphs_follow_signatures_and_outputs_are_not_overwritten(stand_in):
    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    # two sequence lengths alternate (a true-CFG pipeline's two calls): two signatures per block
    inputs = [_toy_inputs(s, tokens=8 if s % 2 else 4) for s in range(8)]
    refs = _calls(tr, inputs)
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with torch.no_grad():
            outs = []
            for a in inputs:
                outs.append(tr(*a))
                kept = [o.clone() for o in outs]
    finally:
        exactdit.unpatch(tr)
    for out, k, ref in zip(outs, kept, refs):
        assert_bits_equal(out, ref)
        assert_bits_equal(out, k)  # later replays left the returned outputs alone
    assert kind.captures == ["block"] * 6
    assert _blocks()["fused"] == 3 * 6 and _blocks()["eager"] == 0


def test_moved_weights_and_train_eval_drop_the_block_graphs(stand_in):
    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    a = _toy_inputs(1)
    exactdit.patch(tr, cuda_graphs=True)
    try:
        _calls(tr, [a, a, a])
        assert kind.captures == ["block"] * 3
        with torch.no_grad():
            tr.blocks[1].proj.weight.mul_(2)  # in place: the replays read it
        out = _calls(tr, [a])[0]
        assert kind.captures == ["block"] * 3
        for p in tr.parameters():  # moved: a replay would read freed memory
            p.data = p.data.clone()
        graphed = cuda_graphs.graphed(tr)
        _calls(tr, [a])
        assert not any(isinstance(r, cuda_graphs._BlockGraph) for t in graphed.blocks.values() for r in t.values())
        _calls(tr, [a, a])  # verified again, recorded, replayed
        assert kind.captures == ["block"] * 6
        tr.train()
        _calls(tr, [a])  # (a call in train mode: the graphs go)
        assert graphed.summary()["block_graphs"] == 0
        tr.eval()
        _calls(tr, [a])
        assert graphed.summary()["block_graphs"] == 0
        moved = _calls(tr, [a, a])[-1]
    finally:
        exactdit.unpatch(tr)
    ref_in_place = _calls(tr, [a])[0]
    assert_bits_equal(out, ref_in_place)
    assert_bits_equal(moved, ref_in_place)
    assert kind.captures == ["block"] * 9


def test_a_block_with_hooks_on_its_layers_is_not_recorded(stand_in):
    kind = stand_in()
    tr = _toy()
    seen = []
    tr.blocks[1].proj.register_forward_hook(lambda m, i, o: seen.append(1))
    a = _toy_inputs(1)
    ref = _calls(tr, [a])[0]
    seen.clear()
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, [a, a, a])
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    assert kind.captures == ["block"] * 2  # blocks 0 and 2; no attempt at the whole forward
    e = _entry()
    assert e["graphed"] == "block runs" and e["graphed_why"] == "torch forward hooks run Python between kernels"
    b = _blocks()
    assert b["fused"] == 4 and b["eager_reasons"] == {
        cuda_graphs.FIRST_BLOCK_CALL: 2, "torch forward hooks on its layers run Python inside its graph": 3}, b


def test_blocks_under_diffusers_hooks_are_recorded_beneath_them(stand_in):
    from diffusers.hooks import HookRegistry, ModelHook

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    kind = stand_in()
    tr = _toy()
    a = _toy_inputs(2)
    ref = _calls(tr, [a])[0]
    HookRegistry.check_if_exists_or_initialize(tr.blocks[0]).register_hook(Counting(), "counting")
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, [a, a, a])
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    assert Counting.calls == 3  # the hook's Python ran at every call, replays included
    assert kind.captures == ["block"] * 3
    assert "diffusers hooks (counting)" in _entry()["graphed_why"]
    assert _blocks()["fused"] == 6 and _blocks()["eager_reasons"] == {cuda_graphs.FIRST_BLOCK_CALL: 3}


@pytest.mark.parametrize("setup, why", [
    (lambda tr: setattr(tr, "_parallel_config", object()), "context parallelism"),
    (lambda tr: __import__("diffusers").hooks.HookRegistry.check_if_exists_or_initialize(tr.blocks[0]).register_hook(
        __import__("diffusers").hooks.ModelHook(), "group_offloading"), "move or cast weights"),
    (lambda tr: tr.blocks[0].proj.weight.requires_grad_(True), "autograd is recording"),
], ids=["context-parallel", "group-offloading", "autograd"])
def test_what_no_graph_may_hold(stand_in, setup, why):
    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    setup(tr)
    a = _toy_inputs(3)
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with torch.set_grad_enabled(why == "autograd is recording"):
            for _ in range(3):
                tr(*a)
    finally:
        exactdit.unpatch(tr)
    assert kind.captures == []
    e = _entry()
    assert e["graphed"] == "nothing" and why in e["graphed_why"] and e["eager"] == 3, e


class WritingBlock(ToyBlock):
    def forward(self, x, temb, scale=1.0):
        temb.mul_(1)  # writes into an input: the caller's tensor would not see it from a replay
        return super().forward(x, temb, scale)


def test_a_block_that_writes_into_its_inputs_is_not_recorded(stand_in):
    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    tr._repeated_blocks = ["WritingBlock"]
    tr.blocks[1] = WritingBlock().to(torch.bfloat16)
    a = _toy_inputs(4)
    ref = _calls(tr, [a])[0]
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, [a] * 4)
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    assert _blocks()["eager_reasons"] == {"the block writes into its inputs": 3}, _blocks()
    assert _blocks()["fused"] == 0 and kind.captures == ["block"]


def test_a_failed_block_recording_runs_the_block_with_the_reason(stand_in):
    stand_in(forward=HOST_COPY, block="operation not permitted when stream is capturing")
    tr = _toy()
    a = _toy_inputs(5)
    ref = _calls(tr, [a])[0]
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, [a] * 3)
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    why = "recording failed: RuntimeError: operation not permitted when stream is capturing"
    assert _blocks()["eager_reasons"] == {why: 6} and _blocks()["fused"] == 0
    assert cuda_graphs.graphed(tr) is None


@pytest.mark.parametrize("name, lens", [("qwen", [7, 4]), ("chroma", [7, 4])], ids=["qwen-padded", "chroma-padded"])
def test_masked_diffusers_forwards_run_as_block_runs(stand_in, name, lens):
    # the real forwards (masks made and read around the blocks) with a capture that fails on the
    # whole forward as CUDA's does: every engine block call is recorded and replayed, bit for bit
    from exactdit.patches import engine

    kind = stand_in(forward=HOST_COPY)
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=1)
    calls = [models.forward_inputs(name, tr, batch=2, text_len=lens, seed=s, height=32, width=32) for s in range(3)]
    refs = [models.run_forward(tr, kw) for kw in calls]
    try:
        exactdit.patch(tr, cuda_graphs=True)
        with torch.no_grad():
            outs = [models.run_forward(tr, kw) for kw in calls]
    finally:
        exactdit.unpatch(tr)
    for out, ref in zip(outs, refs):
        assert_bits_equal(out, ref)
    per_forward = len(engine.targets(tr))
    assert kind.captures == ["block"] * per_forward
    cls = type(tr).__name__
    assert _entry(cls)["graphed"] == "block runs"
    assert _blocks(cls)["fused"] == 2 * per_forward and _blocks(cls)["eager"] == 0, _blocks(cls)


def test_block_outputs_are_copied_out_with_their_layouts_and_aliasing():
    from exactdit.patches.cuda_graphs import _Outputs

    base = torch.randn(2, 12, 8)
    joint = base[:, 1:]                       # a view at an offset, gapped between rows
    out = (joint[:, :4], joint[:, 4:], torch.arange(6.).view(2, 3).t(), None, 7)
    outputs = _Outputs(out, align=64)
    copied = outputs.copy()
    a, b, c, none, seven = copied
    assert none is None and seven == 7
    for new, old in zip((a, b, c), out[:3]):
        assert torch.equal(new, old) and new.stride() == old.stride() and new.shape == old.shape
        assert new.data_ptr() % 64 == old.data_ptr() % 64 and new.data_ptr() != old.data_ptr()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # still views of one copy
    assert b.data_ptr() - a.data_ptr() == out[1].data_ptr() - out[0].data_ptr()
    base.zero_()  # the next replay rewrites the pool: what was copied out stays
    assert torch.equal(a, copied[0]) and a.abs().sum() > 0


class OptionsBlock(ToyBlock):
    def forward(self, x, temb, scale=1.0, options=None):
        return super().forward(x, temb, options.scale if options is not None else scale)


def test_a_block_given_an_object_is_not_recorded(stand_in):
    import types

    kind = stand_in(forward=HOST_COPY)
    tr = _toy()
    tr._repeated_blocks = ["OptionsBlock"]
    tr.blocks[0] = OptionsBlock().to(torch.bfloat16)
    options = types.SimpleNamespace(scale=1.0)
    forward = tr.forward

    def with_options(x, temb):  # (an instance forward: the whole forward is not recorded either)
        keep = torch.tensor([1.0] * x.shape[0], dtype=x.dtype).view(-1, 1, 1)
        x = tr.blocks[0](x, temb, options=options)
        for block in tr.blocks[1:]:
            x = block(x, temb)
        return tr.out(x * keep)

    a = _toy_inputs(6)
    ref = _calls(tr, [a])[0]
    tr.forward = with_options
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = _calls(tr, [a] * 3)
        options.scale = 0.5  # read at every call: a recording would have frozen 1.0
        halved = _calls(tr, [a])[0]
    finally:
        exactdit.unpatch(tr)
        tr.forward = forward
    for out in outs:
        assert_bits_equal(out, ref)
    assert not torch.equal(halved, ref)
    reasons = _blocks()["eager_reasons"]
    assert reasons == {"an argument that is neither a tensor nor a plain value": 4}, reasons
    assert kind.captures == []


def test_a_deleted_graphed_model_is_released(stand_in):
    import gc
    import weakref

    stand_in(forward=HOST_COPY)
    tr = _toy()
    a = _toy_inputs(7)
    exactdit.patch(tr, cuda_graphs=True)
    outs = _calls(tr, [a] * 3)  # recorded and replayed: block tables, outputs, the runner
    alive = weakref.ref(tr)
    del tr, outs
    gc.collect()
    assert alive() is None


def test_graphed_calls_wait_for_kernels_still_compiling(stand_in, monkeypatch):
    """In CUDA-graph mode a signature's plain call must verify every region before the next one
    records: its calls wait for kernels still compiling in workers (unlike plain patched calls,
    which run such regions eager meanwhile)."""
    from exactdit import gate

    stand_in()
    monkeypatch.delenv("EXACTDIT_WAIT_FOR_KERNELS", raising=False)
    seen = []
    run_engine = engine.EngineCall.run_engine

    def noting(self, *args, **kwargs):
        seen.append(gate.waits_for_kernels())
        return run_engine(self, *args, **kwargs)

    monkeypatch.setattr(engine.EngineCall, "run_engine", noting)
    tr = _toy()
    _assert_graphed_calls_equal(tr, [_toy_inputs(0)])
    assert seen and all(seen)
    assert not gate.waits_for_kernels()
    seen.clear()
    exactdit.patch(tr)
    with torch.no_grad():
        tr(*_toy_inputs(0))
    exactdit.unpatch(tr)
    assert seen and not any(seen)
    seen.clear()  # graph mode, but a call no graph may hold (autograd records): it need not wait either
    exactdit.patch(tr, cuda_graphs=True)
    tr.requires_grad_(True)
    try:
        tr(*_toy_inputs(0))
    finally:
        tr.requires_grad_(False)
        exactdit.unpatch(tr)
    assert seen and not any(seen)


def test_a_lora_hotswap_keeps_the_state(flux):
    """A hot-swap copies the new adapter into the weights and the scale tensors a graph reads (no
    new recording); a graph replayed after it computes the new adapter."""
    from tests.ecosystem import lora_state_dict

    tr, _ = flux
    tr.enable_lora_hotswap(target_rank=8)
    tr.load_lora_adapter(lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    watch = _ModelWatch(tr)
    with torch.no_grad():
        before = watch.state()[0]
        tr.load_lora_adapter(lora_state_dict(tr, 2, rank=8), adapter_name="a", prefix=None, hotswap=True)
        assert watch.state()[0] == before


def test_lora_models_are_recorded_and_record_again_when_their_adapters_change(stand_in):
    """A Flux with two LoRA adapters is recorded whole; a change of the adapters' weights records
    again (the first call after it runs the model), and every call gives the unpatched bits."""
    from tests.ecosystem import lora_state_dict

    kind = stand_in()
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=3)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=4)
    tr.load_lora_adapter(lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    tr.load_lora_adapter(lora_state_dict(tr, 2, rank=4), adapter_name="b", prefix=None)
    weights = ([0.7, 0.4], [0.2, 0.9])
    refs = []
    for w in weights:
        tr.set_adapters(["a", "b"], weights=w)
        refs.append(models.run_forward(tr, kw))
    assert not torch.equal(*refs)
    outs = []
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with torch.no_grad():
            for w in weights:
                tr.set_adapters(["a", "b"], weights=w)
                outs.append([models.run_forward(tr, kw) for _ in range(3)])
    finally:
        exactdit.unpatch(tr)
    for calls, ref in zip(outs, refs):
        for out in calls:
            assert_bits_equal(out, ref)
    assert kind.captures == ["forward"] * 2
    assert _entry("FluxTransformer2DModel")["graphed"] == "whole forward"


def test_a_lora_scale_passed_per_call_records_the_blocks_again(stand_in):
    """Qwen-Image runs as block runs; a pipeline passes the LoRA scale per call
    (``attention_kwargs={"scale": s}``), which diffusers applies to peft's scales inside the
    forward: a block graph recorded at one scale must not replay at another."""
    from tests.ecosystem import lora_state_dict

    kind = stand_in(forward=HOST_COPY)
    tr = models.build_transformer("qwen", "tiny", dtype=torch.bfloat16, seed=1)
    tr.load_lora_adapter(lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    kw = models.forward_inputs("qwen", tr, batch=1, seed=2, height=32, width=32)

    def call(scale):
        return models.run_forward(tr, dict(kw, attention_kwargs={"scale": scale}))

    with torch.no_grad():
        refs = [call(1.0), call(0.5)]
        assert not torch.equal(*refs)
        exactdit.patch(tr, cuda_graphs=True)
        try:
            outs, recorded = [], []
            for scale in (1.0, 0.5):
                outs.append([call(scale) for _ in range(3)])
                recorded.append(len(kind.captures))
        finally:
            exactdit.unpatch(tr)
    for calls, ref in zip(outs, refs):
        for out in calls:
            assert_bits_equal(out, ref)
    # each block again at the new scale (the final norm, without LoRA layers, replays)
    assert recorded[1] - recorded[0] == len(tr.transformer_blocks) and set(kind.captures) == {"block"}


def test_blocks_whose_gguf_weights_are_dequantized_around_them_are_not_recorded(stand_in, tmp_path):
    """GGUF weights are dequantized around each block's call (patches.layer_hooks.hoisted_layers): a
    block graph would read the copies of its recording, so where the forward runs as block runs
    (Qwen-Image's host work) those blocks run unrecorded, with the reason, and equal."""
    import gguf

    from exactdit.patches import diffusers_internals
    from exactdit.patches.graph_watch import GGUF_WEIGHTS
    from tests.ecosystem import load_gguf, write_gguf

    kind = stand_in(forward=HOST_COPY)
    tr = models.build_transformer("qwen", "tiny", dtype=torch.bfloat16, seed=1)
    path = write_gguf(tr, str(tmp_path), gguf.GGMLQuantizationType.Q8_0, arch="qwen")
    tr = load_gguf(type(tr), path, str(tmp_path))
    kw = models.forward_inputs("qwen", tr, batch=2, text_len=[7, 4], seed=2, height=32, width=32)
    ref = models.run_forward(tr, kw)
    try:
        exactdit.patch(tr, cuda_graphs=True)
        with torch.no_grad():
            outs = [models.run_forward(tr, kw) for _ in range(3)]
    finally:
        exactdit.unpatch(tr)
    for out in outs:
        assert_bits_equal(out, ref)
    quantized = [m for _, m in engine.targets(tr) if diffusers_internals.dequantizes_gguf(m)]
    plain = len(engine.targets(tr)) - len(quantized)  # (the final norm's linear is not quantized here)
    assert quantized and kind.captures == ["block"] * plain
    blocks = _blocks(type(tr).__name__)
    assert blocks["eager_reasons"].get(GGUF_WEIGHTS) == 2 * len(quantized), blocks  # (the 1st call: no graph)


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (exactdit[quant])")
def test_weights_inside_tensor_subclasses_are_watched(flux):
    """torchao's quantized weights wrap the tensors a graph reads (their own data_ptr is 0): a new
    tensor inside one changes the state a graph is recorded for, as a moved plain weight does."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    tr, _ = flux
    quantize_(tr, Int8WeightOnlyConfig(), filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and "blocks" in n)
    watch = _ModelWatch(tr)
    with torch.no_grad():
        before = watch.state()[0]
        assert watch.state()[0] == before
        weight = tr.transformer_blocks[0].attn.to_q.weight
        assert weight.data_ptr() == 0 and hasattr(weight, "__tensor_flatten__")
        inner = weight.__tensor_flatten__()[0][0]
        setattr(weight, inner, getattr(weight, inner).clone())  # as a move to another device would
        assert watch.state()[0] != before


def test_an_attention_backend_set_after_recording_records_again(stand_in):
    """``set_attention_backend`` changes what the processors dispatch to (an attribute of each
    processor, and diffusers' process-wide default) without new processors: the graphs recorded
    with the old backend must not replay."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    kind = stand_in()
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=3)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=4)
    active = registry.get_active_backend()[0]
    try:
        exactdit.patch(tr, cuda_graphs=True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (experimental API)
            for _ in range(3):
                models.run_forward(tr, kw)
            tr.set_attention_backend("_native_math")
            outs = [models.run_forward(tr, kw) for _ in range(3)]
        exactdit.unpatch(tr)
        ref = models.run_forward(tr, kw)
    finally:
        registry.set_active_backend(active)
    for out in outs:
        assert_bits_equal(out, ref)
    assert kind.captures == ["forward"] * 2


def test_processor_settings_are_part_of_the_state(flux):
    """What an attention processor's call reads as Python (an IP-Adapter's ``scale`` list, set by
    ``set_ip_adapter_scale``) changes the state a graph is recorded for; other objects it holds
    do not."""
    tr, _ = flux
    processor = tr.transformer_blocks[0].attn.processor
    processor.scale = [0.5]
    watch = _ModelWatch(tr)
    with torch.no_grad():
        before = watch.state()[0]
        processor.scale = [0.5]
        processor.cache = {"a": torch.zeros(1)}  # not a plain value: not part of the state
        assert watch.state()[0] == before
        processor.scale = [0.7]
        assert watch.state()[0] != before


def test_library_switches_set_after_recording_record_again(stand_in):
    """A switch that picks the library kernels eager runs (here SDPA's flash backend, as
    ``sdpa_kernel`` sets it) makes a call another signature: recorded on its own, not replayed
    from the graph recorded under the other setting."""
    kind = stand_in()
    tr = _toy()
    calls = [_toy_inputs(s) for s in range(2)]  # one signature
    flash = torch.backends.cuda.flash_sdp_enabled()
    exactdit.patch(tr, cuda_graphs=True)
    try:
        _calls(tr, calls * 2)
        torch.backends.cuda.enable_flash_sdp(not flash)
        _calls(tr, calls * 2)
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        exactdit.unpatch(tr)
    assert kind.captures == ["forward"] * 2


@pytest.mark.parametrize("switch", ["fp32_precision", "sdp_priority", "math_sdp_reduction"])
def test_tf32_through_the_new_api_and_sdpa_priorities_are_switches_too(stand_in, switch):
    """PyTorch's ``fp32_precision`` TF32 settings (after which reading the legacy ``allow_tf32``
    raises: the graphed call must still run), SDPA's backend priority (``sdpa_kernel(...,
    set_priority=True)``) and reduced precision in SDPA's math kernel: each set after recording
    makes another signature."""
    kind = stand_in()
    tr = _toy()
    calls = [_toy_inputs(s) for s in range(2)]
    cuda = torch.backends.cuda
    saved = (cuda.matmul.fp32_precision, torch._C._get_sdp_priority_order(),
             cuda.fp16_bf16_reduction_math_sdp_allowed())
    exactdit.patch(tr, cuda_graphs=True)
    try:
        _calls(tr, calls * 2)
        if switch == "fp32_precision":
            cuda.matmul.fp32_precision = "tf32"
        elif switch == "sdp_priority":
            torch._C._set_sdp_priority_order(list(reversed(saved[1])))
        else:
            cuda.allow_fp16_bf16_reduction_math_sdp(not saved[2])
        with torch.no_grad():
            outs = [tr(*a) for a in calls * 2]
    finally:
        cuda.matmul.fp32_precision = saved[0]
        torch._C._set_sdp_priority_order(saved[1])
        cuda.allow_fp16_bf16_reduction_math_sdp(saved[2])
        exactdit.unpatch(tr)
    assert kind.captures == ["forward"] * 2 and len(outs) == 4


@pytest.mark.parametrize("fail", [{}, {"forward": HOST_COPY}], ids=["whole", "block runs"])
def test_arguments_that_require_grad_are_not_graphed(stand_in, fail):
    """Gradient guidance: frozen weights, latents that require grad. A replay would hand back
    detached copies (block runs) or a graph's spent autograd state (whole forward): such calls run
    the model, and their outputs and gradients are eager's."""
    kind = stand_in(**fail)
    tr = _toy().requires_grad_(False)

    def grad_of(x, temb):
        x = x.clone().requires_grad_(True)
        out = tr(x, temb)
        out.float().sum().backward()
        return out.detach(), x.grad

    inputs = [_toy_inputs(s) for s in range(3)]
    refs = [grad_of(*a) for a in inputs]
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = [grad_of(*a) for a in inputs]
    finally:
        exactdit.unpatch(tr)
    for (out, grad), (ref, ref_grad) in zip(outs, refs):
        assert_bits_equal(out, ref)
        assert_bits_equal(grad, ref_grad)
    assert kind.captures == []
    assert _entry()["eager_reasons"] == {"autograd is recording (an argument requires grad)": 3}


class FakeEvent:
    """A GPU event stand-in: ``elapsed_time`` gives the milliseconds the test set for the timed call."""

    def __init__(self, now):
        self.now, self.ms = now, None

    def record(self):
        self.ms = self.now[0]  # the duration of the call this event ends

    def query(self):
        return self.ms is not None

    def elapsed_time(self, end):
        return end.ms


def _timed_kind(stand_in, graphs_ms: float, plain_ms: float):
    """A stand-in whose clock times calls with block graphs at ``graphs_ms`` and without at ``plain_ms``."""
    kind = stand_in(forward=HOST_COPY)
    now = [0.0]
    kind.clock = lambda device: (lambda: FakeEvent(now))
    replays = cuda_graphs.GraphedCall._run_blocks

    def run_blocks(self, *a, **k):
        now[0] = graphs_ms
        return replays(self, *a, **k)

    return kind, now, run_blocks


@pytest.mark.parametrize("graphs_ms, plain_ms", [(10.0, 12.0), (12.0, 10.0)])
def test_block_graphs_are_kept_only_where_they_time_faster(stand_in, monkeypatch, graphs_ms, plain_ms):
    """Block runs alternate calls with and without their graphs, timed, and keep the faster way
    after three of each; every call equal to the unpatched model."""
    from exactdit.patches import graph_timing

    kind, now, run_blocks = _timed_kind(stand_in, graphs_ms, plain_ms)
    monkeypatch.setattr(cuda_graphs.GraphedCall, "_run_blocks", run_blocks)
    call = cuda_graphs.GraphedCall._call

    def timed_call(self, *a, **k):
        now[0] = plain_ms  # (a call with graphs sets its own)
        return call(self, *a, **k)

    monkeypatch.setattr(cuda_graphs.GraphedCall, "_call", timed_call)
    tr = _toy()
    # 1: plain, whole recording fails; 2: blocks recorded (not timed); 3-8 alternate; 9-11 the choice
    _assert_graphed_calls_equal(tr, [_toy_inputs(s) for s in range(11)])
    assert 2 * graph_timing.SAMPLES == 6
    e = _entry()
    timed = e["eager_reasons"].get(cuda_graphs.TIMING_CALL)
    assert timed == 3, e
    if graphs_ms < plain_ms:
        assert e["graphed"] == "block runs" and _blocks()["fused"] == 3 * (1 + 3 + 3)
    else:
        assert e["graphed"] == "nothing" and "timed slower" in e["graphed_why"] and "12.0 against 10.0" in e["graphed_why"]
        assert _blocks()["fused"] == 3 * (1 + 3) and len(kind.captures) == 3


def test_an_untimed_stand_in_keeps_replaying_block_graphs():
    from exactdit.patches.graph_timing import BlockGraphTimer

    timer = BlockGraphTimer(None)
    assert all(timer.graphed() for _ in range(10))
    with timer.timing(True), timer.timing(False):
        pass
    assert timer.pending == [] and timer.choice is None


def test_a_recording_that_raised_leaves_the_next_call_with_graphs_untimed():
    """The call with graphs that records them is not timed; one that raised recorded nothing, so
    the next call with graphs (which records) is not timed either."""
    from exactdit.patches.graph_timing import BlockGraphTimer

    now = [5.0]
    timer = BlockGraphTimer(lambda: FakeEvent(now))
    assert timer.graphed()
    with pytest.raises(RuntimeError):
        with timer.timing(True):
            raise RuntimeError("recording failed")
    with timer.timing(True):  # records: untimed
        pass
    assert timer.pending == []
    with timer.timing(True), timer.timing(False):
        pass
    assert [graphed for graphed, _, _ in timer.pending] == [False, True]
