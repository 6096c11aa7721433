"""Shared test helpers: bit comparison, random inputs, the layouts real models produce."""

from __future__ import annotations

import torch

from exactdit.gate import first_difference


def assert_bits_equal(out, ref, what=""):
    problem = first_difference(out, ref)
    assert problem is None, f"{what}: {problem}"


def interpreter_rsqrt(x: torch.Tensor) -> torch.Tensor:
    """What ``numerics.rsqrt_approx`` computes in Triton's interpreter: ``fl(1 / fl(sqrt(x)))`` in fp32
    (the sqrt in fp64, rounded: torch's CPU fp32 sqrt is not always correctly rounded). The GPU's
    ``rsqrt.approx`` cannot be reproduced on the CPU."""
    return (torch.ones_like(x, dtype=torch.float32) / torch.sqrt(x.double()).float()).to(x.dtype)


def rand(shape, dtype, device, generator, scale=1.0):
    """Random values with a wide spread of magnitudes (not just N(0, 1))."""
    device = torch.device(device)
    if device.type == "cuda":  # draw on the GPU: CPU generation of large inputs dominates GPU tests
        seed = int(torch.randint(0, 2**31, (1,), generator=generator))
        generator = torch.Generator(device=device).manual_seed(seed)
    base = torch.randn(shape, generator=generator, dtype=torch.float32, device=device)
    spread = torch.exp2(torch.randint(-6, 7, shape, generator=generator, device=device).float())
    return (base * spread * scale).to(dtype=dtype)


def activation(kind, S, B, D, dtype, device, g):
    """An activation as models hand it over: [B, S, D], [S, B, D], or a permuted view."""
    if kind == "bsd":
        return rand((B, S, D), dtype, device, g)
    if kind == "sbd":
        return rand((S, B, D), dtype, device, g)
    if kind == "sbd_as_bsd":  # ERNIE-Image's x.permute(1, 0, 2)
        return rand((S, B, D), dtype, device, g).permute(1, 0, 2)
    if kind == "rows":
        return rand((S * B, D), dtype, device, g)
    if kind == "row_slice":  # non-dense view: every other row of a larger tensor
        return rand((2 * S * B, D), dtype, device, g)[::2]
    raise ValueError(kind)


MODULATION_KINDS = ("vec", "full", "outer", "inner", "chunk", "expanded")


def modulation(kind, shape, dtype, device, g):
    """A modulation vector broadcasting to an activation of ``shape``, in the layouts diffusers
    DiTs use: [D]; a full tensor; [B, 1, D] under [B, S, D] ("outer"); [1, B, D] under
    [S, B, D] ("inner"); a ``chunk`` view of a [B, 1, 3D] projection; ERNIE-Image's expanded
    contiguous copy."""
    shape = tuple(shape)
    D = shape[-1]
    lead = shape[:-1]
    if kind == "vec":
        return rand((D,), dtype, device, g)
    if kind == "full":
        return rand(shape, dtype, device, g)
    if kind == "outer":
        return rand(lead[:1] + (1,) * (len(lead) - 1) + (D,), dtype, device, g)
    if kind == "inner":
        return rand((1,) + lead[1:] + (D,), dtype, device, g)
    if kind == "chunk":
        big = rand(lead[:1] + (1,) * (len(lead) - 1) + (3 * D,), dtype, device, g)
        return big.chunk(3, dim=-1)[1]
    if kind == "expanded":
        return rand((1,) + lead[1:] + (D,), dtype, device, g).expand(shape).contiguous()
    raise ValueError(kind)


def with_special_values(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first elements replaced by +-0, +-inf, NaN, the smallest subnormal and the
    largest finite values of its dtype (where rules most often part from eager)."""
    info = torch.finfo(t.dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), info.smallest_normal * 2**-3,
                            -info.smallest_normal, info.max, -info.max, 1.0, -1.0], dtype=t.dtype)
    t = t.clone()
    n = min(t.numel(), special.numel())
    t.view(-1)[:n] = special[:n].to(t.device)
    return t


def run_benchmark(script: str, *args: str, out_dir) -> list[dict]:
    """``benchmarks/<script>`` run with ``args`` in a fresh interpreter, its results under
    ``out_dir`` (``$OUT``): the rows it appended to ``results.jsonl``. Fails with the script's
    stderr when it exits nonzero (how the device would find it)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", script), *args], capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, OUT=str(out_dir)), cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
