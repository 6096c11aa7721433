"""Registers, spills and shared memory of the fused GEMM kernels, compiled for sm_90a on a machine
without a GPU (Triton's compiler and ptxas need no device): per DiT epilogue case and tile
configuration, what ``ptxas -v`` reports. A proxy, not a time: a configuration that spills its
accumulator or epilogue to local memory pays for it in every tile.

    python3 benchmarks/kernels/gemm_registers.py [--tiles 128,256,64,8,4 128,128,64,4,3,2 ...]

Graphs are built on the meta device (shapes only; the values the engine sees are CPU tensors of
the same layouts, never computed), like ``bench_gemm.py``'s cases.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

ROOT = __file__.rsplit("/benchmarks/", 1)[0]
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "device"))

import compile_for_gpu  # noqa: E402  (sets TRITON_INTERPRET=0 before Triton is imported)
import torch  # noqa: E402
import triton  # noqa: E402

CASES = [("scale", 4096, 3072, 3072), ("gated", 4096, 3072, 3072), ("gelu", 4608, 3072, 12288),
         ("cat-gated", 4608, 15360, 3072)]


def graph(name: str, m: int, k: int, n: int):
    from tests.engine_helpers import GraphBuilder

    aten = torch.ops.aten
    b = GraphBuilder()
    meta = dict(device="meta", dtype=torch.bfloat16)
    if name == "cat-gated":  # A = cat([attn, act]) read as K ranges; act an input here (no GELU table on meta)
        pieces = [b.input(torch.empty(1, m, 3072, **meta)), b.input(torch.empty(1, m, k - 3072, **meta))]
        x = b.op(aten.view.default, b.op(aten.cat.default, pieces, -1), [m, k])
    else:
        x = b.input(torch.empty(m, k, **meta))
    y = b.op(aten.addmm.default, b.input(torch.empty(n, **meta)), x,
             b.op(aten.t.default, b.input(torch.empty(n, k, **meta))))
    if name == "gelu":
        out = b.op(aten.gelu.default, y, approximate="tanh")
    elif name == "scale":  # the least epilogue there is: the GEMM's own registers
        out = b.op(aten.mul.Tensor, y, 2.0)
    else:
        out = b.op(aten.add.Tensor, b.input(torch.empty(1, m, n, **meta)),
                   b.op(aten.mul.Tensor, b.input(torch.empty(1, 1, n, **meta)), b.op(aten.view.default, y, [1, m, n])))
    gm = b.module(out)
    for node in gm.graph.nodes:  # CPU values of the same layouts (uncomputed): the engine takes CPU or CUDA
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor):
            node.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
    return gm


def ptxas_report(ptx: str) -> dict:
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # the newer of Triton's two: the PTX version Triton emits may be newer than the plain one takes
    ptxas = next(p for p in (os.path.join(bin_dir, "ptxas-blackwell"), os.path.join(bin_dir, "ptxas"))
                 if os.path.exists(p))
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    text = done.stdout + done.stderr
    if os.environ.get("PTXAS_DEBUG"):
        print(text)
    get = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else None  # noqa: E731
    return {"registers": get(r"Used (\d+) registers"), "spill_stores": get(r"(\d+) bytes spill stores"),
            "spill_loads": get(r"(\d+) bytes spill loads"), "stack": get(r"(\d+) bytes stack frame")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", nargs="*", default=None,
                    help="BM,BN,BK,WARPS,STAGES[,PER_SM[,WS[,SPLIT[,TMA]]]] (default: the candidates)")
    args = ap.parse_args()
    os.environ["EXACTDIT_GEMM"] = "fused"
    from exactdit.engine.templates import gemm

    print("| case | tiles | registers | spill stores / loads (bytes) | shared bytes |\n|---|---|---|---|---|")
    for name, m, k, n in CASES:
        os.environ.pop(gemm.TILES_ENV, None)
        specs = args.tiles or [t.spec for t in gemm.tile_candidates(m, n, k)]
        for spec in specs:
            os.environ[gemm.TILES_ENV] = spec
            launches = [x for x in compile_for_gpu.region_launches(f"{name}-{spec}", graph(name, m, k, n))
                        if "gemm[" in x[0]]
            for label, fn, sig, consts, options in launches:
                tiles = gemm.Tiles.parse(spec)
                options = dict(options, num_stages=tiles.stages)
                try:
                    compiled = compile_for_gpu.compile_launch(fn, sig, consts, options, {}, 90)
                except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a finding too
                    print(f"| {name} {m}x{k}x{n} | {tiles.label} | does not compile: {type(e).__name__} | | |")
                    continue
                r = ptxas_report(compiled.asm["ptx"])
                print(f"| {name} {m}x{k}x{n} | {tiles.label} | {r['registers']} | {r['spill_stores']} / "
                      f"{r['spill_loads']} | {compiled.metadata.shared} |", flush=True)


if __name__ == "__main__":
    main()
