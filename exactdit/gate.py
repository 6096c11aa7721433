"""The verification gate: no fused kernel ever returns bits that eager would not.

Every fused op is a :class:`FusedOp`: an eager reference (the exact PyTorch expression it
replaces), a predicate for inputs the kernel supports, a signature of everything that can change
the bits, and the kernel launcher. :func:`dispatch` routes each call:

1. malformed call -> ``ValueError`` (the same on every path);
2. fast paths switched off, or inputs the kernel does not support -> eager, counted with why;
3. first call of a signature on this device -> run both (the reference first), compare bit for
   bit (and layout); on a mismatch (or when the kernel raises, e.g. cannot compile) disable that
   signature for the process, warn with the first differing element (or the error) and return
   the eager result; otherwise remember it as verified;
4. verified signature -> kernel only, no host sync. An op may hand the gate a launcher
   specialised to one argument layout (:attr:`FusedOp.specialize`): the signature is verified
   through it, and later calls of that layout go straight to it.

Verification needs a host sync, so while torch.compile traces or a CUDA graph is captured an
unverified signature takes the eager path instead (a verified one runs its kernel). So does one
whose kernels Triton's compile workers are still compiling (:attr:`FusedOp.compiling`): the call
does not wait for them, and the signature is verified at the first call after they are compiled;
CUDA-graph mode and ``EXACTDIT_WAIT_FOR_KERNELS=1`` wait instead (:func:`waiting_for_kernels`).

Environment switches (read at every call):
``EXACTDIT_DISABLE=1`` every op runs eager; ``EXACTDIT_VERIFY_ALL=1`` every fused call is checked
(tests); ``EXACTDIT_TRUST=1`` fused calls are never checked (benchmarks of the raw kernels);
``EXACTDIT_POISON=1`` fused outputs are pre-filled with a NaN pattern (tests);
``EXACTDIT_WAIT_FOR_KERNELS=1`` a first call waits for kernels still compiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import warnings
from collections import Counter
from typing import Any, Callable

import torch

from exactdit import first_calls
from exactdit.device.numerics import INTERPRET
from exactdit.state import STATE

logger = logging.getLogger("exactdit")

Reason = str


class ExactditMismatchWarning(RuntimeWarning):
    """A fused kernel disagreed with eager (or raised); its signature now runs eager."""


@dataclasses.dataclass(frozen=True)
class FusedOp:
    """One fused op. Every callable takes the op's arguments as the public function got them.

    name: key in :func:`exactdit.report`.
    reference: the eager PyTorch expression the kernel reproduces.
    fused: launches the Triton kernel and returns its output(s).
    unsupported: returns why the kernel cannot take these inputs, or None.
    signature: a hashable key of what can change the bits besides device and versions (dtypes,
        width, row-count class, layouts, flags).
    validate: raises ValueError for a malformed call (optional).
    """

    name: str
    reference: Callable[..., Any]
    fused: Callable[..., Any]
    unsupported: Callable[..., Reason | None]
    signature: Callable[..., tuple]
    validate: Callable[..., None] | None = None
    #: optional: ``specialize(*args)`` returns a launcher ``fast(*args, poisoned=False)`` that is
    #: valid for every call whose arguments have these arguments' layout (:func:`arg_key`), with
    #: the per-call work done once (launch plans), or None. The gate verifies a signature through
    #: it, and then serves calls of that layout by it with the least bookkeeping.
    specialize: Callable[..., Callable[..., Any] | None] | None = None
    #: The kernel reproduces an ATen *CUDA* kernel (a reduction order, CUDA's erf): CPU eager
    #: differs, so on CPU (Triton's interpreter) it cannot be verified and runs eager unless
    #: EXACTDIT_TRUST is set. CPU tests hold such kernels to order models instead.
    cuda_numerics: bool = False
    #: optional: ``compiling()`` is True while the kernel is still being compiled elsewhere (a
    #: compile worker): an unverified signature then runs eager rather than wait for it.
    compiling: Callable[[], bool] | None = None


#: why a call ran eager while its kernels compile
COMPILING = "its kernels are compiling (fused from the first call after they are)"


@dataclasses.dataclass
class _OpStats:
    fused: int = 0
    #: calls served by a specialised launcher: ``next()`` of an itertools.count is atomic, so the
    #: fast path counts without taking the lock (read through :func:`_served`)
    served: Any = dataclasses.field(default_factory=itertools.count)
    eager: int = 0
    eager_reasons: Counter = dataclasses.field(default_factory=Counter)
    verified: set = dataclasses.field(default_factory=set)
    disabled: dict = dataclasses.field(default_factory=dict)
    # arg_key -> _Plan: validation, predicate and signature depend only on shapes, strides, dtypes,
    # devices, alignment and flags, so they are worked out once per layout.
    plans: dict = dataclasses.field(default_factory=dict)


class _Plan:
    """What the gate knows about one argument layout: why it runs eager (or None), its signature,
    and once verified the op's specialised launcher for it (``specialized``: asked for once,
    so an op that has none for this layout is not asked again on every call)."""

    __slots__ = ("reason", "signature", "fast", "specialized")

    def __init__(self, reason: Reason | None, signature: tuple | None):
        self.reason, self.signature, self.fast, self.specialized = reason, signature, None, False


_MAX_PLANS = 4096


def arg_key(args: tuple) -> tuple:
    """Everything about the arguments that validation, predicates and signatures may look at:
    tensors by shape, strides, dtype, device and address modulo 16; other values as they are.
    (Computed on every call: a list comprehension, not a generator, for speed.)"""
    return tuple([
        (a.shape, a.stride(), a.dtype, a.device, a.data_ptr() & 15)
        if isinstance(a, torch.Tensor)
        else (arg_key(a) if isinstance(a, tuple) else a)
        for a in args
    ])


_lock = threading.Lock()
#: op name -> its state (kept in the process state: exactdit.state.reset() clears it)
_stats: dict[str, _OpStats] = STATE.signatures


#: os.environ's own store (POSIX: bytes keys), read directly: ``os.environ.get`` costs ~2 us of
#: encoding per read and a fused call reads several switches; it stays live under os.environ[...] =
_ENVIRON = os.environ._data if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None


def _flag(name: str) -> bool:
    if _ENVIRON is not None:
        raw = _ENVIRON.get(name.encode())
        value = "0" if raw is None else raw.decode(errors="replace")
    else:
        value = os.environ.get(name, "0")
    return value.lower() not in ("", "0", "false", "no", "off")


_SWITCHES = ("EXACTDIT_DISABLE", "EXACTDIT_VERIFY_ALL", "EXACTDIT_TRUST", "EXACTDIT_POISON")
_SWITCH_KEYS = tuple(name.encode() for name in _SWITCHES)


def _any_switch() -> bool:
    """Whether any gate switch is on (the common case, none set, costs four dict lookups)."""
    if _ENVIRON is not None:
        get = _ENVIRON.get
        if get(_SWITCH_KEYS[0]) is None and get(_SWITCH_KEYS[1]) is None and get(_SWITCH_KEYS[2]) is None \
                and get(_SWITCH_KEYS[3]) is None:
            return False
    return any(_flag(name) for name in _SWITCHES)


#: the NaN pattern poisoned outputs are pre-filled with, written through an integer view
POISON = {torch.bfloat16: 0x7FA5, torch.float16: 0x7DA5, torch.float32: 0x7FA5A5A5}
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def poison_outputs() -> bool:
    """Whether launchers must pre-fill outputs with a NaN pattern (tests, verification)."""
    return _flag("EXACTDIT_POISON") or getattr(_local, "verifying", False)


_local = threading.local()


def _op_stats(name: str) -> _OpStats:
    st = _stats.get(name)
    if st is None:
        with _lock:
            st = _stats.setdefault(name, _OpStats())
    return st


def forget(prefix: str) -> None:
    """Drop the state of every op whose name starts with ``prefix`` (a graph that is gone: its
    regions' counters, verified and disabled signatures, launch plans)."""
    with _lock:
        for name in [n for n in _stats if n.startswith(prefix)]:
            del _stats[name]


def waits_for_kernels() -> bool:
    """Whether an unverified signature whose kernels are still compiling waits for them (inside
    :func:`waiting_for_kernels`, or with ``EXACTDIT_WAIT_FOR_KERNELS=1``) instead of running eager."""
    return getattr(_local, "waiting", 0) > 0 or _flag("EXACTDIT_WAIT_FOR_KERNELS")


@contextlib.contextmanager
def waiting_for_kernels():
    """Calls inside wait for kernels still compiling (CUDA-graph mode: a signature's plain call
    must verify every region before it is recorded)."""
    _local.waiting = getattr(_local, "waiting", 0) + 1
    try:
        yield
    finally:
        _local.waiting -= 1


def cannot_sync() -> bool:
    """True while torch.compile traces or a CUDA graph is captured: no host sync allowed."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_key(device: torch.device) -> tuple:
    """What about the device and software can change a kernel's bits."""
    import triton

    if device.type == "cuda":
        where = ("cuda", torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device))
    else:
        where = (device.type, "triton-interpreter")
    return where + (torch.__version__, triton.__version__)


