"""exactdit with what diffusers users combine a transformer with (issue 34, the CPU side): peft
LoRA (one adapter, two with ``set_adapters`` weights, fused, hot-swapped), fp8 layerwise casting,
torchao int8 and float8 weight-only quantization, GGUF, bitsandbytes NF4, attention backends that
run on the CPU. Each: the patched model gives the bits of the same configuration unpatched, and its blocks are captured whole (one graph per block class, its
regions run through the gate), so a regression to "captured in parts" or "runs diffusers' code"
fails here. Tiny Flux and Wan in bf16; the regions run in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings

import pytest
import torch

import exactdit
from exactdit.engine import coverage
from exactdit.harness import models
from exactdit.patches import engine
from tests.ecosystem import in_blocks, load_gguf, lora_state_dict, to_nf4, write_gguf
from tests.engine_helpers import engine_eager_reasons
from tests.helpers import assert_bits_equal, run_benchmark

MODELS = ("flux", "wan")
#: the attention and MLP projections a LoRA of Flux or Wan targets
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft not installed (exactdit[lora])")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao not installed (exactdit[quant])")
needs_gguf = pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="gguf not installed (exactdit[quant])")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes not installed (exactdit[quant])")


def _build(name: str):
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=3)
    extra = {"num_frames": 5} if name == "wan" else {}
    return tr, models.forward_inputs(name, tr, batch=1, height=32, width=32, seed=4, **extra)


def _lora_state_dict(tr, seed: int, rank: int = 4) -> dict:
    return lora_state_dict(tr, seed, rank)


def _run(tr, kw, calls: int = 2) -> tuple[torch.Tensor, list]:
    """The unpatched output, and ``calls`` patched outputs (patched left on)."""
    with torch.no_grad():
        ref = tr(**kw, return_dict=False)[0]
        torch._dynamo.reset()
        exactdit.patch(tr)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = [tr(**kw, return_dict=False)[0] for _ in range(calls)]
    return ref, outs


def _block_labels(tr) -> set:
    return {f"{type(tr).__name__}.{cls}" for cls in engine.repeated_blocks(tr)}


def _assert_captured_whole(tr, calls: int, fused_on_cpu: bool = True) -> None:
    """Every block class captured as one graph, run on every call of every block, with fused
    regions in it (``fused_on_cpu=False``: regions that follow CUDA's rounding run ATen's CPU
    kernels here); nothing in parts, nothing run as diffusers' code."""
    assert engine_eager_reasons() == {}
    assert coverage.in_parts() == {}
    blocks = {}
    for cls, _ in engine.targets(tr):
        label = f"{type(tr).__name__}.{cls}"
        blocks[label] = blocks.get(label, 0) + 1
    for label in _block_labels(tr):
        state = engine._states[label]
        assert (state.graphs, state.runs) == (1, calls * blocks[label]), (label, state.graphs, state.runs)
    rep = exactdit.report(show=False)
    for label in _block_labels(tr):
        regions = {k: v for k, v in rep.items() if k.startswith(label + "#")}
        assert regions and (any(v["fused"] for v in regions.values()) or not fused_on_cpu), (label, sorted(rep))
        assert not any(v["disabled"] for v in regions.values()), regions


def _check(tr, kw, calls: int = 2) -> None:
    ref, outs = _run(tr, kw, calls)
    try:
        for out in outs:
            assert_bits_equal(out, ref)
        _assert_captured_whole(tr, calls)
    finally:
        exactdit.unpatch(tr)


def _lora_modules(tr) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in tr.modules() if isinstance(m, LoraLayer)]


@needs_peft
@pytest.mark.parametrize("name", MODELS)
def test_one_lora_adapter_unfused(name):
    tr, kw = _build(name)
    tr.load_lora_adapter(_lora_state_dict(tr, 1), adapter_name="a", prefix=None)
    assert _lora_modules(tr)
    _check(tr, kw)
    # peft's layers are traced into the block graphs: each LoRA layer's two GEMMs are among their ATen ops
    firsts = {}
    for cls, block in engine.targets(tr):
        firsts.setdefault(cls, block)
    lora_layers = sum(len(_lora_modules(b)) for cls, b in firsts.items() if cls in engine.repeated_blocks(tr))
    graphs = [g for g in coverage.graphs() if any(g.name.startswith(lb + "#") for lb in _block_labels(tr))]
    assert lora_layers and sum(g.left.get("mm", 0) for g in graphs) >= 2 * lora_layers, [g.left for g in graphs]


