"""exactdit under diffusers' context parallelism: two CPU processes over gloo.

Each case compares, on both ranks, the patched transformer with the unpatched one under the same
parallel config (benchmarks.parallel.context_parallel.compare). Ring attention needs an attention
backend that returns the log-sum-exp (CUDA only in diffusers): its test stands one in on the CPU.
Uneven shards run through gloo stand-ins (use_gloo_stand_ins).
"""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.minis import Grid
from exactdit.parallel import CP_PLANS, context_parallel_plan

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_group(rank: int, port: int, result_dir: str, job, args: tuple) -> None:
    """One rank of a two-process gloo group: ``job(*args)``'s result as JSON in ``result_dir``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        result = job(*args)
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        # a rank that tears its group down while its peer still talks can abort the peer (SIGABRT
        # in gloo's transport; seen once in CI); only on success, so a failed rank cannot hang here
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run(tmp_path, job, *args) -> list:
    """``job(*args)`` on every rank of a two-process gloo group: each rank's result."""
    mp.spawn(_in_group, args=(_free_port(), str(tmp_path), job, args), nprocs=WORLD)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _attention_with_lse_on_cpu(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """diffusers' cuDNN forward op (model layout (B, S, H, D) in and out, the log-sum-exp as
    (B, S, H)) computed by ATen's CPU flash attention, which returns the log-sum-exp too."""
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def _compare(cases: list) -> list[dict]:
    """``compare`` for each (model, mode, order, build arguments), with gloo's stand-ins and, for
    ring attention on the "_native_cudnn" backend, ATen's CPU flash attention as its op."""
    from diffusers.models import attention_dispatch

    from exactdit import state
    from benchmarks.parallel.context_parallel import compare, use_gloo_stand_ins

    use_gloo_stand_ins(torch.device("cpu"))
    attention_dispatch._cudnn_attention_forward_op = _attention_with_lse_on_cpu
    results = []
    for model, mode, order, build in cases:
        state.reset(), torch._dynamo.reset()
        c = compare(model, mode=mode, order=order, seed=3, batch=1, **build)
        results.append(dict(model=model, mode=mode, order=order, equal=c.equal, fused=c.fused_regions,
                            failed=c.failed_graphs, reasons=c.eager_reasons))
    return results


def _fused_and_equal(per_rank: list, cases: list) -> None:
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases)
        for r in results:
            assert r["equal"], f"rank {rank}: {r}"
            assert r["fused"] > 0, f"rank {rank}: no region ran through the engine: {r}"
            assert not r["failed"], f"rank {rank}: graphs the engine could not rewrite: {r}"
            assert not r["reasons"], f"rank {rank}: blocks ran diffusers' code: {r}"


IMAGE = dict(height=64, width=64)
CASES = [
    ("flux", "ulysses", "patch-last", IMAGE),
    ("flux", "ulysses", "patch-first", IMAGE),
    ("qwen", "ulysses", "patch-last", IMAGE),
    ("wan", "ulysses", "patch-last", dict(height=32, width=32, num_frames=5)),
    ("ernie", "ulysses", "patch-last", IMAGE),  # exactdit's plan
    ("ernie", "ulysses", "patch-first", IMAGE),
    # a mini model whose class carries a diffusers plan, with an even text length to split (the
    # LTX-Video mini's plan fails in diffusers' own eager forward: its RoPE is not split)
    ("flux2", "ulysses", "patch-first", dict(grid=Grid(1, 8, 8, 8))),
]


def test_patched_blocks_match_unpatched_under_ulysses_on_every_rank(tmp_path):
    _fused_and_equal(_run(tmp_path, _compare, CASES), CASES)


def test_patched_blocks_match_unpatched_under_ring_attention(tmp_path):
    """Ring attention (each rank's keys and values gathered inside the captured block, the partial
    outputs merged by their log-sum-exp in fp32): diffusers' cuDNN op is stood in for by ATen's
    CPU flash attention, which returns the log-sum-exp, on both the patched and the unpatched side."""
    ring = dict(IMAGE, attention_backend="_native_cudnn")
    cases = [("flux", "ring", "patch-last", ring), ("qwen", "ring", "patch-first", ring)]
    _fused_and_equal(_run(tmp_path, _compare, cases), cases)


