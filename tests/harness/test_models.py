"""The model registry (CPU, tiny configs): every registered model's real diffusers pipeline builds
offline and samples deterministically, ``forward_inputs`` reproduces the kwargs the pipeline passes its
transformer, and the builder leaves parameter dtypes as ``from_pretrained(torch_dtype=...)`` does."""

import gc
from types import SimpleNamespace

import pytest
import torch

from exactdit.harness import models

NAMES = models.model_names()
#: one spec per transformer class (flux-schnell and wan-1.3b share their family's code and widths)
FAMILIES = ("ernie", "flux", "chroma", "qwen", "zimage", "wan")
PROMPT = "a photo of a cat"  # 5 words for the word-level tiny tokenizers

#: Real text tokens the tiny tokenizers give PROMPT (and the empty negative prompt where CFG rows
#: share one call), as each pipeline forms them: ERNIE [uncond, cond] rows of bare words (the empty
#: prompt becomes BOS); T5 adds EOS; Qwen-Image keeps the chat suffix after dropping the template's 34
#: prefix tokens; Z-Image the whole chat turn. Flux ignores it (every prompt is padded, unmasked).
PIPELINE_TEXT_LENS = {"ernie": (1, 5), "flux": 5, "flux-schnell": 5, "chroma": 6, "qwen": 10, "zimage": 13,
                      "wan": 6, "wan-1.3b": 6}

_PIPES: dict = {}


def tiny_pipe(name):
    if name not in _PIPES:
        _PIPES[name] = models.build_pipeline(name, "tiny", seed=0)
    return _PIPES[name]


def call_kwargs(name, seed=0, steps=2):
    # production-style call (guidance, negative prompt, sequence length) at a tiny geometry
    return models.pipeline_call_kwargs(name, prompt=PROMPT, height=32, width=48, num_frames=5, steps=steps,
                                       seed=seed)


def latents_of(out):
    return out.frames if hasattr(out, "frames") else out.images


def capture_first_call(pipe, kw):
    calls = []

    def hook(module, args, kwargs):
        calls.append((args, dict(kwargs)))

    handle = pipe.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = latents_of(pipe(**kw))
    finally:
        handle.remove()
    args, kwargs = calls[0]
    if args:  # Z-Image passes (x, t, cap_feats) positionally
        kwargs.update(zip(("x", "t", "cap_feats"), args))
    kwargs.pop("return_dict", None)
    return out, kwargs


def describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list) and value and isinstance(value[0], torch.Tensor):
        return [describe(v) for v in value]
    return value


def test_registry():
    assert NAMES[:7] == ("ernie", "flux", "flux-schnell", "chroma", "qwen", "zimage", "wan")
    for name in NAMES:
        spec = models.get_spec(name)
        assert set(models.CONFIG_NAMES) <= set(spec.configs)
        with pytest.raises(TypeError):
            spec.configs["tiny"]["num_layers"] = 3  # specs are read-only
        assert spec.config("tiny") is not spec.config("tiny")  # callers get copies
    with pytest.raises(ValueError, match="unknown model"):
        models.get_spec("sd3")
    with pytest.raises(ValueError, match="unknown config"):
        models.build_transformer("flux", "huge")


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_samples_offline_and_deterministically(name):
    pipe = tiny_pipe(name)
    a = latents_of(pipe(**call_kwargs(name, seed=1)))
    b = latents_of(pipe(**call_kwargs(name, seed=1)))
    c = latents_of(pipe(**call_kwargs(name, seed=2)))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.isfinite(a).all() and a.float().std() > 0.1


@pytest.mark.parametrize("name", NAMES)
def test_forward_inputs_are_what_the_pipeline_passes(name):
    spec = models.get_spec(name)
    pipe = tiny_pipe(name)
    kw = call_kwargs(name, steps=1)
    _, seen = capture_first_call(pipe, kw)
    mine = models.forward_inputs(name, pipe.transformer, height=32, width=48,
                                 num_frames=5 if spec.video else None,
                                 text_len=PIPELINE_TEXT_LENS[name], max_text_len=kw.get("max_sequence_length", 512))
    assert mine.keys() == seen.keys()
    for key in seen:
        assert describe(mine[key]) == describe(seen[key]), key
    # inputs that do not depend on the noise or the text are reproduced exactly
    for key in ("img_ids", "txt_ids", "guidance", "attention_mask", "text_lens"):
        if isinstance(seen.get(key), torch.Tensor):
            assert torch.equal(mine[key], seen[key]), key

    out = models.run_forward(pipe.transformer, mine)
    if isinstance(out, list):  # Z-Image: one prediction per image
        assert [o.shape for o in out] == [x.shape for x in mine["x"]]
        out = torch.stack(out)
    else:
        assert out.shape == mine["hidden_states"].shape
    assert torch.isfinite(out).all() and out.float().std() > 0


