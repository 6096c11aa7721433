"""Probe: Hopper-grade Triton GEMMs (TMA descriptors, persistent grid, warp specialisation) against
cuBLAS (F.linear) at DiT shapes: are their bits cuBLAS's, and how fast are they?

For each shape and each variant / tile configuration: bit-identical to F.linear (with bias) or not,
and the CUDA-event median time against cuBLAS's median in the same loop. A second table times a
fused epilogue (gated residual ``r + g * linear(x)`` with eager's bf16 roundings) against cuBLAS
followed by eager's two elementwise kernels. Prints one JSON line per measurement (and a summary),
so the output can be appended to benchmarks/results.jsonl.

    python benchmarks/probes/probe_gemm_tma.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from exactdit.device.gemm import tile_of  # noqa: E402  (the engine's tile order)


@triton.jit
def gemm_persistent(a_desc, b_desc, c_desc, bias_ptr, r_ptr, g_ptr, c_ptr, M, N, K, srm, HAS_BIAS: tl.constexpr,
                    GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                    NUM_SMS: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr, STORE: tl.constexpr):
    """C = A @ B.T (+ bias), fp32 accumulator, K in order; A [M, K], B [N, K] (nn.Linear's weight).
    STORE 0: the tile through a TMA descriptor; 1: two half tiles through it; 2: pointer stores."""
    start = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(start, num_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS):
        pid_m, pid_n = tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        om = pid_m * BM
        on = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([om, ki * BK])
            b = b_desc.load([on, ki * BK])
            acc = tl.dot(a, b.T, acc)
        rn = on + tl.arange(0, BN)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        y = acc.to(tl.bfloat16)
        if GATED:
            rm = om + tl.arange(0, BM)
            ok = (rm[:, None] < M) & (rn[None, :] < N)
            g = tl.load(g_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            gy = (g[None, :] * y.to(tl.float32)).to(tl.bfloat16)
            r = tl.load(r_ptr + rm[:, None] * srm + rn[None, :], mask=ok, other=0.0)
            y = (r.to(tl.float32) + gy.to(tl.float32)).to(tl.bfloat16)
        if STORE == 0:
            c_desc.store([om, on], y)
        elif STORE == 1:
            y0, y1 = y.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
            c_desc.store([om, on], y0)
            c_desc.store([om, on + BN // 2], y1)
        else:
            rm = om + tl.arange(0, BM)
            tl.store(c_ptr + rm[:, None] * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def gemm_tiles(a_desc, b_desc, c_desc, bias_ptr, M, N, K, HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, GROUP_M: tl.constexpr):
    """One output tile per program, TMA loads; same arithmetic as gemm_persistent."""
    pid_m, pid_n = tile_of(tl.program_id(0), tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    om = pid_m * BM
    on = pid_n * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for ki in range(tl.cdiv(K, BK)):
        acc = tl.dot(a_desc.load([om, ki * BK]), b_desc.load([on, ki * BK]).T, acc)
    if HAS_BIAS:
        rn = on + tl.arange(0, BN)
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    c_desc.store([om, on], acc.to(tl.bfloat16))


NUM_SMS = None


def launch(variant, cfg, x, w, bias, out, r=None, g=None):
    BM, BN, BK, warps, stages = cfg[:5]
    group_m = cfg[5] if len(cfg) > 5 else 8
    store = cfg[6] if len(cfg) > 6 else 0
    M, K = x.shape
    N = w.shape[0]
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    c_desc = TensorDescriptor.from_tensor(out, [BM, BN // 2 if store == 1 else BN])
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    kw = dict(num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    if variant == "tiles":
        gemm_tiles[(tiles,)](a_desc, b_desc, c_desc, bias, M, N, K, True, BM, BN, BK, group_m, **kw)
        return out
    ws = variant.endswith("_ws")
    flatten = "flat" in variant
    gated = r is not None
    gemm_persistent[(min(NUM_SMS, tiles),)](a_desc, b_desc, c_desc, bias, r if gated else out, g if gated else bias, out,
                                            M, N, K, r.stride(0) if gated else 0, True, gated, BM, BN, BK, group_m,
                                            NUM_SMS, ws, flatten, store, **kw)
    return out


def _time(fn):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000


def bench(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return statistics.median(_time(fn) for _ in range(reps))


def bench_pair(ref, fn, reps):
    """Medians of ``ref`` and ``fn`` timed alternately (the clock under the power cap drifts between runs)."""
    for _ in range(3):
        ref()
        fn()
    torch.cuda.synchronize()
    tr, tf = [], []
    for _ in range(reps):
        tr.append(_time(ref))
        tf.append(_time(fn))
    return statistics.median(tr), statistics.median(tf)


SHAPES = [  # label, M, K, N
    ("flux img qkv", 4096, 3072, 9216), ("flux img out", 4096, 3072, 3072), ("flux img mlp up", 4096, 3072, 12288),
    ("flux img mlp down", 4096, 12288, 3072), ("flux single mlp", 4608, 3072, 12288),
    ("flux single out", 4608, 15360, 3072), ("flux txt qkv", 512, 3072, 9216), ("flux txt down", 512, 12288, 3072),
    ("zimage w13", 4352, 3840, 20480), ("zimage w2", 4352, 10240, 3840), ("sd35 qkv B2", 8192, 2432, 7296),
    ("sd35 up B2", 8192, 2432, 9728), ("sd35 down B2", 8192, 9728, 2432), ("wan14 qkv", 14040, 5120, 5120),
    ("wan14 ffn up", 14040, 5120, 13824), ("wan14 ffn down", 14040, 13824, 5120), ("odd", 4160, 3072, 3000),
]
CONFIGS = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
           (128, 128, 64, 8, 5), (256, 128, 64, 8, 3), (128, 64, 64, 4, 5)]
VARIANTS = ["persistent", "persistent_flat", "persistent_ws", "persistent_flat_ws", "tiles"]
SWEEP_SHAPES = ("flux img qkv", "flux img out", "flux img mlp down", "flux txt qkv", "wan14 ffn up", "sd35 qkv B2")
SWEEP_VARIANTS = ["persistent", "persistent_flat", "persistent_flat_ws"]
#: (BM, BN, BK, warps, stages, GROUP_M, STORE)
SWEEP_CONFIGS = [(128, 256, 64, 8, 3, 8, 0), (128, 256, 64, 8, 4, 8, 1), (128, 256, 64, 8, 4, 8, 2),
                 (128, 256, 64, 8, 3, 16, 0), (128, 256, 64, 8, 3, 4, 0), (128, 256, 64, 8, 3, 8, 1),
                 (128, 256, 128, 8, 2, 8, 0), (256, 128, 64, 8, 4, 8, 2), (128, 128, 64, 4, 6, 8, 2),
                 (128, 128, 128, 8, 3, 8, 0), (64, 256, 64, 4, 4, 8, 2)]


def main():
    global NUM_SMS
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="three shapes")
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--sweep", action="store_true", help="a wider grid (stages, group, store mode) on six shapes")
    args = p.parse_args()
    NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(json.dumps({"env": env}), flush=True)
    torch.manual_seed(0)
    shapes = SHAPES[:3] if args.quick else SHAPES
    variants, configs = VARIANTS, CONFIGS
    if args.sweep:
        shapes = [s for s in SHAPES if s[0] in SWEEP_SHAPES]
        variants, configs = SWEEP_VARIANTS, SWEEP_CONFIGS
    broken = {}
    for label, M, K, N in shapes:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16) * 0.1
        ref = F.linear(x, w, bias)
        t_cublas = bench(lambda: F.linear(x, w, bias), args.reps)
        best = None
        rows = []
        for variant in variants:
            for cfg in configs:
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    launch(variant, cfg, x, w, bias, out)
                    torch.cuda.synchronize()
                except Exception as e:  # a configuration this Triton cannot build: say so once
                    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                    if (variant, cfg) not in broken:
                        broken[(variant, cfg)] = msg
                        print(json.dumps({"variant": variant, "cfg": cfg, "broken": msg}), flush=True)
                    continue
                equal = torch.equal(out, ref)
                tc, t = bench_pair(lambda: F.linear(x, w, bias), lambda: launch(variant, cfg, x, w, bias, out), args.reps)
                rows.append((variant, cfg, equal, t, tc))
                if equal and (best is None or t / tc < best[3] / best[4]):
                    best = (variant, cfg, equal, t, tc)
        n_equal = sum(r[2] for r in rows)
        rec = {"probe": "gemm_tma", "shape": label, "M": M, "K": K, "N": N, "cublas_us": round(t_cublas, 1),
               "equal_configs": n_equal, "configs": len(rows),
               "best": None if best is None else {"variant": best[0], "cfg": best[1], "us": round(best[3], 1),
                                                  "cublas_paired_us": round(best[4], 1),
                                                  "vs_cublas": round(best[4] / best[3], 3)},
               "per_variant_best": {v: round(max((r[4] / r[3] for r in rows if r[0] == v and r[2]), default=float("nan")), 3)
                                    for v in variants},
               "top3": [(r[0], r[1], round(r[4] / r[3], 3)) for r in sorted((r for r in rows if r[2]), key=lambda r: r[3] / r[4])[:3]],
               **env}
        print(json.dumps(rec), flush=True)
        # fused gated residual epilogue, with the best equal config of the persistent variants
        if best is not None and best[0] != "tiles" and N == K:
            r = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            g = torch.randn(N, device="cuda", dtype=torch.bfloat16)
            eager = lambda: r + g * F.linear(x, w, bias)  # noqa: E731
            ref2 = eager()
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            cfg = tuple(best[1][:5]) + (8, 2)  # pointer stores: the residual's tile needs the shared memory
            try:
                launch(best[0], cfg, x, w, bias, out, r, g)
            except Exception as e:
                print(json.dumps({"probe": "gemm_tma_gated_residual", "shape": label, "error": str(e)[:200]}))
                continue
            eq2 = torch.equal(out, ref2)
            t_e, t_f = bench_pair(eager, lambda: launch(best[0], cfg, x, w, bias, out, r, g), args.reps)
            print(json.dumps({"probe": "gemm_tma_gated_residual", "shape": label, "equal": eq2,
                              "eager_us": round(t_e, 1), "fused_us": round(t_f, 1),
                              "speedup": round(t_e / t_f, 3), **env}), flush=True)


if __name__ == "__main__":
    main()
