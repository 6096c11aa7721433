"""exactdit under diffusers' context parallelism on CUDA: equality only, on every rank.

    torchrun --nproc-per-node 2 benchmarks/parallel/context_parallel_equality.py --model flux --config full \\
        --height 1024 --width 1024 --modes ulysses ring --backend gloo

Each (mode, order) case builds the model on every rank (same seeded weights), enables context
parallelism (exactdit's plan where diffusers has none) and compares one patched forward with
the unpatched one under the same config (``benchmarks.parallel.context_parallel.compare``), with
``torch.equal`` on each rank. ``--backend gloo`` lets both ranks share one GPU when the two-GPU
machine is not lent: gloo moves the CUDA tensors of the all-to-alls and all-gathers through the
host, which copies bits, so every kernel runs as it does under NCCL on its own GPU (each rank
its own shard's shapes) and the equality carries over; its times would not, so none are taken.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.parallel.bench_context_parallel import UNSUPPORTED  # noqa: E402
from benchmarks.runner import add_model_args, write_json  # noqa: E402
from benchmarks.parallel import context_parallel as cp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--modes", nargs="+", default=["ulysses", "ring"], choices=sorted(cp.MODES))
    ap.add_argument("--orders", nargs="+", default=["patch-last"], choices=["patch-last", "patch-first"])
    ap.add_argument("--ring-backend", default="_native_cudnn")
    ap.add_argument("--backend", default=None, choices=["nccl", "gloo"])
    args = ap.parse_args()
    rank, world, device = cp.init_distributed(args.backend)
    from exactdit import state

    geometry = dict(height=args.height, width=args.width, num_frames=args.frames, batch=args.batch)
    rows = []
    for mode in args.modes:
        if (args.model, mode) in UNSUPPORTED:
            if rank == 0:
                print(f"{mode}: skipped, {UNSUPPORTED[args.model, mode]}", flush=True)
            continue
        for order in args.orders:
            state.reset(), torch._dynamo.reset()
            t = time.perf_counter()
            c = cp.compare(args.model, args.config, mode=mode, order=order, device=device,
                           attention_backend=args.ring_backend if mode == "ring" else None, **geometry)
            torch.cuda.empty_cache()
            per_rank = [None] * world
            dist.all_gather_object(per_rank, dict(equal=c.equal, fused=c.fused_regions, failed=c.failed_graphs,
                                                  shape=c.shape))
            row = dict(model=args.model, config=args.config, mode=mode, order=order, world=world,
                       backend=dist.get_backend(), equal=all(r["equal"] for r in per_rank),
                       per_rank=per_rank, seconds=round(time.perf_counter() - t, 1))
            rows.append(row)
            if rank == 0:
                print(f"| {args.model} | {mode} x{world} | {order} | equal on every rank: {row['equal']} | "
                      f"fused per rank {[r['fused'] for r in per_rank]} | failed graphs "
                      f"{sum(len(r['failed']) for r in per_rank)} | {row['seconds']} s |", flush=True)
    if rank == 0:
        write_json(f"context_parallel_equality_{args.model}_{args.config}.json",
                   {"rows": rows, "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"})
    dist.barrier()  # a rank that leaves while rank 0 still writes can abort gloo's peer (SIGABRT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
