"""Device functions of the generated GEMM kernels (:mod:`exactdit.engine.templates.gemm`).

Contract of the main loop they build: ``acc = sum over k-tiles in order of A[rows, k] @ B[k, cols]``
with an fp32 accumulator, each k-tile one ``tl.dot`` (wgmma on Hopper) added to the running
accumulator. On the H200 (torch 2.11, Triton 3.6) this gives cuBLAS's bits for ``F.linear`` in
bf16 at every DiT shape probed and every tile configuration tried (``benchmarks/probe_gemm_tma.py``,
shared/NUMERICS.md); the gate still verifies each signature against cuBLAS's own output.
"""

from __future__ import annotations

import triton
import triton.language as tl

from exactdit.device.numerics import INTERPRET


@triton.jit
def tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of the ``tile_id``-th output tile: columns of GROUP_M row tiles in turn,
    so that consecutive programs share A's rows and B's columns in L2. Changes no bits: every
    tile accumulates its own K range in order."""
    group = GROUP_M * num_pid_n
    first_m = (tile_id // group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % group) % size_m
    pid_n = (tile_id % group) // size_m
    return pid_m, pid_n


if INTERPRET:

    @triton.jit
    def mma(a, b, acc):
        """``acc + a @ b`` with fp32 products and sums. The interpreter's ``tl.dot`` reads bf16
        as raw integers (numpy has no bf16), so the tiles are widened first (exact); its fp32 sum
        order is numpy's, which is why CPU tests use operands whose sums are exact in any order."""
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")

else:

    @triton.jit
    def mma(a, b, acc):
        """``acc + a @ b``: one tensor-core product per k-tile, fp32 accumulator."""
        return tl.dot(a, b, acc)
