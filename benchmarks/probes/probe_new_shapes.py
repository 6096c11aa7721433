"""What each new input shape costs a patched model under each ``exactdit.patch(dynamic=...)``, on a
machine without a GPU: one block of each class at production width, small grids (the capture and
lowering work does not depend on the sequence length), bf16, regions run as ATen ops on the CPU.

    python3 benchmarks/probes/probe_new_shapes.py --mini hunyuan-video --dynamic auto

For each grid in order: the first call's seconds beyond the second call's, and the first calls'
account (capture, specialize, partition, ...). Rows go to ``$OUT/results.jsonl``.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

#: --dynamic -> exactdit.patch's ``dynamic``
DYNAMIC = {"auto": None, "first": True, "static": False}
GRIDS = "2x8x8,3x10x12,2x12x8,4x8x10"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mini", default="hunyuan-video", help="a mini with a production config (tests/minis)")
    ap.add_argument("--dynamic", choices=list(DYNAMIC), default="static")
    ap.add_argument("--grids", default=GRIDS, help="FxHxW latent grids in order, comma-separated")
    ap.add_argument("--text", type=int, default=16, help="text tokens")
    args = ap.parse_args(argv)

    import torch

    import exactdit
    from benchmarks.runner import append_results
    from exactdit import first_calls
    from exactdit.harness.models import run_forward
    from tests import minis

    accepted = inspect.signature(minis.MINIS[args.mini].transformer_cls.__init__).parameters
    one_layer = {k: 1 for k in ("num_layers", "num_single_layers", "num_refiner_layers") if k in accepted}
    tr = minis.build(args.mini, dtype=torch.bfloat16, seed=3, production=True, overrides=one_layer)
    grids = [minis.Grid(*map(int, g.split("x")), args.text) for g in args.grids.split(",")]
    kws = [minis.forward_inputs(args.mini, tr, batch=1, seed=4, grid=g) for g in grids]
    rows = []
    with torch.no_grad():
        for kw in kws:  # eager's own first calls out of the way
            run_forward(tr, kw)
        exactdit.patch(tr, dynamic=DYNAMIC[args.dynamic])
        for k, (grid, kw) in enumerate(zip(grids, kws)):
            before = first_calls.totals()
            t = time.perf_counter()
            run_forward(tr, kw)
            first = time.perf_counter() - t
            t = time.perf_counter()
            run_forward(tr, kw)
            second = time.perf_counter() - t
            phases = {p: round(s - before.get(p, (0.0, 0))[0], 3) for p, (s, _) in first_calls.totals().items()}
            phases = {p: s for p, s in phases.items() if s > 0.005}
            print(f"dynamic={args.dynamic} grid {grid.frames}x{grid.height}x{grid.width}: first call "
                  f"{first - second:.2f} s beyond the second ({phases})", flush=True)
            rows.append(dict(model_or_op=f"{args.mini} one block per class, production width",
                             shape=f"grid {grid.frames}x{grid.height}x{grid.width} text {grid.text}", dtype="bf16",
                             path=f"exactdit shape {k + 1} (dynamic={args.dynamic}), first call beyond the second",
                             ms=(first - second) * 1e3, ratio=None, ratio_kind=None, equal=None, phases_s=phases))
        exactdit.unpatch(tr)
    print(append_results(rows, "benchmarks/probes/probe_new_shapes.py"), flush=True)


if __name__ == "__main__":
    main()
