"""CUDA-graph mode on the GPU: replays equal eager diffusers bit for bit.

Two input signatures alternate (as a true-CFG pipeline's conditional and unconditional calls do),
fresh values arrive at every call, and every output is compared with ``torch.equal`` against the
unpatched model on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

import exactdit
from exactdit.harness import models
from exactdit.harness.metrics import outputs_equal
from exactdit.patches import cuda_graphs

pytestmark = pytest.mark.gpu

IMAGE_MODELS = [n for n in models.model_names() if not models.get_spec(n).video]


def _calls(name, tr, seeds):
    # two sizes alternate: two signatures, each recorded once and replayed with new values
    return [models.forward_inputs(name, tr, batch=1, seed=s, height=64 + 32 * (s % 2), width=64) for s in seeds]


@torch.no_grad()
def _run(tr, kw):
    return models.run_forward(tr, kw)


def _stats(name):
    return exactdit.report(show=False)[f"cuda_graphs.{name}"]


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_replays_equal_eager(name):
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    calls = _calls(name, tr, range(6))
    refs = [_run(tr, kw) for kw in calls]
    try:
        summary = exactdit.patch(tr, cuda_graphs=True)
        outs = [_run(tr, kw) for kw in calls]
    finally:
        exactdit.unpatch(tr)
    assert summary["cuda_graphs"]
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert outputs_equal(out, ref), f"call {k}"
    stats = _stats(type(tr).__name__)
    if stats["graphed"] == "block runs":  # a forward with host work (Chroma's): its blocks are graphed
        assert name in ("chroma", "qwen") and "recording failed" in stats["graphed_why"], stats
        _assert_block_runs(tr, signatures=2, calls_each=3)
    else:
        assert stats["graphed"] == "whole forward", stats
        assert stats["fused"] == 4 and stats["eager"] == 2, stats  # two recorded, four replayed
    assert not any(v["disabled"] for v in exactdit.report(show=False).values())


def _assert_block_runs(tr, signatures, calls_each):
    """Per signature: the first call runs normally, the second records every block call and
    replays it, then calls alternate without and with the block graphs while they are timed
    (graph_timing: fewer calls than the choice needs); a block never runs outside a graph in a
    call with graphs."""
    from exactdit.patches import engine, graph_timing

    assert calls_each <= 2 * graph_timing.SAMPLES + 1  # (no choice made yet)
    with_graphs = sum(1 for k in range(2, calls_each + 1) if k % 2 == 0)
    name = type(tr).__name__
    per_forward = len(engine.targets(tr))  # each engine target is called once per forward
    blocks = _stats(f"{name}.blocks")
    assert blocks["fused"] == signatures * with_graphs * per_forward and blocks["eager"] == 0, blocks
    stats = _stats(name)
    assert stats["graphed"] == "block runs", stats
    assert stats["eager_reasons"][cuda_graphs.FIRST_CALL] == signatures, stats
    without = calls_each - 1 - with_graphs
    assert stats["eager_reasons"].get(cuda_graphs.TIMING_CALL, 0) == signatures * without, stats


def _mask_cases():
    # Qwen-Image with a text mask of all ones and with padding (two prompt lengths in the batch),
    # Chroma with its padded mask: forwards that create or read host tensors
    return ["qwen-ones", "qwen-padded", "chroma"]


def _masked_calls(case, tr, seeds):
    name = case.split("-")[0]
    calls = []
    for s in seeds:
        size = 64 + 32 * (s % 2)
        if case == "qwen-ones":
            kw = models.forward_inputs(name, tr, batch=2, text_len=[7, 7], seed=s, height=size, width=64)
            kw["encoder_hidden_states_mask"] = torch.ones(kw["encoder_hidden_states"].shape[:2], dtype=torch.long,
                                                          device=kw["encoder_hidden_states"].device)
        elif case == "qwen-padded":
            kw = models.forward_inputs(name, tr, batch=2, text_len=[7, 4], seed=s, height=size, width=64)
            assert kw["encoder_hidden_states_mask"] is not None
        else:
            kw = models.forward_inputs(name, tr, batch=2, text_len=[7, 4], seed=s, height=size, width=64)
        calls.append(kw)
    return calls


@pytest.mark.parametrize("case", _mask_cases())
def test_masked_forwards_graph_their_blocks_bit_identically(case):
    name = case.split("-")[0]
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    calls = _masked_calls(case, tr, range(6))
    refs = [_run(tr, kw) for kw in calls]
    try:
        summary = exactdit.patch(tr, cuda_graphs=True)
        outs = [_run(tr, kw) for kw in calls]
        kept = [o.clone() for o in outs]
        graphed = cuda_graphs.graphed(tr).summary()
    finally:
        exactdit.unpatch(tr)
    assert summary["cuda_graphs"]
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert outputs_equal(out, ref), f"call {k}"
        assert outputs_equal(out, kept[k]), f"call {k} overwritten by a later replay"
    stats = _stats(type(tr).__name__)
    assert stats["graphed"] == "block runs", stats
    assert "Cannot copy between CPU and CUDA" in stats["graphed_why"] or "recording failed" in stats["graphed_why"]
    _assert_block_runs(tr, signatures=2, calls_each=3)
    assert graphed["block_graphs"] > 0 and graphed["graphs"] == 0 and graphed["memory_bytes"] >= 0, graphed
    assert "block runs" in str(exactdit.report(show=False))
    assert not any(v["disabled"] for v in exactdit.report(show=False).values())


def test_outputs_are_not_overwritten_by_the_next_replay():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    first, second = _calls("flux", tr, [2, 4])
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with torch.no_grad():
            tr(**first)
            a = tr(**first, return_dict=False)[0]
            kept = a.clone()
            tr(**second, return_dict=False)
    finally:
        exactdit.unpatch(tr)
    assert torch.equal(a, kept)


def test_weights_changed_in_place_are_read_and_moved_weights_recorded_again():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    (kw,) = _calls("flux", tr, [2])
    exactdit.patch(tr, cuda_graphs=True)
    try:
        _run(tr, kw)
        _run(tr, kw)
        with torch.no_grad():
            tr.proj_out.weight.mul_(2)  # same address: the replay reads the new values
        in_place = _run(tr, kw)
        for p in tr.parameters():  # new addresses: a replay would read freed memory
            p.data = p.data.clone()
        moved = _run(tr, kw)
    finally:
        exactdit.unpatch(tr)
    ref = _run(tr, kw)
    assert outputs_equal(in_place, ref) and outputs_equal(moved, ref)
    stats = _stats("FluxTransformer2DModel")
    assert stats["eager"] == 2 and stats["fused"] == 2, stats
    assert cuda_graphs.graphed(tr) is None


def test_lora_replays_follow_adapter_changes():
    """peft LoRA adapters: replays equal the unpatched model after ``set_adapters`` weights
    change, after a hot-swap (which also resets the swapped adapter's weight: recorded again) and
    after ``fuse_lora``."""
    from tests.ecosystem import lora_state_dict

    def build():
        tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
        tr.enable_lora_hotswap(target_rank=8)
        tr.load_lora_adapter(lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
        tr.load_lora_adapter(lora_state_dict(tr, 2, rank=8), adapter_name="b", prefix=None)
        return tr

    def steps(tr):
        yield tr.set_adapters(["a", "b"], weights=[0.7, 0.4])
        yield tr.set_adapters(["a", "b"], weights=[0.2, 0.9])
        yield tr.load_lora_adapter(lora_state_dict(tr, 3, rank=8), adapter_name="a", prefix=None, hotswap=True)
        yield tr.fuse_lora(lora_scale=0.8)

    unpatched, tr = build(), build()
    (kw,) = _calls("flux", tr, [2])
    refs = [_run(unpatched, kw) for _ in steps(unpatched)]
    exactdit.patch(tr, cuda_graphs=True)
    try:
        outs = [[_run(tr, kw) for _ in range(3)] for _ in steps(tr)]
    finally:
        exactdit.unpatch(tr)
    for calls, ref in zip(outs, refs):
        assert all(outputs_equal(out, ref) for out in calls)
    assert len(set(r.sum().item() for r in refs)) == len(refs)  # each step changed the output
    assert _stats("FluxTransformer2DModel")["fused"] > 0


def test_cache_hooks_keep_their_python_and_the_blocks_beneath_replay():
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    def build():
        tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
        apply_first_block_cache(tr, FirstBlockCacheConfig(threshold=0.05))
        return tr

    ref_tr, tr = build(), build()
    # steps whose inputs drift slowly: the cache computes some steps and reuses others
    base = _calls("flux", tr, [2])[0]
    steps = []
    for k in range(8):
        kw = dict(base)
        kw["hidden_states"] = base["hidden_states"] + 0.02 * k
        steps.append(kw)
    with ref_tr.cache_context("c"):
        refs = [_run(ref_tr, kw) for kw in steps]
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with tr.cache_context("c"):
            outs = [_run(tr, kw) for kw in steps]
    finally:
        exactdit.unpatch(tr)
    for k, (out, ref) in enumerate(zip(outs, refs)):
        assert outputs_equal(out, ref), f"step {k}"
    stats = _stats("FluxTransformer2DModel")
    assert stats["graphed"] == "block runs" and "diffusers hooks" in stats["graphed_why"], stats
    assert _stats("FluxTransformer2DModel.blocks")["fused"] > 0


@pytest.mark.parametrize("case", ["flux", "chroma"])  # a whole-forward graph, block runs
def test_a_deleted_graphed_model_leaves_no_memory(case):
    import gc
    import weakref

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tr = models.build_transformer(case, "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    kw = _calls(case, tr, [2])[0]
    exactdit.patch(tr, cuda_graphs=True)
    for _ in range(3):
        _run(tr, kw)
    assert _stats(type(tr).__name__)["graphed"] == ("whole forward" if case == "flux" else "block runs")
    alive = weakref.ref(tr)
    del tr, kw
    gc.collect()
    torch.cuda.synchronize()
    assert alive() is None
    # (cuBLAS keeps a workspace per stream it ran on: the recording stream's stays)
    assert torch.cuda.memory_allocated() - before <= 0.1 * 2**30


def test_pool_records_again_after_its_graphs_are_gone():
    """A model's pool outlives its graphs: a recording that dropped its graph (as a failed whole
    forward does) while a tensor it allocated lives on must not stop the next recording into the
    same pool (with a bare ``graph_pool_handle`` the allocator asserts ``use_count > 0``)."""
    kind = cuda_graphs.KIND
    pool = kind.new_pool()
    x = torch.randn(1024, device="cuda")
    kept = []

    def run(_):
        kept.append(x * 2)  # allocated in the pool, alive after its graph is gone
        return kept[-1] + 1

    graph, _, _ = kind.capture(pool, lambda: None, run, "forward")
    del graph
    torch.cuda.synchronize()
    graph, _, out = kind.capture(pool, lambda: None, run, "block")
    x.copy_(torch.randn(1024, device="cuda"))
    graph.replay()
    assert torch.equal(out, x * 2 + 1)
