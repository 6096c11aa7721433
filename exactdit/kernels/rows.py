"""Addressing rows of [outer, inner, D] views through strides.

Ops view every operand as a 3-D strided tensor [outer, inner, D] with unit stride along D
(a [D] vector has outer and inner strides 0, a [B, 1, D] modulation vector under an [S, B, D]
activation has outer stride 0). Kernels read broadcast operands through these strides instead
of materialising copies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def row_offsets(rows, inner, stride_outer, stride_inner):
    """Element offset of the start of each flat row index in an [outer, inner, D] view."""
    rows = rows.to(tl.int64)
    return (rows // inner) * stride_outer + (rows % inner) * stride_inner


def as_3d(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` broadcast to ``shape`` (1 to 3 dims) and viewed as [outer, inner, D]; no copy."""
    t = t.expand(shape)
    while t.dim() < 3:
        t = t.unsqueeze(0)
    return t


def row_strides(t3: torch.Tensor) -> tuple[int, int]:
    """(outer, inner) strides of an [outer, inner, D] view, with 0 for size-1 dims so that a
    broadcast is recognisable whatever stride PyTorch reports for it."""
    return tuple(0 if t3.shape[i] == 1 else t3.stride(i) for i in (0, 1))


def elementwise_blocks(n_rows: int, width: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_R, BLOCK_D, grid) for a memory-bound elementwise kernel: tiles of ~4096 elements,
    at most 1024 wide so a non-power-of-two width wastes little of the last tile."""
    block_d = min(1024, triton.next_power_of_2(width))
    block_r = min(max(1, 4096 // block_d), triton.next_power_of_2(n_rows))
    return block_r, block_d, (triton.cdiv(n_rows, block_r), triton.cdiv(width, block_d))
