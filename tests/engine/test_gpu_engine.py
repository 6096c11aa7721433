"""The engine on the GPU: every registered model's tiny config, patched, against eager diffusers.

``torch.equal`` of one forward's output, patched vs unpatched, with every region verified on its
first signature (a region that differed would run eager and show as disabled, which fails here).
"""

from __future__ import annotations

import pytest
import torch

from exactdit.engine import coverage
from exactdit.harness import models
from exactdit.harness.models import qwen
from exactdit.harness.metrics import outputs_equal
from tests.engine_helpers import (assert_patched_equals_eager, engine_eager_reasons, flux_recording_reasons,
                                  graph_break_then, wrap_feed_forward)

pytestmark = pytest.mark.gpu


def _assert_patched_equals_eager(tr, kw):
    assert_patched_equals_eager(tr, kw, models.run_forward)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", models.model_names())
def test_tiny_model_equal_to_eager(name, dtype):
    tr = models.build_transformer(name, "tiny", dtype=dtype, device="cuda", seed=1)
    video = dict(num_frames=5) if models.get_spec(name).video else {}
    _assert_patched_equals_eager(tr, models.forward_inputs(name, tr, batch=2, seed=2, height=128, width=128, **video))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_qwen_image_edit_equal_to_eager(dtype):
    # two image streams per row, the condition's tokens modulated per token (zero_cond_t)
    cfg = {**models.get_spec("qwen").config("tiny"), **qwen.EDIT_CONFIG}
    tr = models.build_transformer("qwen", cfg, dtype=dtype, device="cuda", seed=1)
    kw = models.forward_inputs("qwen", tr, batch=2, seed=2, height=128, width=128)
    _assert_patched_equals_eager(tr, qwen.with_condition_image(kw, seed=3))


@pytest.mark.parametrize("name", ["qwen", "zimage"])
def test_prompts_of_different_lengths_equal_to_eager(name):
    # B = 2 with prompts of 77 and 5 tokens: padded text (Qwen: a mask; Z-Image: padded captions)
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    _assert_patched_equals_eager(tr, models.forward_inputs(name, tr, batch=2, seed=2, height=128, width=128,
                                                           text_len=[77, 5]))


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("use_stream", [False, True], ids=["sync", "stream"])
@pytest.mark.parametrize("first", ["unpatched", "patched"])
def test_group_offloaded_blocks_run_fused_inside_their_hooks(first, use_stream, offload_type):
    # parameters on the CPU between calls, moved in by diffusers' hooks around each block, or
    # around each layer (leaf level: those hooks run for the whole block around its call). With
    # streams the prefetch order is recorded on the first forward: layer by layer (unpatched
    # first), or block by block (patched first)
    from diffusers.hooks import apply_group_offloading

    import exactdit

    cfg = {**models.get_spec("flux").config("tiny"), "num_layers": 2, "num_single_layers": 3}
    tr = models.build_transformer("flux", cfg, dtype=torch.bfloat16, device="cuda", seed=1)
    kw = models.forward_inputs("flux", tr, batch=2, seed=2, height=128, width=128)
    resident = models.run_forward(tr, kw)
    apply_group_offloading(tr.to("cpu"), onload_device=torch.device("cuda"), offload_device=torch.device("cpu"),
                           offload_type=offload_type, use_stream=use_stream,
                           **({"num_blocks_per_group": 1} if offload_type == "block_level" else {}))
    torch._dynamo.reset()
    if first == "unpatched":
        _assert_patched_equals_eager(tr, kw)
        assert outputs_equal(models.run_forward(tr, kw), resident)
    else:
        def on_gpu():  # (a block's offloads may wait for the next block's onloads, not past the forward)
            return {n for n, p in tr.named_parameters() if p.device.type == "cuda"}

        exactdit.patch(tr)
        try:
            outs, left = [], []
            for _ in range(3):
                outs.append(models.run_forward(tr, kw))
                left.append(on_gpu())
        finally:
            exactdit.unpatch(tr)
        assert all(outputs_equal(out, resident) for out in outs + [models.run_forward(tr, kw)])
        assert left == [on_gpu()] * 3
    recorded = first == "patched" and use_stream and offload_type == "leaf_level"  # (the first forward, unfused)
    assert engine_eager_reasons() == (flux_recording_reasons(double=2, single=3) if recorded else {})
    assert not coverage.in_parts()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_block_with_a_graph_break_captured_in_parts_equal_to_eager(dtype):
    tr = models.build_transformer("flux", "tiny", dtype=dtype, device="cuda", seed=1)
    kw = models.forward_inputs("flux", tr, batch=2, seed=2, height=128, width=128)
    wrap_feed_forward(tr.transformer_blocks[0], graph_break_then)
    torch._dynamo.reset()  # no graph of an earlier test's blocks
    _assert_patched_equals_eager(tr, kw)
    assert engine_eager_reasons() == {}
    assert list(coverage.in_parts()) == ["FluxTransformer2DModel.FluxTransformerBlock"]


def test_calls_while_kernels_compile_equal_eager_and_fuse_afterwards(monkeypatch):
    """The default first calls (no EXACTDIT_WAIT_FOR_KERNELS): regions whose kernels the compile
    workers have not finished run their ATen nodes; every call equals eager, and once every kernel
    is compiled no region runs eager for compiling any more, none is disabled."""
    import re

    import exactdit
    from exactdit import gate
    from exactdit.device import compile_workers

    def regions():
        return {n: r for n, r in exactdit.report(show=False).items() if re.search(r"#\d+\.r\d+$", n)}

    def compiling():
        return sum(r["eager_reasons"].get(gate.COMPILING, 0) for r in regions().values())

    monkeypatch.delenv("EXACTDIT_WAIT_FOR_KERNELS", raising=False)
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=7)
    kw = models.forward_inputs("flux", tr, batch=2, seed=8, height=128, width=128)
    ref = models.run_forward(tr, kw)
    exactdit.patch(tr)
    try:
        outs = [models.run_forward(tr, kw)]
        compile_workers.wait_all()
        outs.append(models.run_forward(tr, kw))  # verifies what compiled since
        before = compiling()
        outs.append(models.run_forward(tr, kw))
        after = compiling()
    finally:
        exactdit.unpatch(tr)
    assert all(outputs_equal(out, ref) for out in outs)
    assert after == before
    assert any(r["verified"] for r in regions().values())
    assert not any(r["disabled"] for r in regions().values())