@needs_peft
@pytest.mark.parametrize("name", MODELS)
def test_two_lora_adapters_with_weights(name):
    tr, kw = _build(name)
    tr.load_lora_adapter(_lora_state_dict(tr, 1), adapter_name="a", prefix=None)
    tr.load_lora_adapter(_lora_state_dict(tr, 2), adapter_name="b", prefix=None)
    tr.set_adapters(["a", "b"], weights=[0.7, 0.4])
    _check(tr, kw)


@needs_peft
@pytest.mark.parametrize("name", MODELS)
def test_fused_lora(name):
    tr, kw = _build(name)
    tr.load_lora_adapter(_lora_state_dict(tr, 1), adapter_name="a", prefix=None)
    tr.fuse_lora(lora_scale=0.8)
    _check(tr, kw)


@needs_peft
@pytest.mark.parametrize("name", MODELS)
def test_lora_hotswap_does_not_capture_again(name):
    """``enable_lora_hotswap`` then ``load_lora_adapter(..., hotswap=True)``: the new adapter's
    weights are copied into the tensors the graph reads (its scales are tensors too), so the
    patched model gives the new adapter's bits with the graphs it captured for the first."""
    tr, kw = _build(name)
    tr.enable_lora_hotswap(target_rank=8)
    tr.load_lora_adapter(_lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    ref_a, outs = _run(tr, kw, calls=1)
    try:
        assert_bits_equal(outs[0], ref_a)
        _assert_captured_whole(tr, calls=1, fused_on_cpu=False)  # (the scale's rounding is CUDA's: below)
        # the scales (0-dim fp32 tensors) are multiplied in the regions, not left to ATen
        assert not [g.why_left for g in coverage.graphs() if any("operand of a" in w for w in g.why_left)]
        tr.load_lora_adapter(_lora_state_dict(tr, 2, rank=8), adapter_name="a", prefix=None, hotswap=True)
        with torch.no_grad():
            out_b = tr(**kw, return_dict=False)[0]
        _assert_captured_whole(tr, calls=2, fused_on_cpu=False)  # still one graph per class: nothing captured again
    finally:
        exactdit.unpatch(tr)
    with torch.no_grad():
        ref_b = tr(**kw, return_dict=False)[0]
    assert not torch.equal(ref_a, ref_b)
    assert_bits_equal(out_b, ref_b)


@needs_peft
@pytest.mark.parametrize("name", MODELS)
def test_lora_hotswap_blocks_equal_cuda_order(name):
    """The hot-swap blocks' regions (the 0-dim fp32 scales in them) run in the interpreter and hold
    to the graphs run as CUDA runs them (the CPU's eager reads those scales unrounded)."""
    from tests.engine_helpers import capture_graphs, rewrite_and_check

    tr, kw = _build(name)
    tr.enable_lora_hotswap(target_rank=8)
    tr.load_lora_adapter(_lora_state_dict(tr, 1, rank=4), adapter_name="a", prefix=None)
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, f"{name} hotswap")


@pytest.mark.parametrize("name", MODELS)
def test_fp8_layerwise_casting(name):
    """The casting hooks are hoisted to the block (captured whole, not in parts at each layer);
    the stored fp8 weights keep their bits."""
    tr, kw = _build(name)
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    cast = [(n, p) for n, p in tr.named_parameters() if p.dtype == torch.float8_e4m3fn]
    assert cast
    stored = {n: p.detach().clone() for n, p in cast}
    hooked = [m for m in tr.modules() if "_diffusers_hook" in m.__dict__ and "forward" in m.__dict__]
    _check(tr, kw)
    assert all("forward" in m.__dict__ for m in hooked)  # the hooks are back on their layers
    for n, p in tr.named_parameters():
        if n in stored:
            assert p.dtype == torch.float8_e4m3fn and torch.equal(p.view(torch.uint8), stored[n].view(torch.uint8)), n


@needs_torchao
@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
@pytest.mark.parametrize("name", MODELS)
def test_torchao_weight_only(name, config):
    """torchao's int8 and float8 weight-only tensor subclasses on the blocks' linears (float8 with
    dynamic activations needs a GPU of compute capability 8.9: the device's matrix)."""
    import torchao.quantization

    tr, kw = _build(name)
    torchao.quantization.quantize_(tr, getattr(torchao.quantization, config)(),
                                   filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and in_blocks(n))
    quantized = [n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear) and in_blocks(n)
                 and type(m.weight).__name__ != "Parameter"]
    assert quantized
    _check(tr, kw)


def _gguf_transformer(name: str, tr):
    """``tr``'s weights written to a GGUF file (the blocks' linear weights Q8_0, the rest F32) and
    loaded back through diffusers' GGUF path."""
    import gguf

    with tempfile.TemporaryDirectory(prefix="exactdit-gguf-") as folder:  # (the loaded weights are copies)
        return load_gguf(type(tr), write_gguf(tr, folder, gguf.GGMLQuantizationType.Q8_0, arch=name), folder)


