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
    if name == "chroma":  # its forward copies torch.tensor([0] * batch) to the GPU: not recordable
        assert stats["fused"] == 0 and any("recording failed" in r for r in stats["eager_reasons"]), stats
    else:
        assert stats["fused"] == 4 and stats["eager"] == 2, stats  # two recorded, four replayed
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


def test_hooks_keep_their_behaviour_without_graphs():
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
    (kw,) = _calls("flux", tr, [2])
    apply_first_block_cache(tr, FirstBlockCacheConfig(threshold=0.3))
    exactdit.patch(tr, cuda_graphs=True)
    try:
        with tr.cache_context("c"):
            _run(tr, kw)
    finally:
        exactdit.unpatch(tr)
    reasons = _stats("FluxTransformer2DModel")["eager_reasons"]
    assert any("diffusers hooks" in r for r in reasons), reasons
