"""Mini models (:mod:`exactdit.harness.minis`): more diffusers transformer classes at tiny configs.
On the CPU: which blocks the engine finds, every block class captured, each captured graph
rewritten and held to the graph run with CUDA's reduction orders (kernels in the interpreter),
and ``exactdit.patch`` capturing every block of the model without running any of diffusers' code."""

from __future__ import annotations

import pytest
import torch

import exactdit
from exactdit.engine.capture import repeated_blocks
from exactdit.harness import minis
from exactdit.harness.models import run_forward
from exactdit.patches.engine import RECAPTURES_ALLOWED
from tests.engine_helpers import assert_recaptured_blocks_fall_back, capture_graphs, engine_eager_reasons, rewrite_and_check

NAMES = list(minis.MINIS)
#: held to CUDA's orders in the interpreter, one per kind of graph the others repeat (the
#: interpreter runs each row-per-program kernel program by program: 1-3 minutes per model);
#: tests/harness/test_gpu_minis.py holds every mini to CUDA eager itself. sd3: LayerNorm modulation and
#: RMSNorm of permuted q/k; flux2: SwiGLU, per-head norms with 4-axis RoPE; hunyuan-video: token
#: refiner, sliced cats; ltx-video: RMSNorm across heads; lumina2: grouped-query, sandwich norms;
#: cogvideox: values handed to ATen; pixart-sigma: BasicTransformerBlock; mochi: data-dependent
#: sizes; ltx2-video: audio and video streams; kandinsky5: a bare-tensor output.
INTERPRETED = ["sd3", "flux2", "hunyuan-video", "ltx-video", "lumina2", "cogvideox", "pixart-sigma", "mochi",
               "ltx2-video", "kandinsky5"]


@pytest.mark.parametrize("name", INTERPRETED)
def test_captured_blocks_equal_cuda_order(name):
    tr = minis.build(name, dtype=torch.bfloat16, seed=4)
    kw = minis.forward_inputs(name, tr, batch=1, seed=5)
    graphs = capture_graphs(tr, kw)
    assert {cls for cls, _, _ in graphs} == set(repeated_blocks(tr))
    # a block may hold nothing to fuse (HunyuanVideo's patch embedding: one convolution)
    reports = [rewrite_and_check(gm, inputs, name, need_regions=False) for _, gm, inputs in graphs]
    assert sum(len(r.regions) for r in reports) >= len(reports)


def test_each_capture_counts_the_blocks_that_ran_it():
    """HunyuanVideo's first single block gets its image stream in the patch embedding's layout, the
    others in the row-major layout of the cat before them: two graphs of one class, each credited
    with the blocks that ran it (what the coverage report weights its times by)."""
    tr = minis.build("hunyuan-video", dtype=torch.bfloat16, seed=4)
    graphs = capture_graphs(tr, minis.forward_inputs("hunyuan-video", tr, batch=1, seed=5))
    calls = {}
    for cls, gm, _ in graphs:
        assert gm.meta["calls"] >= 1
        calls.setdefault(cls, []).append(gm.meta["calls"])
    assert len(calls["HunyuanVideoSingleTransformerBlock"]) == 2
    for cls, counts in calls.items():
        assert sum(counts) == sum(type(m).__name__ == cls for m in tr.modules()), (cls, counts)


@pytest.mark.parametrize("name", NAMES)
def test_patch_captures_every_block(name):
    tr = minis.build(name, dtype=torch.float32, seed=4)
    if minis.MINIS[name].eager is not None:  # a known limit
        kws = [minis.forward_inputs(name, tr, batch=2, seed=s) for s in range(5, 5 + RECAPTURES_ALLOWED + 3)]
        return assert_recaptured_blocks_fall_back(tr, kws, run_forward)
    kw = minis.forward_inputs(name, tr, batch=2, seed=5)
    ref = run_forward(tr, kw)
    summary = exactdit.patch(tr)
    try:
        out = run_forward(tr, kw)
    finally:
        exactdit.unpatch(tr)
    assert summary["patched"] and set(summary["modules"]) >= set(repeated_blocks(tr))
    assert engine_eager_reasons() == {}
    assert torch.equal(out, ref)


PRODUCTION = [name for name, m in minis.MINIS.items() if m.production is not None]
#: parameters of the released models (billions, as their model cards state them)
RELEASED_PARAMS = {"flux2": 32.2, "sd3": 8.1, "hunyuan-video": 12.8, "ltx-video": 1.9, "cogvideox": 5.6}


@pytest.mark.parametrize("name", PRODUCTION)
def test_production_config_is_the_released_model(name):
    from exactdit.harness.models.core import thaw

    spec = minis.MINIS[name]
    with torch.device("meta"):
        tr = spec.transformer_cls(**thaw(spec.production.config))
    assert round(sum(p.numel() for p in tr.parameters()) / 1e9, 1) == RELEASED_PARAMS[name]
    assert set(repeated_blocks(tr)) == set(repeated_blocks(minis.build(name)))


@pytest.mark.parametrize("name", PRODUCTION)
def test_inputs_follow_the_grid(name):
    """A mini's inputs at another grid give an output that many more latent positions."""
    spec = minis.MINIS[name]
    tr = minis.build(name, dtype=torch.float32, seed=4)
    small = minis.Grid(1, 4, 6, 5) if not spec.video else minis.Grid(2, 4, 6, 5)
    large = minis.Grid(small.frames * 2 if spec.video else 1, 8, 10, 9)
    outs = [run_forward(tr, minis.forward_inputs(name, tr, batch=1, seed=5, grid=g)) for g in (small, large)]
    positions = [g.frames * g.height * g.width for g in (small, large)]
    assert outs[1].numel() * positions[0] == outs[0].numel() * positions[1]
    with pytest.raises(ValueError, match="no production config"):
        minis.forward_inputs("pixart-sigma", tr, grid=small)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.proj(x)


class _Listed(torch.nn.Module):
    _repeated_blocks = ("_Block",)

    def __init__(self):
        super().__init__()
        self.head = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])  # torch.nn's: no block
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.extra = torch.nn.ModuleList([_Listed.Extra(), _Listed.Extra()])

    class Extra(_Block):
        pass


def test_repeated_blocks_are_listed_or_the_modules_lists_repeat():
    assert repeated_blocks(_Listed()) == ("_Block",)  # listed: the list wins
    unlisted = _Listed()
    unlisted._repeated_blocks = ()
    assert repeated_blocks(unlisted) == ("_Block", "Extra")
    unlisted.blocks.append(torch.nn.Linear(8, 8))  # a list of mixed classes holds no repeated block
    assert repeated_blocks(unlisted) == ("Extra",)
    assert repeated_blocks(torch.nn.Sequential(_Block(), _Block())) == ()


def test_a_model_without_repeated_blocks_is_left_unpatched_with_the_reason():
    with pytest.warns(UserWarning, match="no repeated blocks"):
        summary = exactdit.patch(torch.nn.Sequential(_Block(), _Block()))
    assert not summary["patched"] and "no repeated blocks" in summary["reason"]