def backend_support(tensors: list[torch.Tensor]) -> Reason | None:
    """Why the fused path cannot run on these tensors' device, or None when it can: CUDA GPUs of
    compute capability 8.0 or newer, or CPU tensors when Triton runs in its interpreter."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        return "tensors on different devices"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 0):
            return "GPU older than compute capability 8.0"
        return None
    if device.type == "cpu" and INTERPRET:
        return None
    return f"{device.type} device (fused kernels need a CUDA GPU)"



def count_eager(name: str, reason: Reason) -> None:
    """Record that a site named ``name`` ran eager code for ``reason`` (for model patches whose
    whole forward steps aside, e.g. when autograd is recording)."""
    _count_eager(_op_stats(name), reason)


def count_fused(name: str) -> None:
    """Record that a site named ``name`` ran its fast path (e.g. a CUDA-graph replay)."""
    _count_fused(_op_stats(name))


def _count_eager(st: _OpStats, reason: Reason) -> None:
    with _lock:
        st.eager += 1
        st.eager_reasons[reason] += 1


def _served(st: _OpStats) -> int:
    return int(repr(st.served)[len("count("):-1])  # its next value: how many were taken


def _count_fused(st: _OpStats) -> None:
    with _lock:
        st.fused += 1


CPU_NUMERICS = "ATen's CPU kernel rounds differently from the CUDA kernel this reproduces"


def args_device(args: tuple) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def dispatch(op: FusedOp, *args: Any) -> Any:
    """Run ``op`` on ``args`` through the gate (see the module docstring)."""
    st = _op_stats(op.name)
    key = arg_key(args)
    try:
        plan = st.plans.get(key)
    except TypeError:  # an unhashable argument (e.g. a list): let validation say what is wrong with it
        _plan(op, args)
        raise
    if plan is None:
        plan = _Plan(*_plan(op, args))
        with _lock:
            if len(st.plans) >= _MAX_PLANS:
                st.plans.clear()
            st.plans[key] = plan
    elif plan.fast is not None and not _any_switch() and not _records_grad(args):
        next(st.served)  # a verified layout: nothing left to decide
        return plan.fast(*args)
    reason, sig = plan.reason, plan.signature
    if _flag("EXACTDIT_DISABLE"):
        reason = "disabled by EXACTDIT_DISABLE"
    elif _records_grad(args):
        reason = "autograd is recording (fused kernels have no backward)"
    if reason is not None:
        _count_eager(st, reason)
        return op.reference(*args)

    if sig in st.disabled:
        _count_eager(st, "disabled after a mismatch")
        return op.reference(*args)
    trusted = sig in st.verified and not _flag("EXACTDIT_VERIFY_ALL")
    if trusted and not plan.specialized and op.specialize is not None:
        plan.specialized = True
        try:  # a new layout of a verified signature (e.g. another GPU of the same kind)
            plan.fast = op.specialize(*args)
        except Exception:  # noqa: BLE001 - the plain launch path stays available
            plan.fast = None
    if trusted or _flag("EXACTDIT_TRUST"):
        _count_fused(st)
        return (plan.fast or op.fused)(*args)
    if cannot_sync():
        _count_eager(st, "unverified signature during compile or graph capture")
        return op.reference(*args)
    if op.cuda_numerics and args_device(args).type != "cuda":
        _count_eager(st, CPU_NUMERICS)
        return op.reference(*args)

    if op.compiling is not None and not waits_for_kernels():
        try:
            busy = op.compiling()
        except Exception:  # noqa: BLE001 - verification below meets the same error and disables the signature
            busy = False
        if busy:
            _count_eager(st, COMPILING)
            return op.reference(*args)

    timed = first_calls.start("verify", op.name)  # (the launch plans and compiles inside it are their own)
    # the reference first: an op may learn from it what its kernel needs (a region's output
    # layouts), and need not run it again
    ref = op.reference(*args)
    _local.verifying = True
    fast = None
    try:
        plan.specialized = True
        fast = op.specialize(*args) if op.specialize is not None else None
        out = fast(*args, poisoned=True) if fast is not None else op.fused(*args)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot compile or launch must not break the model
        out, failure = None, f"the fused kernel raised {type(e).__name__}: {_last_line(e)}"
    else:
        failure = None
    finally:
        _local.verifying = False
    problem = failure or first_difference(out, ref) or sharing_difference(args, out, ref)
    first_calls.stop(timed)
    if problem is None:
        with _lock:
            st.verified.add(sig)
            st.fused += 1
        plan.fast = fast
        return out
    message = f"exactdit: {op.name} failed verification for signature {sig}: {problem}; this signature now runs eager"
    with _lock:
        st.disabled[sig] = problem
        for other in st.plans.values():  # EXACTDIT_VERIFY_ALL can disable a verified signature
            if other.signature == sig:
                other.fast = None
    _count_eager(st, "mismatch at verification")
    logger.warning(message)
    warnings.warn(message, ExactditMismatchWarning, stacklevel=3)
    return ref


def _records_grad(args: tuple) -> bool:
    return torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)


def _last_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[-1][:300] if lines else ""


def _plan(op: FusedOp, args: tuple) -> tuple[Reason | None, tuple | None]:
    """Validate a call (raising for a malformed one) and decide, for its layout, whether the
    kernel may take it and under which signature."""
    if op.validate is not None:
        op.validate(*args)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    reason = backend_support(tensors) or op.unsupported(*args)
    if reason is not None:
        return reason, None
    return None, op.signature(*args) + device_key(tensors[0].device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(as_int) if t.dtype.is_floating_point else t


def first_difference(out: Any, ref: Any) -> str | None:
    """None when ``out`` and ``ref`` are bit-identical tensors (or tuples of them) with the same
    shape, dtype and strides; otherwise a description of the first difference."""
    if isinstance(ref, (tuple, list)):
        if not isinstance(out, (tuple, list)) or len(out) != len(ref):
            return f"expected {len(ref)} outputs"
        for i, (o, r) in enumerate(zip(out, ref)):
            problem = first_difference(o, r)
            if problem is not None:
                return f"output {i}: {problem}"
        return None
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return f"got {tuple(out.shape)} {out.dtype}, eager gives {tuple(ref.shape)} {ref.dtype}"
    if out.stride() != ref.stride():
        return f"strides {out.stride()} differ from eager's {ref.stride()}"
    if out.storage_offset() != ref.storage_offset():
        return f"storage offset {out.storage_offset()} differs from eager's {ref.storage_offset()}"
    differs = _bits(out) != _bits(ref)
    if not bool(differs.any()):
        return None
    index = tuple(int(i) for i in differs.nonzero()[0])
    count = int(differs.sum())
    return (
        f"{count} of {out.numel()} elements differ, first at index {index}: "
        f"fused {_show_element(out[index])} vs eager {_show_element(ref[index])}"
    )


def sharing(args: Any, outs: Any) -> tuple:
    """For each output tensor, the first input (``("input", i)``) or earlier output (``("output", i)``)
    whose storage it shares, or None: what a caller sees when it writes into one of them."""
    seen: dict[int, tuple] = {}
    for i, a in enumerate(torch.utils._pytree.tree_leaves(args)):
        if isinstance(a, torch.Tensor) and a.untyped_storage().nbytes():
            seen.setdefault(a.untyped_storage().data_ptr(), ("input", i))
    shared = []
    for i, o in enumerate(torch.utils._pytree.tree_leaves(outs)):
        key = o.untyped_storage().data_ptr() if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() else None
        shared.append(seen.get(key) if key is not None else None)
        if key is not None:
            seen.setdefault(key, ("output", i))
    return tuple(shared)


def sharing_difference(args: Any, out: Any, ref: Any) -> str | None:
    """None where ``out`` shares storages with ``args`` and with itself as ``ref`` does; otherwise
    the first difference (a fused output is a storage of its own: eager's may be a view)."""
    for i, (o, r) in enumerate(zip(sharing(args, out), sharing(args, ref))):
        if o != r:
            return f"output {i} shares the storage of {r or 'nothing else'} in eager, of {o or 'nothing else'} fused"
    return None


def _show_element(t: torch.Tensor) -> str:
    """One element's value and, for floats, its bit pattern (two NaNs print alike, their bits differ)."""
    if not t.dtype.is_floating_point:
        return repr(t.item())
    bits = int(_bits(t).item()) & ((1 << 8 * t.element_size()) - 1)
    return f"{t.item()!r} (0x{bits:0{2 * t.element_size()}x})"


#: name -> fields shown with that name's entry in the report (a model patch's own state: what a
#: model's CUDA graphs cover, ``{"graphed": ..., "graphed_why": ...}``)
_details: dict[str, dict] = STATE.details


def describe(name: str, **fields) -> None:
    """Show ``fields`` with the report entry ``name`` (replacing what was shown before)."""
    _op_stats(name)
    with _lock:
        _details[name] = fields


def snapshot() -> dict:
    """Per op: fused and eager call counts, why calls ran eager, verified and disabled
    signatures (what :func:`exactdit.report` shows)."""
    with _lock:
        return {
            name: {
                "fused": st.fused + _served(st),
                "eager": st.eager,
                "eager_reasons": dict(st.eager_reasons),
                "verified": sorted(map(str, st.verified)),
                "disabled": {str(k): v for k, v in st.disabled.items()},
                **_details.get(name, {}),
            }
            for name, st in _stats.items()
        }


def reset_counts() -> None:
    """Zero the call counters; verified and disabled signatures are kept."""
    with _lock:
        for st in _stats.values():
            st.fused = st.eager = 0
            st.served = itertools.count()
            st.eager_reasons.clear()