@pytest.mark.parametrize("name", NAMES)
def test_transformer_weights_are_seeded_and_never_zero(name):
    a = models.build_transformer(name, "tiny", seed=3)
    b = models.build_transformer(name, "tiny", seed=3)
    c = models.build_transformer(name, "tiny", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in sa if sa[k].numel() > 1)
    # layers diffusers zero-initialises (modulation, output projections) get random weights too
    assert all(p.abs().sum() > 0 for p in a.parameters())
    assert not any(p.requires_grad for p in a.parameters()) and not a.training


@pytest.mark.parametrize("name", NAMES)
def test_dtypes_match_from_pretrained(name, tmp_path):
    spec = models.get_spec(name)
    built = models.build_transformer(name, "tiny", seed=0, dtype=torch.bfloat16)
    spec.transformer_cls(**spec.config("tiny")).save_pretrained(tmp_path)
    loaded = spec.transformer_cls.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)

    def dtypes(m):
        return {**{k: v.dtype for k, v in m.named_parameters()}, **{k: v.dtype for k, v in m.named_buffers()}}

    assert dtypes(built) == dtypes(loaded)
    keep = spec.transformer_cls._keep_in_fp32_modules
    if keep:  # Wan: its RoPE / time embedder / modulation / norms really stay float32
        kept = {k for k, p in built.named_parameters() if any(m in k.split(".") for m in keep)}
        assert kept and all(built.get_parameter(k).dtype == torch.float32 for k in kept)
        assert any(p.dtype == torch.bfloat16 for p in built.parameters())
        assert models.estimate_bytes(name, "tiny", torch.bfloat16) == sum(
            p.numel() * p.element_size() for p in built.parameters())


def _io_only(name, config):
    """The full config's input/output widths (latent and text features) with one narrow block."""
    cfg = models.get_spec(name).config(config)
    slim = {
        "ernie": dict(hidden_size=128, num_attention_heads=1, num_layers=1, ffn_hidden_size=64),
        "flux": dict(num_layers=1, num_single_layers=1, num_attention_heads=1),
        "chroma": dict(num_layers=1, num_single_layers=1, num_attention_heads=1, approximator_hidden_dim=32,
                       approximator_layers=1),
        "qwen": dict(num_layers=1, num_attention_heads=1),
        "zimage": dict(dim=128, n_heads=1, n_kv_heads=1, n_layers=1, n_refiner_layers=1),
        "wan": dict(num_layers=1, num_attention_heads=1, ffn_dim=64),
    }
    return dict(cfg, **slim[name])


@pytest.mark.parametrize("name", FAMILIES)
def test_full_width_components_run_in_the_pipeline(name):
    """Text encoders emit the production feature widths (e.g. T5 4096 + CLIP 768 for Flux) and the VAE
    has the production scale factor: the pipeline runs with a transformer of full input widths."""
    pipe = models.build_pipeline(name, _io_only(name, "full"), seed=0, dtype=torch.bfloat16)
    spec = models.get_spec(name)
    kw = models.pipeline_call_kwargs(name, prompt=PROMPT, height=32, width=32, num_frames=5, steps=1)
    out, seen = capture_first_call(pipe, kw)
    assert torch.isfinite(out.float()).all()
    mine = models.forward_inputs(name, pipe.transformer, height=32, width=32, num_frames=5 if spec.video else None,
                                 text_len=PIPELINE_TEXT_LENS[name], max_text_len=kw.get("max_sequence_length", 512))
    assert {k: describe(v) for k, v in mine.items()} == {k: describe(v) for k, v in seen.items()}


#: One production forward per model (batch and text as the production pipeline runs them).
PRODUCTION_SHAPES = {
    "ernie": dict(hidden_states=(2, 128, 64, 64), text_bth=(2, 128, 3072), timestep=(2,)),
    "flux": dict(hidden_states=(1, 4096, 64), encoder_hidden_states=(1, 512, 4096), pooled_projections=(1, 768),
                 img_ids=(4096, 3), txt_ids=(512, 3), guidance=(1,)),
    "flux-schnell": dict(hidden_states=(1, 4096, 64), encoder_hidden_states=(1, 256, 4096), txt_ids=(256, 3)),
    "chroma": dict(hidden_states=(1, 4096, 64), encoder_hidden_states=(1, 512, 4096), attention_mask=(1, 4608)),
    "qwen": dict(hidden_states=(1, 83 * 83, 64), encoder_hidden_states=(1, 128, 3584)),
    "zimage": dict(t=(1,)),
    "wan": dict(hidden_states=(1, 16, 21, 90, 160), encoder_hidden_states=(1, 512, 4096), timestep=(1,)),
    "wan-1.3b": dict(hidden_states=(1, 16, 21, 60, 104), encoder_hidden_states=(1, 512, 4096)),
}