def test_uneven_shards_run_diffusers_code_with_the_reason(tmp_path):
    """``ulysses_anything`` (a 3 x 3 latent: 9 image tokens over two ranks): diffusers' uneven
    all-to-all runs a collective while Dynamo propagates fake tensors, so no block can be
    captured; every block runs diffusers' code, counted with that reason, and the output stays
    the unpatched model's on both ranks."""
    for (res,) in _run(tmp_path, _compare, [("flux", "ulysses-anything", "patch-last", dict(height=48, width=48))]):
        assert res["equal"], res
        assert res["fused"] == 0, res
        assert any("not captured" in reason for reason in res["reasons"]), res


def test_plans_come_from_diffusers_first_then_exactdit():
    from exactdit.harness import models

    flux = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=0)
    ernie = models.build_transformer("ernie", "tiny", dtype=torch.bfloat16, seed=0)
    zimage = models.build_transformer("zimage", "tiny", dtype=torch.bfloat16, seed=0)
    assert context_parallel_plan(flux) is type(flux)._cp_plan
    assert context_parallel_plan(ernie) is CP_PLANS["ErnieImageTransformer2DModel"]
    with pytest.raises(ValueError, match="ZImageTransformer2DModel has no context-parallel plan"):
        context_parallel_plan(zimage)


def test_ernie_plan_names_the_arguments_diffusers_passes():
    """The split hook finds arguments by name in the block's forward signature: a renamed
    argument in a later diffusers would silently not be split, so check the names here."""
    import inspect

    from diffusers.models.transformers.transformer_ernie_image import ErnieImageSharedAdaLNBlock

    params = inspect.signature(ErnieImageSharedAdaLNBlock.forward).parameters
    plan = CP_PLANS["ErnieImageTransformer2DModel"]
    for key in ("layers.0", "layers.*"):
        assert set(plan[key]) <= set(params), key


def test_equality_script_runs_under_torchrun(tmp_path):
    """benchmarks/parallel/context_parallel_equality.py, which the device runs (two ranks sharing one GPU
    over gloo where two GPUs are not lent), on two CPU processes: every rank equal and fused."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
         str(_free_port()), os.path.join(root, "benchmarks", "parallel", "context_parallel_equality.py"), "--model", "flux",
         "--config", "tiny", "--height", "64", "--width", "64", "--modes", "ulysses", "--backend", "gloo"],
        capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "context_parallel_equality_flux_tiny.json").read_text())["rows"]
    assert [(r["mode"], r["order"], r["world"]) for r in rows] == [("ulysses", "patch-last", WORLD)]
    assert all(r["equal"] and r["fused"] > 0 and not r["failed"] for r in rows[0]["per_rank"]), rows


def _shard(rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s shard in the gather tests: 3 + rank long along ``dim`` (uneven)."""
    shape = [3, 5, 2]
    shape[dim] += rank
    return torch.randn(shape, generator=torch.Generator().manual_seed(10 * rank + dim)).to(torch.bfloat16)


def _gathers() -> list[bool]:
    """The override is registered; per dim: ``funcol.all_gather_tensor`` routed through
    :func:`route_functional_all_gather` (here for CPU tensors, as it is for CUDA ones under gloo)
    equals the unrouted op and the concatenation of the shards of equal size; the uneven stand-in
    equals the concatenation of uneven shards."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from benchmarks.parallel.context_parallel import all_gather_uneven, route_functional_all_gather

    rank, dims, out = dist.get_rank(), (0, 1, 2), []
    even = {d: _shard(0, d) + rank for d in dims}
    unrouted = {d: funcol.all_gather_tensor(even[d], d, dist.group.WORLD) for d in dims}
    route_functional_all_gather("CPU")
    out.append(torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_gather_into_tensor", "CPU"))
    for d in dims:
        expected = torch.cat([_shard(0, d) + r for r in range(WORLD)], dim=d)
        got = funcol.all_gather_tensor(even[d], d, dist.group.WORLD)
        out.append(torch.equal(got, expected) and torch.equal(got, unrouted[d]))
        uneven = torch.cat([_shard(r, d) for r in range(WORLD)], dim=d)
        out.append(torch.equal(all_gather_uneven(_shard(rank, d), d, dist.group.WORLD), uneven))
    return out


def test_gloo_stand_ins_gather_what_the_collectives_they_replace_gather(tmp_path):
    """The all-gathers ranks over gloo use instead of ATen's functional one (CUDA tensors) and of
    diffusers' uneven one (use_gloo_stand_ins) gather every rank's shard in rank order."""
    for result in _run(tmp_path, _gathers):
        assert result == [True] * 7, result
