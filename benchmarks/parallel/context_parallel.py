"""One rank of a context-parallel comparison: exactdit + diffusers' context parallelism against the
unpatched transformer under the same parallel config, on every rank.

Used by ``tests/patches/test_context_parallel.py`` (two CPU processes over gloo),
``benchmarks/parallel/bench_context_parallel.py`` (``torchrun``, one GPU per rank, NCCL: equality and time)
and ``benchmarks/parallel/context_parallel_equality.py`` (equality only; ranks may share a GPU over gloo).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

#: parallel modes: keyword arguments of diffusers' ContextParallelConfig for a world of ``n`` ranks
MODES = {
    "ulysses": lambda n: dict(ulysses_degree=n),
    "ring": lambda n: dict(ring_degree=n),
    "ulysses-anything": lambda n: dict(ulysses_degree=n, ulysses_anything=True),
}


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Joins the process group torchrun (or the caller's environment) describes: (rank, world
    size, this rank's device). Where CUDA is present each rank takes GPU ``LOCAL_RANK`` modulo
    the GPU count, over NCCL by default; ``backend="gloo"`` lets several ranks share one GPU
    (gloo moves CUDA tensors through the host: the same bits, so equality holds as under NCCL,
    but its times mean nothing). Without CUDA: gloo on the CPU. Under gloo the collectives it
    lacks get stand-ins (:func:`use_gloo_stand_ins`)."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        # rank 0 may work alone for minutes (a 1-GPU baseline) while the others wait
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))
    rank = dist.get_rank()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if dist.get_backend() == "gloo":
        use_gloo_stand_ins(device)
    return rank, dist.get_world_size(), device


def use_gloo_stand_ins(device: torch.device) -> None:
    """Collectives diffusers calls that gloo cannot run, replaced by ones that move the same bits:
    the all-gather of uneven shards (``ulysses_anything``'s output hook: gloo's all-gather wants
    equal sizes) by :func:`all_gather_uneven`, and on CUDA tensors ATen's functional all-gather
    (torch 2.11 segfaults there) by :func:`route_functional_all_gather`."""
    from diffusers.hooks import context_parallel as cp_hooks

    cp_hooks._all_gather_anything = all_gather_uneven
    if device.type == "cuda":
        route_functional_all_gather("CUDA")


def all_gather_uneven(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``t`` concatenated along ``dim`` in rank order, the sizes along ``dim`` free to
    differ (diffusers' ``_all_gather_anything``): each rank's shard padded to the largest, gathered,
    and cut back."""
    n = dist.get_world_size(group)
    t = t.contiguous()
    size = torch.tensor([t.shape[dim]], device=t.device)
    sizes = [torch.empty_like(size) for _ in range(n)]
    dist.all_gather(sizes, size, group=group)
    sizes = [int(s) for s in sizes]
    padded = t.new_zeros(t.shape[:dim] + (max(sizes),) + t.shape[dim + 1:])
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    parts = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p.narrow(dim, 0, k) for p, k in zip(parts, sizes)], dim=dim)


_ROUTED_GATHERS: dict = {}  # dispatch key -> the torch.library.Library holding the override


