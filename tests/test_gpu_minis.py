"""Mini models on the GPU (:mod:`exactdit.harness.minis`: SD3, Flux.2, HunyuanVideo, LTX, Sana, ...):
one forward patched against unpatched diffusers, ``torch.equal``, every region verified on its first
signature and none disabled, every block captured unless the mini names why not."""

from __future__ import annotations

import pytest
import torch

from exactdit.harness import minis
from exactdit.harness.models import run_forward
from tests.engine_helpers import assert_patched_equals_eager, engine_eager_reasons

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(minis.MINIS))
def test_mini_model_equal_to_eager(name, dtype):
    tr = minis.build(name, dtype=dtype, device="cuda", seed=1)
    captured = minis.MINIS[name].eager is None
    assert_patched_equals_eager(tr, minis.forward_inputs(name, tr, batch=2, seed=2, device="cuda"), run_forward, captured)
    reasons = engine_eager_reasons()
    assert bool(reasons) != captured, reasons
