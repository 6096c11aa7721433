"""Which ATen reduce config the RMSNorm kernel emulates for (M, D), and how many rows agree.

Run on a CUDA GPU from the repository root:

    python benchmarks/diagnose_rms_norm.py                 # default list of shapes
    python benchmarks/diagnose_rms_norm.py 4224x4096 1x3072 --dtype bf16

For each shape: the emulated config (threads per row, lanes x warps, vectorized or not), the
fraction of rows whose fp32 variance from the kernel (variance-only launch) equals eager's
``x.to(float32).pow(2).mean(-1)`` bit for bit, and the fraction of equal output elements of the
full ``rms_norm`` against ``exactdit.references.rms_norm``. Rows have a large dynamic range.
Shapes the kernel does not emulate print the reason. Writes ``diagnose_rms_norm.json`` to $OUT.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, write_json  # noqa: E402

from exactdit import references  # noqa: E402
from exactdit.aten_reduce import mean_factor  # noqa: E402
from exactdit.kernels.rms_norm import rms_norm_rows  # noqa: E402
from exactdit.ops.rms_norm import RMS_NORM, copy_row_strides, reduce_config  # noqa: E402

DEFAULT = [
    "1x64", "1x4096", "2x4096", "3x1000", "17x4096", "255x3072", "256x1536", "511x5120", "512x6144",
    "4224x64", "4224x100", "4224x128", "4224x1000", "4224x3072", "4224x4096", "4224x5120",
    "4224x6144", "4224x8192", "4224x12288", "4224x16384", "8448x4096", "1x16384", "17x16384",
    "4224x4095", "17x1001", "3x130",
]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def rows(M, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, D, device="cuda", generator=g)
    k = torch.randint(-10, 11, (M, 1), device="cuda", generator=g).float()
    top = 2 if dtype == torch.float16 else 10
    k = k.clamp(max=top)
    return (x * torch.exp2(k)).to(dtype)


def diagnose(M, D, dtype):
    x = rows(M, D, dtype)
    cfg = reduce_config(x)
    if isinstance(cfg, str):
        return {"shape": f"{M}x{D}", "config": "-", "reason": cfg}
    var = torch.empty(M, dtype=torch.float32, device="cuda")
    rms_norm_rows(x, None, 1e-6, mean_factor(M, D), cfg, None, variance=var, write_out=False,
                  copy_strides=copy_row_strides(x))
    ref_var = x.to(torch.float32).pow(2).mean(-1)
    var_ok = (var.view(torch.int32) == ref_var.view(torch.int32)).float().mean().item()
    out = RMS_NORM.fused(x, None, 1e-6)
    ref = references.rms_norm(x, None, 1e-6)
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    out_ok = (out.view(as_int) == ref.view(as_int)).float().mean().item()
    # what a naive reduction would get (tells whether the shape is a discriminating test)
    naive = (x.to(torch.float32).pow(2).sum(-1, dtype=torch.float64) / D).float()
    naive_ok = (naive.view(torch.int32) == ref_var.view(torch.int32)).float().mean().item()
    return {
        "shape": f"{M}x{D}",
        "config": cfg.short(),
        "threads_per_row": cfg.threads_per_row,
        "variance_rows_equal": var_ok,
        "output_elements_equal": out_ok,
        "fp64_mean_rows_equal": naive_ok,
        "reason": "",
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=DEFAULT, help="MxD")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    args = ap.parse_args()
    dtype = DTYPES[args.dtype]
    results = []
    print(f"{'shape':>12}  {'emulated ATen config':<62} {'var==':>7} {'out==':>7} {'fp64==':>7}")
    for s in args.shapes:
        M, D = (int(v) for v in s.lower().split("x"))
        r = diagnose(M, D, dtype)
        results.append(r)
        if r["reason"]:
            print(f"{r['shape']:>12}  eager: {r['reason']}")
        else:
            print(f"{r['shape']:>12}  {r['config']:<62} {r['variance_rows_equal']:7.4f} "
                  f"{r['output_elements_equal']:7.4f} {r['fp64_mean_rows_equal']:7.4f}")
    path = write_json("diagnose_rms_norm.json", {"env": environment(), "dtype": args.dtype, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
