"""exactdit under diffusers' context parallelism: two CPU processes over gloo, Ulysses attention.

Each case compares, on both ranks, the patched transformer with the unpatched one under the same
parallel config (exactdit.harness.context_parallel.compare). Ring attention needs an attention
backend that returns the log-sum-exp (CUDA only in diffusers): its test stands one in on the CPU.
Uneven shards run through gloo stand-ins (use_gloo_stand_ins).
"""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from exactdit.harness.minis import Grid
from exactdit.parallel import CP_PLANS, context_parallel_plan

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, result_dir: str, cases: list) -> None:
    import torch.distributed as dist

    from exactdit import gate
    from exactdit.engine import coverage
    from exactdit.harness.context_parallel import compare
    from exactdit.patches import engine

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = []
        for model, order, geometry in cases:
            gate.reset(), engine.reset(), coverage.reset(), torch._dynamo.reset()
            c = compare(model, mode="ulysses", order=order, seed=3, batch=1, **geometry)
            results.append(dict(model=model, order=order, equal=c.equal, fused=c.fused_regions,
                                failed=c.failed_graphs))
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _run(cases, tmp_path) -> list[list[dict]]:
    mp.spawn(_rank, args=(_free_port(), str(tmp_path), cases), nprocs=WORLD)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]


IMAGE = dict(height=64, width=64)
CASES = [
    ("flux", "patch-last", IMAGE),
    ("flux", "patch-first", IMAGE),
    ("qwen", "patch-last", IMAGE),
    ("wan", "patch-last", dict(height=32, width=32, num_frames=5)),
    ("ernie", "patch-last", IMAGE),  # exactdit's plan
    ("ernie", "patch-first", IMAGE),
    # a mini model whose class carries a diffusers plan, with an even text length to split (the
    # LTX-Video mini's plan fails in diffusers' own eager forward: its RoPE is not split)
    ("flux2", "patch-first", dict(grid=Grid(1, 8, 8, 8))),
]


def test_patched_blocks_match_unpatched_under_ulysses_on_every_rank(tmp_path):
    per_rank = _run(CASES, tmp_path)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(CASES)
        for r in results:
            assert r["equal"], f"rank {rank}: {r}"
            assert r["fused"] > 0, f"rank {rank}: no region ran through the engine: {r}"
            assert not r["failed"], f"rank {rank}: graphs the engine could not rewrite: {r}"


def _uneven_rank(rank: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist

    from exactdit.harness.context_parallel import compare, use_gloo_stand_ins

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    use_gloo_stand_ins(torch.device("cpu"))
    try:
        c = compare("flux", mode="ulysses-anything", seed=3, batch=1, height=48, width=48)
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(dict(equal=c.equal, fused=c.fused_regions, reasons=c.eager_reasons), f)
    finally:
        dist.destroy_process_group()


def test_uneven_shards_run_diffusers_code_with_the_reason(tmp_path):
    """``ulysses_anything`` (a 3 x 3 latent: 9 image tokens over two ranks): diffusers' uneven
    all-to-all runs a collective while Dynamo propagates fake tensors, so no block can be
    captured; every block runs diffusers' code, counted with that reason, and the output stays
    the unpatched model's on both ranks."""
    mp.spawn(_uneven_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["equal"], res
        assert res["fused"] == 0, res
        assert any("not captured" in reason for reason in res["reasons"]), res


def _attention_with_lse_on_cpu(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                               enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """diffusers' cuDNN forward op (model layout (B, S, H, D) in and out, the log-sum-exp as
    (B, S, H)) computed by ATen's CPU flash attention, which returns the log-sum-exp too."""
    q, k, v = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def _ring_rank(rank: int, port: int, result_dir: str, cases: list) -> None:
    import torch.distributed as dist
    from diffusers.models import attention_dispatch

    from exactdit import gate
    from exactdit.engine import coverage
    from exactdit.harness.context_parallel import compare
    from exactdit.patches import engine

    attention_dispatch._cudnn_attention_forward_op = _attention_with_lse_on_cpu
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        results = []
        for model, order in cases:
            gate.reset(), engine.reset(), coverage.reset(), torch._dynamo.reset()
            c = compare(model, mode="ring", order=order, seed=3, batch=1, attention_backend="_native_cudnn", **IMAGE)
            results.append(dict(model=model, equal=c.equal, fused=c.fused_regions, failed=c.failed_graphs,
                                reasons=c.eager_reasons))
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def test_patched_blocks_match_unpatched_under_ring_attention(tmp_path):
    """Ring attention (each rank's keys and values gathered inside the captured block, the partial
    outputs merged by their log-sum-exp in fp32): diffusers' cuDNN op is stood in for by ATen's
    CPU flash attention, which returns the log-sum-exp, on both the patched and the unpatched side."""
    cases = [("flux", "patch-last"), ("qwen", "patch-first")]
    mp.spawn(_ring_rank, args=(_free_port(), str(tmp_path), cases), nprocs=WORLD)
    for r in range(WORLD):
        results = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert len(results) == len(cases)
        for res in results:
            assert res["equal"] and res["fused"] > 0 and not res["failed"] and not res["reasons"], (r, res)


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
    """benchmarks/context_parallel_equality.py, which the device runs (two ranks sharing one GPU
    over gloo where two GPUs are not lent), on two CPU processes: every rank equal and fused."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=root)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
         str(_free_port()), os.path.join(root, "benchmarks", "context_parallel_equality.py"), "--model", "flux",
         "--config", "tiny", "--height", "64", "--width", "64", "--modes", "ulysses", "--backend", "gloo"],
        capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "context_parallel_equality_flux_tiny.json").read_text())["rows"]
    assert [(r["mode"], r["order"], r["world"]) for r in rows] == [("ulysses", "patch-last", WORLD)]
    assert all(r["equal"] and r["fused"] > 0 and not r["failed"] for r in rows[0]["per_rank"]), rows


def _gather_rank(rank: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from exactdit.harness.context_parallel import all_gather_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        t = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        same = [torch.equal(all_gather_tensor(t, d, dist.group.WORLD), funcol.all_gather_tensor(t, d, dist.group.WORLD))
                for d in (0, 1, 2)]
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(same, f)
    finally:
        dist.destroy_process_group()


def test_gather_for_ranks_sharing_a_gpu_equals_functional_all_gather(tmp_path):
    """The all-gather that ranks sharing one GPU over gloo use instead of the functional one
    (init_distributed installs it there) gathers what the functional one gathers, on each dim."""
    mp.spawn(_gather_rank, args=(_free_port(), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == [True, True, True]
