"""The model registry, seeded random-weight building and the shared forward-input entry point.

A :class:`ModelSpec` holds everything model-specific as data plus two small functions (tiny pipeline
components, one forward's inputs); the functions here are generic over specs. Nothing downloads
anything: transformers are diffusers' own classes built from embedded configs with seeded weights.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

CONFIG_NAMES = ("tiny", "small", "full", "diffusers_test")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next((k for k, v in DTYPES.items() if v == dtype), str(dtype).replace("torch.", ""))


def frozen(mapping: Mapping) -> Mapping:
    """A read-only view (nested mappings too), so specs stay immutable."""
    return MappingProxyType({k: frozen(v) if isinstance(v, Mapping) else v for k, v in mapping.items()})


def thaw(mapping: Mapping) -> dict:
    """A mutable deep copy (lists inside a spec's configs must not be shared with callers)."""
    return {k: thaw(v) if isinstance(v, Mapping) else copy.deepcopy(v) for k, v in mapping.items()}


# -------------------------------------------------------------------------------------------- Specs


@dataclass(frozen=True, eq=False)
class Production:
    """How the released model is run (its model card / pipeline defaults). ``prompt_len`` /
    ``negative_prompt_len``: a typical prompt's text tokens (a benchmark choice); ``max_text_len``: the
    pipeline's ``max_sequence_length``. ``cfg_rows``: CFG runs as one call on "uncond,cond" (ERNIE) or
    "cond,uncond" rows (Z-Image); None: guidance is off, distilled or two separate calls."""

    height: int
    width: int
    steps: int
    guidance_scale: float | None
    max_text_len: int
    prompt_len: int = 128
    negative_prompt_len: int = 1
    num_frames: int | None = None
    cfg_rows: str | None = None
    call_kwargs: Mapping[str, Any] = field(default_factory=lambda: frozen({}))

    @property
    def forward_batch(self) -> int:
        """Rows of one transformer call at these settings (one image)."""
        cfg_on = self.guidance_scale is not None and self.guidance_scale > 1.0
        return 2 if self.cfg_rows and cfg_on else 1


@dataclass(frozen=True, eq=False)
class ForwardRequest:
    """What a spec's ``forward_inputs`` function gets: a validated geometry, per-row prompt lengths."""

    spec: "ModelSpec"
    transformer: Any
    height: int
    width: int
    num_frames: int | None
    batch: int
    text_lens: tuple[int, ...]
    max_text_len: int
    sigma: float
    seed: int
    device: torch.device
    dtype: torch.dtype

    def generator(self) -> torch.Generator:
        return torch.Generator("cpu").manual_seed(int(self.seed))

    def randn(self, gen: torch.Generator, *shape: int) -> torch.Tensor:
        """Seeded N(0, 1) drawn in float32 on CPU (device-independent), then cast and moved."""
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(device=self.device, dtype=self.dtype)

    def timestep(self) -> torch.Tensor:
        """Flux's and Qwen-Image's: ``t.expand(B).to(latents.dtype)``, then / 1000 in that dtype."""
        t = torch.full((self.batch,), 1000.0 * self.sigma, dtype=torch.float32, device=self.device)
        return t.to(self.dtype) / 1000

    def guidance(self, scale: float) -> torch.Tensor:
        """A distilled-guidance input: ``scale`` per row in float32."""
        return torch.full([1], scale, device=self.device, dtype=torch.float32).expand(self.batch)


@dataclass(frozen=True, eq=False)
class ComponentRequest:
    """What a spec's ``build_components`` gets: the transformer config the components must fit."""

    spec: "ModelSpec"
    config: Mapping[str, Any]
    seed: int
    dtype: torch.dtype
    device: torch.device

    def part(self, seed_offset: int) -> dict:
        """``seed`` / ``dtype`` / ``device`` of one component (offset seeds: parts share no random stream)."""
        return dict(seed=self.seed + seed_offset, dtype=self.dtype, device=self.device)


@dataclass(frozen=True, eq=False)  # eq=False: hash by identity (the fields hold mappings)
class ModelSpec:
    name: str
    description: str
    transformer_class: str  # attribute of the diffusers package (resolved lazily: importing diffusers is slow)
    pipeline_class: str
    configs: Mapping[str, Mapping[str, Any]]
    production: Production
    build_components: Callable[[ComponentRequest], dict]
    forward_inputs: Callable[[ForwardRequest], dict]
    #: pixels per transformer token along height and width (VAE scale factor x patch size)
    pixel_multiple: int = 16
    video: bool = False
    #: numbers in the configs / production settings not confirmed from a released config file
    unconfirmed: tuple[str, ...] = ()

    @property
    def transformer_cls(self):
        return getattr(importlib.import_module("diffusers"), self.transformer_class)

    @property
    def pipeline_cls(self):
        return getattr(importlib.import_module("diffusers"), self.pipeline_class)

    def config(self, name: str) -> dict[str, Any]:
        try:
            return thaw(self.configs[name])
        except KeyError:
            raise ValueError(
                f"unknown config {name!r} for model {self.name!r}; choose one of {', '.join(self.configs)}"
            ) from None

    def resolve_config(self, config: str | Mapping[str, Any]) -> dict[str, Any]:
        return self.config(config) if isinstance(config, str) else thaw(config)


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"model {spec.name!r} is already registered")
    missing = [c for c in CONFIG_NAMES if c not in spec.configs]
    if missing:
        raise ValueError(f"model {spec.name!r} lacks configs {missing}")
    _REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str | ModelSpec) -> ModelSpec:
    if isinstance(name, ModelSpec):
        return name
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def model_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# ------------------- Seeded random weights, with the dtypes from_pretrained(torch_dtype=...) leaves


