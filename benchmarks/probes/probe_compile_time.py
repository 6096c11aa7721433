"""Triton's compile time per region kernel of a model's blocks at production width, for sm_90, on a
machine without a GPU (the compiler and ptxas need no device). A first call is mostly this compile
(BENCHMARKS.md, "First calls"); the kernels here are those of one block of each class, captured on
the CPU at a small sequence (row counts are kernel arguments: the code is the production one).

    python3 benchmarks/probes/probe_compile_time.py --mini hunyuan-video
    python3 benchmarks/probes/probe_compile_time.py --model flux

Prints the total and the slowest kernels (seconds, PTX lines, region), each compiled with an empty
Triton cache.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "0"  # before Triton is imported: compile, do not interpret
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="exactdit-probe-triton-"))
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])


def block_graphs(args):
    """The captured graphs of one block of each class at production width, on the CPU."""
    import torch

    from exactdit.engine.capture import capture_graphs
    from exactdit.harness import models
    from exactdit.patches.engine import repeated_blocks
    from tests import minis

    one_layer = {k: 1 for k in ("num_layers", "num_single_layers", "num_refiner_layers")}
    if args.mini:
        accepted = inspect.signature(minis.MINIS[args.mini].transformer_cls.__init__).parameters
        tr = minis.build(args.mini, dtype=torch.bfloat16, production=True,
                         overrides={k: v for k, v in one_layer.items() if k in accepted})
        kw = minis.forward_inputs(args.mini, tr, batch=1, grid=minis.Grid(2, 8, 8, 16))
    else:
        spec = models.get_spec(args.model)
        cfg = dict(spec.resolve_config("full"))
        cfg.update({k: v for k, v in one_layer.items() if k in cfg})
        tr = models.build_transformer(args.model, cfg, dtype=torch.bfloat16)
        kw = models.forward_inputs(args.model, tr, batch=1, height=64, width=64,
                                   **({"num_frames": 5} if spec.video else {}))
    return [(cls, gm) for cls, gm, _ in capture_graphs(tr, kw, repeated_blocks(tr))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flux", help="a name of exactdit.harness.models")
    ap.add_argument("--mini", default=None, help="instead: a mini of tests.minis with a production config")
    ap.add_argument("--show", type=int, default=6, help="how many of the slowest kernels to list")
    args = ap.parse_args()
    from tests.device import compile_for_gpu as aot

    rows = []
    for cls, gm in block_graphs(args):
        for label, fn, sig, consts, opts in aot.region_launches(cls, gm):
            start = time.perf_counter()
            kernel = aot.compile_launch(fn, sig, consts, opts, {}, 90)
            rows.append((time.perf_counter() - start, len(kernel.asm["ptx"].splitlines()), label))
    rows.sort(reverse=True)
    print(f"{args.mini or args.model}: {len(rows)} region kernels, {sum(r[0] for r in rows):.1f} s to compile for sm_90")
    for seconds, ptx, label in rows[: args.show]:
        print(f"  {seconds:6.2f} s  {ptx:6d} PTX lines  {label}")


if __name__ == "__main__":
    main()
