"""Fused GEMMs: a captured graph's ``mm`` / ``addmm`` together with the pointwise work that reads
its output (the epilogue: bias, activation, gated residual, casts, ...) in one kernel.

What the kernel computes, as eager does:

* ``addmm(bias, A, B)`` / ``mm(A, B)`` of bf16 or fp16 ``A [M, K]`` (rows contiguous) and ``B [K, N]``
  (a transposed ``nn.Linear`` weight, or row-major): an fp32 accumulator over K in order, one k-tile
  after another (:func:`exactdit.device.gemm.mma`); the bias added to the fp32 accumulator; one
  rounding to the output dtype. That is cuBLAS's result at every DiT shape probed on the H200
  (``benchmarks/probe_gemm_tma.py``), not a law: each signature is verified by the gate against
  cuBLAS's own output, and one that differs (another algorithm at small M, split-K) runs cuBLAS.
* the epilogue: the region's other nodes, emitted by their rules at each element of the output
  tile, exactly as in a pointwise region (per-op roundings, no FMA, tables).
* a prologue of one kind: where A is a ``cat`` along K (the single block's ``cat([attn,
  mlp_act], -1)`` before ``proj_out``) that only this GEMM reads, the kernel reads each piece
  where it lies, as the K range it fills, and no cat is written (:func:`a_pieces`). The k-tiles
  are the same as over the cat, in the same order, because every piece but the last spans whole
  k-tiles: the same bits by construction.

A and B are read by TMA (tensor descriptors made in the kernel), tiles visited by a persistent
grid; outputs are stored through their strides. fp32 GEMMs are left to cuBLAS (its TF32 settings
decide their bits), and so are GEMMs of fewer than :data:`MIN_ROWS` rows (cuBLAS picks other
reductions there, and a tile kernel does not pay).

Which way runs is decided per signature by time: the kernel in each candidate tile configuration
(:func:`tile_candidates`; no tile changes a bit) and the alternative of cuBLAS followed by a
pointwise kernel for the epilogue (:attr:`Region.alternative`) are timed by the first call of a
signature, and the fastest is the one the gate verifies (:mod:`exactdit.engine.runtime`). The whole
path is off unless ``EXACTDIT_GEMM`` turns it on (:data:`CHOICE_ENV`): see BENCHMARKS.md for where
it stands.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import weakref

import torch
import torch.fx as fx

from exactdit.engine.emit import FULL, Code, Emitter, Tile, Unfusable, Val, dtype_of, shape_of
from exactdit.engine.indexing import Atom, Index, Ix, broadcast_index, offset_code, reshape_index, row_int, row_ints
from exactdit.engine.region import Launch, Region
from exactdit.engine.rules import REDUCTION_OUTPUT, Rule, register_rule
from exactdit.engine.templates.base import GeneratedKernel, _kernel, _store_outputs, _table_preamble, output_operands

aten = torch.ops.aten

#: Fused GEMMs are off unless ``EXACTDIT_GEMM`` says otherwise (read at capture): ``auto`` times each
#: signature's ways and keeps the fastest, ``fused`` / ``split`` fix the way (tests, benchmarks).
#: Off by default: on Flux.1-dev 1024^2 (H200) every signature's kernel beat cuBLAS + its epilogue,
#: but the forward took the same energy and so, at the 700 W cap, the same time (BENCHMARKS.md).
CHOICE_ENV = "EXACTDIT_GEMM"
MODES = ("auto", "fused", "split")

GEMM_TARGETS = (aten.mm.default, aten.addmm.default)
#: GEMMs with fewer rows stay with cuBLAS: at M = 2 cuBLAS reduces in another order (probe), and
#: below a few hundred rows a tile kernel is far from cuBLAS's speed (0.6x at M = 512)
MIN_ROWS = 1024
DTYPES = (torch.bfloat16, torch.float16)


def operands(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    """(A, B, bias or None) of an ``mm`` / ``addmm`` node."""
    if node.target is aten.mm.default:
        return node.args[0], node.args[1], None
    return node.args[1], node.args[2], node.args[0]


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def b_layout(b: torch.Tensor) -> str | None:
    """"nk": B is the transpose of an [N, K] matrix with contiguous rows (``linear``'s weight.t());
    "kn": B's own rows are contiguous; None: neither (TMA needs a contiguous innermost dim)."""
    if b.stride(0) == 1 and b.shape[0] > 1:
        return "nk"
    if b.stride(1) == 1:
        return "kn"
    return None


#: the k-tile every candidate configuration uses: a cat piece read as a K range (all but the last)
#: must span whole k-tiles of it, or the kernel's k-tiles would not be the cat's
K_STEP = 64
_ROW_VIEWS = (aten.view.default, aten._unsafe_view.default)


def rows_of(t: torch.Tensor) -> int | None:
    """The row stride of ``t`` read as a matrix [rows of all leading dims, last dim] with the
    last dim contiguous, or None where its leading dims do not merge into one row stride."""
    if t.dim() < 2 or (t.stride(-1) != 1 and t.shape[-1] > 1):
        return None
    row = inner = t.stride(-2)
    size = t.shape[-2]
    for d in range(t.dim() - 3, -1, -1):
        if t.shape[d] == 1:  # (its stride says nothing)
            continue
        if t.stride(d) != inner * size:
            return None
        inner, size = t.stride(d), t.shape[d]
    return row


def a_pieces(node: fx.Node) -> tuple[list[fx.Node], list[tuple[fx.Node, int, int]]] | None:
    """Where the GEMM ``node``'s A is a ``cat`` along its last dim (K), seen through a view that
    merges its leading dims into rows, and nothing else reads the cat or the view: (those
    nodes, [(piece, k start, k size)]); else None. Each piece must be readable by TMA as its
    own [M, k size] matrix, and every piece but the last must span whole k-tiles."""
    a = operands(node)[0]
    chain = []
    if isinstance(a, fx.Node) and a.target in _ROW_VIEWS:
        chain.append(a)
        a = a.args[0]
    if not isinstance(a, fx.Node) or a.target is not aten.cat.default:
        return None
    chain.insert(0, a)
    a_val, cat_val = _val(operands(node)[0]), _val(a)
    if a_val is None or cat_val is None or cat_val.shape[-1] != a_val.shape[-1]:
        return None
    rank = cat_val.dim()
    dim = a.args[1] if len(a.args) > 1 else a.kwargs.get("dim", 0)
    if rank < 2 or (dim + rank if dim < 0 else dim) != rank - 1:
        return None
    if any(len(n.users) != 1 for n in chain) or next(iter(chain[-1].users)) is not node:
        return None
    pieces, start = [], 0
    for t in a.args[0]:
        v = _val(t)
        if v is None or v.dtype != a_val.dtype or tuple(v.shape[:-1]) != tuple(cat_val.shape[:-1]):
            return None
        if v.shape[-1]:
            row = rows_of(v)
            if row is None or (row * v.element_size()) % 16 or v.shape[-1] * v.element_size() < 16:
                return None
            pieces.append((t, start, int(v.shape[-1])))
        start += int(v.shape[-1])
    if len(pieces) < 2 or any(size % K_STEP for _, _, size in pieces[:-1]):
        return None
    return chain, pieces


def prologue(region: Region) -> tuple[list[fx.Node], list[tuple[fx.Node, int, int]]] | None:
    """The region's K-range prologue (:func:`a_pieces`), where the partition put it in the region."""
    found = a_pieces(region.anchor)
    return found if found is not None and found[0][0] in region.nodes else None


def why_not_gemm(node: fx.Node) -> str | None:
    """None when ``node`` can anchor a fused GEMM region; else why it stays with cuBLAS."""
    if node.op != "call_function" or node.target not in GEMM_TARGETS:
        return "not a GEMM"
    if os.environ.get(CHOICE_ENV, "off") not in MODES:
        return f"fused GEMMs are off ({CHOICE_ENV}=auto turns them on)"
    a, b, bias = (_val(x) for x in operands(node))
    out = _val(node)
    if a is None or b is None or out is None or (node.target is aten.addmm.default and bias is None):
        return "GEMM of non-tensor operands"
    if node.target is aten.addmm.default and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return "addmm with beta or alpha"
    if not all(type(s) is int for t in (a, b, out) for s in (*t.shape, *t.stride())):
        return "GEMM of symbolic shape"
    if a.dtype not in DTYPES or b.dtype != a.dtype or out.dtype != a.dtype:
        return f"{a.dtype} GEMM (fp32 stays with cuBLAS: its TF32 settings decide the bits)"
    if a.device.type not in ("cuda", "cpu"):
        return f"{a.device.type} tensors"
    (m, k), n = a.shape, b.shape[1]
    if m < MIN_ROWS:
        return f"{m} rows (GEMMs below {MIN_ROWS} rows stay with cuBLAS)"
    esize = a.element_size()
    if a.stride(1) != 1 or (a.stride(0) * esize) % 16:
        return "A's rows are not contiguous and 16-byte aligned"
    layout = b_layout(b)
    if layout is None:
        return "B has no contiguous dim"
    if ((b.stride(1) if layout == "nk" else b.stride(0)) * esize) % 16 or (k if layout == "nk" else n) * esize < 16:
        return "B's rows are not 16-byte aligned"
    if bias is not None:
        if bias.dtype != a.dtype:
            return f"{bias.dtype} bias"
        if bias.dim() == 0 or bias.shape[-1] != n or any(s != 1 for s in bias.shape[:-1]):
            return "bias is not one row"
    return None


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A tile configuration; none changes a bit (each output tile accumulates its K in order)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group_m: int = 8
    #: persistent programs per multiprocessor: with two (small enough tiles), one program's
    #: epilogue runs while the other's main loop does
    per_sm: int = 1
    #: Triton's warp specialisation of the tile loop (loads in their own warps)
    ws: bool = False
    #: the epilogue runs on the accumulator in this many column slices (1 or 2), one after the
    #: other: its loads and temporaries for half a tile at a time, so that they fit in registers
    #: next to the accumulator instead of spilling (``benchmarks/kernels/gemm_registers.py``)
    split: int = 1
    #: the epilogue reads and writes whole tiles through TMA descriptors (:class:`_TileEmitter`);
    #: off: through tiles of pointers (more registers, less shared memory)
    tma: bool = True

    def __post_init__(self):
        if self.split not in (1, 2) or self.bn % (2 * self.split):
            raise ValueError(f"epilogue split {self.split} of {self.bn} columns: 1 or 2 halves")

    @property
    def label(self) -> str:
        extra = (f"/{self.per_sm}perSM" if self.per_sm != 1 else "") + ("/ws" if self.ws else "") + \
            (f"/split{self.split}" if self.split != 1 else "") + ("" if self.tma else "/ptr")
        return f"{self.bm}x{self.bn}x{self.bk}/{self.warps}w/{self.stages}s{extra}"

    @property
    def spec(self) -> str:
        """The configuration as :data:`TILES_ENV` and ``bench_gemm.py --tiles`` take it."""
        return (f"{self.bm},{self.bn},{self.bk},{self.warps},{self.stages},{self.per_sm},{int(self.ws)},{self.split},"
                f"{int(self.tma)}")

    @staticmethod
    def parse(spec: str) -> "Tiles":
        """``BM,BN,BK,WARPS,STAGES[,PER_SM[,WS[,SPLIT[,TMA]]]]``."""
        values = [int(v) for v in spec.split(",")]
        if not 5 <= len(values) <= 9:
            raise ValueError(f"{TILES_ENV}={spec!r}: expected BM,BN,BK,WARPS,STAGES[,PER_SM[,WS[,SPLIT[,TMA]]]]")
        bm, bn, bk, warps, stages, *rest = values
        per_sm, ws, split, tma = (rest + [1, 0, 1, 1][len(rest):])
        return Tiles(bm, bn, bk, warps, stages, per_sm=per_sm, ws=bool(ws), split=split, tma=bool(tma))

    def main_loop_bytes(self, esize: int) -> int:
        """Shared memory of the main loop's pipeline: ``stages`` k-tiles of A and of B."""
        return self.stages * (self.bm + self.bn) * self.bk * esize


#: ``EXACTDIT_GEMM_TILES=BM,BN,BK,WARPS,STAGES[,PER_SM[,WS[,SPLIT[,TMA]]]]`` replaces :func:`tile_candidates`
#: (tile sweeps: :attr:`Tiles.spec`)
TILES_ENV = "EXACTDIT_GEMM_TILES"
#: Where ``bench_gemm.py`` (H200) found each the fastest or within 2%: 128 x 256 with 4 stages on
#: most Flux / Wan shapes, 3 stages on some, 256 x 128 and 128 x 128 where 128 x 256 leaves the last
#: wave of tiles mostly empty (4608 x 3072: 432 tiles on 132 SMs, 3.27 waves).
#: Since the epilogue's whole tiles go through TMA (no spills in ptxas's report, where a tile of
#: pointers spilled 1.6-2.5 KB per thread at 128 x 256), a 128 x 256 tile's epilogue runs in two
#: halves with 3 stages to fit shared memory; the earlier fastest (4 stages, pointers) stays a
#: candidate until the H200 says which is faster.
WIDE_TILES = (Tiles(128, 256, 64, 8, 3, split=2), Tiles(256, 128, 64, 8, 3, split=2), Tiles(128, 128, 64, 8, 4),
              Tiles(128, 256, 64, 8, 4, tma=False))
NARROW_TILES = (Tiles(128, 128, 64, 4, 4),)


def tile_candidates(m: int, n: int, k: int) -> tuple[Tiles, ...]:
    """The tile configurations a signature's fused kernel is timed in (the first is the one a
    signature runs when it is not timed: the interpreter, ``EXACTDIT_GEMM=fused``)."""
    forced = os.environ.get(TILES_ENV)
    if forced:
        return (Tiles.parse(forced),)
    return NARROW_TILES if n <= 128 else WIDE_TILES


@functools.lru_cache(maxsize=None)
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def programs_for(device: torch.device, tiles: int, per_sm: int = 1) -> int:
    """Persistent programs: ``per_sm`` per multiprocessor (4 in the interpreter), at most one per tile."""
    sms = _programs(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return max(1, min(sms * per_sm, tiles))


#: per GEMM region, the inputs and outputs its kernels read or write as whole tiles through TMA
#: descriptors (:class:`_TileEmitter`), whose layout :func:`layout_problem` checks at each call
_TILE_OPERANDS: "weakref.WeakKeyDictionary[Region, frozenset[fx.Node]]" = weakref.WeakKeyDictionary()


def tma_matrix(t: torch.Tensor, m: int, n: int) -> bool:
    """Whether ``t`` (of shape [..., n] with m rows in all) can be read or written as one [m, n]
    matrix by a TMA descriptor: its leading dims merge into rows (:func:`rows_of`), 16-byte
    aligned (the base is checked per call)."""
    row = rows_of(t) if t.dim() >= 2 and t.shape[-1] == n and t.numel() == m * n else None
    return row is not None and (row * t.element_size()) % 16 == 0 and n * t.element_size() >= 16


#: shared memory a program may use on the GPUs the fused GEMMs target (sm_90: 227 KiB), less a
#: margin for barriers and the compiler's own scratch
SHARED_BYTES = 227 * 1024 - 2048


class _TileEmitter(Emitter):
    """The epilogue's emitter: an operand read (or an output written) at exactly the tile's
    elements, as an [M, N] matrix, goes through a TMA descriptor (made once per program) rather
    than a tile of 64-bit pointers, which would hold as many registers as the accumulator and
    spill it (``benchmarks/kernels/gemm_registers.py``). Descriptors zero-fill reads outside the
    matrix, as the masked loads do, and drop writes outside it. Same values, same bits."""

    def __init__(self, *args, head: Code, nodes: dict, m: int, n: int, cfg: Tiles, esize: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.head, self.nodes, self.m, self.n, self.cfg = head, nodes, m, n, cfg
        self.descriptors: dict[str, str] = {}
        self.tiled: set[fx.Node] = set()
        #: a descriptor's tile is staged in shared memory: as many as fit beside the main loop's
        self.shared = cfg.main_loop_bytes(esize)

    def _descriptor(self, operand, index) -> str | None:
        node = self.nodes.get(operand.ptr) or next((nd for nd, op in self.loads.items() if op is operand), None)
        val = _val(node)
        if not self.cfg.tma or self._guard or val is None or val.dtype == torch.bool or len(index) != val.dim() \
                or not tma_matrix(val, self.m, self.n):
            return None
        # read at the tile's own elements: the domain's [rows, cols] viewed as the operand's shape
        at_tile = reshape_index(self.tile.domain, (self.m, self.n), val.shape)
        if not all(a.same_value(b) for a, b in zip(index, at_tile)):
            return None
        name = self.descriptors.get(operand.ptr)
        if name is None:
            staged = self.cfg.bm * (self.cfg.bn // self.cfg.split) * val.element_size()
            if self.shared + staged > SHARED_BYTES // self.cfg.per_sm:  # (programs sharing a multiprocessor)
                return None
            self.shared += staged
            name = self.descriptors[operand.ptr] = f"t{len(self.descriptors)}_desc"
            self.head.line(f"{name} = tl.make_tensor_descriptor({operand.ptr}, shape=[{self.m}, {self.n}], "
                           f"strides=[{operand.strides[-2]}, 1], block_shape=[BM, BN_EPI])")
        self.tiled.add(node)
        return name

    def load(self, operand, index, dtype):
        desc = self._descriptor(operand, index)
        if desc is not None:
            self.accesses.append((operand, index))
            return self.let(f"{desc}.load([om, on_epi])", dtype, FULL, "x")
        if not self._guard and index and index[-1].same_value(self.tile.domain[1]) \
                and all(ix.is_const for ix in index[:-1]) and dtype != torch.bool:
            # one row of values for every row of the tile (a gate, a scale): loaded once as a row
            # and broadcast, not through a tile of pointers
            self.accesses.append((operand, index))
            row = self.code.let(f"tl.load({operand.ptr} + ({offset_code(index, operand.strides, operand.wide)}), "
                                f"mask=cols < {self.n}, other=0.0)", "r")
            return self.let(f"tl.broadcast_to({row}, {self.tile.full_shape})", dtype, FULL, "x")
        return super().load(operand, index, dtype)

    def store(self, operand, index, v):
        desc = self._descriptor(operand, index)
        if desc is None:
            return super().store(operand, index, v)
        self.accesses.append((operand, index))
        full = self.broadcast(v, FULL).name
        self.code.line(f"{desc}.store([om, on_epi], tl.broadcast_to({full}, {self.tile.full_shape}))")


def gemm(region: Region, launch: Launch, tiles: Tiles | None = None) -> GeneratedKernel:
    """The kernel of a GEMM region in ``tiles`` (the first candidate by default): persistent
    tiles of the output, each computing its accumulator and then the epilogue's outputs at the
    tile's elements."""
    mm = region.anchor
    a_node, b_node, bias_node = operands(mm)
    a, b = _val(a_node), _val(b_node)
    (m, k), n = a.shape, b.shape[1]
    if tuple(launch.shape) != (m, n) or launch.pieces:
        raise Unfusable("a GEMM region is one launch over the GEMM's output", mm)
    layout = b_layout(b)
    cfg = tiles or tile_candidates(m, n, k)[0]
    loads: dict = {}
    outs = output_operands(region)
    code = Code()
    slots = _table_preamble(region, code)
    head = code.scope("    ")  # descriptors, made once per program
    loop = code.scope("    ")
    body = code.scope("        ")
    # the epilogue: in the tile loop, or in a loop over the accumulator's column slices in it
    epi = body.scope("            ") if cfg.split > 1 else body
    tile = Tile((Ix.of(Atom("rows", m, False)), Ix.of(Atom("cols", n, True))), "[BM, BN_EPI]", "[BM, 1]", "mask",
                "row_ok", whole_rows=False, aligned_columns=cfg.bn // cfg.split)
    nodes: dict = {}  # outputs by pointer name (inputs are the emitter's loads)
    em = _TileEmitter(epi, tile, members=set(region.nodes), loads=loads, pieces={}, tables=slots, head=head,
                      nodes=nodes, m=m, n=n, cfg=cfg, esize=a.element_size())
    # A: one matrix, or the pieces of a cat along K, each read as the K range it fills
    found = prologue(region)
    k_ranges = [(a_node, 0, k)] if found is None else found[1]
    if any(start % cfg.bk for _, start, _ in k_ranges):
        raise Unfusable(f"a cat piece that does not start a {cfg.bk}-wide k-tile", mm)
    a_ops = [em.input_operand(piece) for piece, _, _ in k_ranges]
    b_op = em.input_operand(b_node)
    if b_op.wide or any(op.wide for op in a_ops):
        raise Unfusable("GEMM operands of 2^31 elements or more", mm)
    for i, ((_, _, size), op) in enumerate(zip(k_ranges, a_ops)):
        head.line(f"a{i}_desc = tl.make_tensor_descriptor({op.ptr}, shape=[{m}, {size}], "
                  f"strides=[{op.strides[-2]}, 1], block_shape=[BM, BK])")
    if layout == "nk":
        head.line(f"b_desc = tl.make_tensor_descriptor({b_op.ptr}, shape=[{n}, {k}], strides=[{b_op.strides[1]}, 1], "
                  "block_shape=[BN, BK])")
        b_tile = "b_desc.load([on, {k}]).T"
    else:
        head.line(f"b_desc = tl.make_tensor_descriptor({b_op.ptr}, shape=[{k}, {n}], strides=[{b_op.strides[0]}, 1], "
                  "block_shape=[BK, BN])")
        b_tile = "b_desc.load([{k}, on])"
    pid_m, pid_n = -(-m // cfg.bm), -(-n // cfg.bn)
    loop.line(f"for tile_id in tl.range(tl.program_id(0), {pid_m * pid_n}, PROGRAMS, flatten=True"
              f"{', warp_specialize=True' if cfg.ws else ''}):")
    body.line(f"pid_m, pid_n = gemm_k.tile_of(tile_id, {pid_m}, {pid_n}, GROUP_M)")
    body.line("om = pid_m * BM")
    body.line("on = pid_n * BN")
    body.line("acc = tl.zeros((BM, BN), dtype=tl.float32)")
    for i, (_, start, size) in enumerate(k_ranges):  # K in order: each range's k-tiles in turn
        body.line(f"for ki in range({-(-size // cfg.bk)}):")
        k_at = f"{start} + ki * BK" if start else "ki * BK"
        body.line(f"    acc = gemm_k.mma(a{i}_desc.load([om, ki * BK]), {b_tile.format(k=k_at)}, acc)")
    body.line("rows = om + tl.arange(0, BM)[:, None]")
    body.line(f"row_ok = rows < {row_int(m)}")
    acc = "acc"
    if cfg.split > 1:  # columns [0, BN_EPI) of the tile, then [BN_EPI, BN): the same values, in turn
        body.line("acc_lo, acc_hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN_EPI)), (0, 2, 1)))")
        body.line("for half in tl.static_range(2):")
        epi.line("if half == 0:")
        epi.line("    acc_h = acc_lo")
        epi.line("else:")
        epi.line("    acc_h = acc_hi")
        epi.line("on_epi = on + half * BN_EPI")
        acc = "acc_h"
    else:
        epi.line("on_epi = on")
    epi.line("cols = on_epi + tl.arange(0, BN_EPI)[None, :]")
    epi.line(f"mask = row_ok & (cols < {n})")
    if bias_node is not None:  # one row of BN values, added to every row of the accumulator
        bias_op = em.input_operand(bias_node)
        offset = offset_code(broadcast_index(tile.domain, (m, n), shape_of(bias_node)), bias_op.strides)
        bias = epi.let(f"tl.load({bias_op.ptr} + ({offset}), mask=cols < {n}, other=0.0)", "bias")
        widened = epi.let(f"widen_bf16({bias})" if dtype_of(bias_node) == torch.bfloat16 else f"{bias}.to(tl.float32)",
                          "bias")
        acc = epi.let(f"add_rn({acc}, {widened})", "acc")
    em.stats[mm] = {"index": tile.domain, "y": em.rounded(acc, dtype_of(mm), FULL)}
    nodes.update({op.ptr: node for node, op in zip(region.outputs, outs)})
    _store_outputs(em, region, launch, tile.domain, outs)
    if epi is not body:
        body.extend(epi)
    for part in (head, loop, body):
        code.extend(part)
    # (every tile configuration's kernel of the region: what any of them reads through TMA)
    _TILE_OPERANDS[region] = _TILE_OPERANDS.get(region, frozenset()) | frozenset(em.tiled)
    programs = programs_for(a.device, pid_m * pid_n, cfg.per_sm)
    kernel = _kernel(region, loads, code, {"BM": cfg.bm, "BN": cfg.bn, "BK": cfg.bk, "BN_EPI": cfg.bn // cfg.split,
                                             "GROUP_M": cfg.group_m, "PROGRAMS": programs}, (programs,), cfg.warps)
    return dataclasses.replace(kernel, launch_options=(("num_stages", cfg.stages),))


def gemm_value(em: Emitter, node: fx.Node, index: Index) -> Val:
    """The rule of an ``mm`` / ``addmm`` node inside its GEMM region: the rounded accumulator,
    which exists only at the tile's own elements."""
    stats = em.stats.get(node)
    if stats is None:
        raise Unfusable("a GEMM's output read outside its own region's tile")
    if len(index) != 2 or not all(i.same_value(j) for i, j in zip(index, stats["index"])):
        raise Unfusable("reads the GEMM's output at another element than the tile's")
    return stats["y"]


def layout_problem(region: Region, inputs) -> str | None:
    """Why the compiled GEMM kernel cannot take these inputs (it was built for the layout seen
    at capture; TMA needs 16-byte aligned bases and rows), or None."""
    mm = region.anchor
    a_node, b_node, _ = operands(mm)
    position = {n: i for i, n in enumerate(region.inputs)}
    found = prologue(region)
    a_parts = [inputs[position[a_node]]] if found is None else [inputs[position[p]] for p, _, _ in found[1]]
    b = inputs[position[b_node]]
    want = b_layout(_val(b_node))
    esize = b.element_size()
    rows = [rows_of(a) for a in a_parts]
    if any(r is None or (r * esize) % 16 or a.data_ptr() % 16 for r, a in zip(rows, a_parts)) \
            or b_layout(b) != want or b.data_ptr() % 16 \
            or ((b.stride(1) if want == "nk" else b.stride(0)) * esize) % 16:
        return "GEMM operands not in the layout the kernel was built for (contiguous, 16-byte aligned rows)"
    (m, _), n = _val(a_node).shape, _val(b_node).shape[1]
    for node in _TILE_OPERANDS.get(region, ()):
        t = inputs[position[node]] if node in position else None
        if t is not None and (not tma_matrix(t, m, n) or t.data_ptr() % 16):
            return "an epilogue operand not in the layout the kernel was built for (16-byte aligned rows)"
    return None


def output_problem(region: Region, layouts) -> str | None:
    """Why outputs of these layouts ((shape, strides, dtype) each, eager's for the call's inputs)
    cannot be written by the region's kernels, or None: those written through TMA need rows
    that merge and are 16-byte aligned (the allocator aligns their bases)."""
    (m, _), n = _val(operands(region.anchor)[0]).shape, _val(operands(region.anchor)[1]).shape[1]
    tiled = _TILE_OPERANDS.get(region, ())
    for node, (shape, stride, dtype) in zip(region.outputs, layouts):
        if node in tiled and not tma_matrix(torch.empty_strided(shape, stride, dtype=dtype, device="meta"), m, n):
            return "an output of another layout than the kernel writes (16-byte aligned rows)"
    return None


_allocator_set = False


def ensure_allocator() -> None:
    """TMA descriptors made inside a kernel live in a scratch buffer Triton asks the process for;
    the caching allocator provides it (inside a CUDA graph, from the graph's pool)."""
    global _allocator_set
    if _allocator_set:
        return
    import triton

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)
    _allocator_set = True


for _target in GEMM_TARGETS:  # the GEMM's value inside its own region: the rounded accumulator
    register_rule(_target, Rule(REDUCTION_OUTPUT, gemm_value, why_not_gemm))


# --- run time: fused kernel or cuBLAS + epilogue, by time ------------------------------------------

def first_tiles(region: Region) -> Tiles:
    """The tile configuration the region's own kernel is built in."""
    a, b, _ = operands(region.anchor)
    (m, k), n = _val(a).shape, _val(b).shape[1]
    return tile_candidates(m, n, k)[0]


def other_tiles(region: Region) -> list[tuple[Tiles, GeneratedKernel]]:
    """The region's kernel in each other candidate tile configuration (same epilogue, same K order)."""
    a, b, _ = operands(region.anchor)
    (m, k), n = _val(a).shape, _val(b).shape[1]
    kernels = []
    for cfg in tile_candidates(m, n, k)[1:]:
        with row_ints():
            try:
                kernels.append((cfg, gemm(region, region.launches[0], cfg)))
            except Unfusable:
                continue
    return kernels


#: timed calls of each way (after two warm-ups), alternating: the clock under the power cap drifts
TIMED_CALLS = 5


def choose(ways: dict, inputs) -> tuple[str, dict[str, float]]:
    """The fastest of a signature's ways (name -> callable: the fused kernel in each tile
    configuration, ``"split"``: cuBLAS then the epilogue) on these inputs, and each way's median
    us. All give the same bits (the gate verifies the one chosen against the region's ATen
    nodes), so only time decides. A way that raises is left out; ``EXACTDIT_GEMM=fused`` /
    ``split`` fixes the way (the first fused one, or cuBLAS)."""
    fused = next(name for name in ways if name != "split")
    forced = os.environ.get(CHOICE_ENV, "")
    if forced in ("fused", "split"):
        return (fused if forced == "fused" else "split"), {}
    device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
    if device.type != "cuda":
        return fused, {}
    working = {}
    for name, fn in ways.items():
        try:
            fn(*inputs)
            fn(*inputs)
        except Exception:  # noqa: BLE001 - a tile configuration that does not build or launch here
            if name == "split":
                raise
            continue
        working[name] = fn
    times: dict[str, list[float]] = {name: [] for name in working}
    for _ in range(TIMED_CALLS):
        for name, fn in working.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*inputs)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return min(medians, key=medians.get), medians
