"""What every op module shares: where the fused path may run, signatures, outputs."""

from __future__ import annotations

import functools

import torch

from exactdit.gate import poison_outputs

#: dtypes the kernels accept; anything else runs eager.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_POISON = {torch.bfloat16: 0x7FA5, torch.float16: 0x7DA5, torch.float32: 0x7FA5A5A5}
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def require_tensors(op: str, **tensors) -> None:
    """Malformed call: a required argument is not a tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"exactdit.ops.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def require_broadcast(op: str, target: torch.Size, **operands) -> None:
    """Malformed call: an operand does not broadcast to the activation's shape."""
    for name, t in operands.items():
        if t is None:
            continue
        try:
            if torch.broadcast_shapes(t.shape, target) == target:
                continue
        except RuntimeError:
            pass
        raise ValueError(
            f"exactdit.ops.{op}: {name} of shape {tuple(t.shape)} does not broadcast to the "
            f"activation shape {tuple(target)}"
        )


def require_gated_residual(op: str, residual, update, gate) -> None:
    """Malformed call of an op that computes ``residual + gate * update``: non-tensors, an
    update of another shape, a gate that does not broadcast."""
    require_tensors(op, residual=residual, update=update, gate=gate)
    if update.shape != residual.shape:
        raise ValueError(
            f"exactdit.ops.{op}: update shape {tuple(update.shape)} differs from residual shape "
            f"{tuple(residual.shape)}"
        )
    require_broadcast(op, residual.shape, gate=gate)


def dtype_support(*tensors: torch.Tensor | None) -> str | None:
    """Why the kernels cannot take these dtypes (they need one shared kernel dtype), or None."""
    present = [t for t in tensors if t is not None]
    dtypes = {t.dtype for t in present}
    if len(dtypes) > 1:
        return "mixed dtypes"
    dtype = dtypes.pop()
    return None if dtype in KERNEL_DTYPES else f"unsupported dtype {dtype}"


def layout(t: torch.Tensor | None, shape: torch.Size) -> tuple | str:
    """The part of an operand's layout that selects a kernel variant: which dims are broadcast
    or strided, and whether the data is 16-byte aligned."""
    if t is None:
        return "none"
    e = t.expand(shape)
    dims = tuple("1" if n == 1 else ("b" if s == 0 else "s") for n, s in zip(e.shape, e.stride()))
    return dims + (t.data_ptr() % 16 == 0,)


def n_rows(x: torch.Tensor) -> int:
    """Rows of an activation: all dims but the last flattened."""
    return x.numel() // max(1, x.shape[-1]) if x.dim() else 1


def rows_class(n_rows: int) -> str:
    """Row-count class of an elementwise op: the bits never depend on it, the launch grid does."""
    return "one row" if n_rows == 1 else "rows"


def unit_stride_support(shape: torch.Size, **tensors: torch.Tensor | None) -> str | None:
    """The kernels address [outer, inner, D] views with unit stride along D, at most 3 dims."""
    if len(shape) > 3 or len(shape) == 0:
        return f"{len(shape)}-d activation (kernels take 1 to 3 dims)"
    if shape[-1] == 0 or shape.numel() == 0:
        return "empty tensor"
    for name, t in tensors.items():
        if t is not None and shape[-1] > 1 and t.expand(shape).stride(-1) != 1:
            return f"{name} not contiguous along the last dim"
    return None


@functools.lru_cache(maxsize=4096)
def _eager_layouts(reference, spec: tuple) -> tuple:
    args = [
        torch.empty_strided(a[1], a[2], dtype=a[3], device="meta") if isinstance(a, tuple) and a[:1] == ("tensor",) else a
        for a in spec
    ]
    out = reference(*args)
    outs = out if isinstance(out, tuple) else (out,)
    return tuple((o.shape, o.stride(), o.dtype) for o in outs)


def new_outputs(reference, *args, device: torch.device):
    """Outputs with exactly the shapes, strides and dtypes eager gives for these arguments
    (found by running ``reference`` on meta tensors once per layout), pre-filled with a NaN
    pattern when poisoning is on. Returns a tensor, or a tuple when the reference does."""
    spec = tuple(("tensor", a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    outs = []
    for shape, stride, dtype in _eager_layouts(reference, spec):
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if poison_outputs():
            out.view(_INT_VIEW[dtype]).fill_(_POISON[dtype])
        outs.append(out)
    return outs[0] if len(outs) == 1 else tuple(outs)
