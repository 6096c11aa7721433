"""Fused GEMM regions against cuBLAS + their epilogue as a separate kernel, on graphs of the shapes
and epilogues DiT blocks have: per tile configuration, the two times the runtime's choice measures
(``exactdit.engine.templates.gemm.choose``) and whether the outputs equal eager's. ``--energy`` also
runs each way back to back for two seconds: its time per call, SM clock, board power and energy per
call (NVML). At the 700 W cap a forward's GEMMs run power-limited, so a fused kernel that is faster
alone but spends more energy per call loses inside the forward: this is the number that says which.

    python3 benchmarks/kernels/bench_gemm.py [--tiles 128,256,64,8,3 128,128,64,4,3,2 ...] [--energy]

By default each case's candidate tile configurations (``gemm.tile_candidates``) are timed in turn
with cuBLAS in one pass, as the runtime's choice times them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.models.profiling import clocks_while  # noqa: E402
from benchmarks.runner import append_results, environment, fused_from_the_first_call  # noqa: E402
from exactdit.engine.templates import gemm  # noqa: E402
from exactdit.engine.backend import rewrite  # noqa: E402
from tests.engine_helpers import GraphBuilder  # noqa: E402

aten = torch.ops.aten


def case(name: str, m: int, k: int, n: int, seed: int = 0):
    torch.manual_seed(seed)
    b = GraphBuilder()
    if name == "cat-gated":  # the single block's proj_out: A = cat([attn, gelu(mlp)]), read as K ranges
        attn = b.input(torch.randn(1, m, 3072, device="cuda", dtype=torch.bfloat16))
        act = b.op(aten.gelu.default, b.input(torch.randn(1, m, k - 3072, device="cuda", dtype=torch.bfloat16)),
                   approximate="tanh")
        x = b.op(aten.view.default, b.op(aten.cat.default, [attn, act], -1), [m, k])
        name = "gated"
    else:
        x = b.input(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    wt = b.op(aten.t.default, b.input(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5))
    y = b.op(aten.addmm.default, b.input(torch.randn(n, device="cuda", dtype=torch.bfloat16)), x, wt)
    if name == "gelu":
        out = [b.op(aten.gelu.default, y, approximate="tanh")]
    elif name == "cast":
        out = [b.op(aten.mul.Tensor, y, 1.0), b.op(aten.add.Tensor, y, 0.0)]
    else:  # gated residual
        y3 = b.op(aten.view.default, y, [1, m, n])
        gate = b.input(torch.randn(1, 1, n, device="cuda", dtype=torch.bfloat16))
        out = [b.op(aten.add.Tensor, b.input(torch.randn(1, m, n, device="cuda", dtype=torch.bfloat16)),
                    b.op(aten.mul.Tensor, gate, y3))]
    return b.module(*out), b.inputs


def node_values(gm, inputs) -> dict:
    """Every node's value in a run of ``gm``, by node name."""
    values = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            values[n.name] = super().run_node(n)
            return values[n.name]

    Recorder(gm).run(*inputs)
    return values


def back_to_back(fn, inputs) -> dict:
    """One way run back to back (queued, no waits): us per call, clock, power, mJ per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        fn(*inputs)
    end.record()
    end.synchronize()
    c = clocks_while(lambda: fn(*inputs), seconds=2.0, synchronize_each=False)
    return {"us": start.elapsed_time(end) * 20, "sm_mhz": c["sm_mhz"], "power_w": c["power_w"],
            "mj": c["energy_j"] * 1e3 if c["energy_j"] is not None else None}


CASES = [("gated", 4096, 3072, 3072), ("gelu", 4608, 3072, 12288), ("gated", 4096, 12288, 3072),
         ("gated", 4608, 15360, 3072), ("cat-gated", 4608, 15360, 3072), ("gelu", 14040, 5120, 13824),
         ("cast", 4096, 3072, 9216)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="*", default=[],
                    help="BM,BN,BK,WARPS,STAGES[,PER_SM[,WS]]: one pass per configuration forced "
                         "(EXACTDIT_GEMM_TILES); by "
                         "default one pass where the runtime times every candidate configuration against cuBLAS")
    ap.add_argument("--energy", action="store_true", help="also time, clock and energy of each way back to back")
    args = ap.parse_args()
    fused_from_the_first_call()  # (the first call's choice times compiled kernels, not ATen's while they compile)
    env = environment()
    rows = []
    os.environ[gemm.CHOICE_ENV] = "auto"  # fused GEMMs on, each signature timed
    for tiles in args.tiles or ["candidates"]:
        if tiles == "candidates":
            os.environ.pop(gemm.TILES_ENV, None)
        else:
            os.environ[gemm.TILES_ENV] = tiles
        for name, m, k, n in CASES:
            gm, inputs = case(name, m, k, n)
            with torch.no_grad():
                ref = gm(*inputs)
                values = node_values(gm, inputs)  # (a region's inputs, for --energy)
                rewrite(gm, f"bench-{name}-{m}x{k}x{n}-{tiles}")  # a new label: the gate keys ops by name
                try:
                    out = gm(*inputs)
                except Exception as e:  # noqa: BLE001 - a tile configuration that does not build
                    print(f"{tiles} {name} {m}x{k}x{n}: {type(e).__name__} {str(e)[:100]}", flush=True)
                    continue
            ops = [nd.target.exactdit_region for nd in gm.graph.nodes if hasattr(nd.target, "exactdit_region")]
            choices = [c for op in ops for c in op.choices.values()]
            equal = all(torch.equal(o, r) for o, r in zip(out, ref))
            for way, times in choices:
                t_split = times["split"]
                for fused, t_fused in times.items():
                    if fused == "split":
                        continue
                    print(f"{name} {m}x{k}x{n} {fused}: {t_fused:.1f} us, cuBLAS + epilogue {t_split:.1f} us "
                          f"({t_split / t_fused:.3f}x) equal={equal}", flush=True)
                    rows.append(dict(model_or_op=f"gemm+{name}", shape=f"{m}x{k}x{n}", dtype="bf16", path=fused,
                                     us=t_fused, split_us=t_split, ratio=t_split / t_fused, chosen=fused == way,
                                     ratio_kind="cublas+epilogue_us/fused_us", equal=equal, **env))
            if args.energy:
                for op in (op for op in ops if op.region.kind == "gemm"):
                    region_args = [values[n.name] for n in op.region.inputs]
                    measured = {way: back_to_back(fn, region_args) for way, fn in op.gemm_ways(*region_args).items()}
                    print(f"{tiles} {name} {m}x{k}x{n} back to back: {measured}", flush=True)
                    rows.append(dict(model_or_op=f"gemm+{name}", shape=f"{m}x{k}x{n}", dtype="bf16",
                                     path=f"fused {tiles}, back to back", back_to_back=measured, equal=equal, **env))
    append_results(rows, "benchmarks/kernels/bench_gemm.py")


if __name__ == "__main__":
    main()
