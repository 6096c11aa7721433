"""The lowered graphs' disk cache (engine/capture_cache.py): a capture that meets a graph lowered
before loads it and rewrites it to the same graph, with the same bits; graphs whose AOTAutograd
wrapper does more than run them, or that are lowered under other conditions, are not shared."""

import os
import re
import subprocess
import sys

import pytest
import torch

from exactdit.engine import backend, capture_cache, make_backend
from exactdit.state import STATE


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTDIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EXACTDIT_CAPTURE_CACHE", raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _block(x, w, y):
    h = torch.nn.functional.linear(x, w)
    return torch.nn.functional.gelu(h * y + 1.0) * 2.0, torch.nn.functional.silu(y).sum(-1)


def _inputs(dtype=torch.bfloat16, transposed=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g).to(dtype)
    w = torch.randn(16, 16, generator=g).to(dtype)
    y = torch.randn(16, 6, generator=g).to(dtype).t() if transposed else torch.randn(6, 16, generator=g).to(dtype)
    return x, w, y


def _captured(fn, args):
    """fn's output compiled through a fresh exactdit backend (a new Dynamo trace)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=make_backend("Toy.Block"), fullgraph=True, dynamic=False)
    with torch.no_grad():
        return compiled(*args)


def _spy_on_rewrites(monkeypatch) -> list:
    """The code of each graph the engine rewrites from now on, graph numbers left out."""
    rewritten, original = [], backend.rewrite

    def spy(gm, label):
        report = original(gm, label)
        rewritten.append(re.sub(r"(?i)toy_block_\d+", "N", gm.code))
        return report

    monkeypatch.setattr(backend, "rewrite", spy)
    return rewritten


def _equal(a, b):
    return all(torch.equal(p, q) and p.stride() == q.stride() for p, q in zip(a, b, strict=True))


def test_a_graph_lowered_before_is_loaded_and_rewritten_to_the_same_graph(monkeypatch):
    args = _inputs()
    with torch.no_grad():
        eager = _block(*args)
    rewritten = _spy_on_rewrites(monkeypatch)
    out1 = _captured(_block, args)
    assert STATE.captures == {"stored": 1}
    assert len(os.listdir(capture_cache.cache_dir())) == 1
    out2 = _captured(_block, args)
    assert STATE.captures == {"stored": 1, "loaded": 1}
    assert len(rewritten) == 2 and rewritten[0] == rewritten[1] and "exactdit" in rewritten[0]  # the same regions
    assert _equal(out1, eager) and _equal(out2, eager)


def test_another_layout_dtype_or_torch_lowers_again(monkeypatch):
    _captured(_block, _inputs())
    _captured(_block, _inputs(transposed=True))  # strides of y differ
    _captured(_block, _inputs(dtype=torch.float32))
    assert STATE.captures == {"stored": 3}
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    _captured(_block, _inputs())
    assert STATE.captures == {"stored": 4}
    monkeypatch.setenv("EXACTDIT_CAPTURE_CACHE", "0")
    _captured(_block, _inputs())
    assert STATE.captures == {"stored": 4}


def test_grad_mode_is_part_of_the_key():
    args = _inputs()
    _captured(_block, args)
    torch._dynamo.reset()
    compiled = torch.compile(_block, backend=make_backend("Toy.Block"), fullgraph=True, dynamic=False)
    with torch.enable_grad():  # (an inference graph still: nothing requires grad)
        out = compiled(*args)
        eager = _block(*args)
    assert _equal(out, eager)
    assert STATE.captures == {"stored": 2}


def _mutates_input(x, w, y):
    y.mul_(2.0)
    return torch.nn.functional.gelu(x * y + 1.0)


def _returns_a_view_of_an_input(x, w, y):
    return x[1:], torch.nn.functional.gelu(x * y + 1.0)


@pytest.mark.parametrize("fn, reason", [
    (_mutates_input, "the graph mutates an input"),
    (_returns_a_view_of_an_input, "an output aliases an input or an intermediate"),
])
def test_graphs_whose_wrapper_does_more_than_run_them_are_not_stored(fn, reason):
    for _ in range(2):
        args, ref_args = _inputs(), _inputs()
        out = _captured(fn, args)
        with torch.no_grad():
            eager = fn(*ref_args)
        assert _equal(out, eager) and _equal(args, ref_args)  # mutations written back as eager writes them
        if fn is _returns_a_view_of_an_input:
            assert out[0].data_ptr() == args[0].data_ptr() + 32
    assert STATE.captures == {"not stored": {reason: 2}}
    assert os.listdir(capture_cache.cache_dir()) == []


def test_autocast_and_custom_ops_are_not_stored():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _captured(_block, _inputs(dtype=torch.float32))

    @torch.library.custom_op("exactdit_test::scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    @scale.register_fake
    def _(x):
        return torch.empty_like(x)

    _captured(lambda x, w, y: scale(x) + y, _inputs())
    assert STATE.captures == {"not stored": {"autocast is on": 1, "the graph calls the custom op exactdit_test::": 1}}


def _attention(q, k, v):
    return (torch.nn.functional.scaled_dot_product_attention(q, k, v),)


def test_what_picks_a_kernel_at_trace_time_is_part_of_the_key():
    """The math attention's fp16 / bf16 reduction flag and the default autocast dtype an
    ``autocast`` inside the block reads are read while AOTAutograd traces: found by a review, where
    a graph stored under one setting was loaded under the other with other bits."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, 2, 37, 64, generator=g).bfloat16() for _ in range(3)]
    for reduced in (False, True):
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(reduced)
        try:
            with sdpa_kernel(SDPBackend.MATH):
                out = _captured(_attention, qkv)
                with torch.no_grad():
                    assert _equal(out, _attention(*qkv))
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    assert STATE.captures == {"stored": 2}

    def autocast_inside(x, w, y):
        with torch.autocast("cpu"):
            return (x @ w,)

    before = torch.get_autocast_dtype("cpu")
    args = _inputs(dtype=torch.float32)
    try:
        for dtype in (torch.bfloat16, torch.float16):
            torch.set_autocast_dtype("cpu", dtype)
            out = _captured(autocast_inside, args)
            with torch.no_grad():
                assert out[0].dtype == dtype and _equal(out, autocast_inside(*args))
    finally:
        torch.set_autocast_dtype("cpu", before)
    assert STATE.captures == {"stored": 4}