@contextlib.contextmanager
def constructing(dtype: torch.dtype) -> Iterator[None]:
    """Construct as from_pretrained does: under ``dtype`` as the default (buffers made in __init__ from
    default-dtype tensors come out in it), parameters on the meta device (no memory, no init cost) while
    buffers and plain tensor attributes are computed for real, accelerate's init_empty_weights split.
    (A ``torch.device("meta")`` context would also put the RoPE tables that some models compute in
    ``__init__`` on meta, losing their values.)"""
    old, register = torch.get_default_dtype(), torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    if dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
        torch.set_default_dtype(old)


def loaded_dtype(model: torch.nn.Module, dtype: torch.dtype) -> Callable[[str, torch.Tensor], torch.dtype]:
    """The dtype ``from_pretrained(torch_dtype=dtype)`` leaves a named parameter (or persistent buffer)
    in: its own if not floating, float32 where the loader keeps it so, else ``dtype``.

    diffusers: any name with a component in ``_keep_in_fp32_modules``, whatever the dtype (the check
    in ``load_model_dict_into_meta``). transformers: ``_keep_in_fp32_modules`` for float16 only,
    ``_keep_in_fp32_modules_strict`` for float16 and bfloat16 (matched here by name component too).
    """
    keep: set[str] = set()
    if dtype != torch.float32:
        from transformers import PreTrainedModel

        if not isinstance(model, PreTrainedModel) or dtype == torch.float16:
            keep |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
        if isinstance(model, PreTrainedModel) and dtype in (torch.float16, torch.bfloat16):
            keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return lambda name, t: (t.dtype if not t.is_floating_point()
                            else torch.float32 if keep & set(name.split(".")) else dtype)


