"""Where the engine's first calls spend their time: a wall-clock account per phase and block class.

A patched model's first call (and each new resolution's) captures every block class, partitions and
generates kernels, compiles them with Triton and verifies every region; a replayed call does none of
that. The phases, each timed with ``time.perf_counter`` where the engine does that work only:

* ``capture``: Dynamo tracing and AOTAutograd (a Dynamo compile, timed by Dynamo's compile
  start / end callbacks, less the engine's own work inside it);
* ``specialize``: a graph captured with symbolic sizes traced at a signature's concrete sizes
  (:mod:`exactdit.engine.specialize`);
* ``partition``: :func:`exactdit.engine.backend.rewrite` (preparing the graph, choosing regions,
  building the rewritten graph) less kernel source generation and the kernels sent ahead;
* ``codegen``: kernel sources generated from a region's templates, and written and imported;
* ``ahead``: a new graph's kernels sent to Triton's compile workers (GPU only): Triton specialises
  each launch in this process first (binder, cache key; the first kernel of a process also waits
  for Triton's key and CUDA driver, :func:`exactdit.device.compile_workers.start`);
* ``workers``: waiting for the kernels Triton's compile workers compile ahead (counted: those they
  compiled; :mod:`exactdit.device.compile_workers`);
* ``compile``: Triton compiling a kernel (its first launch for one specialisation; for a kernel a
  worker compiled, loading it from Triton's cache);
* ``layout``: the region's ATen nodes run once per input layout to read eager's output layout;
* ``plans``: launch plans built for a verified layout, and the fused / split GEMM timing;
* ``verify``: the gate's first call of a signature (fused kernel, ATen reference, comparison);
* ``other``: the rest of a new graph's first run (the ATen ops left to eager, host overhead).

Each phase's time is exclusive: a phase run inside another (a compile inside a verification) is
taken out of the outer one's. GPU work is asynchronous and only some phases wait for it (the gate's
comparison syncs, as does GEMM timing): the GPU time of work launched before (``layout``'s
reference run, the graph's ATen ops) spills into the next phase that syncs, usually ``verify``.

Nothing is timed on a call that replays what earlier calls set up. The account is kept in
:data:`exactdit.state.STATE` (``first_calls``: block class -> phase -> [seconds, count]) and
cleared by :func:`exactdit.state.reset`; :func:`exactdit.report` shows it.
"""

from __future__ import annotations

import contextlib
import threading
import time

from exactdit.state import STATE

PHASES = ("capture", "specialize", "partition", "codegen", "ahead", "workers", "compile", "layout", "plans", "verify",
          "other")
#: what each phase counts (shown beside its seconds)
UNITS = {"capture": "graphs", "specialize": "graphs", "partition": "graphs", "codegen": "kernels", "ahead": "kernels",
         "workers": "kernels", "compile": "kernels", "layout": "layouts", "plans": "layouts", "verify": "signatures",
         "other": "graphs"}

_account: dict[str, dict[str, list]] = STATE.first_calls
_lock = threading.Lock()
_local = threading.local()


def block_of(name: str) -> str:
    """The block class a region, graph or label belongs to: ``Model.Block#3.r5`` -> ``Model.Block``."""
    return name.split("#", 1)[0]


def add(phase: str, where: str, seconds: float, count: int = 1) -> None:
    """Add ``seconds`` (and ``count`` things done) to ``phase`` of ``where``'s block class."""
    with _lock:
        entry = _account.setdefault(block_of(where), {}).setdefault(phase, [0.0, 0])
        entry[0] += seconds
        entry[1] += count


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class _Frame:
    __slots__ = ("phase", "where", "start", "inner", "count")

    def __init__(self, phase: str, where: str | None, count: int):
        self.phase, self.where, self.count = phase, where, count
        self.start, self.inner = time.perf_counter(), 0.0


def _open(phase: str, where: str | None, count: int = 1) -> _Frame:
    frame = _Frame(phase, where, count)
    _stack().append(frame)
    return frame


