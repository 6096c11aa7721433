"""Mini models (:mod:`tests.minis`): more diffusers transformer classes at tiny configs.
On the CPU: which blocks the engine finds, every block class captured, each captured graph
rewritten and held to the graph run with CUDA's reduction orders (kernels in the interpreter),
and ``exactdit.patch`` capturing every block of the model without running any of diffusers' code."""

from __future__ import annotations

import pytest
import torch

import exactdit
from exactdit.patches.engine import repeated_blocks
from tests import minis
from exactdit.harness.metrics import outputs_equal
from exactdit.harness.models import run_forward
from exactdit.patches.engine import RECAPTURES_ALLOWED
from tests.engine_helpers import assert_recaptured_blocks_fall_back, capture_graphs, engine_eager_reasons, rewrite_and_check

NAMES = list(minis.MINIS)
#: held to CUDA's orders in the interpreter, one per kind of graph the others repeat (the
#: interpreter runs each row-per-program kernel program by program: 1-3 minutes per model);
#: tests/minis/test_gpu_minis.py holds every mini to CUDA eager itself. sd3: LayerNorm modulation and
#: RMSNorm of permuted q/k; flux2: SwiGLU, per-head norms with 4-axis RoPE; hunyuan-video: token
#: refiner, sliced cats; ltx-video: RMSNorm across heads; lumina2: grouped-query, sandwich norms;
#: cogvideox: values handed to ATen; pixart-sigma: BasicTransformerBlock; mochi: data-dependent
#: sizes; ltx2-video: audio and video streams; kandinsky5: a bare-tensor output; cosmos3: size-1 dims (one
#: generation token) whose strides eager keeps.
INTERPRETED = ["sd3", "flux2", "hunyuan-video", "ltx-video", "lumina2", "cogvideox", "pixart-sigma", "mochi",
               "ltx2-video", "kandinsky5", "cosmos3"]


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
    ref, summary, out = _unpatched_and_patched(tr, kw)
    assert summary["patched"] and set(summary["modules"]) >= set(repeated_blocks(tr))
    assert engine_eager_reasons() == {}
    assert outputs_equal(out, ref)  # Cosmos3: a list of per-item tensors


def _unpatched_and_patched(tr, kw):
    """The unpatched forward, ``exactdit.patch``'s summary and the patched forward (unpatched after)."""
    ref = run_forward(tr, kw)
    summary = exactdit.patch(tr)
    try:
        return ref, summary, run_forward(tr, kw)
    finally:
        exactdit.unpatch(tr)


#: minis at 1-layer configs, as diffusers' own tests build these classes: the lone block of the
#: model's block list is patched (issue 35 item 16)
LONE_BLOCK = {name: {"num_layers": 1} for name in ("pixart-sigma", "sana", "hunyuan-dit", "dit", "latte", "allegro",
                                                   "transformer-temporal")}


def assert_blocks_captured_and_equal(tr, kw, blocks) -> None:
    """``exactdit.patch(tr)`` patches every module of the classes ``blocks``, each class is captured
    whole (a graph of it in ``exactdit.report()``, none in parts, no block run as diffusers' code), and
    the patched forward is ``torch.equal`` to the unpatched one."""
    from exactdit.engine import coverage

    ref, summary, out = _unpatched_and_patched(tr, kw)
    assert summary["patched"], summary
    model = type(tr).__name__
    for cls in blocks:
        assert summary["modules"].get(cls) == sum(type(m).__name__ == cls for m in tr.modules()), (cls, summary)
        assert any(k.startswith(f"{model}.{cls}#") for k in exactdit.report(show=False)), (cls, exactdit.report())
    assert engine_eager_reasons() == {} and not coverage.in_parts()
    assert outputs_equal(out, ref)


@pytest.mark.parametrize("name", list(LONE_BLOCK))
def test_a_lone_block_is_patched(name):
    tr = minis.build(name, dtype=torch.float32, seed=4, overrides=LONE_BLOCK[name])
    blocks = repeated_blocks(tr)
    lists = [m for m in tr.modules() if isinstance(m, torch.nn.ModuleList) and len(m) and type(m[0]).__name__ in blocks]
    assert blocks and lists and all(len(m) == 1 for m in lists)  # Latte: a spatial and a temporal list of one
    assert_blocks_captured_and_equal(tr, minis.forward_inputs(name, tr, batch=2, seed=5), blocks)


