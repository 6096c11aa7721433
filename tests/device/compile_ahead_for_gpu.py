"""A tiny Wan block's region kernels compiled ahead by exactdit's compile workers for sm_90, then
"launched" (``JITFunction.run(warmup=True)``, Triton's own path) with real tensors of the same
layout: prints one JSON object with how many were sent, how many workers compiled and how many
of the launches found their binary in Triton's cache. No GPU: Triton's driver is replaced by one
that answers what ``JITFunction.run`` asks before it compiles (device 0, stream 0, target sm_90).
Run as a script with TRITON_INTERPRET unset and TRITON_CACHE_DIR empty (tests/device/test_compile_workers.py).
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402


class Sm90:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def cache_entries() -> int:
    return sum(len(files) for _, _, files in os.walk(os.environ["TRITON_CACHE_DIR"]))


def like(fake):
    """A real CPU tensor with ``fake``'s dtype, shape, strides and storage offset."""
    size = fake.storage_offset() + sum((n - 1) * s for n, s in zip(fake.shape, fake.stride())) + 1
    return torch.zeros(size, dtype=fake.dtype).as_strided(fake.shape, fake.stride(), fake.storage_offset())


def gated_linear():
    """``r + g * linear(x)`` with 1024 rows (a fused GEMM region under EXACTDIT_GEMM=fused)."""
    from tests.engine_helpers import GraphBuilder

    aten = torch.ops.aten
    b = GraphBuilder()
    x, w = b.input(torch.zeros(1024, 64).bfloat16()), b.input(torch.zeros(256, 64).bfloat16())
    y = b.op(aten.addmm.default, b.input(torch.zeros(256).bfloat16()), x, b.op(aten.t.default, w))
    y3 = b.op(aten.view.default, y, [1, 1024, 256])
    out = b.op(aten.add.Tensor, b.input(torch.zeros(1, 1024, 256).bfloat16()),
               b.op(aten.mul.Tensor, b.input(torch.zeros(1, 1, 256).bfloat16()), y3))
    return b.module(out)


def main() -> None:
    from exactdit.device import compile_workers, launch
    from exactdit.engine.capture import capture_graphs
    from exactdit.engine.partition import find_regions
    from exactdit.engine.runtime import RegionOp
    from exactdit.harness import models
    from exactdit.patches.engine import repeated_blocks

    driver.set_active(Sm90())
    launch.supported = lambda device: True  # (the launch plans' route; here only run(warmup=True) is used)
    if "--gemm" in sys.argv:  # a fused GEMM region: its kernel in every candidate tiling, and its epilogue alone
        graphs = [gated_linear()]
    else:
        tr = models.build_transformer("wan", "tiny", dtype=torch.bfloat16, seed=4)
        kw = models.forward_inputs("wan", tr, batch=1, seed=5, height=32, width=32, num_frames=5)
        graphs = [gm for _, gm, _ in capture_graphs(tr, kw, repeated_blocks(tr))]
    # (a GELU table is built by a kernel launch, which this machine cannot run)
    ops = [RegionOp(r) for gm in graphs for r in find_regions(gm, "wan").regions if not r.tables]
    sent = sum(op.compile_ahead() for op in ops)
    compiled, launches = 0, []
    every = [x for op in ops for x in [op] + [v for _, v in (op.tile_variants() if op.region.kind == "gemm" else [])]
             + ([op._alternative] if op._alternative is not None else [])]
    for op in every:
        ins = [n.meta["val"] for n in op.region.inputs]
        outs = [like(n.meta["val"]) for n in op.region.outputs]
        views = [torch.view_as_real(like(t)) if t.dtype == torch.complex64 else like(t) for t in ins]
        for plan, args in op._arguments(torch.device("cpu"), views, outs, [t.stride() for t in outs]):
            compiled += compile_workers.wait(plan.fn)
            launches.append((plan, args))
    before = cache_entries()
    for plan, args in launches:
        plan.fn.run(*args, grid=plan.grid, warmup=True, **plan.kwargs)
    print(json.dumps({"sent": sent, "compiled_by_workers": compiled, "launches": len(launches),
                      "new_cache_files_at_launch": cache_entries() - before}))


if __name__ == "__main__":
    main()