@needs_gguf
@pytest.mark.parametrize("name", MODELS)
def test_gguf_q8_0(name):
    """The GGUF weights are dequantized before each block's call (as each layer's forward would):
    traced, diffusers' GGUFParameter spread to the activations and the blocks failed."""
    tr, kw = _build(name)
    tr = _gguf_transformer(name, tr)
    quantized = {n: p for n, p in tr.named_parameters() if type(p).__name__ == "GGUFParameter"}
    assert quantized
    _check(tr, kw)
    assert all(p is dict(tr.named_parameters())[n] for n, p in quantized.items())  # given back after each call


@needs_gguf
def test_q8_0_gives_gguf_pys_bytes():
    """The benchmark's torch Q8_0 writer against gguf-py's: random rows, a zero block, halves that
    round away from zero, bf16 weights as the models hold them."""
    import gguf

    from tests.ecosystem import q8_0

    g = torch.Generator().manual_seed(3)
    w = torch.randn(7, 96, generator=g) * torch.logspace(-6, 3, 7).unsqueeze(1)
    w[2, 32:64] = 0
    w[3, :32] = torch.arange(-16, 16) * 0.5 + 0.25  # max 7.75: x * 127 / 7.75 lands on halves
    w[4, :32] = torch.tensor([127.0, 0.5, -0.5, 1.5, -1.5] + [2.5] * 27)
    for t in (w, w.to(torch.bfloat16)):
        expected = gguf.quants.quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
        got = q8_0(t)
        assert got.dtype == expected.dtype and got.shape == expected.shape and (got == expected).all()


@needs_gguf
def test_gguf_with_leaf_level_group_offloading():
    """A GGUF layer with offloading hooks: its hooks are run around the block and its weight is
    dequantized too (it raised), and put back before the offload moves the layer again."""
    from diffusers.hooks import apply_group_offloading

    tr, kw = _build("flux")
    tr = _gguf_transformer("flux", tr)
    apply_group_offloading(tr, onload_device="cpu", offload_device="cpu", offload_type="leaf_level")
    with torch.no_grad():
        before = tr(**kw, return_dict=False)[0]
    _check(tr, kw)
    with torch.no_grad():  # unpatched again: the layers' weights and hooks as they were
        assert_bits_equal(tr(**kw, return_dict=False)[0], before)


@needs_bnb
@pytest.mark.parametrize("name", MODELS)
def test_bitsandbytes_nf4(name):
    """bitsandbytes' NF4 layers (4-bit weights dequantized by its own op before each GEMM) are
    traced into the block graphs, captured whole, and keep their quantized weights."""
    import bitsandbytes as bnb

    tr, kw = _build(name)
    tr = to_nf4(tr)
    layers = [m for m in tr.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(m.weight.dtype == torch.uint8 for m in layers)
    packed = [m.weight.data.clone() for m in layers]
    _check(tr, kw)
    assert all(torch.equal(m.weight.data, w) for m, w in zip(layers, packed))


@pytest.mark.parametrize("backend", ["_native_math", "_native_flash", "flex"])
def test_attention_backends_that_run_on_the_cpu(backend):
    """``set_attention_backend``: diffusers' dispatch to another attention kernel (ATen's CPU flash
    attention, the math path, flex attention's higher-order op) is traced into the block graphs and
    run as the unpatched model runs it; the blocks are captured whole."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as registry

    tr, kw = _build("flux")
    active = registry.get_active_backend()[0]  # set_attention_backend sets the process's default too
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (experimental API; flex attention run without compile)
            tr.set_attention_backend(backend)
            _check(tr, kw)
    finally:
        registry.set_active_backend(active)


@pytest.mark.slow
@needs_peft
def test_the_ecosystem_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/models/bench_ecosystem.py, which the device runs (rows of the matrix, CUDA graphs
    with --graphs), on the tiny Flux in the interpreter: every row ran and is equal, so a device
    session is not spent on the script's own errors."""
    configs = ["plain", "lora-2", "lora-hotswap", "fp8-cast", "group-offload-leaf"]
    rows = run_benchmark("models/bench_ecosystem.py", "--device", "cpu", "--config", "tiny", "--height", "32",
                         "--width", "32", "--repeat", "1", "--no-compile", "--graphs", "--configs", *configs,
                         out_dir=tmp_path)
    assert {r["config"] for r in rows} == set(configs)
    assert all(r["status"] == "ok" and r["equal"] for r in rows), [r for r in rows if not r["equal"]]
    assert {r["path"] for r in rows} == {"eager", "exactdit", "exactdit + CUDA graphs"}