def test_lone_blocks_of_a_class_without_a_mini_are_found():
    """HunyuanVideo-Framepack at the 1-layer config diffusers tests it with (no mini: its inputs
    are many): its lone dual- and single-stream blocks are blocks (built on the meta device)."""
    import diffusers

    with torch.device("meta"):
        tr = diffusers.HunyuanVideoFramepackTransformer3DModel(num_layers=1, num_single_layers=1, num_refiner_layers=1)
    assert {"HunyuanVideoTransformerBlock", "HunyuanVideoSingleTransformerBlock",
            "HunyuanVideoIndividualTokenRefinerBlock"} <= set(repeated_blocks(tr))


def test_blocks_a_model_runs_but_does_not_list_are_patched():
    """HunyuanVideo's token-replace configuration (image-to-video) runs block classes its
    ``_repeated_blocks`` omits: the members of its block lists are patched all the same (issue 35
    item 17)."""
    tr = minis.build("hunyuan-video", dtype=torch.float32, seed=4, overrides={"image_condition_type": "token_replace"})
    replace = ("HunyuanVideoTokenReplaceTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock")
    assert not set(replace) & set(tr._repeated_blocks) and set(replace) <= set(repeated_blocks(tr))
    assert_blocks_captured_and_equal(tr, minis.forward_inputs("hunyuan-video", tr, batch=2, seed=5), replace)


def _wan_animate_2_generation_inputs(kv_cache, seed: int = 6) -> dict:
    """WanAnimate2's generation pass (``kv_cache_mode="cached"``: flex attention over the generation
    tokens and the cached reference) for one sample, as diffusers' tests run it."""
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=[minis.randn(g, 16, 3, 4, 4)], timestep=torch.tensor([500.0]),
                encoder_hidden_states=[minis.randn(g, 8, 32)], condition_latents=[minis.randn(g, 20, 3, 4, 4)],
                encoder_hidden_states_image=minis.randn(g, 1, 4, 1280), kv_cache=kv_cache, kv_cache_mode="cached",
                seq_len=12, reference_grid_sizes=torch.tensor([[2, 2, 2]]), origin_len=5, origin_area=[32, 32])


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_block_computing_shapes_from_an_integer_tensor_is_captured_whole(dynamic):
    """WanAnimate2's blocks read the patch grid from a (1, 3) integer tensor (``grid_sizes.tolist()``
    in ``rope_apply``) and slice by its products; Dynamo turns the values into unbacked symbols and
    cannot guard on ``freqs[0][:f]`` ("Could not guard on data-dependent expression 6*u4 < 2"). The
    blocks are handed the values instead (``IntValues``) and captured whole: the reference pass (its
    K/V cache too) and the generation pass equal diffusers' (issue 35 item 18). Under
    ``dynamic=True`` that second capture is the block's first too: its sizes are symbolic."""
    from exactdit import first_calls, state
    from exactdit.engine import coverage

    tr = minis.build("wan-animate-2", dtype=torch.float32, seed=4)
    ref_kw, kw = (minis.forward_inputs("wan-animate-2", tr, batch=2, seed=5) for _ in range(2))
    with torch.no_grad():
        ref = run_forward(tr, ref_kw)
        one = minis.forward_inputs("wan-animate-2", tr, batch=1, seed=5)
        run_forward(tr, one)  # a one-sample cache for the generation pass
        ref_gen = run_forward(tr, _wan_animate_2_generation_inputs(one["kv_cache"]))
        state.reset()
        torch._dynamo.reset()
        exactdit.patch(tr, dynamic=dynamic)
        try:
            out = run_forward(tr, kw)
            gen = run_forward(tr, _wan_animate_2_generation_inputs(one["kv_cache"]))
        finally:
            exactdit.unpatch(tr)
    assert outputs_equal(out, ref) and outputs_equal(gen, ref_gen)
    assert (first_calls.totals().get("specialize", (0, 0))[1] > 0) == dynamic  # made concrete from symbolic sizes
    for a, b in zip(kw["kv_cache"].layer_caches, ref_kw["kv_cache"].layer_caches):
        assert torch.equal(a.key, b.key) and torch.equal(a.value, b.value)
    graphs = [k for k in exactdit.report(show=False) if k.startswith("WanAnimate2Transformer3DModel.WanAnimate2TransformerBlock#")]
    assert len({k.split(".r")[0] for k in graphs}) == 2  # one graph per pass, each run by both blocks
    assert engine_eager_reasons() == {} and not coverage.in_parts()


