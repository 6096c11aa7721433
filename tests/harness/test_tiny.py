import pytest
import torch

from exactdit.harness import metrics
from exactdit.harness.sampling import make_inputs, sample
from exactdit.harness.tiny import CONFIGS, build_transformer, get_config


def _tiny_inputs(model, seed=0, guidance=4.0):
    cfg = get_config("tiny")
    return make_inputs(model, latent_hw=(8, 8), text_len=cfg["text_len"], neg_text_len=cfg["neg_text_len"],
                       seed=seed, guidance_scale=guidance)


def test_configs_are_consistent():
    for name, cfg in CONFIGS.items():
        m = cfg["model"]
        head_dim = m["hidden_size"] // m["num_attention_heads"]
        assert sum(m["rope_axes_dim"]) == head_dim, name
        assert all(a % 2 == 0 for a in m["rope_axes_dim"]), name
        assert cfg["neg_text_len"] < cfg["text_len"]
    with pytest.raises(ValueError, match="unknown config"):
        get_config("huge")


def test_builder_is_seeded_and_reinitialises_zero_layers():
    a = build_transformer("tiny", seed=3)
    b = build_transformer("tiny", seed=3)
    c = build_transformer("tiny", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    # diffusers zero-initialises these; the builder must not leave them at zero
    for name in ("adaLN_modulation.1.weight", "adaLN_modulation.1.bias", "final_linear.weight", "final_linear.bias"):
        assert sa[name].abs().sum() > 0, name
    assert not any(p.requires_grad for p in a.parameters())


def test_builder_dtype():
    m = build_transformer("tiny", seed=0, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())


def test_sampling_is_deterministic_and_non_trivial():
    model = build_transformer("tiny", seed=0)
    inputs = _tiny_inputs(model)
    assert inputs.text_bth.shape[0] == 2  # [uncond, cond] with CFG
    assert inputs.text_lens.tolist() == [get_config("tiny")["neg_text_len"], get_config("tiny")["text_len"]]
    r1 = sample(model, inputs, 3)
    r2 = sample(model, inputs, 3)
    assert len(r1.step_times_s) == 3 and r1.total_s > 0
    assert metrics.md5_tensor(r1.latents) == metrics.md5_tensor(r2.latents)
    # the transformer actually moved the latents
    assert not torch.equal(r1.latents, inputs.latents)
    assert torch.isfinite(r1.latents).all()
    # different seed -> different result; no CFG -> single batch
    r3 = sample(model, _tiny_inputs(model, seed=1), 3)
    assert not torch.equal(r1.latents, r3.latents)
    nocfg = _tiny_inputs(model, guidance=1.0)
    assert nocfg.text_bth.shape[0] == 1
    assert sample(model, nocfg, 2).latents.shape == inputs.latents.shape
    with pytest.raises(ValueError):
        sample(model, inputs, 0)


def test_latent_hw_for_pixel_sizes():
    from exactdit.harness.sampling import latent_hw_for

    assert latent_hw_for(1024, 1024) == (64, 64)
    assert latent_hw_for(848, 1264) == (53, 79)
    for bad in ((1000, 1024), (0, 16), (16, -16)):
        with pytest.raises(ValueError, match="multiples of 16"):
            latent_hw_for(*bad)


def test_forward_inputs_pad_text_and_are_seeded():
    from exactdit.harness.sampling import forward, forward_inputs

    model = build_transformer("tiny", seed=0, dtype=torch.bfloat16)
    cfg = model.config
    kw = forward_inputs(model, latent_hw=(5, 3), text_lens=[9, 4], seed=2, sigma=0.5)
    assert kw["hidden_states"].shape == (2, cfg.in_channels, 5, 3)
    assert kw["hidden_states"].dtype == torch.bfloat16
    assert kw["text_bth"].shape == (2, 9, cfg.text_in_dim) and kw["text_bth"].dtype == torch.bfloat16
    assert kw["text_lens"].tolist() == [9, 4]
    assert kw["text_bth"][1, 4:].abs().sum() == 0 and kw["text_bth"][1, :4].abs().sum() > 0
    assert kw["timestep"].tolist() == [500.0, 500.0]
    again = forward_inputs(model, latent_hw=(5, 3), text_lens=[9, 4], seed=2, sigma=0.5)
    assert all(torch.equal(kw[k], again[k]) for k in kw)
    other = forward_inputs(model, latent_hw=(5, 3), text_lens=[9, 4], seed=3)
    assert not torch.equal(kw["hidden_states"], other["hidden_states"])
    out = forward(model, kw)
    assert out.shape == kw["hidden_states"].shape and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="text_lens"):
        forward_inputs(model, latent_hw=(2, 2), text_lens=[])


def test_cli_offers_every_embedded_config():
    from exactdit.cli import CONFIG_CHOICES

    assert set(CONFIG_CHOICES) == set(CONFIGS)


def test_configs_are_the_registry_configs():
    from exactdit.harness import models

    spec = models.get_spec("ernie")
    assert {name: cfg["model"] for name, cfg in CONFIGS.items()} == {n: spec.config(n) for n in CONFIGS}


def test_tiny_pipeline_keeps_its_small_vae():
    from exactdit.harness.tiny import build_tiny_pipeline

    pipe = build_tiny_pipeline(seed=0)
    assert pipe.vae_scale_factor == 4 and pipe.transformer.config.in_channels == 16
    out = pipe(prompt="a red cat", num_inference_steps=1, height=16, width=16, output_type="latent",
               generator=torch.Generator("cpu").manual_seed(0)).images
    assert out.shape == (1, 16, 4, 4) and torch.isfinite(out).all()