def route_functional_all_gather(dispatch_key: str) -> None:
    """Makes ``_c10d_functional.all_gather_into_tensor`` on ``dispatch_key`` tensors run
    ``dist.all_gather_into_tensor`` (every rank's tensor stacked along dim 0, in rank order): the
    op both eager ``funcol.all_gather_tensor`` (diffusers' output gather) and the graphs Dynamo
    captures call (ring attention's key/value gather inside a block), so one override serves
    both. Fake tensors keep the op's own meta kernel."""
    if dispatch_key in _ROUTED_GATHERS:
        return
    from torch.distributed import distributed_c10d as c10d

    def gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
        out = t.new_empty((group_size * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=c10d._resolve_process_group(group_name))
        return out

    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", gather, dispatch_key)
    _ROUTED_GATHERS[dispatch_key] = lib


def parallel_config(mode: str, world: int, device: torch.device):
    """diffusers' ContextParallelConfig for ``mode`` over all ranks. On CPU its device mesh is
    built here: diffusers builds it on the accelerator and divides by the accelerator count."""
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(**MODES[mode](world))
    if device.type == "cpu":
        from torch.distributed.device_mesh import init_device_mesh

        config.mesh = init_device_mesh("cpu", config.mesh_shape, mesh_dim_names=config.mesh_dim_names)
        if torch.accelerator.device_count() == 0:  # diffusers computes rank % device_count
            torch.accelerator.device_count = lambda: 1
    return config


@dataclasses.dataclass
class Comparison:
    model: str
    mode: str
    order: str
    equal: bool  # on this rank
    fused_regions: int  # region calls that ran fused, plus verified signatures
    failed_graphs: list  # captured graphs the engine could not rewrite (they ran as captured)
    shape: tuple
    eager_reasons: dict  # why calls of this model ran diffusers' code (exactdit.report), with counts


def prepare(model: str, config: str = "tiny", *, mode: str = "ulysses", device: torch.device | str = "cpu",
            dtype=torch.bfloat16, seed: int = 0, attention_backend: str | None = None, **geometry):
    """(transformer, kwargs of one forward, its ContextParallelConfig): ``model`` built with the
    same seeded weights on every rank, its attention backend set where given (ring attention needs
    one that returns the log-sum-exp, e.g. "_native_cudnn"). ``model`` names a model of
    :mod:`exactdit.harness.models` or a mini model (:mod:`tests.minis`, its tiny
    config and inputs at ``geometry["grid"]`` where given, a :class:`~tests.minis.Grid`)."""
    from exactdit.harness import models
    from tests import minis

    device = torch.device(device)
    if model in minis.MINIS:
        tr = minis.build(model, dtype=dtype, device=device, seed=seed)
        kw = minis.forward_inputs(model, tr, batch=geometry.get("batch") or 1, seed=seed + 1, device=device,
                                  grid=geometry.get("grid"))
    else:
        tr = models.build_transformer(model, config, dtype=dtype, device=device, seed=seed)
        kw = models.forward_inputs(model, tr, seed=seed + 1, **geometry)
    if attention_backend:
        tr.set_attention_backend(attention_backend)
    return tr, kw, parallel_config(mode, dist.get_world_size(), device)


def compare(model: str, config: str = "tiny", *, mode: str = "ulysses", order: str = "patch-last",
            **build) -> Comparison:
    """One forward of ``model`` (:func:`prepare`) patched and unpatched under the same context
    parallel config, with exactdit's plan where diffusers has none.

    ``order``: "patch-last" (enable_parallelism, eager forward, patch, forward) or "patch-first"
    (patch, enable_parallelism, forward, unpatch, eager forward)."""
    import exactdit
    from exactdit import gate
    from exactdit.engine import coverage
    from exactdit.parallel import enable_context_parallel

    tr, kw, cp = prepare(model, config, mode=mode, **build)
    with torch.no_grad(), gate.waiting_for_kernels():  # (one patched call: it must run the kernels)
        if order == "patch-first":
            exactdit.patch(tr)
            enable_context_parallel(tr, cp)
            out = tr(**kw, return_dict=False)[0]
            exactdit.unpatch(tr)
            ref = tr(**kw, return_dict=False)[0]
        else:
            enable_context_parallel(tr, cp)
            ref = tr(**kw, return_dict=False)[0]
            exactdit.patch(tr)
            out = tr(**kw, return_dict=False)[0]
            exactdit.unpatch(tr)
    report = exactdit.report(show=False)
    name = type(tr).__name__
    fused = sum(v["fused"] + len(v["verified"]) for k, v in report.items() if k.startswith(name))
    failed = [f"{g.name}: {g.failed}" for g in coverage.graphs() if g.failed]
    reasons = {r: n for k, v in report.items() if k.startswith(f"engine.{name}") for r, n in v["eager_reasons"].items()}
    return Comparison(model, mode, order, torch.equal(out, ref), fused, failed, tuple(out.shape), reasons)