@pytest.mark.parametrize("name", NAMES)
def test_forward_inputs_default_to_production_shapes(name):
    from diffusers.configuration_utils import FrozenDict

    spec = models.get_spec(name)
    # forward_inputs reads only config, dtype and device: no need to build the 12B-20B model here
    stand_in = SimpleNamespace(config=FrozenDict(spec.config("full")), dtype=torch.bfloat16, device=torch.device("cpu"))
    kw = models.forward_inputs(name, stand_in)
    for key, shape in PRODUCTION_SHAPES[name].items():
        assert tuple(kw[key].shape) == shape, key
    floats = [v for v in kw.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert floats and {v.dtype for v in floats} <= {torch.bfloat16, torch.float32}
    if name == "zimage":
        assert [tuple(x.shape) for x in kw["x"]] == [(16, 1, 128, 128)]
        assert [tuple(c.shape) for c in kw["cap_feats"]] == [(128, 2560)]
    if name == "qwen":
        assert kw["img_shapes"] == [[(1, 83, 83)]] and kw["encoder_hidden_states_mask"] is None
    if name == "flux-schnell":
        assert kw["guidance"] is None
    if spec.video:
        with pytest.raises(ValueError, match="4k\\+1"):
            models.forward_inputs(name, stand_in, num_frames=80)
    with pytest.raises(ValueError, match="multiples of 16"):
        models.forward_inputs(name, stand_in, height=1000)


def test_forward_inputs_cfg_rows_and_padding():
    tr = tiny_pipe("ernie").transformer
    kw = models.forward_inputs("ernie", tr, height=64, width=32, batch=2, seed=1)
    prod = models.get_spec("ernie").production
    assert kw["text_lens"].tolist() == [prod.negative_prompt_len, prod.prompt_len]  # [uncond, cond]
    again = models.forward_inputs("ernie", tr, height=64, width=32, batch=2, seed=1)
    assert all(torch.equal(kw[k], again[k]) for k in kw)
    tr = tiny_pipe("qwen").transformer
    kw = models.forward_inputs("qwen", tr, height=32, width=32, batch=2, text_len=(7, 3))
    assert kw["encoder_hidden_states_mask"].tolist() == [[1] * 7, [1] * 3 + [0] * 4]
    assert kw["encoder_hidden_states"][1, 3:].abs().sum() == 0
    tr = tiny_pipe("wan").transformer
    kw = models.forward_inputs("wan", tr, height=32, width=32, num_frames=5, text_len=4, max_text_len=16)
    assert kw["encoder_hidden_states"].shape[1] == 16 and kw["encoder_hidden_states"][0, 4:].abs().sum() == 0
    with pytest.raises(ValueError, match="entries"):
        models.forward_inputs("wan", tr, height=32, width=32, num_frames=5, batch=2, text_len=(3,))



@pytest.mark.gpu
@pytest.mark.parametrize("name", FAMILIES)
def test_full_pipeline_on_gpu(name):
    """The "full" (production) transformer in bf16 inside its real pipeline: one step at production
    resolution (Wan: 480x832x21 to keep it short) passes exactly what forward_inputs builds."""
    spec = models.get_spec(name)
    pipe = models.build_pipeline(name, "full", seed=0, dtype=torch.bfloat16, device="cuda")
    try:
        geometry = dict(height=480, width=832, num_frames=21) if spec.video else {}
        kw = models.pipeline_call_kwargs(name, prompt=PROMPT, steps=1, **geometry)
        out, seen = capture_first_call(pipe, kw)
        assert torch.isfinite(out.float()).all()
        mine = models.forward_inputs(name, pipe.transformer, text_len=PIPELINE_TEXT_LENS[name],
                                     max_text_len=kw.get("max_sequence_length", 512), **geometry)
        assert {k: describe(v) for k, v in mine.items()} == {k: describe(v) for k, v in seen.items()}
        pred = models.run_forward(pipe.transformer, mine)
        pred = torch.stack(pred) if isinstance(pred, list) else pred
        assert torch.isfinite(pred.float()).all() and pred.float().std() > 0
    finally:
        # A pipeline's modules refer to each other in cycles: without a collection the next
        # family's build meets this one's weights (Qwen-Image after Chroma ran out of an H100).
        del pipe
        gc.collect()
        torch.cuda.empty_cache()
