"""The ``pointwise`` template: tiles of ``[BLOCK_R, BLOCK_C]`` of the domain (rows = all dims
but the last). Where an operand's rows lie adjacent in memory (:func:`rows_adjacent`: a patch
embedding's (B, C, L) output, flattened and transposed) the kernel is regenerated over tiles of many
rows (:data:`ROWS_ADJACENT_TILE`); no value changes."""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from exactdit.device.rows import ELEMENTWISE_TILE, elementwise_blocks, next_power_of_2
from exactdit.engine.emit import Code, Emitter, Operand, Tile
from exactdit.engine.indexing import Atom, Index, Ix, row_int
from exactdit.engine.region import Launch, Region
from exactdit.engine.templates.base import (
    GeneratedKernel, _kernel, _row_atoms, _store_outputs, _table_preamble, output_operands,
)


#: row tiles per program when a region reads tables (each program loads its tables once). 8 to 32
#: (as a dynamic loop) measured no faster on Wan's GELU and Z-Image's SwiGLU, nor did 1-8 tiles of
#: 2048-8192 elements on 4 or 8 warps on Flux's and Wan-1.3B's GELU (within 1-5%, 1.28-1.42x the
#: memory floor): the lookups, not the table loads, set their time (tune_region_templates.py)
TABLE_TILES = 4

#: [BLOCK_R, BLOCK_C] of the pointwise tiles when an operand lies with its rows adjacent in memory
#: (see :func:`rows_adjacent`): 64 rows give each column's load 128 contiguous bytes of a bf16
#: operand, and 64 columns the same to a row-major operand (Triton moves the tile between the two
#: layouts through shared memory). Not yet swept on the GPU.
ROWS_ADJACENT_TILE = (64, 64)


def pointwise(region: Region, launch: Launch) -> GeneratedKernel:
    kernel, adjacent = _pointwise(region, launch, None)
    return _pointwise(region, launch, ROWS_ADJACENT_TILE)[0] if adjacent else kernel


def _pointwise(region: Region, launch: Launch, blocks: tuple[int, int] | None) -> tuple[GeneratedKernel, bool]:
    """The kernel in tiles of ``blocks`` (None: the elementwise tiles of row-major data), and
    whether an operand lies with its rows adjacent."""
    shape = launch.shape
    n_rows, width = math.prod(shape[:-1]), shape[-1]
    if blocks is None:
        block_r, block_c, (grid_r, grid_c) = elementwise_blocks(n_rows, width)
    else:
        block_r, block_c = min(blocks[0], next_power_of_2(n_rows)), min(blocks[1], next_power_of_2(width))
        grid_r, grid_c = -(-n_rows // block_r), -(-width // block_c)
    tiles = TABLE_TILES if region.tables else 1
    loads: dict[fx.Node, Operand] = {}
    outs = output_operands(region)
    code = Code()
    code.line("pid_r = tl.program_id(0)")
    code.line("cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]")
    code.line(f"col_ok = cols < {width}")
    slots = _table_preamble(region, code)
    code.line("for tile in tl.static_range(TILES):")  # unrolled: a dynamic loop of 4 measured 6-9% slower
    body = code.scope("        ")
    body.line("rows = (pid_r * TILES + tile) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
    body.line(f"row_ok = rows < {row_int(n_rows)}")
    body.line("mask = row_ok & col_ok")
    index = tuple(_row_atoms(body, "rows", shape)) + (Ix.of(Atom("cols", width, True)),)
    tile = Tile(index, "[BLOCK_R, BLOCK_C]", "[BLOCK_R, 1]", "mask", "row_ok", whole_rows=grid_c == 1,
                aligned_columns=block_c)
    em = Emitter(body, tile, members=set(region.nodes), loads=loads, pieces=dict(launch.pieces), tables=slots)
    _store_outputs(em, region, launch, index, outs)
    code.extend(body)
    kernel = _kernel(region, loads, code, {"BLOCK_R": block_r, "BLOCK_C": block_c, "TILES": tiles},
                     (-(-grid_r // tiles), grid_c), ELEMENTWISE_TILE["num_warps"])
    return kernel, rows_adjacent(region, loads, outs, em.accesses, index[:-1])


def rows_adjacent(region: Region, loads: dict, outs: list[Operand], accesses, row: Index) -> bool:
    """Whether a kernel reads or writes an operand whose elements lie ``rows`` apart along a row
    while consecutive rows are adjacent in memory: a (B, L, C) activation kept in the (B, C, L)
    memory of a convolution's output that was flattened and transposed (the patch embeddings of
    HunyuanVideo, Wan-VACE, Sana, PixArt; residual adds keep that layout block after block).
    Walking such an operand a row at a time touches a new 32-byte sector per element; tiles of
    many rows read whole sectors."""
    atoms = [ix.terms[0][0] for ix in row if len(ix.terms) == 1 and ix.terms[0][1] == 1]
    if not atoms:
        return False
    inner = atoms[-1]  # the innermost dim of the rows that is not of size 1
    vals = {op.ptr: n.meta.get("val") for n, op in loads.items()}
    vals.update((op.ptr, n.meta.get("val")) for n, op in zip(region.outputs, outs))
    for op, index in accesses:
        val = vals.get(op.ptr)
        if not isinstance(val, torch.Tensor) or val.dim() != len(index) or val.dim() < 2 or val.stride()[-1] <= 1:
            continue
        # by code: inside a cat piece the same atom carries the piece's tighter bound
        along_rows = sum(c * st for ix, st in zip(index, val.stride()) for a, c in ix.terms if a.code == inner.code)
        if along_rows == 1:
            return True
    return False
