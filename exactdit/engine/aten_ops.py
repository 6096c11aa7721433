"""What each ATen op of a captured graph computes, as the engine reproduces it.

One rule per op family, keyed by ATen overload:

* ``Pointwise`` rules emit one eager CUDA kernel's arithmetic for one element: operands widened
  to fp32 (ATen's opmath for bf16, fp16 and fp32), Python-number operands rounded to fp32 as
  ``scalar_value<opmath_t>()`` does, one ``.rn`` operation, one rounding to the node's dtype.
  Where both operands and the result are bf16 (or fp16) tensors, the packed
  ``numerics.dtype_*`` ops give those bits in one instruction per pair.
* ``View`` rules move an index from a view's output to its input (no data moves) and ``Cat``
  rules pick, per index, the input that holds the element (:mod:`exactdit.engine.aten_views`).
* ``Unary`` rules (transcendental functions of bf16/fp16) read a table of eager's own results,
  built and checked on the device (:mod:`exactdit.engine.tables`).
* Reduction outputs (``native_layer_norm``, ``_fused_rms_norm``, ``mean``) read per-row
  statistics that a kernel template computed in ATen's order (:mod:`exactdit.engine.templates`).

Anything else is not fused: the partitioner leaves it to ATen.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from exactdit.engine.emit import COMPLEX, FLOAT_DTYPES, FULL, SCALAR, Emitter, Val, dtype_of, f32
from exactdit.engine.indexing import Index
from exactdit.engine.rules import (  # noqa: F401  (the kinds, Rule and rule_for are read from here too)
    CAT, POINTWISE, REDUCTION_OUTPUT, UNARY_TABLE, VIEW, Rule, register_rule, rule_for,
)

aten = torch.ops.aten
prims = torch.ops.prims

def why_not_fusable(node: fx.Node) -> str | None:
    """None when the engine can emit ``node``; else the reason."""
    rule = rule_for(node)
    if rule is None:
        return f"{_name(node)} is not an op the engine fuses"
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return f"{_name(node)} does not produce one tensor"
    if not all(_static(a.meta.get("val")) for a in (node, *node.all_input_nodes)):
        return "data-dependent shape"  # e.g. after nonzero (Mochi's text selection): sizes known only at run time
    if val.numel() == 0:
        return "empty tensor"
    if rule.kind not in (VIEW,) and val.dtype not in FLOAT_DTYPES + (COMPLEX,) and node.target not in BOOL_RESULTS:
        return f"{_name(node)} produces {val.dtype}"
    if val.device.type not in ("cuda", "cpu"):
        return f"{val.device.type} tensors"
    return rule.check(node)


def _static(val) -> bool:
    """Whether ``val`` (a node's value) has plain integer sizes and strides, or is no tensor."""
    if isinstance(val, (tuple, list)):
        return all(_static(v) for v in val)
    if not isinstance(val, torch.Tensor):
        return True
    return all(type(s) is int for s in (*val.shape, *val.stride()))


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _register(targets, rule: Rule) -> None:
    for t in targets:
        register_rule(t, rule)


def _kwarg(node: fx.Node, name: str, position: int, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def _tensor_args_float(node: fx.Node) -> str | None:
    for a in node.all_input_nodes:
        val = a.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return "non-tensor graph input"
        if val.dtype not in FLOAT_DTYPES:
            return f"operand of dtype {val.dtype}"
    return None


def _no_wider_operand(node: fx.Node, allowed=()) -> str | None:
    """Operands wider than the result (a 0-dim fp32 tensor meeting a bf16 tensor) are converted
    by ATen through the result dtype; reproduced only for the ``allowed`` ones."""
    out = dtype_of(node)
    for a in node.all_input_nodes:
        if a not in allowed and a.meta["val"].element_size() > torch.empty((), dtype=out).element_size():
            return f"a {a.meta['val'].dtype} operand of a {out} op"
    return None


# --- binary arithmetic -------------------------------------------------------------------------

_FP32_OP = {"add": "add_rn", "sub": "sub_rn", "mul": "mul_rn", "div": "div_rn"}
_DTYPE_OP = {"add": "dtype_add", "sub": "dtype_sub", "mul": "dtype_mul"}


def _representable(value: float, dtype: torch.dtype) -> bool:
    return float(torch.tensor(f32(value), dtype=torch.float32).to(dtype).float()) == f32(value) and math.isfinite(value)


def _binary(op: str) -> Rule:
    def check(node):
        if dtype_of(node) == COMPLEX:
            return _complex_mul_check(node) if op == "mul" else f"complex {op}"
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            return f"{op} with alpha={alpha}"
        if op == "div" and node.kwargs.get("rounding_mode") is not None:
            return "division with a rounding mode"
        for a in node.args[:2]:
            if not isinstance(a, (fx.Node, int, float)) or isinstance(a, bool):
                return f"operand {a!r}"
        if op == "div" and not isinstance(node.args[0], fx.Node):
            return "a number divided by a tensor"
        return _tensor_args_float(node) or _no_wider_operand(node, _cast_on_load(node))

    def emit(em: Emitter, node: fx.Node, index: Index) -> Val:
        out = dtype_of(node)
        a, b = (_loaded_as(em, node, arg, index) for arg in node.args[:2])
        if out == COMPLEX:
            return _complex_mul(em, a, b)
        if op == "div" and not isinstance(b, Val):
            # ATen divides by a CPU scalar as a multiply by its fp32 reciprocal
            return _fp32_binary(em, "mul", a, f32(1.0) / f32(b) if f32(b) != 0 else _div_by_zero(b), out)
        return _binary_values(em, op, a, b, out)

    # CUDA divides by a scalar as a multiply by its reciprocal, the CPU divides; CUDA's complex
    # multiply is contracted into FMAs, the CPU's is not
    if op == "div":
        cuda_only = lambda node: not isinstance(node.args[1], fx.Node) or bool(_cast_on_load(node))  # noqa: E731
    else:
        cuda_only = lambda node: dtype_of(node) == COMPLEX or bool(_cast_on_load(node))  # noqa: E731
    return Rule(POINTWISE, emit, check, cuda_only)


def _cast_on_load(node: fx.Node) -> set[fx.Node]:
    """Operands of a binary op that ATen's CUDA kernel converts to the result dtype as it loads them:
    0-dim float tensors on the op's device wider than a result they did not promote (a LoRA
    hot-swap's fp32 scale times a bf16 activation: ``fetch_and_cast`` rounds the scale to bf16, then
    the op runs as between two bf16 tensors). A 0-dim CPU tensor is a scalar there, read unrounded:
    not one of these. ATen's CPU kernels read a second operand unrounded too (cuda_only)."""
    out = node.meta["val"]
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.dtype not in (torch.bfloat16, torch.float16):
        return set()
    found = set()
    for a in node.args[:2]:
        val = a.meta.get("val") if isinstance(a, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.dim() == 0 and val.dtype == torch.float32 and val.device == out.device:
            found.add(a)
    return found


def _loaded_as(em: Emitter, node: fx.Node, arg, index: Index):
    """An operand of a binary ``node`` as its kernel loads it (:func:`_cast_on_load`)."""
    v = em.operand(node, arg, index)
    return em.rounded(v.name, dtype_of(node), v.kind) if arg in _cast_on_load(node) else v


def _complex_mul_check(node) -> str | None:
    if not all(isinstance(a, fx.Node) and dtype_of(a) == COMPLEX for a in node.args[:2]):
        return "complex multiply with a real or Python operand"
    return None


def _complex_mul(em: Emitter, a: Val, b: Val) -> Val:
    """complex64 ``a * b`` as ATen's CUDA kernel computes it (``c10::complex::operator*=``, nvcc
    fusing the first product of each part): ``re = fma(ar, br, -fl(ai * bi))``,
    ``im = fma(ar, bi, fl(ai * br))``."""
    kind = max(a.kind, b.kind)
    re = em.code.let(f"tl.fma({a.name}, {b.name}, neg_f32(mul_rn({a.imag}, {b.imag})))", "re")
    im = em.code.let(f"tl.fma({a.name}, {b.imag}, mul_rn({a.imag}, {b.name}))", "im")
    return Val(re, COMPLEX, kind, im)


def _div_by_zero(b: float) -> float:
    # fp32 1/0 is inf with the sign of the zero
    return math.copysign(math.inf, math.copysign(1.0, b))


def _binary_values(em: Emitter, op: str, a, b, out: torch.dtype) -> Val:
    """``a op b`` for values/numbers of an eager op whose result dtype is ``out``."""
    half = out in (torch.bfloat16, torch.float16)
    if half and op in _DTYPE_OP:
        va = a if isinstance(a, Val) else (em.constant(a, out) if _representable(a, out) else None)
        vb = b if isinstance(b, Val) else (em.constant(b, out) if _representable(b, out) else None)
        if va is not None and vb is not None and va.dtype == vb.dtype == out:
            kind = max(va.kind, vb.kind)
            if em.effective(kind) == FULL:
                va, vb = em.broadcast(va, FULL), em.broadcast(vb, FULL)
                return em.let(f"{_DTYPE_OP[op]}({va.name}, {vb.name})", out, FULL)
    return _fp32_binary(em, op, a, b, out)


def _fp32_binary(em: Emitter, op: str, a, b, out: torch.dtype) -> Val:
    kind = max(v.kind for v in (a, b) if isinstance(v, Val)) if any(isinstance(v, Val) for v in (a, b)) else SCALAR
    wa = em.widen(a) if isinstance(a, Val) else em.constant(a, torch.float32).name
    wb = em.widen(b) if isinstance(b, Val) else em.constant(b, torch.float32).name
    return em.rounded(f"{_FP32_OP[op]}({wa}, {wb})", out, kind)


for _op in ("add", "sub", "mul", "div"):
    _register([getattr(aten, _op).Tensor, getattr(aten, _op).Scalar], _binary(_op))


def _addcmul_value(node: fx.Node) -> float:
    return _kwarg(node, "value", 3, 1)


def _addcmul_check(node):
    value = _addcmul_value(node)
    if isinstance(value, (fx.Node, bool)) or not isinstance(value, (int, float)):
        return f"addcmul with value {value!r}"
    if not all(isinstance(a, fx.Node) for a in node.args[:3]):
        return "addcmul with a Python operand"
    return _tensor_args_float(node) or _no_wider_operand(node)


def _addcmul_emit(em, node, index):
    # ATen's CUDA addcmul (DeviceAddCmulCdiv.cuh) in opmath: value 1 is fma(t1, t2, self), one
    # rounding of the exact product's sum; any other value is fma(value, fl(t1 * t2), self)
    a, b, c = (em.operand(node, arg, index) for arg in node.args[:3])
    wa, wb, wc = em.widen(a), em.widen(b), em.widen(c)
    value = _addcmul_value(node)
    if f32(value) == 1.0:
        code = f"tl.fma({wb}, {wc}, {wa})"
    else:
        code = f"tl.fma({em.constant(value, torch.float32).name}, mul_rn({wb}, {wc}), {wa})"
    return em.rounded(code, dtype_of(node), max(a.kind, b.kind, c.kind))


def _addcmul_cuda_only(node) -> bool:
    # ATen's CPU kernel multiplies and adds with two roundings; with value 1 and half-precision
    # operands the fp32 product is exact, so both kernels round once
    half = all(a.meta["val"].dtype in (torch.bfloat16, torch.float16) for a in node.args[:3])
    return not (half and f32(_addcmul_value(node)) == 1.0)


_register([aten.addcmul.default], Rule(POINTWISE, _addcmul_emit, _addcmul_check, _addcmul_cuda_only))


# --- unary exact ops ---------------------------------------------------------------------------


def _unary(fp32_expr: Callable[[str], str]) -> Rule:
    def emit(em, node, index):
        x = em.value(node.args[0], index)
        return em.rounded(fp32_expr(em.widen(x)), dtype_of(node), x.kind)

    return Rule(POINTWISE, emit, lambda node: _tensor_args_float(node) or _no_wider_operand(node))


_register([aten.neg.default], _unary(lambda x: f"neg_f32({x})"))  # not Triton's `-x`: 0 - x in 3.6
_register([aten.abs.default], _unary(lambda x: f"tl.abs({x})"))
_register([aten.rsqrt.default], dataclasses.replace(_unary(lambda x: f"rsqrt_approx({x})"), cuda_only=lambda n: True))
_register([aten.sqrt.default], _unary(lambda x: f"tl.sqrt_rn({x})"))
_register([aten.reciprocal.default], _unary(lambda x: f"div_rn(tl.full({x}.shape, 1.0, tl.float32), {x})"))


def _pow_check(node):
    if node.args[1] != 2:
        return f"pow with exponent {node.args[1]!r}"
    return _tensor_args_float(node)


def _pow_emit(em, node, index):
    # ATen's pow special-cases the exponent 2 as base * base (in opmath)
    x = em.value(node.args[0], index)
    w = em.widen(x)
    return em.rounded(f"mul_rn({w}, {w})", dtype_of(node), x.kind)


_register([aten.pow.Tensor_Scalar], Rule(POINTWISE, _pow_emit, _pow_check))


def _clamp_bounds(node) -> list:
    """[min, max] of a clamp-family node (None: unbounded); ``relu`` is ATen's ``clamp_min(x, 0)``."""
    if node.target is aten.relu.default:
        return [0.0, None]
    if node.target is aten.clamp_min.default:
        return [node.args[1], None]
    if node.target is aten.clamp_max.default:
        return [None, node.args[1]]
    return [_kwarg(node, "min", 1), _kwarg(node, "max", 2)]


def _clamp_check(node):
    bounds = _clamp_bounds(node)
    if any(b is not None and (isinstance(b, (fx.Node, bool)) or not isinstance(b, (int, float))) for b in bounds):
        return "clamp with tensor bounds"
    device = getattr(node.meta.get("val"), "device", None)
    if _clamp_at_zero(node) and device is not None and device.type == "cuda":
        lo_ok, hi_ok = cuda_zero_ties_as_modelled(device.index or 0)
        lo, hi = bounds
        if (lo is not None and float(lo) == 0 and not lo_ok) or (hi is not None and float(hi) == 0 and not hi_ok):
            return "this torch's CUDA clamp keeps the sign of a zero on a tie with a zero bound (the rule models torch 2.11's)"
    return _tensor_args_float(node)


_ZERO_TIES: dict[int, tuple[bool, bool]] = {}


def cuda_zero_ties_as_modelled(index: int) -> tuple[bool, bool]:
    """Whether the live CUDA clamp orders -0 below +0 at a zero lower / upper bound as
    :func:`_clamp_emit` does (torch 2.11: ``clamp_min([-0., 0.], 0.)`` is ``[0., 0.]``,
    ``clamp_max([-0., 0.], -0.)`` is ``[-0., -0.]``), asked once per device. A torch that returns
    the input on a tie (later PyTorch source) leaves those clamps to ATen rather than give another
    zero's sign."""
    known = _ZERO_TIES.get(index)
    if known is None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        try:
            with unset_fake_temporarily():  # (partition may run under a tracing fake mode)
                z = torch.tensor([-0.0, 0.0], device=torch.device("cuda", index))
                lo, hi = torch.signbit(torch.clamp_min(z, 0.0)), torch.signbit(torch.clamp_max(z, -0.0))
                known = (bool((~lo).all()), bool(hi.all()))
        except Exception:  # noqa: BLE001 - e.g. a CUDA graph being recorded: refused now, asked again later
            return (False, False)
        _ZERO_TIES[index] = known
    return known


def _clamp_emit(em, node, index):
    lo, hi = _clamp_bounds(node)
    x = em.value(node.args[0], index)
    v = em.widen(x)
    y = v
    # ATen's clamp kernels: NaN stays NaN, else min(max(v, lo), hi) in opmath with CUDA's
    # fmaxf / fminf, which order -0 below +0 (relu(-0.0) is +0.0, measured): written as selects,
    # a bound of the other zero's sign wins a tie. (torch 2.11's launch_clamp_scalar in
    # ATen/native/cuda/TensorCompare.cu; PyTorch's later source returns v where v == the bound,
    # relu(-0.0) = -0.0 as on the CPU: where the live kernel does that, _clamp_check refuses.)
    if lo is not None:
        k = em.constant(float(lo), torch.float32).name
        tie = "<=" if float(lo) == 0 and math.copysign(1.0, float(lo)) > 0 else "<"
        y = em.code.let(f"tl.where({y} {tie} {k}, {k}, {y})", "c")
    if hi is not None:
        k = em.constant(float(hi), torch.float32).name
        tie = "<=" if float(hi) == 0 and math.copysign(1.0, float(hi)) < 0 else "<"
        y = em.code.let(f"tl.where({k} {tie} {y}, {k}, {y})", "c")
    return em.rounded(f"tl.where({v} != {v}, {v}, {y})", dtype_of(node), x.kind)


def _clamp_at_zero(node) -> bool:
    # the CPU kernels select (relu(-0.0) is -0.0 there), CUDA's order the zeros
    return any(b is not None and float(b) == 0 for b in _clamp_bounds(node))


_register([aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.relu.default],
          Rule(POINTWISE, _clamp_emit, _clamp_check, _clamp_at_zero))


# --- dtype conversions and copies -----------------------------------------------------------------


def _convert_check(node):
    val = node.meta["val"]
    src = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(src, torch.Tensor) or src.dtype not in FLOAT_DTYPES:
        return "conversion of a non-float tensor"
    if src.device != val.device:
        return "copy between devices"
    return None


def _convert_emit(em, node, index):
    x = em.value(node.args[0], index)
    out = dtype_of(node)
    if x.dtype == out:
        return x
    return em.rounded(em.widen(x), out, x.kind)


_register([aten._to_copy.default, prims.convert_element_type.default], Rule(POINTWISE, _convert_emit, _convert_check))


def _copy_check(node):
    # functional copy (an in-place ``out[..., 0::2] = v`` after functionalization): the result is
    # ``src`` broadcast to ``dst``'s shape in ``dst``'s dtype; ``dst``'s values are not read
    dst, src = node.args[0], node.args[1]
    if not isinstance(src, fx.Node) or src.meta["val"].dtype not in FLOAT_DTYPES:
        return "copy of a non-float tensor"
    if src.meta["val"].device != dst.meta["val"].device:
        return "copy between devices"
    return None


def _copy_emit(em, node, index):
    x = em.operand(node, node.args[1], index)
    out = dtype_of(node)
    return x if x.dtype == out else em.rounded(em.widen(x), out, x.kind)


_register([aten.copy.default], Rule(POINTWISE, _copy_emit, _copy_check))


def _empty_emit(em, node, index):
    # uninitialised memory: any value is eager's; inside a region only (the partition hands none back:
    # its ATen reference's garbage would fail verification), so only fully overwritten ones are fused
    return em.constant(0.0, dtype_of(node))


_register([aten.empty_like.default], Rule(POINTWISE, _empty_emit, lambda node: None))


def _identity_emit(em, node, index):
    return em.value(node.args[0], index)


_register([aten.clone.default, aten.lift_fresh_copy.default], Rule(POINTWISE, _identity_emit, lambda node: None))


#: pointwise by their values, but their result is their input's storage: inside a region they are
#: the identity; a region hands one back only where nothing else of that storage is seen outside it
#: (partition: a region's outputs are storages of their own)
SHARES_STORAGE = {aten.alias.default, aten.detach.default}
_register(SHARES_STORAGE, Rule(POINTWISE, _identity_emit, lambda node: None))

#: ops whose result is their first input's storage though their schemas say nothing of it
#: (``_unsafe_view``: AOTAutograd's reshape of a matmul's result; ``getitem``: an item of a list view)
_SAME_STORAGE_UNANNOTATED = (operator.getitem, aten._unsafe_view.default)


def shares_input_storage(node: fx.Node) -> bool:
    """Whether ``node``'s value is its first input's storage: a view, an alias, an item of a list
    view, ``_unsafe_view``."""
    return node.op == "call_function" and (node.target in _SAME_STORAGE_UNANNOTATED
                                           or getattr(node.target, "is_view", False))


def _where_check(node):
    cond = node.args[0]
    if not isinstance(cond, fx.Node) or cond.meta["val"].dtype != torch.bool:
        return "where with a non-tensor condition"
    for a in node.args[1:3]:
        if isinstance(a, fx.Node):
            if a.meta["val"].dtype not in FLOAT_DTYPES:
                return f"where operand of dtype {a.meta['val'].dtype}"
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            return f"where operand {a!r}"
    return _no_wider_operand_values(node)


def _index_compare_check(node):
    x, k = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or x.meta["val"].dtype not in (torch.int32, torch.int64):
        return "comparison of a non-integer tensor"
    if isinstance(k, bool) or not isinstance(k, int):
        return f"comparison with {k!r}"
    return None


def _index_compare_emit(em, node, index):
    # an integer tensor against an integer: exact in any order (Qwen-Image-Edit's per-token
    # modulation index, `index == 0`, feeding a where); the bool stays in registers
    x = em.value(node.args[0], index)
    return em.let(f"{x.name} == {int(node.args[1])}", torch.bool, x.kind)


#: ops whose bool result a region computes but never stores (a consumer inside reads it)
BOOL_RESULTS = {aten.eq.Scalar}
_register(BOOL_RESULTS, Rule(POINTWISE, _index_compare_emit, _index_compare_check))


def _no_wider_operand_values(node):
    out = dtype_of(node)
    for a in node.args[1:3]:
        if isinstance(a, fx.Node) and a.meta["val"].element_size() > torch.empty((), dtype=out).element_size():
            return f"a {a.meta['val'].dtype} operand of a {out} op"
    return None


def _as_dtype(em: Emitter, v, out: torch.dtype, kind: int) -> Val:
    if not isinstance(v, Val):
        return em.constant(float(v), out)
    if v.dtype == out:
        return v
    return em.rounded(em.widen(v), out, v.kind)


def _where_emit(em, node, index):
    out = dtype_of(node)
    c = em.operand(node, node.args[0], index)
    a = em.operand(node, node.args[1], index)
    b = em.operand(node, node.args[2], index)
    kind = max(v.kind for v in (c, a, b) if isinstance(v, Val))
    va, vb = _as_dtype(em, a, out, kind), _as_dtype(em, b, out, kind)
    return em.let(f"tl.where({c.name}, {va.name}, {vb.name})", out, kind)


_register([aten.where.self], Rule(POINTWISE, _where_emit, _where_check))


# --- transcendental functions of half-precision values: tables of eager's results ----------------------


def _table_check(node):
    x = node.args[0]
    if not isinstance(x, fx.Node):
        return "not a tensor"
    src, out = x.meta["val"].dtype, dtype_of(node)
    if src != out or out not in (torch.bfloat16, torch.float16):
        return f"{_name(node)} of {src} (tables cover bf16/fp16 in and out)"
    return None


def _table_emit(em, node, index):
    from exactdit.engine.tables import lookup_code

    x = em.value(node.args[0], index)
    # a one-element operand loads as a 0-d value, which the lookup's gather cannot index: broadcast
    x = em.broadcast(x, FULL) if em.effective(x.kind) == SCALAR else x
    return em.let(lookup_code(em, node, x), x.dtype, x.kind)


_register(
    [aten.gelu.default, aten.silu.default, aten.tanh.default, aten.sigmoid.default, aten.exp.default,
     aten.erf.default, aten.sin.default, aten.cos.default, aten.log.default],
    Rule(UNARY_TABLE, _table_emit, _table_check),
)


def cuda_only(node: fx.Node) -> bool:
    """Whether ``node``'s rule reproduces only the CUDA kernel (see ``Rule.cuda_only``)."""
    rule = rule_for(node)
    return rule is not None and rule.cuda_only(node)


def table_function(node: fx.Node) -> Callable[[torch.Tensor], torch.Tensor]:
    """The eager op of a table rule node, as a function of its tensor argument."""
    args, kwargs = node.args[1:], dict(node.kwargs)
    return lambda x: node.target(x, *args, **kwargs)
