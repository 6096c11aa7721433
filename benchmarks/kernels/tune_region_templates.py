"""Sweep the launch knobs of the engine's kernel templates on a model's own regions.

    python3 benchmarks/kernels/tune_region_templates.py --template mean --model zimage --config full --height 1024 --width 1024
    python3 benchmarks/kernels/tune_region_templates.py --template fused_rms_norm --model wan-1.3b --height 480 --width 832 --frames 81
    python3 benchmarks/kernels/tune_region_templates.py --template tables --model wan-1.3b --height 480 --width 832 --frames 81

``--template`` picks the regions of the model's first block graph and the knob swept:
* ``mean`` (decomposed RMSNorm): rows per program, warps, loop unroll (``templates.mean_launch_shape``);
* ``fused_rms_norm`` (``F.rms_norm`` + epilogue): rows per program, warps (``templates.fused_rms_launch_shape``);
* ``layer_norm_rows`` (LayerNorm over rows of at most 512): rows per program, warps
  (``templates.layer_norm_rows_launch``);
* ``tables`` (pointwise regions with bf16 function tables): row tiles per program, which is how
  often a program loads its tables (``templates.TABLE_TILES``);
* ``rows_adjacent`` (regions over operands whose rows lie adjacent in memory, HunyuanVideo's image
  stream): the pointwise tile and the LayerNorm's rows and warps per program
  (``templates.ROWS_ADJACENT_TILE``, ``templates.LAYER_NORM_ROW_BLOCK``), e.g.
  ``--mini hunyuan-video --graph HunyuanVideoTransformerBlock``.
None of these changes a row's order of additions or any value; each variant's outputs are still
compared with the region's ATen nodes (torch.equal) before it is timed (CUDA-graph replays).
Prints one line per region and variant (time, multiple of the region's memory floor) and writes
tune_region_templates_<template>.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.runner import add_model_args, copy_bandwidth_gbs, environment, fused_from_the_first_call, model_and_inputs, write_json  # noqa: E402,E501
from benchmarks.models.profile_engine import gpu_ms, nbytes  # noqa: E402
from exactdit.engine import templates, timing  # noqa: E402
from exactdit.engine.templates import norms as norm_templates, pointwise as pointwise_template  # noqa: E402
from exactdit.engine.runtime import RegionOp  # noqa: E402
from exactdit.patches.engine import repeated_blocks  # noqa: E402
from exactdit.device import trees as rms_k  # noqa: E402
from exactdit.device import rows as rows_k  # noqa: E402


def _mean_variants():
    default = templates.mean_launch_shape
    for rows, warps, unroll in itertools.product([None, 2, 4, 8, 16, 32], [2, 4, 8], [2, 4]):
        def shape(chunk, width, rows=rows, warps=warps, unroll=unroll):
            r = default(chunk, width).rows if rows is None else rows
            return templates.MeanLaunch(r, warps, unroll, rms_k.tail_block(chunk, width, r))

        yield f"rows={rows or 'default'} warps={warps} unroll={unroll}", [(norm_templates, "mean_launch_shape", shape)]


def _fused_rms_variants():
    for rows, warps in itertools.product([1, 2, 4, 8, 16, 32], [2, 4, 8]):
        yield f"rows={rows} warps={warps}", [(norm_templates, "fused_rms_launch_shape", lambda width, r=rows, w=warps: (r, w))]


def _layer_norm_rows_variants():
    for rows, warps in itertools.product([4, 8, 16, 32, 64], [1, 2, 4, 8]):
        yield f"rows={rows} warps={warps}", [(norm_templates, "layer_norm_rows_launch", lambda width, r=rows, w=warps: (r, w))]


def _table_variants():
    """Tiles per program (how often a program loads its tables) and the tile itself (elements,
    warps): a tile's lookups are one ``tl.gather`` from the on-chip window."""
    for tiles, elements, warps in itertools.product([1, 2, 4, 8], [2048, 4096, 8192], [4, 8]):
        tile = dict(rows_k.ELEMENTWISE_TILE, elements=elements, num_warps=warps)
        yield (f"tiles={tiles} elements={elements} warps={warps}",
               [(pointwise_template, "TABLE_TILES", tiles), (pointwise_template, "ELEMENTWISE_TILE", tile), (rows_k, "ELEMENTWISE_TILE", tile)])


