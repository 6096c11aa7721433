"""exactdit under diffusers' context parallelism on several GPUs: equality and time, same run.

    torchrun --nproc-per-node 2 benchmarks/parallel/bench_context_parallel.py --model flux --config full \\
        --height 1024 --width 1024 --modes ulysses ring

In one torchrun job: first rank 0 alone times eager and exactdit on one GPU (the single-GPU
speedup), then for each mode all ranks build the model (same seeded weights), enable context
parallelism (exactdit's plan where diffusers has none), time eager, patch, time exactdit and
compare the output with ``torch.equal`` on every rank. Ring attention runs on the
``--ring-backend`` attention backend (it needs the log-sum-exp); ERNIE-Image's full-length mask
does not fit diffusers' ring attention, so its ring run is skipped with that reason.
Appends rows to ``$OUT/results.jsonl`` and prints each speedup over eager divided by the 1-GPU one (the issue asks >= 0.9).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import exactdit  # noqa: E402
from benchmarks.models.bench_engine import first_call_s, forward_ms  # noqa: E402
from benchmarks.runner import add_model_args, append_results, model_and_inputs, outputs_equal, write_json  # noqa: E402
from benchmarks.parallel import context_parallel as cp  # noqa: E402

#: (model, mode) pairs diffusers cannot run, with the reason
UNSUPPORTED = {("ernie", "ring"): "diffusers' ring attention passes one full-length mask to each key chunk"}


def timed_pair(tr, kw, repeat: int, enable=None) -> dict:
    """Eager, then exactdit: median ms of each, exactdit's first call and the equality."""
    if enable is not None:
        enable(tr)
    eager_ms, ref = forward_ms(tr, kw, repeat)
    exactdit.patch(tr)
    first = first_call_s(tr, kw)
    ms, out = forward_ms(tr, kw, repeat)
    exactdit.unpatch(tr)
    return dict(eager_ms=eager_ms, exactdit_ms=ms, first_call_s=first, equal=outputs_equal(out, ref))


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    ap.add_argument("--modes", nargs="+", default=["ulysses", "ring"], choices=sorted(cp.MODES))
    ap.add_argument("--ring-backend", default="_native_cudnn")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    rank, world, device = cp.init_distributed()
    geometry = dict(height=args.height, width=args.width, num_frames=args.frames, batch=args.batch)
    shape = f"{args.height}x{args.width}" + (f"x{args.frames}" if args.frames else "") + f" B={args.batch}"
    rows = []

    if rank == 0:  # one GPU, no parallelism: the speedup context parallelism should keep
        tr, kw = model_and_inputs(args, device=device)
        single = timed_pair(tr, kw, args.repeat)
        rows.append(dict(path="1 GPU", gpus=1, **single))
        print(f"1 GPU: {single}", flush=True)
        del tr, kw
        torch.cuda.empty_cache()
    dist.barrier()

    for mode in args.modes if world > 1 else ():
        if (args.model, mode) in UNSUPPORTED:
            if rank == 0:
                print(f"{mode}: skipped, {UNSUPPORTED[args.model, mode]}", flush=True)
            continue
        torch._dynamo.reset()
        backend = args.ring_backend if mode == "ring" else None
        t = time.perf_counter()
        tr, kw, config = cp.prepare(args.model, args.config, mode=mode, device=device, attention_backend=backend,
                                    **geometry)
        built = time.perf_counter() - t
        result = timed_pair(tr, kw, args.repeat, enable=lambda m: exactdit.enable_context_parallel(m, config))
        equal = torch.tensor([int(result["equal"])], device=device)
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)  # equal on every rank
        result["equal"] = bool(equal.item())
        rows.append(dict(path=f"{mode} {world} GPUs", gpus=world, **result))
        if rank == 0:
            print(f"{mode} x{world} (built in {built:.0f} s): {result}", flush=True)
        del tr, kw
        torch.cuda.empty_cache()

    if rank == 0:
        single_speedup = rows[0]["eager_ms"] / rows[0]["exactdit_ms"]
        for r in rows:
            r["speedup"] = r["eager_ms"] / r["exactdit_ms"]
            r["speedup_vs_1gpu"] = r["speedup"] / single_speedup
            print(f"| {r['path']} | eager {r['eager_ms']:.2f} ms | exactdit {r['exactdit_ms']:.2f} ms | "
                  f"x{r['speedup']:.3f} | {r['speedup_vs_1gpu']:.3f} of the 1-GPU speedup | equal {r['equal']} |")
        model = f"{args.model} transformer forward ({args.config})"
        append_results([dict(model_or_op=model, shape=shape, dtype="bf16", path=f"{r['path']}: {path}", ms=ms,
                             ratio=r["eager_ms"] / ms, ratio_kind="eager_ms/ms", equal=r["equal"] if path != "eager"
                             else True, gpus=r["gpus"]) for r in rows
                        for path, ms in (("eager", r["eager_ms"]), ("exactdit", r["exactdit_ms"]))],
                       "benchmarks/parallel/bench_context_parallel.py")
        write_json(f"bench_context_parallel_{args.model}_{args.config}.json", {"rows": rows})
    dist.barrier()  # a rank that leaves while rank 0 still writes can abort its peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
