"""What the compiler makes of the engine's kernels, on a machine without a GPU: for each region of
a mini model's captured blocks, its kernels compiled for sm_90 and counted: layout conversions
(TTGIR), barriers, shuffles and shared memory (PTX). A proxy, not a time: it shows where a kernel
moves data through shared memory.

    python benchmarks/kernels/kernel_layout_counts.py --mini cogvideox \\
        --set attention_head_dim=64 num_attention_heads=2 num_layers=2 --match layer_norm

``--set`` overrides the mini's tiny config (production widths give production kernels; keep two
blocks or more, so that they are captured); ``--match`` keeps the regions whose description
contains it.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

ROOT = __file__.rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "device"))

import compile_for_gpu  # noqa: E402  (sets TRITON_INTERPRET=0 before Triton is imported)
import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mini", required=True)
    ap.add_argument("--set", nargs="*", default=[], help="config overrides, key=python-literal")
    ap.add_argument("--match", default="")
    args = ap.parse_args()
    from exactdit.engine.capture import capture_graphs
    from exactdit.patches.engine import repeated_blocks
    from tests import minis
    from exactdit.harness.models.core import build_random, thaw

    spec = minis.MINIS[args.mini]
    cfg = thaw(spec.config)
    cfg.update({k: ast.literal_eval(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    model = build_random(lambda: spec.transformer_cls(**cfg), seed=0, dtype=torch.bfloat16, device="cpu")
    print("| graph | region | warps | layout conversions | barriers | shuffles | shared bytes |")
    print("|---|---|---|---|---|---|---|")
    for cls, gm, _ in capture_graphs(model, minis.forward_inputs(args.mini, model), repeated_blocks(model)):
        for label, fn, sig, consts, options in compile_for_gpu.region_launches(args.mini, gm):
            if args.match not in label:
                continue
            k = compile_for_gpu.compile_launch(fn, sig, consts, options, {}, 90)
            ptx = k.asm["ptx"]
            print(f"| {cls.rsplit('.', 1)[-1]} | {label.split(' ', 2)[-1][:70]} | {options['num_warps']} | "
                  f"{k.asm['ttgir'].count('ttg.convert_layout')} | {ptx.count('bar.sync')} | {ptx.count('shfl.')} | "
                  f"{k.metadata.shared} |", flush=True)


if __name__ == "__main__":
    main()
