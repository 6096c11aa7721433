"""Small integer CPU tensors read as constants by a block's capture (:class:`IntValues`)."""

from __future__ import annotations

import torch


#: integer tensors of at most this many elements, on the CPU, may be read as constants (IntValues)
INT_VALUES_MAX = 64


class IntValues:
    """A small integer CPU tensor's values, standing in for it in a block's captured call where the
    block computes shapes from them: WanAnimate2's ``rope_apply`` reads its ``grid_sizes`` tensor with
    ``.tolist()`` and slices by the products, which Dynamo cannot capture from a tensor (the values
    become unbacked symbols and ``freqs[0][:f]`` needs a guard on them: "Could not guard on
    data-dependent expression"). Handed these instead, Dynamo reads the values as constants and
    guards on each (other values capture again), and the graph is what eager runs for them. Only
    reads are modelled (``tolist``, ``item``, indexing, iteration, ``len``, ``shape``, ``dim``,
    ``numel``, ``dtype``); any other use fails the capture, and the block runs as it would without
    (in parts). Used only for classes whose capture with the tensors failed on data-dependent shapes."""

    def __init__(self, values, shape: tuple, dtype: torch.dtype):
        self.values, self.shape, self.dtype = values, torch.Size(shape), dtype

    def tolist(self):
        return _copied(self.values)

    def item(self):
        if self.shape.numel() != 1:
            raise RuntimeError(f"a Tensor with {self.shape.numel()} elements cannot be converted to Scalar")
        value = self.values
        while isinstance(value, list):
            value = value[0]
        return value

    def __getitem__(self, i):
        if not self.shape:
            raise IndexError("invalid index of a 0-dim tensor")
        if not isinstance(i, int):
            raise TypeError("IntValues: only integer indexing is modelled")
        return IntValues(self.values[i], tuple(self.shape[1:]), self.dtype)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()


def _copied(values):
    return [_copied(v) for v in values] if isinstance(values, list) else values


def values_for_ints(value):
    """``value`` (a tensor, or tuples / lists / dicts of them) with each integer CPU tensor of at most
    :data:`INT_VALUES_MAX` elements replaced by its :class:`IntValues`; ``value`` itself where there is none."""
    if isinstance(value, torch.Tensor):
        if (value.device.type == "cpu" and not value.is_floating_point() and not value.is_complex()
                and value.dtype != torch.bool and value.numel() <= INT_VALUES_MAX and not value.requires_grad):
            return IntValues(value.tolist(), tuple(value.shape), value.dtype)
        return value
    if isinstance(value, (tuple, list)):
        items = [values_for_ints(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)  # (a namedtuple)
    if isinstance(value, dict):
        items = {k: values_for_ints(v) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    return value
