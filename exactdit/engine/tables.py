"""Transcendental functions of bf16/fp16 values as tables of eager's own results.

A bf16 (or fp16) input has only 2^16 values, so ``gelu``, ``silu``, ``tanh``, ``exp``, ... of a
half-precision tensor is a lookup: the table holds exactly what the eager op returns on this
device for every bit pattern, so the fused result is eager's by construction, whichever libm,
FMA contraction or approximation eager's kernel used.

Reading 2^16 entries from global memory for every element would be slow, so the table is cut to
a window of magnitudes ``[lo, lo + win)`` per sign, kept on chip (``tl.gather``; loading the
window's entries from L1 instead measured 1.35x slower on Wan's GELU region), and the two
tails outside it follow one of three rules found from the table itself: the input unchanged
(``gelu``/``silu`` of large positive values), ``round(x * 0.5)`` (``gelu``/``silu`` of tiny
values) or one constant (``tanh`` of large values, ``exp`` of tiny ones). Infinities and NaN
come from three constants read off the table. When no window up to ``MAX_WINDOW`` works (fp16
has 1,024 values per binade), the full table is read from memory instead.

Before a table is used on a device, a kernel built from the same lookup runs over all 2^16
inputs and must return the table bit for bit (:func:`table_for`); otherwise the op is not fused
there.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
from typing import Callable

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import unset_fake_temporarily

from exactdit.device import hash_in_one_order
from exactdit.device.numerics import LAUNCH_OPTIONS, mul_rn, round_to, widen

logger = logging.getLogger("exactdit")

#: largest window (entries per sign) kept on chip: 2 * 4096 int16 = 16 KB
MAX_WINDOW = 4096
#: tail rules
IDENTITY, HALF, CONSTANT = 0, 1, 2
#: ``TableSpec.specials`` flag: a NaN input comes out unchanged (CPU kernels keep payloads)
NAN_KEEPS_PAYLOAD = 1 << 48


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """How a kernel reads one table. ``window == 0``: the full table from memory."""

    lo: int
    window: int
    low_pos: int  # rule * 2**16 + constant bits
    low_neg: int
    high_pos: int
    high_neg: int
    specials: int  # NaN, +inf, -inf results: 16 bits each (NaN: or NAN_KEEPS_PAYLOAD)
    inf_bits: int  # magnitude bits of +inf (0x7F80 bf16, 0x7C00 fp16)

    def constexprs(self, prefix: str) -> dict[str, int]:
        return {f"{prefix}_{k.upper()}": v for k, v in dataclasses.asdict(self).items()}


CONSTEXPR_FIELDS = [f.name.upper() for f in dataclasses.fields(TableSpec)]


@triton.jit
def _rule(x, bits, RULE: tl.constexpr):
    KIND: tl.constexpr = RULE >> 16
    if KIND == 0:
        return bits
    elif KIND == 1:
        h = round_to(mul_rn(widen(x), tl.full(x.shape, 0.5, tl.float32)), x.dtype)
        return h.to(tl.int16, bitcast=True).to(tl.int32)
    else:
        return tl.full(bits.shape, RULE & 0xFFFF, tl.int32)


@triton.jit
def _sign_extend16(v):
    return ((v & 0xFFFF) ^ 0x8000) - 0x8000


@triton.jit
def table_lookup(x, table, table_ptr, LO: tl.constexpr, WINDOW: tl.constexpr, LOW_POS: tl.constexpr,
                 LOW_NEG: tl.constexpr, HIGH_POS: tl.constexpr, HIGH_NEG: tl.constexpr,
                 SPECIALS: tl.constexpr, INF_BITS: tl.constexpr):
    """eager ``f(x)`` for a bf16/fp16 tensor ``x`` from the table (see the module docstring):
    ``table`` is the on-chip window ``[2 * WINDOW]`` (int16: positive magnitudes, then
    negative), or with ``WINDOW == 0`` the full table is read at ``table_ptr``."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32)
    if WINDOW == 0:
        out = tl.load(table_ptr.to(tl.pointer_type(tl.int16)) + (bits & 0xFFFF)).to(tl.int32)
    else:
        magnitude = bits & 0x7FFF
        negative = bits < 0
        i = magnitude - LO
        inside = i.to(tl.uint32, bitcast=True) < WINDOW
        # out-of-window lanes read some entry and discard it (cheaper than clamping)
        index = (i & (WINDOW - 1)) + tl.where(negative, WINDOW, 0)
        looked_up = tl.reshape(tl.gather(table, tl.reshape(index, [index.numel]), 0), index.shape).to(tl.int32)
        low = tl.where(negative, _rule(x, bits, LOW_NEG), _rule(x, bits, LOW_POS))
        high = tl.where(negative, _rule(x, bits, HIGH_NEG), _rule(x, bits, HIGH_POS))
        out = tl.where(inside, looked_up, tl.where(i < 0, low, high))
        if (SPECIALS >> 48) & 1:
            nan = bits
        else:
            nan = tl.full(bits.shape, (SPECIALS >> 32) & 0xFFFF, tl.int32)
        special = tl.where(magnitude > INF_BITS, nan,
                           tl.where(negative, _sign_extend16(SPECIALS), _sign_extend16(SPECIALS >> 16)))
        out = tl.where(magnitude >= INF_BITS, special, out)
    return out.to(tl.int16).to(x.dtype, bitcast=True)


