"""Bit-exact arithmetic for Triton kernels: the one toolkit every exactdit kernel uses.

Eager PyTorch runs each op as its own kernel: operands are upcast to fp32 ("opmath"), one
operation is done, and the result is rounded to the tensor's dtype with round-to-nearest-even.
A fused kernel reproduces eager bit for bit only if it

* rounds exactly where eager rounds (``round_to`` / ``rounded``),
* never contracts ``a * b + c`` into one FMA where eager ran two kernels (``mul_rn``/``add_rn``
  and launching with ``LAUNCH_OPTIONS``),
* divides with ``div.rn`` where ATen divides, and uses ``rsqrt.approx.f32`` where ATen calls
  ``rsqrt`` (``div_rn`` / ``rsqrt_approx``),
* reads scalar arguments as fp32 (``as_fp32``), never letting them promote a chain to fp64.

An eager multiply, add or subtract of two bf16 (or fp16) tensors computes in fp32 and rounds
once to the dtype. ``dtype_mul`` / ``dtype_add`` / ``dtype_sub`` do the same op directly in the
dtype on packed pairs (one ``fma.rn.bf16x2`` per two elements, no widening or conversion
instructions) and give the same bits: the fp32 product of two bf16/fp16 values is exact (8 + 8
or 11 + 11 significant bits), and an fp32 sum is exact unless the exponents are more than 16
(bf16) or 13 (fp16) apart, when the smaller operand is too small to move the dtype rounding. So
"fp32 op, then round" is the single rounding of the exact result that the dtype op performs.

Every helper also runs under ``TRITON_INTERPRET=1`` (CPU tests) and gives the same bits there,
with one documented exception: ``rsqrt_approx`` is a hardware approximation; the interpreter
uses the correctly rounded ``1 / sqrt(x)``, so CPU tests compare against an order model that
does the same.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

#: True when Triton runs kernels in its CPU interpreter (decided at import, as Triton does).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Keyword arguments for every kernel launch. Triton contracts ``a * b + c`` into an FMA by
#: default and, with contraction on, was also seen dropping explicit round trips; eager
#: PyTorch rounds after every op, so contraction is off everywhere. Triton also makes libdevice
#: functions (erf, exp, ...) flush denormals by default, which ATen (built without fast-math)
#: does not: on an H200 Triton's default erf differed from torch.erf in 6.5% of 2.1M inputs.
LAUNCH_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


@triton.jit
def _round_to_bf16_bits(x):
    """fp32 -> bf16, round-to-nearest-even, by integer arithmetic on the bits.

    Overflow rounds to +-Inf, Inf stays Inf, subnormal fp32 inputs round like any other value
    (bf16 shares fp32's exponent range), and NaN becomes the canonical 0x7FFF that CUDA's
    ``cvt.rn.bf16.f32`` produces.
    """
    bits = x.to(tl.uint32, bitcast=True)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) >> 16
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = tl.where(is_nan, 0x7FFF, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


if INTERPRET:
    # The interpreter's own fp32 -> bf16 conversion truncates; integer rounding gives the
    # GPU's bits.
    round_to_bf16 = _round_to_bf16_bits
else:

    @triton.jit
    def round_to_bf16(x):
        """fp32 -> bf16 with the hardware's ``cvt.rn.bf16.f32`` (round-to-nearest-even, NaN ->
        0x7FFF), as ATen converts. One instruction per pair of values: the integer version
        made the three-rounding native modulation chain compute-bound on an H200."""
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """Round an fp32 value to DTYPE (bf16, fp16 or fp32) as ``tensor.to(DTYPE)`` does.

    fp16 uses the hardware conversion ``cvt.rn.f16.f32`` (round-to-nearest-even, subnormals
    kept); the interpreter's fp16 conversion is also round-to-nearest-even.
    """
    if DTYPE == tl.bfloat16:
        return round_to_bf16(x)
    elif DTYPE == tl.float16:
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def widen_bf16(x):
    """bf16 -> fp32 (exact) by moving the bits. The interpreter's own conversion gets subnormal
    bf16 values wrong (triton 3.9); on the GPU this is the same shift the conversion compiles to."""
    return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


if INTERPRET:
    # numpy's fp32 arithmetic is correctly rounded and never contracted.

    @triton.jit
    def mul_rn(a, b):
        """fp32 ``a * b`` rounded once; never fused with a neighbouring add."""
        return a * b

    @triton.jit
    def add_rn(a, b):
        """fp32 ``a + b`` rounded once; never fused with a neighbouring multiply."""
        return a + b

    @triton.jit
    def sub_rn(a, b):
        """fp32 ``a - b`` rounded once; never fused with a neighbouring multiply."""
        return a - b

    @triton.jit
    def rsqrt_approx(x):
        """Interpreter stand-in for ``rsqrt.approx.f32``: ``1 / sqrt(x)``, each op rounded to fp32."""
        return tl.div_rn(1.0, tl.sqrt_rn(x))

    @triton.jit
    def neg_f32(x):
        """fp32 ``-x``: the sign flipped (numpy's negative)."""
        return -x

else:
    # PTX ``.rn`` arithmetic is never contracted into FMA by ptxas, whatever the launch options.

    @triton.jit
    def mul_rn(a, b):
        """fp32 ``a * b`` rounded once; never fused with a neighbouring add."""
        return tl.inline_asm_elementwise(
            "mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def add_rn(a, b):
        """fp32 ``a + b`` rounded once; never fused with a neighbouring multiply."""
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def sub_rn(a, b):
        """fp32 ``a - b`` rounded once; never fused with a neighbouring multiply."""
        return tl.inline_asm_elementwise(
            "sub.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def rsqrt_approx(x):
        """``torch.rsqrt`` on CUDA: the PTX approximation ``rsqrt.approx.f32`` (not libdevice,
        not ``1 / sqrt``; those differ from ATen in a large fraction of values)."""
        return tl.inline_asm_elementwise(
            "rsqrt.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def neg_f32(x):
        """fp32 ``-x`` as ATen's ``-a`` compiles (PTX ``neg.f32``): ``-(+0)`` is -0. Triton 3.6
        lowers unary minus to ``0 - x``, which gives +0 there (3.9 emits ``fneg``)."""
        return tl.inline_asm_elementwise("neg.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def widen(a):
    """A bf16/fp16/fp32 value as fp32, exactly (bits for bf16: the interpreter's conversion is
    wrong for subnormal bf16)."""
    if a.dtype == tl.bfloat16:
        return widen_bf16(a)
    else:
        return a.to(tl.float32)


def _packed_fma(kind: str, constant: str, operands: str) -> tl.constexpr:
    """PTX for ``fma.rn`` on packed pairs of ``kind`` (bf16 or f16; sm_80+), with ``c`` holding
    ``constant`` in both halves."""
    return tl.constexpr(f"{{ .reg .b32 c; mov.b32 c, {constant}; fma.rn.{kind}x2 $0, {operands}; }}")


# a * b + (-0) is a * b, zeros' signs included; a * 1 + b is a + b; b * -1 + a is a - b.
_MUL_BF16 = _packed_fma("bf16", "0x80008000", "$1, $2, c")
_ADD_BF16 = _packed_fma("bf16", "0x3F803F80", "$1, c, $2")
_SUB_BF16 = _packed_fma("bf16", "0xBF80BF80", "$2, c, $1")
_MUL_F16 = _packed_fma("f16", "0x80008000", "$1, $2, c")
_ADD_F16 = _packed_fma("f16", "0x3C003C00", "$1, c, $2")
_SUB_F16 = _packed_fma("f16", "0xBC00BC00", "$2, c, $1")


@triton.jit
def _packed(a, b, ASM_BF16: tl.constexpr, ASM_F16: tl.constexpr):
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(ASM_BF16, "=r,r,r", [a, b], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(ASM_F16, "=r,r,r", [a, b], dtype=tl.float16, is_pure=True, pack=2)


#: ``_dtype_op`` codes
_MUL, _ADD, _SUB = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _fp32_op(x, y, OP: tl.constexpr):
    if OP == 0:
        return mul_rn(x, y)
    elif OP == 1:
        return add_rn(x, y)
    else:
        return sub_rn(x, y)


if INTERPRET:

    @triton.jit
    def _dtype_op(a, b, OP: tl.constexpr, ASM_BF16: tl.constexpr, ASM_F16: tl.constexpr):
        """The eager op as its definition: fp32 op, one rounding to the dtype."""
        return round_to(_fp32_op(widen(a), widen(b), OP), a.dtype)

else:

    @triton.jit
    def _dtype_op(a, b, OP: tl.constexpr, ASM_BF16: tl.constexpr, ASM_F16: tl.constexpr):
        """The eager op on packed pairs (half dtypes) or as one ``.rn`` fp32 op."""
        if a.dtype == tl.float32:
            return _fp32_op(a, b, OP)
        else:
            return _packed(a, b, ASM_BF16, ASM_F16)


@triton.jit
def dtype_mul(a, b):
    """``a * b`` for two tensors of one dtype (bf16, fp16, fp32) as the eager op: the fp32
    product rounded once to the dtype (on the GPU: packed pairs, see the module docstring)."""
    return _dtype_op(a, b, _MUL, _MUL_BF16, _MUL_F16)


@triton.jit
def dtype_add(a, b):
    """``a + b`` for two tensors of one dtype as the eager op (see ``dtype_mul``)."""
    return _dtype_op(a, b, _ADD, _ADD_BF16, _ADD_F16)


@triton.jit
def dtype_sub(a, b):
    """``a - b`` (also ``a + (-b)``: IEEE defines them as one operation) for two tensors of one
    dtype as the eager op (see ``dtype_mul``)."""
    return _dtype_op(a, b, _SUB, _SUB_BF16, _SUB_F16)


@triton.jit
def div_rn(a, b):
    """fp32 ``a / b`` correctly rounded (PTX ``div.rn.f32``), as ATen's tensor division."""
    return tl.div_rn(a, b)
