"""Kernel templates: the loop structure a region's values are emitted into, one module per kind
(:mod:`.pointwise`, :mod:`.norms`: ``layer_norm`` / ``fused_rms_norm`` / ``mean``, :mod:`.gemm`: a
GEMM with its epilogue); what they share is in :mod:`.base`, the rules of the reductions' outputs
in :mod:`.outputs`."""

from __future__ import annotations

from exactdit.engine.indexing import row_ints
from exactdit.engine.region import Launch, Region
from exactdit.engine.templates import outputs  # noqa: F401  (registers the reductions' output rules)
from exactdit.engine.templates.base import GeneratedKernel, output_operands  # noqa: F401
from exactdit.engine.templates.norms import (  # noqa: F401
    LAYER_NORM_ROW_BLOCK, MeanLaunch, _fused_rms_norm, _layer_norm, _mean, fused_rms_launch_shape, layer_norm_rows_launch,
    mean_launch_shape, reduction_kind, why_not_reduction,
)
from exactdit.engine.templates.gemm import gemm as gemm_template  # (the package's `gemm` stays the module)
from exactdit.engine.templates.pointwise import ROWS_ADJACENT_TILE, TABLE_TILES, pointwise, rows_adjacent  # noqa: F401

TEMPLATES = {"pointwise": pointwise, "layer_norm": _layer_norm, "fused_rms_norm": _fused_rms_norm, "mean": _mean,
             "gemm": gemm_template}


def generate(region: Region, launch: Launch) -> GeneratedKernel:
    """The kernel of one launch of ``region`` (raises :class:`Unfusable`), its per-row integers
    (row counts, divisors, cat boundaries) as arguments: a new resolution reuses its binary."""
    with row_ints():
        return TEMPLATES[region.kind](region, launch)

