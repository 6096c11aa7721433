"""Malformed calls name the function that was called; ``unpatch`` has one result shape."""

import pytest
import torch

import exactdit
from exactdit.harness import models


def test_unpatch_of_something_else_names_unpatch():
    with pytest.raises(TypeError, match=r"^exactdit\.unpatch: .*NoneType"):
        exactdit.unpatch(None)
    with pytest.raises(TypeError, match=r"^exactdit\.patch: .*NoneType"):
        exactdit.patch(None)


def test_unpatch_of_an_unpatched_model_says_nothing_was_restored():
    assert exactdit.unpatch(torch.nn.Linear(2, 2)) == {"restored": {}}


def test_patch_of_a_pipeline_without_a_transformer_says_what_is_missing():
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    from exactdit.harness.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline()
    pipe.transformer = None
    for call in (exactdit.patch, exactdit.unpatch):
        with pytest.raises(TypeError, match=rf"^exactdit\.{call.__name__}: ErnieImagePipeline has no transformer to "
                                            rf"{call.__name__} \(its transformer is None\)$"):
            call(pipe)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), norm_num_groups=8,
                       layers_per_block=1, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    ddpm = DDPMPipeline(unet=unet, scheduler=DDPMScheduler())
    with pytest.raises(TypeError, match=r"^exactdit\.patch: DDPMPipeline has no transformer to patch \(its denoiser "
                                        r"is a UNet, pipe\.unet; exactdit patches diffusion transformers\)$"):
        exactdit.patch(ddpm)


def test_the_cuda_graph_switch_is_a_bool_and_turns_the_mode_off_too():
    from exactdit.patches import cuda_graphs

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=1)
    with pytest.raises(TypeError, match="cuda_graphs must be True or False, got 'no'"):
        exactdit.patch(tr, cuda_graphs="no")
    try:
        assert exactdit.patch(tr, cuda_graphs=True)["cuda_graphs"] is True and cuda_graphs.graphed(tr)
        assert exactdit.patch(tr)["cuda_graphs"] is False and cuda_graphs.graphed(tr) is None
    finally:
        exactdit.unpatch(tr)


def test_context_parallelism_takes_a_pipeline_or_says_what_it_needs():
    from types import SimpleNamespace

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=1)
    seen = []
    tr.enable_parallelism = lambda config, cp_plan: seen.append((config, cp_plan))
    exactdit.enable_context_parallel(SimpleNamespace(transformer=tr), "config")
    assert seen and seen[0][0] == "config" and seen[0][1]
    with pytest.raises(TypeError, match="expected a diffusers transformer or pipeline, got object"):
        exactdit.enable_context_parallel(object(), "config")


def test_both_transformers_of_a_wan22_pipeline_are_patched_and_unpatched():
    """Wan 2.2 A14B: ``transformer_2`` runs the low-noise steps; it was left to diffusers' code (and
    a pipeline with only ``transformer_2`` raised "no transformer")."""
    import diffusers

    from exactdit.patches.engine import EngineCall

    p = models.build_pipeline("wan", "tiny", seed=0, dtype=torch.bfloat16)
    second = models.build_transformer("wan", "tiny", dtype=torch.bfloat16, seed=7)
    pipe = diffusers.WanPipeline(tokenizer=p.tokenizer, text_encoder=p.text_encoder, vae=p.vae, scheduler=p.scheduler,
                                 transformer=p.transformer, transformer_2=second, boundary_ratio=0.5)

    def patched(model):
        return sum(isinstance(m._compiled_call_impl, EngineCall) for m in model.modules())

    blocks = len(second.blocks)
    summary = exactdit.patch(pipe)
    assert summary["patched"] and set(summary["models"]) == {"transformer", "transformer_2"}
    assert patched(pipe.transformer) >= blocks and patched(second) >= blocks
    assert summary["modules"]["WanTransformerBlock"] == 2 * blocks
    assert exactdit.unpatch(pipe)["restored"]["WanTransformerBlock"] == 2 * blocks
    assert patched(pipe.transformer) == patched(second) == 0
    pipe.register_modules(transformer=None)
    assert exactdit.patch(pipe)["modules"]["WanTransformerBlock"] == blocks and patched(second) >= blocks
    exactdit.unpatch(pipe)


