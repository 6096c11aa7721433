"""Launching a compiled Triton kernel without Triton's per-call binding.

``fn[grid](*args, **kwargs)`` costs 20.7 us of host time per launch on the H200's host, against
8.4 us for a plan that allocates the output and calls the compiled launcher (bench_host_overhead.py):
it binds the arguments, builds the specialisation key (dtypes, integer values, pointer alignment),
looks the compiled kernel up and builds launch metadata. When everything that key looks at is fixed -
which is what a verified gate signature fixes - that work can be done once. :func:`compile_for`
compiles (or finds) the kernel for one set of arguments without launching it and returns a
:class:`CompiledLaunch`: the compiled kernel's launcher with every argument but the stream and the
kernel's own parameters bound (for Triton 3.6's CUDA launcher, its C launch function itself).

The kernel's parameters are passed as ``JITFunction.run`` passes them: all bound arguments,
constexprs included. :func:`supported` reads that convention from the installed Triton (3.6 to 3.9
use it) and answers False for anything else, whose callers keep launching through ``fn[grid]``;
so do callers while a Triton launch hook (a profiler's) is installed. The gate verifies each
signature through the launch route that serves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from typing import Callable

import torch

from exactdit.device import compile_workers
from exactdit.device.numerics import INTERPRET

#: The launch statement of ``JITFunction.run`` whose argument order :func:`compile_for`'s launcher expects.
_CONVENTION = (
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,",
    "*bound_args.values())",
)


#: The current CUDA device's index and a device's current stream, as Triton's launches read them.
current_device = getattr(torch._C, "_cuda_getDevice", None)
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def supported(device: torch.device) -> bool:
    """Whether kernels for ``device`` can be launched through :func:`compile_for`'s launchers."""
    return device.type == "cuda" and _triton_convention()


@functools.lru_cache(maxsize=None)
def _triton_convention() -> bool:
    """Whether the installed Triton launches compiled kernels with the convention this module
    relies on (never under the interpreter, which compiles nothing)."""
    if INTERPRET:
        return False
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return passes_all_bound_arguments(JITFunction.run)


def passes_all_bound_arguments(run) -> bool:
    """Whether ``run`` (a ``JITFunction.run``) launches with :data:`_CONVENTION`'s statement."""
    try:
        source = " ".join(inspect.getsource(run).split())
    except (OSError, TypeError):  # no source to read: launch through fn[grid]
        return False
    return all(" ".join(part.split()) in source for part in _CONVENTION)


def hooks_installed() -> bool:
    """Whether a Triton launch hook (e.g. a profiler's) is set: :class:`CompiledLaunch` would skip it."""
    runtime = _knobs().runtime
    return _active(runtime.launch_enter_hook) or _active(runtime.launch_exit_hook)


def _active(hook) -> bool:
    # Triton 3.6+ keeps a HookChain there, empty unless something added a hook
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=None)
def _knobs():
    from triton import knobs

    return knobs


class StandIn:
    """What Triton's specialisation reads of a tensor argument, for compiling before the tensor
    exists: its dtype and its address modulo 16 (the caching allocator's blocks start aligned;
    a view may not)."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self.shape = t.dtype, [1]
        self._offset = (t.storage_offset() * t.element_size()) % 16

    def data_ptr(self) -> int:
        return self._offset


@dataclasses.dataclass(frozen=True)
class CompiledLaunch:
    """A compiled kernel ready to launch: ``call(*head, stream, *tail, *arguments)`` launches it on
    ``stream`` with ``arguments`` (every kernel parameter in declaration order). Triton's launch
    hooks are not called: callers launch through ``fn[grid]`` while :func:`hooks_installed`."""

    call: Callable
    head: tuple
    tail: tuple
    arguments: list


def compile_for(fn, grid: tuple[int, ...], args: tuple, kwargs: dict, device: torch.device) -> CompiledLaunch:
    """Compile ``fn`` for exactly these arguments on ``device`` without launching it. Raises
    what Triton raises for a kernel that cannot compile."""
    compile_workers.wait(fn)  # a worker compiling it into Triton's cache: found there, not compiled again
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel = fn.run(*args, grid=grid, warmup=True, **kwargs)
        if hasattr(kernel, "result"):  # an asynchronous compile
            kernel = kernel.result()
        if kernel is None:  # a cache hook took the compile over
            raise RuntimeError(f"Triton returned no compiled kernel for {fn.fn.__name__}")
        launcher = kernel.run  # loads the binary on this device
    head = tuple(grid) + (1,) * (3 - len(grid))
    arguments = bound_arguments(fn, args, kwargs)
    if _plain_cuda_launcher(launcher):  # its C launch directly: no scratch to allocate
        tail = (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                kernel.packed_metadata, None, None, None)
        return CompiledLaunch(launcher.launch, head, tail, arguments)
    return CompiledLaunch(launcher, head, (kernel.function, kernel.packed_metadata, None, None, None), arguments)


#: Triton 3.6's CudaLauncher hands its arguments to the C launch with two scratch buffers inserted.
_C_LAUNCH = "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, " \
            "global_scratch, profile_scratch, *args)"


def _plain_cuda_launcher(launcher) -> bool:
    """Whether ``launcher`` is a CudaLauncher that only forwards to its C launch (Triton 3.6's,
    for a kernel with no global or profile scratch)."""
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return False
    return _forwards_to_c_launch(type(launcher))


@functools.lru_cache(maxsize=None)
def _forwards_to_c_launch(cls) -> bool:
    """Whether ``cls.__call__`` only allocates scratch and calls ``self.launch`` as Triton 3.6's does."""
    try:
        source = " ".join(inspect.getsource(cls.__call__).split())
    except (OSError, TypeError):
        return False
    return _C_LAUNCH in source and source.count("self.launch(") == 1


def cached_kernels(fn, device: torch.device) -> int | None:
    """How many compiled specialisations of ``fn`` Triton keeps for ``device`` (its in-memory
    cache: :func:`compile_for` compiled when the number grew), or None where this Triton keeps
    them otherwise."""
    try:
        return len(fn.device_caches[device.index][0])
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def bound_arguments(fn, args: tuple, kwargs: dict) -> list:
    """The values ``JITFunction.run`` binds to each parameter, in declaration order:
    positionals, then keywords, then the parameters' defaults."""
    values = list(args)
    for p in list(inspect.signature(fn.fn).parameters.values())[len(args):]:
        if p.name in kwargs:
            values.append(kwargs[p.name])
        elif p.default is not inspect.Parameter.empty:
            values.append(p.default)
        else:
            raise TypeError(f"{fn.fn.__name__}: no value for parameter {p.name}")
    return values
