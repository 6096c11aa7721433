"""GPU probe: does exactdit.aten.reduce reproduce eager ``x.mean(-1)`` bit for bit?

Run on the GPU machine from the repository root:

    python3 benchmarks/probes/probe_aten_reduce.py            # full grid
    python3 benchmarks/probes/probe_aten_reduce.py --quick    # a few shapes

Needs only torch (2.11 expected) and numpy. For every (M, D) it builds a fresh
``x = h.to(float32).pow(2)`` on the GPU (h bf16, rows with large dynamic
range), computes eager ``x.mean(-1, keepdim=True)`` and the CPU order model on
a subsample of rows (the GPU tensor keeps the real M), and reports the
fraction of sampled rows whose fp32 bits match. Alternative hypotheses are
scored where they would change the answer:

* ``yx``: warps combined before lanes (pre-late-2025 order), warp-split shapes.
* ``gt128``: vectorize only for D > 128 (older rule), D == 128.
* ``inv``: factor fl(1/D) instead of fl(M)/fl(M*D), where they differ.

Also checks that ``[2, M/2, D]`` (3-d) gives the same bits as ``[M, D]``.
Writes ``$OUT/probe_aten_reduce.json`` when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from exactdit.aten.reduce import (  # noqa: E402
    mean_factor,
    mean_lastdim_launches,
    mean_lastdim_reference_order,
)

MS = [1, 2, 3, 4, 7, 8, 16, 17, 31, 32, 64, 127, 128, 255, 256, 511, 512, 1024, 2048,
      4096, 4224, 8448, 16384]
DS = [64, 96, 100, 127, 128, 384, 1000, 1024, 1536, 2047, 2048, 3072, 4095, 4096, 5120,
      6144, 8192, 12288, 16384]
# shapes where fl(M)/fl(M*D) != fl(1/D), plus a 32-bit-split shape
EXTRA = [(4097, 4097), (55126, 727), (9666, 14790), (8164, 13253), (33000, 16384)]
QUICK = [(1, 4096), (4096, 4096), (4224, 4096), (16, 16384), (7, 2047), (1, 127), (1, 128),
         (4096, 100), (4097, 4097)]


def f32(v: float) -> float:
    return float(np.float32(v))


def make_input(M: int, D: int, gen: torch.Generator, dev: str) -> torch.Tensor:
    h = torch.randn(M, D, device=dev, generator=gen, dtype=torch.float32)
    # per-row scale over 2**-24 .. 2**16 and ~1% spikes x1000 in every 4th row
    e = torch.randint(-24, 17, (M, 1), device=dev, generator=gen).float()
    h = h * torch.exp2(e)
    spike = (torch.rand(M, D, device=dev, generator=gen) < 0.01)
    spike &= (torch.arange(M, device=dev) % 4 == 1).unsqueeze(1)
    h = torch.where(spike, h * 1000.0, h)
    h = h.to(torch.bfloat16)
    return h.to(torch.float32).pow(2)  # fresh contiguous fp32, as in diffusers RMSNorm


def pick_rows(M: int, D: int, n: int, gen: torch.Generator) -> list:
    if M <= n:
        return list(range(M))
    rows = set(range(8)) | set(range(M - 8, M))
    # include every misalignment class and 32-bit piece boundaries
    for s, c, _ in mean_lastdim_launches(M, D):
        rows |= {s, min(s + 1, M - 1), s + c - 1}
    extra = torch.randint(0, M, (n,), generator=gen).tolist()
    for r in extra:
        if len(rows) >= n:
            break
        rows.add(r)
    return sorted(rows)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.int32) == b.contiguous().view(torch.int32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", type=int, default=48, help="sampled rows per shape")
    ap.add_argument("--budget-s", type=float, default=55.0)
    ap.add_argument("--device", default="cuda", help="'cpu' only dry-runs the script")
    args = ap.parse_args()

    dev = args.device
    if dev == "cuda":
        if not torch.cuda.is_available():
            print("needs a CUDA device")
            return 2
        props = torch.cuda.get_device_properties(0)
        name = props.name
        num_sms = props.multi_processor_count
        max_thr = getattr(props, "max_threads_per_multi_processor", 2048)
    else:
        name, num_sms, max_thr = "cpu-dry-run", 132, 2048
    print(f"torch {torch.__version__} device {name} SMs {num_sms} threads/SM {max_thr}")

    shapes = QUICK if args.quick else [(m, d) for d in DS for m in MS] + EXTRA
    gen_gpu = torch.Generator(device=dev).manual_seed(1234)
    if dev == "cpu" and not args.quick:
        shapes = [(m, d) for m, d in shapes if m * d <= 4096 * 4096]
    gen_cpu = torch.Generator().manual_seed(99)
    t0 = time.time()
    records = []
    total_rows = total_match = 0
    for M, D in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"time budget reached, stopping before ({M}, {D})")
            break
        x = make_input(M, D, gen_gpu, dev)
        y = x.mean(-1, keepdim=True)
        base_off = (x.data_ptr() // 4) % 4
        rows = pick_rows(M, D, args.rows, gen_cpu)
        ridx = torch.tensor(rows, device=dev)
        xs = x.index_select(0, ridx).cpu()
        ys = y.index_select(0, ridx).cpu().reshape(-1)
        launches = mean_lastdim_launches(M, D, num_sms=num_sms, max_threads_per_sm=max_thr)
        cfg = launches[0][2]
        kw = dict(num_rows=M, row_index=rows, base_elem_offset=base_off, num_sms=num_sms,
                  max_threads_per_sm=max_thr)
        model = mean_lastdim_reference_order(xs, **kw)
        eq = bits_equal(model, ys)
        n_match = int(eq.sum())
        rec = {
            "M": M, "D": D, "config": cfg.short(), "pieces": len(launches),
            "vectorize": cfg.vectorize_input, "block_width": cfg.block_width,
            "block_height": cfg.block_height, "warps_split_row": cfg.warps_split_row,
            "ctas_per_output": cfg.ctas_per_output, "base_elem_offset": base_off,
            "rows_checked": len(rows), "match": n_match, "match_frac": n_match / len(rows),
            "mismatch_rows": [rows[i] for i in torch.nonzero(~eq).reshape(-1).tolist()][:16],
        }
        alts = {}
        if any(c.warps_split_row for _, _, c in launches):
            alts["yx"] = mean_lastdim_reference_order(xs, block_order="yx", **kw)
        if D == 128:
            alts["gt128"] = mean_lastdim_reference_order(xs, vectorize_min_dim0=129, **kw)
        if mean_factor(M, D) != f32(1.0 / D):
            alts["inv"] = mean_lastdim_reference_order(xs, factor=f32(1.0 / D), **kw)
        for k, v in alts.items():
            rec["alt_" + k] = int(bits_equal(v, ys).sum()) / len(rows)
        # also: is the order model distinguishable from a plain fp32 row sum * fl(1/D)?
        plain = xs.sum(-1) * torch.tensor(f32(1.0 / D))
        rec["plain_cpu_sum_frac"] = int(bits_equal(plain, ys).sum()) / len(rows)
        # 3-d view [2, M/2, D] must give the same bits as [M, D]
        if M % 2 == 0 and M >= 2:
            y3 = x.view(2, M // 2, D).mean(-1, keepdim=True).reshape(M, 1)
            rec["view3d_equal"] = bool(torch.equal(y3.view(torch.int32), y.view(torch.int32)))
        records.append(rec)
        total_rows += len(rows)
        total_match += n_match
        alt_s = " ".join(f"{k}={rec['alt_' + k]:.2f}" for k in alts)
        v3 = rec.get("view3d_equal", "-")
        print(f"M={M:6d} D={D:6d} {cfg.short():60s} match {n_match:3d}/{len(rows):3d} "
              f"({rec['match_frac']:.3f}) plain={rec['plain_cpu_sum_frac']:.2f} 3d={v3} {alt_s}")
        del x, y
    elapsed = time.time() - t0
    bad = [r for r in records if r["match"] != r["rows_checked"]]
    print(f"\n{len(records)} shapes, {total_match}/{total_rows} rows bit-identical, "
          f"{len(bad)} shapes with mismatches, {elapsed:.1f} s")
    for r in bad[:40]:
        print(f"  MISMATCH M={r['M']} D={r['D']} {r['config']} {r['match']}/{r['rows_checked']} "
              f"rows {r['mismatch_rows']}")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe_aten_reduce.json"), "w") as fh:
            json.dump({"torch": torch.__version__, "device": name, "num_sms": num_sms,
                       "elapsed_s": elapsed, "records": records}, fh, indent=1)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
