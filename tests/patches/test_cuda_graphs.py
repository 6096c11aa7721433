"""CUDA-graph mode, what the CPU can check: when a call may not be replayed from a graph and why,
and that such calls run the model unchanged (replays themselves: tests/patches/test_gpu_cuda_graphs.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import exactdit
from exactdit.harness import models
from exactdit.patches import cuda_graphs
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
        key, reason = watch.state()
        assert reason is None and watch.state()[0] == key
        tr.proj_out.weight.mul_(2)  # in place: a replay reads it
        assert watch.state()[0] == key
        tr.proj_out.weight.data = tr.proj_out.weight.data.clone()  # moved
        moved = watch.state()[0]
        assert moved != key
        states = [moved]
        changes = [lambda: tr.train(), lambda: tr.eval(),
                   lambda: tr.transformer_blocks[0].attn.set_processor(type(tr.transformer_blocks[0].attn.processor)()),
                   lambda: setattr(tr.transformer_blocks[0].norm1, "extra", torch.nn.Identity())]  # a new module
        for change in changes:
            change()
            states.append(watch.state()[0])
            assert states[-1] != states[-2] and watch.state()[0] == states[-1]
    tr.proj_out.weight.requires_grad_(True)
    assert watch.state()[1] == "autograd is recording"
    with torch.no_grad():
        assert watch.state()[1] is None


def _hook_reason(tr):
    with torch.no_grad():
        return _ModelWatch(tr).state()[1]


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


def test_lora_adapters_are_named(flux):
    from peft import LoraConfig

    tr, _ = flux
    tr.add_adapter(LoraConfig(r=4, target_modules=["to_q"]))
    assert "LoRA" in _hook_reason(tr)


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