def test_blocks_compiled_before_patching_get_their_compile_back():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=1)
    tr.compile_repeated_blocks(backend="eager")
    block = tr.transformer_blocks[0]
    before = block._compiled_call_impl
    assert before is not None
    with pytest.warns(UserWarning, match="were compiled"):
        exactdit.patch(tr)
    assert block._compiled_call_impl is not before
    exactdit.unpatch(tr)
    assert block._compiled_call_impl is before


def test_patch_takes_dynamic_as_torch_compile_does():
    with pytest.raises(TypeError, match=r"^exactdit\.patch: dynamic must be None, True or False, got 'auto'$"):
        exactdit.patch(torch.nn.Linear(2, 2), dynamic="auto")


@pytest.mark.parametrize("dynamic", [True, False])
def test_dynamic_chooses_when_blocks_are_captured_with_symbolic_sizes(dynamic):
    """True: the first call captures each block class with symbolic sizes, and new resolutions are
    lowered from it (no capture); False: every new resolution is captured again, nothing lowered.
    Equal to the unpatched forward either way; patching again with the other value switches."""
    from exactdit import first_calls, state
    from tests.engine_helpers import engine_eager_reasons, uncompile

    def count(phase):
        return first_calls.totals().get(phase, (0.0, 0))[1]

    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    sizes = ((32, 32), (48, 64), (64, 32))
    kws = [models.forward_inputs("flux", tr, batch=1, height=h, width=w, seed=7) for h, w in sizes]
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in kws]
        state.reset()
        torch._dynamo.reset()
        exactdit.patch(tr, dynamic=not dynamic)
        exactdit.patch(tr, dynamic=dynamic)  # the latest wins
        try:
            outs, counts = [], []
            for kw in kws:
                outs.append(tr(**kw, return_dict=False)[0])
                counts.append((count("capture"), count("specialize")))
        finally:
            exactdit.unpatch(tr)
            uncompile(tr)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs))
    assert engine_eager_reasons() == {}
    captures, lowerings = zip(*counts)
    if dynamic:  # the first call captures (symbolic) and lowers; the others only lower
        assert captures[0] == captures[1] == captures[2] > 0 and 0 < lowerings[0] < lowerings[1] < lowerings[2], counts
    else:
        assert 0 < captures[0] < captures[1] < captures[2] and lowerings == (0, 0, 0), counts


def test_dynamic_leaves_no_marks_on_the_callers_tensors():
    """``dynamic=True`` marks the sizes of the blocks' inputs for the first capture only: a tensor
    the caller passes in (HunyuanVideo's blocks take the text states as given) carries no marks
    after, and marks of its own are as they were."""
    from tests import minis
    from tests.engine_helpers import uncompile

    tr = minis.build("hunyuan-video", dtype=torch.float32, seed=4)
    kw = minis.forward_inputs("hunyuan-video", tr, batch=2, seed=5)
    torch._dynamo.maybe_mark_dynamic(kw["hidden_states"], 0)
    with torch.no_grad():
        torch._dynamo.reset()
        exactdit.patch(tr, dynamic=True)
        try:
            tr(**kw, return_dict=False)
        finally:
            exactdit.unpatch(tr)
            uncompile(tr)
    text = kw["encoder_hidden_states"]
    assert not hasattr(text, "_dynamo_weak_dynamic_indices") and not hasattr(text, "_has_dynamo_dim_marking")
    assert kw["hidden_states"]._dynamo_weak_dynamic_indices == {0}


def test_dynamic_puts_back_the_marks_of_a_tensor_passed_twice():
    """A tensor passed to a block twice (positional and keyword) is marked once and left as it came."""
    from exactdit.patches.engine import _MARKS, _sizes_symbolic

    t = torch.randn(2, 3)
    with _sizes_symbolic(((t,), {"encoder_hidden_states": t})):
        assert t._dynamo_weak_dynamic_indices == {0, 1}
    assert not any(k in t.__dict__ for k in _MARKS), {k: t.__dict__.get(k) for k in _MARKS}