def _close(frame: _Frame, record: bool = True) -> None:
    elapsed = time.perf_counter() - frame.start
    stack = _stack()
    while stack:  # (frames above it were left open by an error: they close with it)
        if stack.pop() is frame:
            break
    if stack:
        stack[-1].inner += elapsed
    if record and frame.where is not None:
        add(frame.phase, frame.where, max(elapsed - frame.inner, 0.0), frame.count)


def start(name: str, where: str, count: int = 1) -> _Frame:
    """Start timing ``name`` of ``where`` (:func:`stop` ends it): :func:`phase` without a ``with``
    block. A frame never stopped (an error in between) is recorded by no one and closes with the
    frame around it."""
    return _open(name, where, count)


def stop(frame: _Frame) -> None:
    _close(frame)


@contextlib.contextmanager
def phase(name: str, where: str, count: int = 1):
    """Time the block as ``name`` of ``where`` (a region, graph or block label), less the phases
    timed inside it. Yields the frame: ``frame.count`` may be set to what was done, ``frame.where``
    to None where nothing was (not recorded)."""
    frame = _open(name, where, count)
    try:
        yield frame
    finally:
        _close(frame)


# --- Dynamo's capture -----------------------------------------------------------------------------


def _capture_started(*_args) -> None:
    _local.capture = _open("capture", None)


def _capture_ended(*_args) -> None:
    frame = getattr(_local, "capture", None)
    if frame is not None:
        _local.capture = None
        _close(frame)  # recorded only when an exactdit backend claimed it (another compile: not ours)


def claim_capture(label: str) -> None:
    """Called by an exactdit backend inside Dynamo's compile: the compile under way is ``label``'s."""
    frame = getattr(_local, "capture", None)
    if frame is not None and frame.where is None:
        frame.where = label


def install_capture_timer() -> bool:
    """Time Dynamo's compiles (its compile start / end callbacks, process-wide, called only when
    Dynamo compiles a frame); idempotent, and again after ``torch._dynamo.reset()`` (which drops
    every callback). False where this torch has no such callbacks (capture time then shows in no
    phase)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return False
    with _lock:
        if _capture_started not in getattr(callback_handler, "start_callbacks", ()):
            try:
                callback_handler.register_start_callback(_capture_started)
                callback_handler.register_end_callback(_capture_ended)
            except AttributeError:
                return False
    return True


# --- reading the account --------------------------------------------------------------------------


def snapshot() -> dict[str, dict[str, tuple[float, int]]]:
    """block class -> phase -> (seconds, count), phases in :data:`PHASES` order."""
    with _lock:
        return {block: {p: tuple(phases[p]) for p in PHASES if p in phases} for block, phases in _account.items()}


def totals(account: dict | None = None) -> dict[str, tuple[float, int]]:
    """phase -> (seconds, count) summed over block classes."""
    out: dict[str, list] = {}
    for phases in (snapshot() if account is None else account).values():
        for p, (s, n) in phases.items():
            entry = out.setdefault(p, [0.0, 0])
            entry[0] += s
            entry[1] += n
    return {p: tuple(out[p]) for p in PHASES if p in out}


def describe(phases: dict[str, tuple[float, int]]) -> str:
    """``capture 3.1 s (4 graphs), ..., compile 20.3 s (57 kernels), ...``"""
    return ", ".join(f"{p} {s:.2f} s ({n} {UNITS[p]})" for p, (s, n) in phases.items())


def lines(account: dict | None = None) -> list[str]:
    """The report's lines: the phases summed, then per block class (where there are several)."""
    account = snapshot() if account is None else account
    if not account:
        return []
    whole = totals(account)
    out = [f"first calls: {describe(whole)}; total {sum(s for s, _ in whole.values()):.2f} s"]
    if len(account) > 1:
        for block, phases in sorted(account.items()):
            out.append(f"  {block}: {describe(phases)}")
    return out
