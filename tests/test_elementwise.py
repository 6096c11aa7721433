"""residual_gate_add and modulate: kernels bit-identical to their eager references.

On CPU the kernels run in Triton's interpreter against CPU eager; on a GPU (device runs) the
same tests hold them to CUDA eager. Kernels are called directly (``FusedOp.fused``) so the gate
cannot hide a wrong kernel, with outputs poisoned beforehand; the public ops are then checked to
have taken the fused path.
"""

import itertools

import pytest
import torch

import exactdit
from exactdit import ops, references
from exactdit.ops.elementwise import MODULATE, RESIDUAL_GATE_ADD
from tests.conftest import DEVICE, ON_GPU
from tests.helpers import MODULATION_KINDS, activation, assert_bits_equal, modulation

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ACTIVATIONS = ["bsd", "sbd", "sbd_as_bsd", "rows", "row_slice"]
# (S, B, D): one row, odd widths, widths that are not multiples of the tile, a real width.
SHAPES = [(1, 1, 64), (3, 2, 37), (17, 2, 129), (5, 1, 1000), (33, 2, 1536)]
if ON_GPU:
    SHAPES += [(4224, 1, 4096), (4224, 2, 4096), (1, 2, 3072), (255, 2, 5120), (4097, 1, 61)]


def _cases():
    for (S, B, D), dtype, kind in itertools.product(SHAPES, DTYPES, ACTIVATIONS):
        yield pytest.param(S, B, D, dtype, kind, id=f"{S}x{B}x{D}-{str(dtype)[6:]}-{kind}")


@pytest.mark.parametrize("S,B,D,dtype,kind", list(_cases()))
def test_residual_gate_add_kernel_bit_exact(S, B, D, dtype, kind):
    g = torch.Generator().manual_seed(S * 7 + D)
    residual = activation(kind, S, B, D, dtype, DEVICE, g)
    update = activation(kind, S, B, D, dtype, DEVICE, g)
    for gk in MODULATION_KINDS:
        gate = modulation(gk, residual.shape, dtype, DEVICE, g)
        out = RESIDUAL_GATE_ADD.fused(residual, update, gate)
        assert_bits_equal(out, references.residual_gate_add(residual, update, gate), f"gate {gk}")


@pytest.mark.parametrize("S,B,D,dtype,kind", list(_cases()))
def test_modulate_kernel_bit_exact(S, B, D, dtype, kind):
    g = torch.Generator().manual_seed(S * 5 + D)
    x = activation(kind, S, B, D, dtype, DEVICE, g)
    for (sk, hk), upcast in itertools.product([("outer", "outer"), ("inner", "chunk"), ("full", "vec"), ("expanded", None)], [False, True]):
        scale = modulation(sk, x.shape, dtype, DEVICE, g)
        shift = None if hk is None else modulation(hk, x.shape, dtype, DEVICE, g)
        out = MODULATE.fused(x, scale, shift, upcast)
        ref = references.modulate(x, scale, shift, upcast=upcast)
        assert_bits_equal(out, ref, f"scale {sk} shift {hk} upcast {upcast}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp32_chain_differs_from_native_chain(dtype):
    """The two modulation formulations really are different functions for bf16 (so a kernel
    that mixed them up would be caught), and identical for fp32."""
    g = torch.Generator().manual_seed(3)
    x = activation("rows", 64, 1, 256, dtype, DEVICE, g)
    scale, shift = (modulation("vec", x.shape, dtype, DEVICE, g) for _ in range(2))
    up, native = MODULATE.fused(x, scale, shift, True), MODULATE.fused(x, scale, shift, False)
    assert torch.equal(up, native) == (dtype == torch.float32)


def test_public_ops_take_the_fused_path():
    g = torch.Generator().manual_seed(4)
    x = activation("sbd", 9, 2, 96, torch.bfloat16, DEVICE, g)
    vec = modulation("inner", x.shape, torch.bfloat16, DEVICE, g)
    assert_bits_equal(ops.modulate(x, vec, vec, upcast=True), references.modulate(x, vec, vec, upcast=True))
    assert_bits_equal(ops.modulate(x, vec), references.modulate(x, vec))
    assert_bits_equal(ops.residual_gate_add(x, x, vec), references.residual_gate_add(x, x, vec))
    rep = exactdit.report(show=False)
    assert rep["modulate"]["fused"] == 2 and rep["modulate"]["eager"] == 0
    assert rep["residual_gate_add"]["fused"] == 1 and rep["residual_gate_add"]["eager"] == 0
    assert not rep["modulate"]["disabled"] and len(rep["modulate"]["verified"]) == 2


def test_output_layout_follows_the_activation():
    g = torch.Generator().manual_seed(5)
    x = activation("sbd_as_bsd", 7, 2, 64, torch.float16, DEVICE, g)
    out = MODULATE.fused(x, modulation("outer", x.shape, torch.float16, DEVICE, g), None, False)
    assert out.stride() == x.stride()