def test_functions_whose_trace_reads_unkeyed_state_and_subclass_outputs_are_not_stored():
    g = torch.Generator().manual_seed(0)
    abc = (torch.randn(64, 3, generator=g), torch.randn(3, 64, generator=g), torch.randn(64, 64, generator=g))
    out = _captured(lambda a, b, c: (torch.einsum("ij,jk,kl->il", a, b, c),), abc)  # (opt_einsum's order)
    with torch.no_grad():
        assert _equal(out, (torch.einsum("ij,jk,kl->il", *abc),))
    jagged = (torch.randn(10, 4, generator=g), torch.tensor([0, 3, 7, 10]))
    out = _captured(lambda v, off: torch.nested.nested_tensor_from_jagged(v * 2, off + 0).sin(), jagged)
    assert out.is_nested  # (a hit would have skipped AOTAutograd's wrapping: a plain tensor)
    assert STATE.captures == {"not stored": {
        "the graph calls torch.functional.einsum": 1,
        "the graph calls torch.nested._internal.nested_tensor.nested_view_from_values_offsets_lengths": 1}}


def test_a_file_that_does_not_load_is_lowered_again_and_replaced():
    args = _inputs()
    _captured(_block, args)
    (name,) = os.listdir(capture_cache.cache_dir())
    path = os.path.join(capture_cache.cache_dir(), name)
    with open(path, "wb") as f:
        f.write(b"not a graph")
    out = _captured(_block, args)
    with torch.no_grad():
        assert _equal(out, _block(*args))
    assert STATE.captures == {"stored": 2, "not stored": {"loading failed: UnpicklingError": 1}}
    out = _captured(_block, args)
    assert STATE.captures["loaded"] == 1


def test_the_report_says_what_was_loaded_stored_and_why_not():
    _captured(_block, _inputs())
    _captured(_block, _inputs())
    _captured(_returns_a_view_of_an_input, _inputs())
    assert capture_cache.lines() == ["lowered graphs: 1 loaded from the disk cache, 1 stored; not stored: "
                                     "an output aliases an input or an intermediate (1)"]


_TWO_PROCESSES = """
import hashlib, sys, torch
import exactdit
from exactdit.harness import models
from exactdit.state import STATE
model = models.build_transformer("{model}", "tiny", dtype=torch.bfloat16)
kwargs = models.forward_inputs("{model}", model)
with torch.no_grad():
    eager = models.run_forward(model, kwargs)
exactdit.patch(model)
with torch.no_grad():
    out = models.run_forward(model, kwargs)
assert torch.equal(out, eager)
print(STATE.captures.get("loaded", 0), STATE.captures.get("stored", 0), hashlib.md5(out.float().numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "wan"])
def test_a_second_process_loads_every_graph_the_first_stored(model, tmp_path):
    env = dict(os.environ, EXACTDIT_CACHE=str(tmp_path / "shared"))
    runs = [subprocess.run([sys.executable, "-c", _TWO_PROCESSES.format(model=model)], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    (loaded1, stored1, md5_1), (loaded2, stored2, md5_2) = (r.stdout.split()[-3:] for r in runs)
    assert (loaded1, stored2) == ("0", "0") and int(stored1) >= 1 and loaded2 == stored1
    assert md5_1 == md5_2
