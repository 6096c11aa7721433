"""Run each fused op at ERNIE-Image's production shapes a few times, for Nsight Compute:

    ncu --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        -k regex:"^(rms_norm_kernel|norm_rope_kernel|geglu_kernel|layer_norm_kernel)$" -c 8 \
        python benchmarks/ncu_ops.py --repeat 1

(the anchored names keep ATen's ``vectorized_layer_norm_kernel`` out). Every op is checked
against eager once (``torch.equal``) before the profiled calls.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import D, FFN, HEAD_DIM, HEADS, S, outputs_equal  # noqa: E402

from exactdit import ops, references  # noqa: E402


def calls():
    """(name, fused call, eager call) at B = 1, bf16, the fp32 modulation chain."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    x, u = rnd(1, S, D), rnd(1, S, D)
    gate, scale, shift = rnd(1, 1, D), rnd(1, 1, D), rnd(1, 1, D)
    q, k = rnd(1, S, D).unflatten(-1, (HEADS, -1)), rnd(1, S, D).unflatten(-1, (HEADS, -1))
    wq, wk = rnd(HEAD_DIM), rnd(HEAD_DIM)
    tables = references.rope_tables(torch.rand(1, S, 1, HEAD_DIM, device="cuda", generator=g) * 1000, torch.bfloat16)
    ga, up = rnd(1, S, FFN), rnd(1, S, FFN)
    yield ("rms_norm_modulate", lambda: ops.rms_norm_modulate(x, None, 1e-6, scale, shift, upcast=True),
           lambda: references.rms_norm_modulate(x, None, 1e-6, scale, shift, upcast=True))
    yield ("gated_rms_norm_modulate", lambda: ops.gated_rms_norm_modulate(x, u, gate, None, 1e-6, scale, shift, upcast=True),
           lambda: references.gated_rms_norm_modulate(x, u, gate, None, 1e-6, scale, shift, upcast=True))
    yield ("qk_norm_rope", lambda: ops.qk_norm_rope(q, k, wq, wk, 1e-6, tables),
           lambda: references.qk_norm_rope(q, k, wq, wk, 1e-6, tables))
    yield "geglu", lambda: ops.geglu(ga, up), lambda: references.geglu(ga, up)
    yield ("layer_norm_modulate", lambda: ops.layer_norm_modulate(x, 1e-6, scale, shift, upcast=True),
           lambda: references.layer_norm_modulate(x, 1e-6, scale, shift, upcast=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    for name, fused, eager in calls():
        assert outputs_equal(fused(), eager()), name
        os.environ["EXACTDIT_TRUST"] = "1"
        for _ in range(args.repeat):
            fused()
        os.environ.pop("EXACTDIT_TRUST")
        torch.cuda.synchronize()
        print(f"{name}: equal, ran {args.repeat} more times")


if __name__ == "__main__":
    main()