def test_int_values_read_as_the_tensor_reads():
    from exactdit.patches.int_values import IntValues, values_for_ints

    t = torch.tensor([[2, 3, 4], [5, 6, 7]])
    v = values_for_ints(t)
    assert isinstance(v, IntValues) and v.tolist() == t.tolist() and v.tolist() is not v.values
    assert v[1].tolist() == t[1].tolist() and v[1][2].item() == t[1][2].item() and [r.tolist() for r in v] == t.tolist()
    assert (v.shape, v.dim(), v.numel(), len(v), v.dtype) == (t.shape, t.dim(), t.numel(), len(t), t.dtype)
    with pytest.raises(RuntimeError):
        v.item()
    with pytest.raises(AttributeError):
        v.float()  # only reads are modelled: a capture using the tensor otherwise fails
    floats, big, flags = torch.ones(3), torch.arange(65), torch.tensor([True])
    args = (floats, big, flags, "x")
    assert values_for_ints(args) is args and values_for_ints({"a": args}) is not None


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


def test_repeated_blocks_are_listed_and_the_members_of_block_lists():
    # listed, and a list's class the model does not list (issue 35 item 17)
    assert repeated_blocks(_Listed()) == ("_Block", "Extra")
    unlisted = _Listed()
    unlisted._repeated_blocks = ()
    assert repeated_blocks(unlisted) == ("_Block", "Extra")
    unlisted.blocks.append(torch.nn.Linear(8, 8))  # a list of mixed classes holds no block
    assert repeated_blocks(unlisted) == ("Extra",)
    assert repeated_blocks(torch.nn.Sequential(_Block(), _Block())) == ()
    lone = _Listed()
    lone._repeated_blocks = ()
    lone.blocks, lone.extra = torch.nn.ModuleList([_Block()]), torch.nn.ModuleList()
    assert repeated_blocks(lone) == ("_Block",)  # a block list of one (item 16); an empty one holds none


class _Staged(torch.nn.Module):
    """Lists inside listed blocks, and stages holding listed blocks, are captured with those blocks."""

    _repeated_blocks = ("_Stage",)

    class _Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.ModuleList([_Block(), _Block()])

    class _Group(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stage = _Staged._Stage()

    def __init__(self):
        super().__init__()
        self.stages = torch.nn.ModuleList([_Staged._Stage()])
        self.groups = torch.nn.ModuleList([_Staged._Group(), _Staged._Group()])


class _Stage2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.resnets = torch.nn.ModuleList([_Block(), _Block()])
        self.downsamplers = torch.nn.ModuleList([_Listed.Extra()])  # a lone list inside a list: no block


class _UNetLike(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = torch.nn.ModuleList([_Stage2(), torch.nn.Linear(8, 8)])  # mixed: looked into
        self.temporal_in = _Staged._Stage()  # a lone _Block list in it, _Stage being no block here
        self.mids = torch.nn.ModuleList([_Staged._Group()])  # holds a _Stage, which holds _Blocks


def test_lists_inside_or_around_listed_blocks_add_no_block():
    assert repeated_blocks(_Staged()) == ("_Stage",)
    # _Group is a lone block at the top; _Block, inside _Group's modules, is then no block anywhere
    # (a class is patched in all its instances, and no block may lie inside a block)
    assert repeated_blocks(_UNetLike()) == ("_Group",)


def test_a_model_without_repeated_blocks_is_left_unpatched_with_the_reason():
    with pytest.warns(UserWarning, match="no repeated blocks"):
        summary = exactdit.patch(torch.nn.Sequential(_Block(), _Block()))
    assert not summary["patched"] and "no repeated blocks" in summary["reason"]
