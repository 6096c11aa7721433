"""Whole captured blocks of every registered model, rewritten, against CUDA's orders."""

from __future__ import annotations

import pytest
import torch

from exactdit.harness import models
from exactdit.harness.models import qwen
from tests.engine_helpers import capture_graphs, rewrite_and_check

aten = torch.ops.aten


@pytest.mark.parametrize("name", [n for n in models.model_names() if n not in ("flux-schnell", "wan-1.3b")])
def test_captured_blocks_equal_cuda_order(name):
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=4)
    video = dict(num_frames=5) if models.get_spec(name).video else {}
    kw = models.forward_inputs(name, tr, batch=2, seed=5, height=32, width=32, **video)
    listed = set(getattr(tr, "_repeated_blocks", None) or ())
    for cls, gm, inputs in capture_graphs(tr, kw):
        # members of block lists a class does not list may hold nothing to fuse (Chroma's guidance MLP)
        rewrite_and_check(gm, inputs, name, need_regions=not listed or cls in listed)


@pytest.mark.parametrize("name", ["qwen", "zimage"])
def test_captured_blocks_with_prompts_of_different_lengths(name):
    # a batch of two prompts, 9 and 4 tokens: Qwen-Image pads the text with a mask, Z-Image pads
    # each caption itself; the rewritten blocks hold to CUDA's orders with the padding in place
    tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16, seed=4)
    kw = models.forward_inputs(name, tr, batch=2, seed=5, height=32, width=32, text_len=[9, 4])
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, name)


def test_qwen_image_edit_two_image_streams_and_per_token_modulation():
    # Qwen-Image-Edit-2511: a second (condition) image stream after the target's tokens, and
    # zero_cond_t's modulation picked per token through `where` (timestep 0 for the condition)
    cfg = {**models.get_spec("qwen").config("tiny"), **qwen.EDIT_CONFIG}
    tr = models.build_transformer("qwen", cfg, dtype=torch.bfloat16, seed=4)
    kw = qwen.with_condition_image(models.forward_inputs("qwen", tr, batch=1, seed=5, height=32, width=32), seed=6)
    for _, gm, inputs in capture_graphs(tr, kw):
        rewrite_and_check(gm, inputs, "qwen-edit")
