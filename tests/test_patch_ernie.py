"""exactdit.patch on diffusers' ERNIE-Image transformer (CPU): the patched model computes exactly
what diffusers computes (fused kernels that exist run in Triton's interpreter, the others take
their eager fallback), keeps its structure, and unpatches cleanly."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_ernie_image import (
    ErnieImageSingleStreamAttnProcessor,
    ErnieImageTransformer2DModel,
)

import exactdit
from exactdit.patches import ernie_image
from tests.helpers import assert_bits_equal

TINY = dict(
    hidden_size=64,
    num_attention_heads=2,
    num_layers=2,
    ffn_hidden_size=128,
    in_channels=16,
    out_channels=16,
    text_in_dim=32,
    rope_axes_dim=(8, 12, 12),  # sums to head_dim 32
)


def tiny_model(dtype=torch.float32, seed=0, **overrides) -> ErnieImageTransformer2DModel:
    """Random tiny ERNIE-Image; the zero-initialised layers and the all-ones norm weights get
    random values so every site changes the output."""
    torch.manual_seed(seed)
    model = ErnieImageTransformer2DModel(**{**TINY, **overrides})
    with torch.no_grad():
        for layer in (model.adaLN_modulation[-1], model.final_linear):
            layer.weight.normal_(0, 0.05)
            layer.bias.normal_(0, 0.05)
        for name, p in model.named_parameters():
            if name.endswith(("adaLN_sa_ln.weight", "adaLN_mlp_ln.weight", "norm_q.weight", "norm_k.weight")):
                p.normal_(1, 0.2)
    return model.to(dtype).eval()


def inputs(B, dtype, H=4, W=6, text_lens=(7, 3), seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(text_lens[:B])
    return dict(
        hidden_states=torch.randn(B, TINY["in_channels"], H, W, generator=g).to(dtype),
        timestep=torch.tensor([700.0, 250.0][:B]).to(dtype),
        text_bth=torch.randn(B, int(lens.max()), TINY["text_in_dim"], generator=g).to(dtype),
        text_lens=lens,
    )


def run(model, kw):
    with torch.no_grad():
        return model(**kw).sample


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*should be kept in float32.*")
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 2])
def test_patched_output_equals_eager(dtype, B):
    model = tiny_model(dtype)
    kw = inputs(B, dtype)
    ref = run(model, kw)
    summary = exactdit.patch(model, mirror=True)
    assert summary == {
        "patched": True,
        "already_patched": False,
        "blocks": 2,
        "attention_processors": 2,
        "final_norm": 1,
        "transformer_forward": 1,
    }
    exactdit.reset_report()
    out = run(model, kw)
    assert_bits_equal(out, ref, f"{dtype} B={B}")
    rep = exactdit.report(show=False)
    # every site went through its op, 2 layers
    for op, calls in [("rms_norm_modulate", 2), ("qk_norm_rope", 2), ("gated_rms_norm_modulate", 2),
                      ("geglu", 2), ("residual_gate_add", 2), ("layer_norm_modulate", 1)]:
        assert rep[op]["fused"] + rep[op]["eager"] == calls, op
    assert not any(name.startswith("ernie_image.") for name in rep)  # no site fell back to diffusers' code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_block_output_matches_eager_bits_and_layout(dtype):
    """Not just the final output: each block's and the final norm's output has eager's bits and
    strides (layouts decide GEMM / reduction configurations on the GPU)."""
    model = tiny_model(dtype)
    kw = inputs(2, dtype, H=3, W=5, text_lens=(6, 2))

    def capture():
        seen = []
        hooks = [m.register_forward_hook(lambda m, a, o: seen.append(o)) for m in (*model.layers, model.final_norm)]
        run(model, kw)
        for h in hooks:
            h.remove()
        return seen

    ref = capture()
    exactdit.patch(model, mirror=True)
    out = capture()
    assert len(out) == len(ref) == 3
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_bits_equal(o, r, f"site {i}")


def test_partial_rotary_and_single_text_token():
    """rot_dim < head_dim (the pass-through channels) and a 1-token text."""
    model = tiny_model(torch.bfloat16, rope_axes_dim=(4, 8, 8))
    kw = inputs(2, torch.bfloat16, H=2, W=3, text_lens=(1, 1))
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    assert_bits_equal(run(model, kw), ref)


def test_structure_state_dict_and_processors_unchanged():
    model = tiny_model()
    names = [n for n, _ in model.named_modules()]
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    processors = [b.self_attention.processor for b in model.layers]
    exactdit.patch(model, mirror=True)
    assert [n for n, _ in model.named_modules()] == names
    assert {n: p for n, p in model.named_parameters()} == params  # same Parameter objects
    new_state = model.state_dict()
    assert list(new_state) == list(state)
    for k in state:
        assert torch.equal(new_state[k], state[k])
    for b, proc in zip(model.layers, processors):
        assert b.self_attention.processor is proc  # same object, class swapped
        assert isinstance(proc, ErnieImageSingleStreamAttnProcessor)


def test_save_and_load_pretrained_roundtrip(tmp_path):
    model = tiny_model()
    kw = inputs(1, torch.float32)
    exactdit.patch(model, mirror=True)
    model.save_pretrained(tmp_path)
    loaded = ErnieImageTransformer2DModel.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    # compare against the reloaded model itself: its memory-mapped weights are only 8-byte aligned,
    # and CPU GEMMs give other bits for them than for the original's (eager vs eager)
    ref = run(loaded, kw)
    exactdit.patch(loaded, mirror=True)
    assert_bits_equal(run(loaded, kw), ref, "reloaded, patched")


def test_unpatch_restores_diffusers_forwards():
    model = tiny_model()
    kw = inputs(2, torch.float32)
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    restored = exactdit.unpatch(model)
    assert restored == {"blocks": 2, "attention_processors": 2, "final_norm": 1, "transformer_forward": 1}
    for m in (model, model.final_norm, *model.layers):
        assert "forward" not in m.__dict__ and "_exactdit_original" not in m.__dict__
        assert m.forward.__func__ is type(m).forward
    for b in model.layers:
        assert type(b.self_attention.processor) is ErnieImageSingleStreamAttnProcessor
    exactdit.reset_report()
    assert_bits_equal(run(model, kw), ref)
    assert exactdit.report(show=False) == {}  # nothing went through exactdit
    assert exactdit.unpatch(model) == {"blocks": 0, "attention_processors": 0, "final_norm": 0, "transformer_forward": 0}


def test_patch_twice_is_harmless():
    model = tiny_model(torch.bfloat16)
    kw = inputs(2, torch.bfloat16)
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    forwards = [m.forward for m in (model, model.final_norm, *model.layers)]
    assert exactdit.patch(model, mirror=True)["already_patched"] is True
    assert [m.forward for m in (model, model.final_norm, *model.layers)] == forwards
    assert_bits_equal(run(model, kw), ref)
    exactdit.unpatch(model)
    assert "forward" not in model.__dict__


def test_grad_enabled_runs_diffusers_code_and_report_says_why():
    """Fused ops have no backward: with grad on, every patched site runs diffusers' code (so LoRA
    training works); the report names the sites and the reason."""
    model = tiny_model()
    kw = inputs(2, torch.float32)
    ref = model(**kw).sample
    exactdit.patch(model, mirror=True)
    exactdit.reset_report()
    out = model(**kw).sample  # grad enabled
    assert torch.equal(out, ref)
    out.sum().backward()
    assert model.layers[0].mlp.gate_proj.weight.grad is not None
    rep = exactdit.report(show=False)
    assert rep["ernie_image.transformer"]["eager_reasons"] == {"grad enabled (fused ops have no backward)": 1}
    assert rep["ernie_image.block"]["eager"] == 2 and rep["ernie_image.attention"]["eager"] == 2
    assert "rms_norm_modulate" not in rep
    text = str(exactdit.report(show=False))
    assert "grad enabled" in text


def test_report_shows_op_fallback_reasons():
    model = tiny_model(torch.bfloat16)
    exactdit.patch(model, mirror=True)
    exactdit.reset_report()
    run(model, inputs(1, torch.bfloat16))
    rep = exactdit.report(show=False)
    assert rep["residual_gate_add"]["fused"] == 2 and rep["residual_gate_add"]["verified"]  # kernel ran, verified
    for op in ("rms_norm_modulate", "gated_rms_norm_modulate", "qk_norm_rope", "geglu", "layer_norm_modulate"):
        e = rep[op]
        if e["fused"] == 0:  # kernel not landed yet (or unsupported here): the report says why
            assert e["eager"] > 0 and sum(e["eager_reasons"].values()) == e["eager"], op


def test_disabled_switch_still_exact(monkeypatch):
    monkeypatch.setenv("EXACTDIT_DISABLE", "1")
    model = tiny_model(torch.bfloat16)
    kw = inputs(2, torch.bfloat16)
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    assert_bits_equal(run(model, kw), ref)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(backend):
    model = tiny_model(torch.bfloat16)
    kw = inputs(2, torch.bfloat16)
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    exactdit.reset_report()
    assert_bits_equal(run(compiled, kw), ref, backend)
    assert_bits_equal(run(compiled, kw), ref, backend + " second call")
    rep = exactdit.report(show=False)
    assert rep["residual_gate_add"]["fused"] + rep["residual_gate_add"]["eager"] == 4  # custom op ran the public op


def test_torch_compile_repeated_blocks_fullgraph():
    model = tiny_model(torch.bfloat16)
    kw = inputs(2, torch.bfloat16)
    ref = run(model, kw)
    exactdit.patch(model, mirror=True)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    assert_bits_equal(run(model, kw), ref)


def _sample_args(name):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    S, B, D, H, hd = 5, 2, 16, 2, 8
    x, vec = r(S, B, D), r(1, B, D)
    q, k = r(B, S, H, hd), r(B, S, H, hd)
    return {
        "residual_gate_add": (x, r(B, S, D).permute(1, 0, 2), vec),
        "modulate": (x, vec, vec, True),
        "rms_norm_modulate": (x, r(D), 1e-6, vec, vec, True),
        "gated_rms_norm_modulate": (x, r(S, B, D), vec, r(D), 1e-6, vec, vec, True),
        "rope_tables": (r(B, S, 1, hd), torch.bfloat16),
        "qk_norm_rope": (q, k, r(hd), r(hd), 1e-6, r(B, S, 1, hd), r(B, S, 1, hd)),
        "geglu": (r(S, B, 2 * D), r(S, B, 2 * D)),
        "layer_norm_modulate": (x, 1e-6, vec, vec, None, None, False),
    }[name]


@pytest.mark.parametrize("name", sorted(__import__("exactdit.ops.library", fromlist=["CUSTOM_OPS"]).CUSTOM_OPS))
def test_custom_op_registration(name):
    from exactdit.ops import library

    args = _sample_args(name)
    torch.library.opcheck(
        library.CUSTOM_OPS[name], args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static")
    )
    # the fake (meta) result has eager's shapes, strides and dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = getattr(torch.ops.exactdit, name)(*args)
    with FakeTensorMode() as mode:
        fake = getattr(torch.ops.exactdit, name)(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    real, fake = (real, fake) if isinstance(real, tuple) else ((real,), (fake,))
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_pipeline_objects_accepted():
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    model = tiny_model(torch.bfloat16)
    pipe = ErnieImagePipeline(
        transformer=model, vae=None, text_encoder=None, tokenizer=None, scheduler=FlowMatchEulerDiscreteScheduler()
    )
    g = torch.Generator().manual_seed(0)
    embeds = dict(prompt_embeds=[torch.randn(5, 32, generator=g)], negative_prompt_embeds=[torch.randn(3, 32, generator=g)])

    def sample():
        return pipe(**embeds, height=64, width=96, num_inference_steps=3, output_type="latent",
                    generator=torch.Generator().manual_seed(1), use_pe=False).images

    ref = sample()
    assert exactdit.patch(pipe, mirror=True)["blocks"] == 2
    assert "forward" in model.__dict__
    exactdit.reset_report()
    assert_bits_equal(sample(), ref, "pipeline latents")
    assert exactdit.report(show=False)["qk_norm_rope"]["eager"] + exactdit.report(show=False)["qk_norm_rope"]["fused"] == 6
    exactdit.unpatch(pipe)
    assert "forward" not in model.__dict__
    # anything with a .transformer
    holder = types.SimpleNamespace(transformer=model)
    assert exactdit.patch(holder, mirror=True)["patched"] and exactdit.unpatch(holder)["blocks"] == 2


def test_unsupported_objects():
    with pytest.raises(TypeError):
        exactdit.patch(torch.nn.Linear(2, 2), mirror=True)
    model = tiny_model()

    class OtherProcessor(ErnieImageSingleStreamAttnProcessor):
        pass

    model.layers[1].self_attention.set_processor(OtherProcessor())
    with pytest.warns(UserWarning, match="OtherProcessor"):
        summary = exactdit.patch(model, mirror=True)
    assert summary["patched"] is False
    assert "forward" not in model.__dict__ and "forward" not in model.layers[0].__dict__


def test_source_guard_refuses_changed_diffusers(monkeypatch):
    model = tiny_model()
    monkeypatch.setitem(ernie_image._MIRRORED_SOURCES, "RMSNorm.forward",
                        (ernie_image._MIRRORED_SOURCES["RMSNorm.forward"][0], "0" * 16))
    with pytest.warns(UserWarning, match="source differs"):
        assert exactdit.patch(model, mirror=True)["patched"] is False
    assert "forward" not in model.__dict__


def test_lora_adapter_before_and_after_patch():
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                        target_modules=["to_q", "to_k", "to_v", "to_out.0", "gate_proj", "up_proj", "linear_fc2"])
    kw = inputs(2, torch.float32)
    a = tiny_model()
    a.add_adapter(config)
    ref = run(a, kw)  # unpatched with LoRA
    exactdit.patch(a, mirror=True)
    assert_bits_equal(run(a, kw), ref, "adapter then patch")
    b = tiny_model()
    exactdit.patch(b, mirror=True)
    torch.manual_seed(123)
    b.add_adapter(config)
    b.load_state_dict(a.state_dict())
    assert_bits_equal(run(b, kw), ref, "patch then adapter")
    assert set(b.state_dict()) == set(a.state_dict())


def test_accelerate_hooks_either_order():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    kw = inputs(2, torch.float32)
    model = tiny_model()
    ref = run(model, kw)
    # hook after patch (what enable_model_cpu_offload does to a patched pipeline)
    exactdit.patch(model, mirror=True)
    add_hook_to_module(model, Counting())
    exactdit.reset_report()
    assert_bits_equal(run(model, kw), ref)
    assert Counting.calls == 1 and exactdit.report(show=False)["geglu"]["eager"] + exactdit.report(show=False)["geglu"]["fused"] == 2
    exactdit.unpatch(model)  # hook stays, diffusers' forward under it
    assert_bits_equal(run(model, kw), ref)
    assert Counting.calls == 2 and model._old_forward.__func__ is ErnieImageTransformer2DModel.forward
    # patch after hook
    exactdit.patch(model, mirror=True)
    exactdit.reset_report()
    assert_bits_equal(run(model, kw), ref)
    assert Counting.calls == 3 and "geglu" in exactdit.report(show=False)
    remove_hook_from_module(model)  # leaves the patched forward in place
    assert model.forward.__func__ is ernie_image.transformer_forward
    exactdit.unpatch(model)
    assert "forward" not in model.__dict__


def test_sequential_offload_style_hooks_refused():
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_model()
    add_hook_to_module(model.layers[0].adaLN_sa_ln, ModelHook())
    with pytest.warns(UserWarning, match="accelerate hook"):
        assert exactdit.patch(model, mirror=True)["patched"] is False
