"""The mini-model registry (:data:`MINIS`, :func:`mini`, :func:`build`) and what its entries share
(:class:`Grid`, :class:`Production`, input helpers); what a mini model is: :mod:`tests.minis`."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from exactdit.harness.models.core import build_random, frozen, thaw

#: (model, batch, generator, dtype) -> forward kwargs (CPU tensors; ``return_dict`` is the caller's:
#: :func:`exactdit.harness.models.run_forward` runs one). Minis with a production config also take
#: ``grid=`` (a :class:`Grid`; None: the tiny default).
InputsFn = Callable[..., dict]


@dataclass(frozen=True)
class Grid:
    """One forward's size in the transformer's input units: latent frames, latent height and width
    (before the model's patching) and text tokens."""

    frames: int
    height: int
    width: int
    text: int


@dataclass(frozen=True, eq=False)
class Production:
    """A released model of a mini's class: its transformer config, a typical forward's grid and
    what that grid is in pixels (for benchmarks; weights stay seeded random)."""

    model: str
    config: Mapping[str, Any]
    grid: Grid
    pixels: str


@dataclass(frozen=True, eq=False)
class Mini:
    """A diffusers transformer class at a tiny config. ``video``: inputs have a frame axis.
    ``eager``: why the engine ends up leaving its blocks to diffusers' code (a known limit: captured
    in parts at first, see :mod:`exactdit.patches.engine`), else None."""

    name: str
    cls: str
    config: Mapping[str, Any]
    inputs: InputsFn
    video: bool = False
    eager: str | None = None
    production: Production | None = None

    @property
    def transformer_cls(self) -> type:
        import diffusers

        return getattr(diffusers, self.cls)


_MINIS: dict[str, Mini] = {}
MINIS: Mapping[str, Mini] = MappingProxyType(_MINIS)


def mini(name: str, cls: str, config: Mapping[str, Any], *, video: bool = False, eager: str | None = None,
         production: Production | None = None):
    """Register the decorated inputs function as mini model ``name``."""

    def register(fn: InputsFn) -> InputsFn:
        if name in _MINIS:
            raise ValueError(f"mini model {name!r} registered twice")
        if production is not None and "grid" not in inspect.signature(fn).parameters:
            raise ValueError(f"mini model {name!r} has a production config but its inputs take no grid")
        released = None if production is None else dataclasses.replace(production, config=frozen(production.config))
        _MINIS[name] = Mini(name, cls, frozen(config), fn, video, eager, released)
        return fn

    return register


def build(name: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
          device: torch.device | str = "cpu", production: bool = False,
          overrides: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """Mini model ``name`` with seeded random weights and ``from_pretrained(torch_dtype=dtype)``'s dtypes;
    ``production``: at its released model's config instead of the tiny one; ``overrides``: config
    entries replaced (``{"num_layers": 1}``: one block)."""
    spec = MINIS[name]
    cfg = dict(thaw(production_of(name).config if production else spec.config), **(overrides or {}))
    return build_random(lambda: spec.transformer_cls(**cfg), seed=seed, dtype=dtype, device=device)


def production_of(name: str) -> Production:
    spec = MINIS[name]
    if spec.production is None:
        with_one = ", ".join(k for k, v in MINIS.items() if v.production is not None)
        raise ValueError(f"mini model {name!r} has no production config; these do: {with_one}")
    return spec.production


def forward_inputs(name: str, model: torch.nn.Module, *, batch: int = 2, seed: int = 0,
                   device: torch.device | str = "cpu", grid: Grid | None = None) -> dict:
    """One forward's keyword arguments for mini model ``name``, on ``device``; ``grid``: its size
    (minis with a production config), else the tiny default."""
    g = torch.Generator().manual_seed(seed)
    spec = MINIS[name]
    if grid is not None:
        production_of(name)  # only those honour a grid
        return _to(spec.inputs(model, batch, g, compute_dtype(model), grid=grid), device)
    return _to(spec.inputs(model, batch, g, compute_dtype(model)), device)


def _to(value, device):
    """``value`` with every tensor in it (in dicts, lists and tuples too) moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of most of ``model``'s parameters (modules kept in float32 aside)."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    return max(sizes, key=sizes.get)


TEXT_LEN = 7  #: text tokens of every mini's prompt (odd on purpose)


def text_mask(batch: int, dtype: torch.dtype = torch.long, length: int = TEXT_LEN, pad: int = 2) -> torch.Tensor:
    """[batch, length] text attention mask as tokenizers give it (1 = token): the second row, when
    there is one, ends in ``pad`` padding tokens; the others have none."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[1, length - pad:] = 0
    return mask.to(dtype)


def randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def timesteps(g: torch.Generator, batch: int, scale: float = 1000.0) -> torch.Tensor:
    """Distinct float timesteps in [0, scale) per row (a float32 tensor, as pipelines pass)."""
    return torch.rand(batch, generator=g) * scale