def _rows_adjacent_variants():
    for tile, block in itertools.product([(32, 64), (64, 64), (64, 128), (128, 64)], [(8, 4), (16, 4), (16, 8), (32, 8)]):
        yield (f"tile={tile[0]}x{tile[1]} ln_rows={block[0]} ln_warps={block[1]}",
               [(pointwise_template, "ROWS_ADJACENT_TILE", tile), (norm_templates, "LAYER_NORM_ROW_BLOCK", block)])


def _rows_adjacent(region) -> bool:
    """Whether the region's kernels were made for operands with adjacent rows (LayerNorm row blocks,
    or the pointwise tile of such operands, which the row-major tiles never are)."""
    tile = tuple(templates.ROWS_ADJACENT_TILE)
    return any("ln_k.welford_elements" in k.source or
               (dict(k.constexprs).get("BLOCK_R"), dict(k.constexprs).get("BLOCK_C")) == tile for k in region.kernels)


SWEEPS = {
    "mean": (lambda r: r.kind == "mean", _mean_variants),
    "fused_rms_norm": (lambda r: r.kind == "fused_rms_norm", _fused_rms_variants),
    "tables": (lambda r: r.kind == "pointwise" and bool(r.tables), _table_variants),
    "layer_norm_rows": (lambda r: r.kind == "layer_norm" and r.domain[-1] <= 512, _layer_norm_rows_variants),
    "rows_adjacent": (_rows_adjacent, _rows_adjacent_variants),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", choices=sorted(SWEEPS), default="mean")
    add_model_args(ap)
    ap.add_argument("--graph", default=None, help="sweep the regions of the first captured graph of this block class "
                                                  "(default: the first captured graph)")
    args = ap.parse_args()
    fused_from_the_first_call()
    os.environ["EXACTDIT_TRUST"] = "1"  # equality is checked here, once per variant
    bandwidth = copy_bandwidth_gbs()
    tr, kw = model_and_inputs(args)
    measured = timing.measure(tr, kw, repeated_blocks(tr))
    graph, timer, partition = next(m for m in measured if args.graph in (None, m[0].name))
    values = {n.name: v for n, v in timer.values.items()}
    picks, variants = SWEEPS[args.template]
    results = []
    for region in [r for r in partition.regions if picks(r)]:
        inputs = [values[n.name] for n in region.inputs]
        floor = (nbytes(inputs) + sum(nbytes(values[n.name]) for n in region.outputs)) / bandwidth / 1e6
        expected = RegionOp(region).reference(*inputs)
        for label, settings in variants():
            defaults = [(module, knob, getattr(module, knob)) for module, knob, _ in settings]
            for module, knob, value in settings:
                setattr(module, knob, value)
            try:
                region.kernels = [templates.generate(region, launch) for launch in region.launches]
            finally:
                for module, knob, value in defaults:
                    setattr(module, knob, value)
            op = RegionOp(region)
            out = op(*inputs)
            equal = all(torch.equal(a, b) for a, b in zip(out, expected))
            ms = gpu_ms(lambda: op(*inputs))
            results.append(dict(region=region.name, kind=region.describe(), width=region.domain[-1], variant=label,
                                us=1e3 * ms, x_floor=ms / floor, equal=equal))
            print(f"| {region.name} | {region.domain[-1]} | {label} | {1e3 * ms:.1f} | {ms / floor:.2f} | {equal} |",
                  flush=True)
    model = args.mini or args.model
    write_json(f"tune_region_templates_{args.template}_{model}.json", {"model": model, "results": results, **environment()})


if __name__ == "__main__":
    main()