@triton.jit
def _lookup_all_kernel(x_ptr, out_ptr, table_ptr, N: tl.constexpr, LO: tl.constexpr, WINDOW: tl.constexpr,
                       LOW_POS: tl.constexpr, LOW_NEG: tl.constexpr, HIGH_POS: tl.constexpr,
                       HIGH_NEG: tl.constexpr, SPECIALS: tl.constexpr, INF_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    if WINDOW == 0:
        table = x
    else:
        table = tl.load(table_ptr.to(tl.pointer_type(tl.int16)) + tl.arange(0, 2 * WINDOW))
    y = table_lookup(x, table, table_ptr, LO, WINDOW, LOW_POS, LOW_NEG, HIGH_POS, HIGH_NEG, SPECIALS, INF_BITS)
    tl.store(out_ptr + offs, y)


# --- building tables ------------------------------------------------------------------------------


def every_value(dtype: torch.dtype, device) -> torch.Tensor:
    """All 2^16 values of a 16-bit float dtype, indexed by bit pattern 0x0000..0xFFFF."""
    return torch.arange(2**16, dtype=torch.int32, device=device).to(torch.int16).view(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).to(torch.int32) & 0xFFFF


def _rule_outputs(values: torch.Tensor) -> dict[int, torch.Tensor]:
    """Bits each non-constant rule gives for ``values`` (on the CPU: exact fp32 arithmetic)."""
    v = values.cpu()
    return {IDENTITY: _bits(v), HALF: _bits((v.float() * 0.5).to(v.dtype))}


def _tail_rule(out: torch.Tensor, candidates: dict[int, torch.Tensor], lo: int, hi: int) -> int | None:
    """A rule giving ``out[lo:hi]`` exactly (as ``rule << 16 | constant``), or None."""
    if hi <= lo:
        return IDENTITY << 16
    seg = out[lo:hi]
    for kind, got in candidates.items():
        if torch.equal(got[lo:hi], seg):
            return kind << 16
    if bool((seg == seg[0]).all()):
        return (CONSTANT << 16) | int(seg[0])
    return None


def derive_spec(eager_out: torch.Tensor, dtype: torch.dtype) -> TableSpec:
    """The smallest window (and its tail rules) that reproduces ``eager_out`` (eager's result
    for every bit pattern, as returned by the op) outside the window."""
    inf_bits = 0x7F80 if dtype == torch.bfloat16 else 0x7C00
    out = _bits(eager_out.cpu())
    inputs = every_value(dtype, "cpu")
    cand = _rule_outputs(inputs)
    nan_in = torch.cat([cand[IDENTITY][inf_bits + 1: 0x8000], cand[IDENTITY][0x8000 + inf_bits + 1:]])
    nan_out = torch.cat([out[inf_bits + 1: 0x8000], out[0x8000 + inf_bits + 1:]])
    if torch.equal(nan_out, nan_in):
        nan_rule = NAN_KEEPS_PAYLOAD
    elif bool((nan_out == nan_out[0]).all()):
        nan_rule = int(nan_out[0]) << 32
    else:
        return _full_spec(inf_bits)
    specials = nan_rule | (int(out[inf_bits]) << 16) | int(out[0x8000 | inf_bits])

    ends = []
    for sign in (0, 0x8000):
        o = out[sign: sign + inf_bits]
        c = {k: v[sign: sign + inf_bits] for k, v in cand.items()}
        low = _match_lengths(o, c, from_end=False)[0]
        high = inf_bits - _match_lengths(o, c, from_end=True)[0]
        ends.append((low, high))
    lo = min(e[0] for e in ends)
    hi = max(e[1] for e in ends)
    window = 1 << max(0, (max(1, hi - lo) - 1).bit_length())
    if window > MAX_WINDOW:
        return _full_spec(inf_bits)
    rules = []
    for sign in (0, 0x8000):
        o = out[sign: sign + inf_bits]
        c = {k: v[sign: sign + inf_bits] for k, v in cand.items()}
        rules.append((_tail_rule(o, c, 0, lo), _tail_rule(o, c, min(lo + window, inf_bits), inf_bits)))
    if any(r is None for pair in rules for r in pair):
        return _full_spec(inf_bits)
    return TableSpec(lo, window, rules[0][0], rules[1][0], rules[0][1], rules[1][1], specials, inf_bits)


def _match_lengths(o: torch.Tensor, cand: dict[int, torch.Tensor], from_end: bool) -> tuple[int, int]:
    """The longest run at the start (or end) of ``o`` that one rule reproduces: (length, rule)."""
    best = (0, IDENTITY << 16)
    runs = {kind << 16: got == o for kind, got in cand.items()}
    first = o[-1] if from_end else o[0]
    runs[(CONSTANT << 16) | int(first)] = o == first
    for rule, ok in runs.items():
        ok = ok.flip(0) if from_end else ok
        bad = torch.nonzero(~ok)
        n = int(bad[0]) if len(bad) else len(o)
        if n > best[0]:
            best = (n, rule)
    return best


def _full_spec(inf_bits: int) -> TableSpec:
    return TableSpec(0, 0, 0, 0, 0, 0, 0, inf_bits)


@dataclasses.dataclass(frozen=True)
class Table:
    spec: TableSpec
    data: torch.Tensor  # int16: the window [2 * window] or the full table [65536]


def build_table(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device) -> tuple[Table | None, str | None]:
    """(table, None) when a lookup of ``fn``'s eager results reproduces ``fn`` on all 2^16
    inputs on ``device``; (None, why) otherwise."""
    inputs = every_value(dtype, device)
    eager = fn(inputs)
    if eager.dtype != dtype or eager.shape != inputs.shape:
        return None, f"the op returns {eager.dtype}"
    spec = derive_spec(eager, dtype)
    bits = eager.view(torch.int16)
    if spec.window:
        idx = torch.arange(spec.lo, spec.lo + spec.window, device=device)
        idx = idx.clamp(max=0x7FFF)
        data = torch.cat([bits[idx], bits[idx + 0x8000]]).contiguous()
    else:
        data = bits.contiguous()
    table = Table(spec, data)
    got = torch.empty_like(inputs)
    _lookup_all_kernel[(2**16 // 1024,)](
        inputs, got, data, 2**16, **{k: getattr(spec, k.lower()) for k in CONSTEXPR_FIELDS}, BLOCK=1024,
        **LAUNCH_OPTIONS,
    )
    if not torch.equal(got.view(torch.int16), bits):
        wrong = int((got.view(torch.int16) != bits).sum())
        return None, f"the lookup differs from eager on {wrong} of 65536 inputs"
    return table, None


_cache: dict[tuple, tuple[Table | None, str | None]] = {}
_lock = threading.Lock()


def table_for(key: tuple, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device) -> tuple[Table | None, str | None]:
    """The checked table of ``fn`` (identified by ``key``) on ``device``, built on first use."""
    full_key = key + (dtype, str(device))
    hit = _cache.get(full_key)
    if hit is None:
        with _lock:
            hit = _cache.get(full_key)
            if hit is None:
                # from real values, also when asked while a graph is rewritten (under Dynamo's fake mode)
                with unset_fake_temporarily():
                    hit = build_table(fn, dtype, device)
                if hit[1] is not None:
                    logger.warning("exactdit: %s on %s runs eager: %s", key[0], device, hit[1])
                _cache[full_key] = hit
    return hit


def lookup_code(em, node, x) -> str:
    """Generated code of the lookup of ``node`` (a table op) applied to value ``x``."""
    slot = em.tables[node]
    args = ", ".join(f"{slot}_{f}" for f in CONSTEXPR_FIELDS)
    return f"table_lookup({x.name}, {slot}, {slot}_ptr, {args})"


hash_in_one_order(sys.modules[__name__])  # (the keys of kernels that call table_lookup: see there)