def test_dynamic_true_captures_every_layout_of_the_first_forward_symbolic():
    """``dynamic=True`` marks each block's first call, not only its class's: HunyuanVideo's first
    single block takes the double blocks' output and the next one a slice of the first's, two layouts
    of one class in one forward. Both are captured symbolic, so a new resolution captures nothing."""
    from exactdit import first_calls, state
    from tests import minis
    from tests.engine_helpers import engine_eager_reasons, uncompile

    tr = minis.build("hunyuan-video", dtype=torch.bfloat16, seed=4)
    grids = (minis.Grid(2, 4, 6, 5), minis.Grid(3, 6, 8, 5))
    kws = [minis.forward_inputs("hunyuan-video", tr, batch=1, seed=5, grid=g) for g in grids]
    with torch.no_grad():
        refs = [tr(**kw, return_dict=False)[0] for kw in kws]
        state.reset()
        torch._dynamo.reset()
        exactdit.patch(tr, dynamic=True)
        try:
            outs, captures = [], []
            for kw in kws:
                outs.append(tr(**kw, return_dict=False)[0])
                captures.append(first_calls.totals()["capture"][1])
        finally:
            exactdit.unpatch(tr)
            uncompile(tr)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs)) and engine_eager_reasons() == {}
    assert captures[0] == captures[1], captures


# --- what changes after a capture (review findings; each failed before its fix) ---


def _flux_forward_patched_and_eager(change):
    """Tiny Flux fp32: a patched forward (the capture), ``change()``, then the patched and the
    unpatched forwards; ``change`` returns what undoes it."""
    from tests.engine_helpers import uncompile

    tr = models.build_transformer("flux", "tiny", dtype=torch.float32, seed=1)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=2)
    undo = None
    exactdit.patch(tr)
    try:
        with torch.no_grad():
            tr(**kw, return_dict=False)
            undo = change(tr)
            out = tr(**kw, return_dict=False)[0]
            exactdit.unpatch(tr)
            ref = tr(**kw, return_dict=False)[0]
    finally:
        if undo is not None:
            undo.remove()
        exactdit.unpatch(tr)
        uncompile(tr)
    return out, ref


def test_a_hook_added_to_a_layer_after_the_capture_runs():
    # Dynamo's default skips guards on a layer's empty hook dicts: the captured graph ran without it
    out, ref = _flux_forward_patched_and_eager(
        lambda tr: tr.transformer_blocks[0].attn.to_out[0].register_forward_hook(lambda m, i, o: o + 1))
    assert torch.equal(out, ref), (out - ref).abs().max()


def test_a_hook_for_every_module_registered_after_the_capture_runs():
    # Dynamo guards the global hook dicts by type only: the blocks run diffusers' code while they exist
    out, ref = _flux_forward_patched_and_eager(lambda tr: torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 2 if type(m) is torch.nn.Linear else None))
    assert torch.equal(out, ref), (out - ref).abs().max()


def test_a_block_given_a_numpy_array_raises_eagers_error():
    # Dynamo took the array as a tensor and the patched call returned an output
    from tests.engine_helpers import uncompile

    tr = models.build_transformer("flux", "tiny", dtype=torch.float32, seed=1)
    block, dim = tr.single_transformer_blocks[0], tr.inner_dim
    hidden = torch.randn(1, 4, dim)
    kwargs = dict(encoder_hidden_states=torch.randn(1, 3, dim), temb=torch.randn(1, dim),
                  image_rotary_emb=(torch.ones(7, 16), torch.zeros(7, 16)))
    with torch.no_grad():
        with pytest.raises(TypeError) as eager_error:
            block(hidden.numpy(), **kwargs)
        exactdit.patch(tr)
        try:
            block(hidden, **kwargs)  # captured
            with pytest.raises(TypeError) as patched_error:
                block(hidden.numpy(), **kwargs)
        finally:
            exactdit.unpatch(tr)
            uncompile(tr)
    assert str(patched_error.value) == str(eager_error.value)
