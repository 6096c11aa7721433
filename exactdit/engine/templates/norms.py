"""The reduction templates ``layer_norm`` / ``fused_rms_norm`` / ``mean``, and which reductions
they take.

The domain's rows are the rows of a reduction over its last dim. Pass 1 walks each row in the
order ATen's CUDA kernel adds in (the order models of :mod:`exactdit.aten.norms` /
:mod:`exactdit.aten.reduce`, reproduced by the device library :mod:`exactdit.device`) and
computes the row statistics; the region's values that feed the reduction (its prologue) are
emitted inside that walk, so a gated residual is added on the fly. Pass 2 emits every output (the
epilogue: normalisation, modulation, RoPE, ...) from the statistics. A prologue value the region
must also return is stored in pass 1 and read back in pass 2.

Where an operand's rows lie adjacent in memory (:func:`rows_adjacent`), ``layer_norm`` regenerates
its kernel over tiles of many rows (:func:`_layer_norm_row_blocks`); no value or order of
additions changes.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from exactdit.aten.reduce import mean_factor, one_block_config
from exactdit.device.rows import next_power_of_2
from exactdit.engine.emit import Code, Emitter, Operand, Tile, Unfusable, Val, dtype_of, f32_literal, shape_of
from exactdit.engine.indexing import Atom, Index, Ix, row_int
from exactdit.engine.region import Launch, Region
from exactdit.engine.templates.gemm import GEMM_TARGETS, why_not_gemm
from exactdit.engine.templates.base import (
    GeneratedKernel, _kernel, _row_atoms, _table_preamble, output_index, output_operands,
)
from exactdit.engine.templates.pointwise import rows_adjacent

aten = torch.ops.aten


def reduction_kind(node: fx.Node) -> str | None:
    """The template that computes ``node``'s statistics, when it is a reduction the engine
    reproduces; None otherwise."""
    if node.op != "call_function":
        return None
    check = _REDUCTIONS.get(node.target)
    return None if check is None or check[1](node) is not None else check[0]


def why_not_reduction(node: fx.Node) -> str | None:
    check = _REDUCTIONS.get(node.target)
    return "not a reduction" if check is None else check[1](node)


def _last_dim_only(node: fx.Node, normalized) -> str | None:
    shape = shape_of(node.args[0])
    if list(normalized) != [shape[-1]]:
        return f"normalised over {list(normalized)} (the engine takes the last dim)"
    return None


def _params_like_input(node: fx.Node, params) -> str | None:
    dtype = dtype_of(node.args[0])
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"input of dtype {dtype}"
    for p in params:
        if p is not None and (not isinstance(p, fx.Node) or dtype_of(p) != dtype or len(shape_of(p)) != 1):
            return "weight or bias of another dtype or shape"
    return None


def _layer_norm_check(node: fx.Node) -> str | None:
    x, normalized, weight, bias = node.args[:4]
    if bias is not None and weight is None:
        return "bias without weight (eager's expression for it not reproduced)"
    width = shape_of(x)[-1]
    if width % 4:
        return "D % 4 != 0 (ATen's non-vectorised LayerNorm)"
    return _last_dim_only(node, normalized) or _params_like_input(node, (weight, bias))


def _fused_rms_check(node: fx.Node) -> str | None:
    x, normalized, weight = node.args[:3]
    width = shape_of(x)[-1]
    if width % 4:
        return "D % 4 != 0 (ATen's non-vectorised RMSNorm)"
    if width > 16384:
        return "rows wider than 16384"
    return _last_dim_only(node, normalized) or _params_like_input(node, (weight,))


def _rows_of_contiguous_columns(val: torch.Tensor) -> bool:
    """Whether ``val``'s last dim is contiguous and its rows tile memory densely in any order
    (a permuted contiguous tensor: q/k after ``transpose(1, 2)`` in SD3's processor). ATen's
    reduction configuration depends on the row count, the row width and the reduced dim's stride,
    and every row then starts at a multiple of the width, as in a contiguous tensor: the same order
    per row (``benchmarks/probes/probe_permuted_mean.py`` checks it on the GPU)."""
    if val.is_contiguous():
        return True
    dims = sorted((st, n) for n, st in zip(val.shape, val.stride()) if n != 1)
    expected = 1
    for st, n in dims:  # innermost first: each dim's stride is the extent of those inside it
        if st != expected:
            return False
        expected *= n
    return val.shape[-1] == 1 or val.stride(-1) == 1


def _mean_check(node: fx.Node) -> str | None:
    x = node.args[0]
    shape = shape_of(x)
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None or [d % len(shape) for d in dims] != [len(shape) - 1]:
        return "mean over other dims than the last"
    if node.kwargs.get("dtype") is not None or dtype_of(x) != torch.float32:
        return "mean of a non-fp32 tensor"
    width = shape_of(x)[-1]
    if width >= 128 and width % 4:
        return "rows misaligned in ATen's reduction (D % 4 != 0)"
    val = x.meta["val"]
    if not _rows_of_contiguous_columns(val):
        return "mean of rows that are not each contiguous"
    cfg = one_block_config(math.prod(shape[:-1]), width)
    return cfg if isinstance(cfg, str) else None


_REDUCTIONS = {
    aten.native_layer_norm.default: ("layer_norm", _layer_norm_check),
    aten._fused_rms_norm.default: ("fused_rms_norm", _fused_rms_check),
    aten.mean.dim: ("mean", _mean_check),
    # a GEMM's accumulator is its region's one "reduction" (over K): see templates/gemm.py
    **{target: ("gemm", why_not_gemm) for target in GEMM_TARGETS},
}


def _launch_reduction(region: Region, launch: Launch) -> fx.Node:
    """The reduction whose rows this launch computes (the one feeding its cat piece)."""
    if launch.pieces:
        cat, k = launch.pieces[0]
        from exactdit.engine.aten_views import cat_pieces

        piece_input = cat_pieces(cat)[1][k][0]
        found = [r for r in region.reductions if _feeds(r, piece_input, set(region.nodes))]
    else:
        found = list(region.reductions)
    if len(found) != 1:
        raise Unfusable(f"{len(found)} reductions in one launch")
    red = found[0]
    if shape_of(red.args[0]) != tuple(launch.shape):
        raise Unfusable("reduction rows do not match the launch", red)
    return red


def _feeds(a: fx.Node, b: fx.Node, members: set) -> bool:
    """Whether ``a`` is ``b`` or an ancestor of it inside the region."""
    todo, seen = [b], set()
    while todo:
        n = todo.pop()
        if n is a:
            return True
        if n in seen or n not in members:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return False


def _prologue_outputs(region: Region, red: fx.Node) -> list[int]:
    """Outputs computed before the reduction (its input or feeding it): stored in pass 1."""
    members = set(region.nodes)
    return [k for k, out in enumerate(region.outputs) if out is not red and _feeds(out, red.args[0], members)]


class _Reduction:
    """Shared plumbing of the reduction templates: one region, one launch, two passes."""

    def __init__(self, region: Region, launch: Launch):
        self.region = region
        self.launch = launch
        self.red = _launch_reduction(region, launch)
        self.x = self.red.args[0]
        self.width = launch.shape[-1]
        self.n_rows = math.prod(launch.shape[:-1])
        self.loads: dict[fx.Node, Operand] = {}
        self.outs = output_operands(region)
        self.code = Code()
        self.members = set(region.nodes)
        self.slots = _table_preamble(region, self.code)
        self.early = _prologue_outputs(region, self.red)
        self.stats: dict = {}
        self.emitters: list[Emitter] = []

    def emitter(self, code: Code, tile: Tile, stored: dict | None = None) -> Emitter:
        em = Emitter(code, tile, members=self.members, loads=self.loads, stored=stored, stats=self.stats,
                     pieces=dict(self.launch.pieces), tables=self.slots)
        self.emitters.append(em)
        return em

    def rows_adjacent(self, row: Index) -> bool:
        """:func:`rows_adjacent` for everything the passes emitted so far."""
        accesses = [a for em in self.emitters for a in em.accesses]
        return rows_adjacent(self.region, self.loads, self.outs, accesses, row)

    def reduction_input(self, em: Emitter, index: Index) -> str:
        """fp32 code of the reduction's input at ``index``, with the prologue outputs stored."""
        full = self.launch.full_index(index)
        for k in self.early:
            node = self.region.outputs[k]
            out_index = output_index(self.region, node, full)
            em.store(self.outs[k], out_index, em.value(node, out_index))
        x = em.value(self.x, index)
        return em.widen(em.broadcast(x, 2))

    def epilogue(self, em: Emitter, index: Index) -> None:
        full = self.launch.full_index(index)
        for k, node in enumerate(self.region.outputs):
            if k in self.early:
                continue
            out_index = output_index(self.region, node, full)
            em.store(self.outs[k], out_index, em.value(node, out_index))

    def stored(self) -> dict[fx.Node, Operand]:
        return {self.region.outputs[k]: self.outs[k] for k in self.early}

    def set_stats(self, row: Index, **vals: Val) -> None:
        self.stats[self.red] = dict(vals, row=_row_form(row, self.launch.shape), shape=tuple(self.launch.shape))

    def kernel(self, consts: dict, grid, num_warps: int) -> GeneratedKernel:
        return _kernel(self.region, self.loads, self.code, consts, grid, num_warps)


def _row_form(row: Index, shape) -> Ix:
    from exactdit.engine.indexing import linearize

    return linearize(row, shape[:-1])


def _eps32(node: fx.Node, position: int) -> str:
    """A norm's ``eps`` argument as ATen's kernels take it: fp32 (``None``: fp32's epsilon)."""
    eps = node.args[position] if len(node.args) > position else None
    return f32_literal(torch.finfo(torch.float32).eps if eps is None else float(eps))


def layer_norm_rows_launch(width: int) -> tuple[int, int]:
    """(rows per program, warps) of the LayerNorm template for rows of at most 512 (a vector
    per thread at most): neither changes a row's order. 2048 elements and 4 warps per program:
    on CogVideoX-5B's q/k regions (rows of 64 + RoPE, H200) 32 rows / 4 warps took 126.1 us, the
    best of the sweep (8 rows / 1 warp) 123.1, 4 rows / 2 warps 166.4
    (``tune_region_templates.py --template layer_norm_rows``)."""
    return max(1, 2048 // next_power_of_2(width)), 4


@dataclasses.dataclass(frozen=True)
class _ThreadLoop:
    """How each of ATen's 128 LayerNorm threads walks a row: its vectors ``j * 128 + t`` for ``j``
    below ``iterations`` (unrolled up to ``ln_k.MAX_UNROLL``, so that ``1 / count`` is a constant);
    ``full``: every thread has a vector in every iteration (no masks); ``per_thread``: the elements
    each thread holds when that is the same for all and the tree's reciprocals can be constants,
    else 0."""

    width: int
    iterations: int
    unroll: bool
    full: bool
    per_thread: int

    @staticmethod
    def of(width: int, unroll: bool = True) -> "_ThreadLoop":
        """``unroll=False``: a loop whatever the iteration count."""
        from exactdit.device import welford as ln_k

        iterations = -(-(width // 4) // ln_k.THREADS)
        full = width % (4 * ln_k.THREADS) == 0
        constant = full and not ln_k.CHOICES["rcp_approx"] and width <= ln_k.MAX_CONSTANT_COUNT
        return _ThreadLoop(width, iterations, unroll and iterations <= ln_k.MAX_UNROLL, full,
                           width // ln_k.THREADS if constant else 0)

    def begin(self, code: Code, var: str = "j", trips: int | None = None) -> Code:
        """A loop over the iterations (or ``trips``), unrolled like the statistics loop; its body."""
        n = self.iterations if trips is None else trips
        code.line(f"for {var} in tl.static_range({n}):" if self.unroll else f"for {var} in range(0, {n}):")
        return code.scope("        ")

    @property
    def update_args(self) -> str:
        """The arguments of ``ln_k.welford_update`` after the tile (of ``welford_elements`` after
        the elements, but the lane count)."""
        from exactdit.device import welford as ln_k

        approx = ln_k.CHOICES["rcp_approx"]
        return f"j, {self.width // 4}, mean, m2, cnt, {approx}, {self.unroll and not approx}, {self.full}"


def _layer_norm(region: Region, launch: Launch) -> GeneratedKernel:
    """ATen's ``vectorized_layer_norm_kernel``: 128 Welford "threads" per row; one row per
    program, or for rows of at most 512 several rows per program (:func:`_layer_norm_rows`)."""
    from exactdit.device import welford as ln_k

    t = _Reduction(region, launch)
    code, width = t.code, t.width
    if width <= 4 * ln_k.THREADS:
        return _layer_norm_rows(t, launch)
    loop = _ThreadLoop.of(width)
    choices = ln_k.CHOICES
    code.line("row = tl.program_id(0)")
    row = tuple(_row_atoms(code, "row", launch.shape))
    code.line(f"eps = {_eps32(t.red, 4)}")
    for v in ("mean", "m2", "cnt"):
        code.line(f"{v} = tl.zeros((128,), tl.float32)")
    body = loop.begin(code)
    body.line("cols1 = ln_k.vector_columns(j)")
    body.line(f"mask1 = cols1 < {width}")
    em = t.emitter(body, Tile(row + (Ix.of(Atom("cols1", width, True)),), "[128, 4]", None, "mask1", None,
                              aligned_columns=4))
    x = t.reduction_input(em, row + (Ix.of(Atom("cols1", width, True)),))
    body.line(f"mean, m2, cnt = ln_k.welford_update({x}, {loop.update_args})")
    code.extend(body)
    code.line(f"mean_r, rstd_r = ln_k.welford_finish(mean, m2, cnt, {width}, eps, "
              f"{ln_k._MEAN_FMA[choices['mean_fma']]}, {choices['sigma_fma']}, {choices['rcp_approx']}, {loop.per_thread})")
    if t.early:
        code.line("tl.debug_barrier()  # pass 1's stores are visible to every thread")
    t.set_stats(row, mean=Val("mean_r", torch.float32, 1), rstd=Val("rstd_r", torch.float32, 1))
    block = min(2048, max(512, next_power_of_2(width)))
    body = loop.begin(code, "k2", -(-width // block))
    body.line(f"cols2 = k2 * {block} + tl.arange(0, {block})[None, :]")
    body.line(f"mask2 = cols2 < {width}")
    index = row + (Ix.of(Atom("cols2", width, True)),)
    t.epilogue(t.emitter(body, Tile(index, f"[1, {block}]", None, "mask2", None, aligned_columns=block), stored=t.stored()),
               index)
    code.extend(body)
    if t.rows_adjacent(row):
        return _layer_norm_row_blocks(_Reduction(region, launch), launch)
    return t.kernel({}, (t.n_rows,), ln_k.NUM_WARPS)


#: (rows, warps) per program of the LayerNorm template for wide rows whose operands lie with their
#: rows adjacent in memory: each of ATen's thread vectors is then four loads of 16 consecutive
#: rows (32 bytes of bf16, a whole sector). Not yet swept on the GPU.
LAYER_NORM_ROW_BLOCK = (16, 8)


def _layer_norm_row_blocks(t: "_Reduction", launch: Launch) -> GeneratedKernel:
    """:func:`_layer_norm` for rows whose elements lie far apart and whose neighbours are adjacent
    (:func:`rows_adjacent`): ROWS rows per program, each of ATen's 128 threads a lane of [ROWS, 128]
    states. Iteration j loads element i of every thread's vector ``j * 128 + t`` as one [ROWS, 128]
    tile (column ``4 * (j * 128 + t) + i``: each load is ROWS consecutive elements of memory per
    column) and folds it in ATen's order (``ln_k.welford_elements``); the states combine in ATen's
    tree (``ln_k.lanes_finish``, 128 lanes); pass 2 writes [ROWS, 256] tiles."""
    from exactdit.device import welford as ln_k

    code, width = t.code, t.width
    rows, warps = LAYER_NORM_ROW_BLOCK
    threads = ln_k.THREADS
    # a loop, not unrolled (1 / count then a division per iteration: the same bits, see
    # ln_k.welford_elements): HunyuanVideo's kernels of this template compiled for sm_90 in 4.2-4.7 s
    # each unrolled, 0.8-0.9 s as loops (2-core CPU, Triton 3.9)
    loop = _ThreadLoop.of(width, unroll=False)
    choices = ln_k.CHOICES
    code.line(f"rows = tl.program_id(0) * {rows} + tl.arange(0, {rows})[:, None]")
    code.line(f"row_ok = rows < {row_int(t.n_rows)}")
    row = tuple(_row_atoms(code, "rows", launch.shape))
    code.line(f"eps = {_eps32(t.red, 4)}")
    for v in ("mean", "m2", "cnt"):
        code.line(f"{v} = tl.zeros([{rows}, {threads}], tl.float32)")
    body = loop.begin(code)
    elements = []
    for i in range(4):
        body.line(f"cols{i} = (j * {threads} + tl.arange(0, {threads})[None, :]) * 4 + {i}")
        body.line(f"mask{i} = row_ok & (cols{i} < {width})")
        index = row + (Ix.of(Atom(f"cols{i}", width, True)),)
        em = t.emitter(body, Tile(index, f"[{rows}, {threads}]", f"[{rows}, 1]", f"mask{i}", "row_ok"))
        elements.append(t.reduction_input(em, index))
    body.line(f"mean, m2, cnt = ln_k.welford_elements({', '.join(elements)}, {loop.update_args}, {threads})")
    code.extend(body)
    code.line(f"mean_r, rstd_r = ln_k.lanes_finish(mean, m2, cnt, {width}, eps, {threads}, {loop.per_thread}, "
              f"{ln_k._MEAN_FMA[choices['mean_fma']]}, {choices['sigma_fma']}, {choices['rcp_approx']})")
    code.line("mean_r = mean_r[:, None]")
    code.line("rstd_r = rstd_r[:, None]")
    if t.early:
        code.line("tl.debug_barrier()  # pass 1's stores are visible to every thread")
    t.set_stats(row, mean=Val("mean_r", torch.float32, 1), rstd=Val("rstd_r", torch.float32, 1))
    block = min(256, next_power_of_2(width))
    # a loop, not unrolled: a tile's outputs depend on its own columns and the row's statistics only.
    # Unrolled, HunyuanVideo's single-block kernel was 36k lines of PTX and 42 s to compile for sm_90
    # (2-core CPU, Triton 3.9); as a loop 13k lines and 8 s
    code.line(f"for k2 in tl.range(0, {-(-width // block)}):")
    body = code.scope("        ")
    body.line(f"cols = k2 * {block} + tl.arange(0, {block})[None, :]")
    body.line(f"mask = row_ok & (cols < {width})")
    index = row + (Ix.of(Atom("cols", width, True)),)
    t.epilogue(t.emitter(body, Tile(index, f"[{rows}, {block}]", f"[{rows}, 1]", "mask", "row_ok",
                                    aligned_columns=block), stored=t.stored()), index)
    code.extend(body)
    return t.kernel({}, (-(-t.n_rows // rows),), warps)


def _layer_norm_rows(t: "_Reduction", launch: Launch) -> GeneratedKernel:
    """Rows of at most 512 (CogVideoX's per-head q/k norms: 853k rows of 64): a tile of
    ``BLOCK_R`` whole rows, thread t of each row owning columns 4t .. 4t + 3; the states combine
    in ATen's tree (``ln_k.lanes_finish``) and the same tile gives the outputs."""
    from exactdit.device import welford as ln_k

    code, width = t.code, t.width
    lanes = next_power_of_2(width // 4)
    block_r, num_warps = layer_norm_rows_launch(width)
    code.line(f"rows = tl.program_id(0) * {block_r} + tl.arange(0, {block_r})[:, None]")
    code.line(f"row_ok = rows < {row_int(t.n_rows)}")
    row = tuple(_row_atoms(code, "rows", launch.shape))
    code.line(f"eps = {_eps32(t.red, 4)}")
    index = row + (Ix.of(Atom("cols", width, True)),)
    code.line(f"cols = tl.arange(0, {4 * lanes})[None, :]")
    code.line(f"mask = row_ok & (cols < {width})")
    em = t.emitter(code, Tile(index, f"[{block_r}, {4 * lanes}]", f"[{block_r}, 1]", "mask", "row_ok",
                              whole_rows=True, aligned_columns=4 * lanes))
    x = t.reduction_input(em, index)
    choices = ln_k.CHOICES
    code.line(f"mean, m2, cnt = ln_k.welford_lanes({x}, {block_r}, {lanes}, {width // 4})")
    per_lane = 4 if width // 4 == lanes else 0
    code.line(f"mean_r, rstd_r = ln_k.lanes_finish(mean, m2, cnt, {width}, eps, {lanes}, {per_lane}, "
              f"{ln_k._MEAN_FMA[choices['mean_fma']]}, {choices['sigma_fma']}, {choices['rcp_approx']})")
    code.line("mean_r = mean_r[:, None]")
    code.line("rstd_r = rstd_r[:, None]")
    t.set_stats(row, mean=Val("mean_r", torch.float32, 1), rstd=Val("rstd_r", torch.float32, 1))
    t.epilogue(em, index)
    return t.kernel({}, (-(-t.n_rows // block_r),), num_warps)


def fused_rms_launch_shape(width: int) -> tuple[int, int]:
    """(rows per program, warps) of the "fused_rms_norm" template: the hand kernels' tile
    (:mod:`exactdit.device.vectorized_norm`). Neither changes a row's order of additions."""
    from exactdit.device import vectorized_norm as rope_k

    return max(1, rope_k.ROW_BLOCK_ELEMENTS // next_power_of_2(width)), rope_k.NUM_WARPS


def _fused_rms_norm(region: Region, launch: Launch) -> GeneratedKernel:
    """ATen's ``vectorized_layer_norm_kernel`` with the rms flag (``F.rms_norm``): 128 threads
    per row, thread t owns the float4 vectors t, t + 128, ...; ``BLOCK_R`` rows per program.
    Rows of up to 512 (one vector per thread) are one tile for both passes."""
    from exactdit.device import vectorized_norm as rope_k

    t = _Reduction(region, launch)
    code, width = t.code, t.width
    n_vec = width // 4
    threads = rope_k.THREADS
    iters = -(-n_vec // threads)
    block_n = next_power_of_2(width)
    block_r, num_warps = fused_rms_launch_shape(width)
    code.line(f"rows = tl.program_id(0) * {block_r} + tl.arange(0, {block_r})[:, None]")
    code.line(f"row_ok = rows < {row_int(t.n_rows)}")
    row = tuple(_row_atoms(code, "rows", launch.shape))
    code.line(f"eps = {_eps32(t.red, 3)}")
    row_shape = f"[{block_r}, 1]"
    if iters == 1:
        lanes = next_power_of_2(n_vec)  # threads past the row add +0: no change to any sum
        index = row + (Ix.of(Atom("cols", width, True)),)
        code.line(f"cols = tl.arange(0, {block_n})[None, :]")
        code.line(f"mask = row_ok & (cols < {width})")
        em = t.emitter(code, Tile(index, f"[{block_r}, {block_n}]", row_shape, "mask", "row_ok", whole_rows=True,
                                  aligned_columns=block_n))
        x = t.reduction_input(em, index)
        code.line(f"acc = rope_k.thread_sums_from_tile(tl.where(mask, {x}, 0.0), {block_r}, {lanes}, "
                  f"{rope_k.SQUARE_FMA})")
        code.line(f"var = div_rn(rms_k.block_sum(acc, {block_r}, {lanes}), tl.full((), {width}, tl.float32))")
        code.line("rstd_r = rsqrt_approx(add_rn(var, eps))[:, None]")
        t.set_stats(row, rstd=Val("rstd_r", torch.float32, 1))
        t.epilogue(em, index)
        return t.kernel({}, (-(-t.n_rows // block_r),), num_warps)
    # pass 1 in chunks of one vector per thread: chunk j's tile holds vectors j * threads + t,
    # each in its thread's registers, so the loads are contiguous and the order is ATen's
    chunk = 4 * threads
    code.line(f"acc = tl.zeros([{block_r}, {threads}], tl.float32)")
    code.line(f"for j in tl.static_range({iters}):")
    body = code.scope("        ")
    body.line(f"cols1 = j * {chunk} + tl.arange(0, {chunk})[None, :]")
    body.line(f"mask1 = row_ok & (cols1 < {width})")
    index1 = row + (Ix.of(Atom("cols1", width, True)),)
    tile1 = Tile(index1, f"[{block_r}, {chunk}]", row_shape, "mask1", "row_ok", aligned_columns=chunk)
    x = t.reduction_input(t.emitter(body, tile1), index1)
    body.line(f"acc = rope_k.accumulate_vectors(acc, tl.where(mask1, {x}, 0.0), {block_r}, {threads}, "
              f"{rope_k.SQUARE_FMA})")
    code.extend(body)
    if t.early:
        code.line("tl.debug_barrier()  # pass 1's stores are visible to every thread")
    code.line(f"var = div_rn(rms_k.block_sum(acc, {block_r}, {threads}), tl.full((), {width}, tl.float32))")
    code.line("rstd_r = rsqrt_approx(add_rn(var, eps))[:, None]")
    t.set_stats(row, rstd=Val("rstd_r", torch.float32, 1))
    tile = min(block_n, 2048)
    code.line(f"for k2 in tl.static_range({-(-width // tile)}):")
    body = code.scope("        ")
    body.line(f"cols2 = k2 * {tile} + tl.arange(0, {tile})[None, :]")
    body.line(f"mask2 = row_ok & (cols2 < {width})")
    index2 = row + (Ix.of(Atom("cols2", width, True)),)
    t.epilogue(t.emitter(body, Tile(index2, f"[{block_r}, {tile}]", row_shape, "mask2", "row_ok",
                                    whole_rows=tile >= width, aligned_columns=tile), stored=t.stored()),
               index2)
    code.extend(body)
    return t.kernel({}, (-(-t.n_rows // block_r),), num_warps)


@dataclasses.dataclass(frozen=True)
class MeanLaunch:
    """How the "mean" template runs a region; none of it changes a row's order of additions."""

    rows: int  # rows per program
    warps: int
    unroll: int  # unroll factor of the loops over a row's chunks
    tail: int  # width of pass 2's tiles


def mean_launch_shape(chunk: int, width: int) -> MeanLaunch:
    """The "mean" template's launch, chosen with ``benchmarks/kernels/tune_region_templates.py`` on
    Z-Image-Turbo's and ERNIE-Image's regions at 1024^2 (H200):
    * rows of one chunk (q/k norms of 128 + complex RoPE): 8 rows per program, 4 warps (18.6 us,
      1.22x the memory floor; 16 rows 20.1, 2 rows 51.8);
    * wider rows: 2 rows, 4 warps, 4x unrolled loops: no slower than the previous 4 rows and 8
      warps on any of the six regions measured (3840 and 4096 wide), faster on four (Z-Image's
      sandwich norm with its gated residual 26.7 against 30.6 us, ERNIE's 39.8 against 42.3 and
      79.8 against 86.4); the best setting differed per region.
    * narrow rows of several chunks (SD3.5 Large's q/k norms: 168k rows of 64 in chunks of 32
      threads): 16 rows, 4 warps (11.8 us, 1.17x the floor; 32 rows 11.9-12.4, 8 rows 15.8,
      2 rows 57.5); between 64 and the wide rows, 1024 elements per program.
    Holding a wide row's chunks in registers for pass 2 instead of loading them again measured
    1.4-2.2x slower (register pressure); for one-chunk rows the compiler already reuses pass 1's
    load."""
    from exactdit.device import trees as rms_k

    if width <= chunk:
        rows, warps, unroll = 8, 4, 2
    else:
        per_program = 1024 // width  # rows of 1024 elements, a power of two of them
        rows = 2 if per_program < 2 else min(16, 1 << (per_program.bit_length() - 1))
        warps, unroll = 4, (4 if rows == 2 else 2)
    return MeanLaunch(rows, warps, unroll, rms_k.tail_block(chunk, width, rows))


def _mean(region: Region, launch: Launch) -> GeneratedKernel:
    """ATen's generic reduction (Reduce.cuh) of ``x.mean(-1)`` for fp32 rows, in the launch
    configuration ATen picks for this row count (:mod:`exactdit.aten.reduce`)."""
    t = _Reduction(region, launch)
    if t.x not in t.members:
        raise Unfusable("mean of a tensor the region does not compute", t.red)
    code, width = t.code, t.width
    cfg = one_block_config(t.n_rows, width)
    if isinstance(cfg, str):
        raise Unfusable(cfg, t.red)
    threads = cfg.block_width * cfg.warps_per_row
    chunk = 4 * threads if cfg.vectorize_input else threads
    n_chunks = -(-width // chunk)
    shape = mean_launch_shape(chunk, width)
    rows = shape.rows
    factor = mean_factor(t.n_rows, width)
    code.line(f"rows = tl.program_id(0) * {rows} + tl.arange(0, {rows})[:, None]")
    code.line(f"row_ok = rows < {row_int(t.n_rows)}")
    row = tuple(_row_atoms(code, "rows", launch.shape))
    for a in ("acc", "a1", "a2", "a3"):
        code.line(f"{a} = tl.zeros([{rows}, {chunk}], tl.float32)")
    accumulators = ["acc", "a1", "a2", "a3"]
    if cfg.vectorize_input:
        code.line(f"for j in tl.range(0, {n_chunks}, loop_unroll_factor={shape.unroll}):")
        loops = [("j", "acc")]
    else:
        loops = [(str(j), accumulators[j % 4]) for j in range(n_chunks)]
    for j, acc in loops:
        body = code.scope("        " if cfg.vectorize_input else "    ")
        body.line(f"cols1 = {j} * {chunk} + tl.arange(0, {chunk})[None, :]")
        body.line(f"mask1 = row_ok & (cols1 < {width})")
        em1 = t.emitter(body, Tile(row + (Ix.of(Atom("cols1", width, True)),), f"[{rows}, {chunk}]",
                                   f"[{rows}, 1]", "mask1", "row_ok", aligned_columns=chunk))
        x = t.reduction_input(em1, row + (Ix.of(Atom("cols1", width, True)),))
        body.line(f"{acc} = add_rn({acc}, tl.where(mask1, {x}, 0.0))")
        code.extend(body)
    bw, wy = cfg.block_width, cfg.warps_per_row
    code.line(f"total = rms_k.row_total(acc, a1, a2, a3, {rows}, {bw}, {wy}, {bool(cfg.vectorize_input)})")
    code.line(f"mean_r = mul_rn(total, {f32_literal(factor)})[:, None]")
    if t.early:
        code.line("tl.debug_barrier()  # pass 1's stores are visible to every thread")
    t.set_stats(row, mean=Val("mean_r", torch.float32, 1))
    tail = shape.tail
    code.line(f"for k2 in tl.range(0, {-(-width // tail)}, loop_unroll_factor={shape.unroll}):")
    body = code.scope("        ")
    body.line(f"cols2 = k2 * {tail} + tl.arange(0, {tail})[None, :]")
    body.line(f"mask2 = row_ok & (cols2 < {width})")
    index = row + (Ix.of(Atom("cols2", width, True)),)
    t.epilogue(t.emitter(body, Tile(index, f"[{rows}, {tail}]", f"[{rows}, 1]", "mask2", "row_ok",
                                    whole_rows=tail >= width, aligned_columns=tail), stored=t.stored()), index)
    code.extend(body)
    return t.kernel({}, (-(-t.n_rows // rows),), shape.warps)