@torch.no_grad()
def materialize(model: torch.nn.Module, *, seed: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give a model built under :func:`constructing` real, seeded parameters on ``device``.

    Floating parameters and persistent floating buffers get ``dtype`` except those the loader keeps
    in float32; non-persistent buffers keep the dtype they were computed in; tied parameters stay tied.
    Matrices / conv kernels are drawn N(0, 1/fan_in) (activations stay O(1)), 1-d weights (norm scales)
    1 + N(0, 0.02), biases N(0, 0.02): also the layers diffusers zero-initialises, so gates and outputs
    are not identically zero. Drawn in float32 one parameter at a time in name order, then rounded:
    the result depends only on (config, seed, device type, dtypes)."""
    device = torch.device(device)
    loaded = loaded_dtype(model, dtype)
    made: dict[int, torch.nn.Parameter] = {}
    for mod_name, module in model.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                dt = loaded(f"{mod_name}.{pname}" if mod_name else pname, p)
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dt, device=device), requires_grad=False)
            module._parameters[pname] = made[id(p)]
        for bname, b in list(module._buffers.items()):
            if b is None:
                continue
            if bname not in module._non_persistent_buffers_set:
                b = b.to(loaded(f"{mod_name}.{bname}" if mod_name else bname, b))
            module._buffers[bname] = b.to(device)
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        tmp = torch.empty(p.shape, dtype=torch.float32, device=device)
        if p.dim() >= 2:
            tmp.normal_(0.0, 1.0 / math.sqrt(math.prod(p.shape[1:])), generator=gen)
        else:  # 1-d weights are norm scales
            tmp.normal_(1.0 if name.endswith(".weight") else 0.0, 0.02, generator=gen)
        p.copy_(tmp)
        del tmp  # peak memory: the model plus one float32 parameter
    model.eval()
    model.requires_grad_(False)


def build_random(factory: Callable[[], torch.nn.Module], *, seed: int, dtype: torch.dtype,
                 device: torch.device | str) -> torch.nn.Module:
    """``factory()`` (a model constructor) with seeded random weights and from_pretrained dtypes."""
    with constructing(dtype):
        model = factory()
    materialize(model, seed=seed, dtype=dtype, device=device)
    return model


def _transformer_factory(name: str | ModelSpec, config: str | Mapping[str, Any]) -> Callable[[], torch.nn.Module]:
    spec = get_spec(name)
    cfg, cls = spec.resolve_config(config), spec.transformer_cls
    return lambda: cls(**cfg)


def on_meta(name: str | ModelSpec, config: str | Mapping[str, Any], dtype: torch.dtype = torch.float32):
    """The transformer of ``name`` / ``config`` with its parameters on the meta device (nothing allocated)."""
    with constructing(dtype):
        return _transformer_factory(name, config)()


def build_transformer(name: str | ModelSpec, config: str | Mapping[str, Any] = "tiny", *, seed: int = 0,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """diffusers' transformer class of model ``name`` from an embedded (or given) config, with seeded
    random weights and the parameter dtypes ``from_pretrained(torch_dtype=dtype)`` would leave."""
    return build_random(_transformer_factory(name, config), seed=seed, dtype=dtype, device=device)


def estimate_bytes(name: str | ModelSpec, config: str | Mapping[str, Any], dtype: torch.dtype) -> int:
    """Parameter memory of a transformer config in ``dtype`` (fp32-kept modules at 4 bytes)."""
    model = on_meta(name, config, dtype)
    loaded = loaded_dtype(model, dtype)
    return sum(p.numel() * torch.empty((), dtype=loaded(n, p)).element_size() for n, p in model.named_parameters())


# -------------------------------------------------------------- Pipelines and single-forward inputs


def build_pipeline(name: str | ModelSpec, config: str | Mapping[str, Any] = "tiny", *, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """diffusers' own pipeline class of model ``name`` around a seeded random transformer and tiny offline
    components (text encoders emitting the widths ``config`` expects, a VAE with the production scale
    factor, a scheduler), ready for ``pipe(..., output_type="latent")``; its progress bar is off."""
    spec = get_spec(name)
    transformer = build_transformer(spec, config, seed=seed, dtype=dtype, device=device)
    req = ComponentRequest(spec, frozen(spec.resolve_config(config)), int(seed), dtype, torch.device(device))
    pipe = spec.pipeline_cls(transformer=transformer, **spec.build_components(req))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _check_geometry(spec: ModelSpec, height: int, width: int, num_frames: int | None) -> None:
    m = spec.pixel_multiple
    if height <= 0 or width <= 0 or height % m or width % m:
        raise ValueError(f"{spec.name}: image size {height}x{width} must be positive multiples of {m}")
    if spec.video:
        if num_frames is None or num_frames < 1 or (num_frames - 1) % 4:
            raise ValueError(f"{spec.name}: num_frames must be 4k+1, got {num_frames}")
    elif num_frames is not None:
        raise ValueError(f"{spec.name} is an image model; num_frames must be None")


def forward_inputs(name: str | ModelSpec, transformer, *, height: int | None = None, width: int | None = None,
                   num_frames: int | None = None, batch: int | None = None,
                   text_len: int | Sequence[int] | None = None, max_text_len: int | None = None,
                   sigma: float = 0.7, seed: int = 0, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None) -> dict[str, Any]:
    """Keyword arguments of ONE ``transformer`` forward as the model's pipeline passes them for an
    image (video) of ``height`` x ``width`` (x ``num_frames``) pixels; unset geometry is production's.

    ``batch``: rows (default: production's, 2 where the pipeline batches CFG). ``text_len``: real prompt
    tokens, one int or one per row (default: the typical prompt, the negative prompt's length on uncond
    rows). ``max_text_len``: the pipeline's ``max_sequence_length``. ``sigma``: the step's noise level.
    Random tensors come from a CPU generator seeded with ``seed``, in float32, cast to ``dtype``
    (default ``transformer.dtype``). Call ``transformer(**kw, return_dict=False)``."""
    spec = get_spec(name)
    prod = spec.production
    height = prod.height if height is None else int(height)
    width = prod.width if width is None else int(width)
    if spec.video and num_frames is None:
        num_frames = prod.num_frames
    _check_geometry(spec, height, width, num_frames)
    batch = prod.forward_batch if batch is None else int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if text_len is None:
        lens = (prod.prompt_len,) * batch
        if prod.forward_batch == 2 and batch % 2 == 0:
            cond, uncond = (prod.prompt_len,) * (batch // 2), (prod.negative_prompt_len,) * (batch // 2)
            lens = uncond + cond if prod.cfg_rows == "uncond,cond" else cond + uncond
    elif isinstance(text_len, int):
        lens = (int(text_len),) * batch
    else:
        lens = tuple(int(n) for n in text_len)
        if len(lens) != batch:
            raise ValueError(f"text_len has {len(lens)} entries for a batch of {batch}")
    if min(lens) < 1:
        raise ValueError(f"text lengths must be positive, got {lens}")
    max_len = prod.max_text_len if max_text_len is None else int(max_text_len)
    device = transformer.device if device is None else torch.device(device)
    dtype = transformer.dtype if dtype is None else dtype
    req = ForwardRequest(spec, transformer, height, width, num_frames, batch, lens, max_len, float(sigma),
                         int(seed), torch.device(device), dtype)
    return spec.forward_inputs(req)


@torch.no_grad()
def run_forward(transformer, inputs: Mapping[str, Any]):
    """One transformer forward on :func:`forward_inputs`; returns the prediction (a tensor, or the list
    of per-image tensors Z-Image returns; Kandinsky 5 returns a bare tensor, not a tuple)."""
    out = transformer(**inputs, return_dict=False)
    return out if isinstance(out, torch.Tensor) else out[0]


def pipeline_call_kwargs(name: str | ModelSpec, *, prompt: str = "a photo of a cat", height: int | None = None,
                         width: int | None = None, num_frames: int | None = None, steps: int | None = None,
                         seed: int = 0, output_type: str = "latent") -> dict[str, Any]:
    """``pipe(**kw)`` arguments for a production-style call (guidance, negative prompt, sequence
    length as the model card runs it); geometry and steps default to production."""
    spec = get_spec(name)
    prod = spec.production
    kw: dict[str, Any] = dict(prompt=prompt, height=prod.height if height is None else height,
                              width=prod.width if width is None else width,
                              num_inference_steps=prod.steps if steps is None else steps,
                              generator=torch.Generator("cpu").manual_seed(int(seed)), output_type=output_type)
    if prod.guidance_scale is not None:
        kw["guidance_scale"] = prod.guidance_scale
    if spec.video:
        kw["num_frames"] = prod.num_frames if num_frames is None else num_frames
    kw.update(thaw(prod.call_kwargs))
    return kw
