"""Triton's compiler in worker processes, so that a model's first call compiles its kernels side by side.

A first call compiled one region kernel after another as its regions ran: HunyuanVideo 544x960x17
spent 42 of 49 s in Triton's compiler for 24 kernels (H200 machine, Triton 3.6). Threads did not
overlap there (the first call was 66.6 s with eight of them against 55.9 s without), so this
module does what Inductor's compile workers do, in processes:

* the kernels of a rewritten graph are known before its first region runs
  (``RegionOp.compile_ahead``). :func:`submit` specialises each in this process exactly as its
  first launch will (Triton's own ``JITFunction.run``, stopped by a ``jit_cache_hook`` before it
  compiles) and hands Triton's specialisation data to a worker;
* a worker (this file run as a script, off the GPU: ``CUDA_VISIBLE_DEVICES`` empty) compiles it
  for the device's target into Triton's disk cache, under the key the launch will look up;
* until its kernels are compiled (:func:`compiling`) a region's calls run its ATen nodes (the
  gate's choice; CUDA-graph mode waits instead); then the launch's own compile
  (``launch.compile_for``) waits for its kernel's jobs (:func:`wait`) and finds the binary, and
  the C launcher Triton 3.6 builds per kernel signature, in the cache.

Correctness never rests on a worker: a job that fails, or a specialisation that differs from the
launch's, costs time only (the launch compiles as before). ``EXACTDIT_COMPILE_WORKERS`` sets how
many workers run (0: none; default ``min(8, CPUs - 1)``); each exits after :data:`IDLE_S` seconds
without work, and is started again when needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import queue
import select
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # (not the builtin before Python 3.11)

#: seconds a worker waits for a job before it exits
IDLE_S = 300.0
#: seconds a launch waits for its kernel's worker before compiling it itself
WAIT_S = 600.0


def worker_count() -> int:
    """How many workers compile (``EXACTDIT_COMPILE_WORKERS``; unset or empty: ``min(8, CPUs - 1)``)."""
    value = os.environ.get("EXACTDIT_COMPILE_WORKERS", "")
    if value.strip():
        if not value.strip().isdigit():
            raise ValueError(f"EXACTDIT_COMPILE_WORKERS must be a whole number of processes, got {value!r}")
        return int(value)
    return max(0, min(8, (os.cpu_count() or 1) - 1))


def import_file(name: str, path: str):
    """The module ``name`` loaded from ``path`` (once per process): how generated kernels are imported."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


# --- this process's side ------------------------------------------------------------------------

_PENDING: dict = {}  # per kernel (JITFunction): futures of its jobs, True when the worker compiled it
_lock = threading.Lock()


def submit(fn, grid: tuple, args: tuple, kwargs: dict, device) -> bool:
    """Have a worker compile ``fn`` for arguments like ``args`` on ``device`` (tensors may be
    stand-ins with a dtype and a ``data_ptr``: what Triton's specialisation reads). False where
    nothing was sent: no worker, Triton already holds this specialisation in memory, or another
    compile hook is installed."""
    from triton.runtime.jit import JITFunction

    if worker_count() == 0 or not isinstance(fn, JITFunction):  # (the interpreter compiles nothing)
        return False
    data, target = _specialization(fn, grid, args, kwargs, device)
    if data is None:
        return False
    job = {"module": fn.fn.__module__, "path": sys.modules[fn.fn.__module__].__file__, "name": fn.fn.__name__,
           "specialization": data, "target": target}
    future: Future = Future()
    pool = _pool()  # (raises before anything is pending: compile_ahead then sends nothing)
    with _lock:
        _PENDING.setdefault(fn, []).append(future)
    pool.put((job, future))
    return True


def pending(fn) -> bool:
    """Whether jobs of ``fn`` were sent to workers and not waited for."""
    return fn in _PENDING


def compiling(fn) -> bool:
    """Whether a worker is still compiling a job of ``fn``."""
    return any(not f.done() for f in _PENDING.get(fn, ()))


def wait_all() -> int:
    """Wait for every job sent to the workers; how many compiled there (benchmarks: the time until
    every region can run fused)."""
    return sum(wait(fn) for fn in list(_PENDING))


def wait(fn) -> int:
    """Wait for the jobs of ``fn`` sent to workers; how many compiled there."""
    with _lock:
        futures = _PENDING.pop(fn, ())
    compiled = 0
    for future in futures:
        try:
            compiled += future.result(timeout=WAIT_S)
        except FutureTimeout:  # a worker that hangs: the launch compiles it itself
            pass
    return compiled


def _specialization(fn, grid, args, kwargs, device) -> tuple:
    """(Triton's specialisation data for this launch, the device's target as a dict), or (None,
    None) where Triton would not compile (already compiled in this process) or a hook is taken."""
    import torch
    from triton import knobs
    from triton.runtime import driver

    if knobs.runtime.jit_cache_hook is not None:
        return None, None
    _await_key()
    found = []

    def hook(*, fn: object, compile: dict, **_) -> bool:
        if getattr(fn, "jit_function", None) is not target_fn:
            return False  # another kernel's compile (another thread): not ours to take
        found.append(compile["specialization_data"])
        return True  # taken over: run returns without compiling

    target_fn = fn
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        target = dataclasses.asdict(driver.active.get_current_target())
        knobs.runtime.jit_cache_hook = hook
        try:
            fn.run(*args, grid=grid, warmup=True, **kwargs)
        finally:
            knobs.runtime.jit_cache_hook = None
    return (found[0], target) if found else (None, None)


class _Workers:
    """A job queue and one thread per worker process, each sending its worker one job at a time."""

    #: workers in a row that died without answering before the pool stops starting them (an
    #: interpreter that cannot import exactdit, say): its jobs then answer False at once
    GIVE_UP = 3

    def __init__(self, n: int):
        self.jobs: queue.Queue = queue.Queue()
        self.silent = 0  # workers in a row that died without answering
        self.threads = [threading.Thread(target=self._feed, name=f"exactdit-compile-{i}", daemon=True)
                        for i in range(n)]
        for t in self.threads:
            t.start()

    def put(self, item) -> None:
        self.jobs.put(item)

    def _feed(self) -> None:
        try:
            process = _spawn()  # started before its first job: importing Triton and torch takes seconds
        except Exception:  # noqa: BLE001 - started (or given up) at the first job, inside its try
            process = None
        while True:
            job, future = self.jobs.get()
            ok = False
            try:
                for _ in range(2):  # a worker that idled out (or died) is started again, once
                    if self.silent >= self.GIVE_UP:
                        break
                    if process is None or process.poll() is not None:
                        process = _spawn()
                    if process is None:
                        self.silent = self.GIVE_UP
                        break
                    try:
                        process.stdin.write(json.dumps(job) + "\n")
                        process.stdin.flush()
                        # a worker that does not answer within WAIT_S is killed: the job answers
                        # False (the launch compiles it), and compiling() does not stay True for ever
                        answered = select.select([process.stdout], [], [], WAIT_S)[0]
                        line = process.stdout.readline() if answered else ""
                    except (BrokenPipeError, OSError, ValueError):
                        line = ""
                    if line:
                        ok, self.silent = bool(json.loads(line).get("ok")), 0
                        break
                    self.silent += 1
                    process.kill()
                    process.wait()
            except Exception:  # noqa: BLE001 - no worker: the launch compiles it itself
                ok = False
            finally:
                future.set_result(ok)


_POOL: list = []


def start() -> None:
    """Start the workers (they import Triton and the device library while a model's first call
    captures its blocks; none where :func:`worker_count` is 0), and have a thread compute the key
    Triton puts in every kernel's cache key: Triton hashes its own files once per process, the
    415 MB ``libtriton.so`` of Triton 3.6 included (0.4 s of a fresh process's first call, where the
    first kernel looked its binary up). File reads and sha256 release the GIL, so the hashing runs
    beside the first capture instead of after it (with a short switch interval:
    :func:`_short_switch_interval`). Where CUDA is up, the thread then starts Triton's
    CUDA driver, whose C helpers a cold cache builds with the host's compiler (a subprocess): the
    first region's specialisation (:func:`submit`) would otherwise wait for it."""
    if worker_count():
        _pool()
    with _lock:
        if _KEYED:
            return
        _KEYED.append(threading.Thread(target=_triton_key, name="exactdit-triton-key", daemon=True))
    _KEYED[0].start()


_KEYED: list = []  # the thread computing Triton's key, once per process


def _await_key(timeout_s: float = 120.0) -> None:
    """Wait for the key thread (:func:`start`). Triton computes its key (``functools.lru_cache``)
    and its driver (``driver.active``) lazily and without a lock: a caller that does not wait
    computes them a second time beside the thread, the 415 MB hash included."""
    with _lock:
        thread = _KEYED[0] if _KEYED else None
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join(timeout_s)


#: the interpreter's switch interval while the key thread hashes (seconds; Python's default is 0.005)
KEY_SWITCH_INTERVAL_S = 1e-4


def _triton_key() -> None:
    try:
        from triton.runtime.cache import triton_key  # (cached by Triton: later calls return it)

        with _short_switch_interval():
            triton_key()
        import torch

        if torch.cuda.is_initialized():  # (never the one to start CUDA: a process may fork later)
            from triton.runtime import driver

            driver.active.get_current_target()
    except Exception:  # noqa: BLE001 - another Triton: its first kernel computes what it needs
        pass


@contextlib.contextmanager
def _short_switch_interval():
    """Triton hashes ``libtriton.so`` in 1 MB reads, taking the GIL back after each read and each
    hash update; while the main thread traces blocks (Dynamo: pure Python) each take waits for the
    holder's switch interval, 5 ms: 2-3 s for 415 MB instead of 0.5 s, and the first region's
    specialisation waits for it (``ahead``). A 0.1 ms interval while the thread hashes hands the GIL
    over at once (measured on 2 cores: 5.3 -> 0.5 s, the busy thread keeping 94% of its pace). The
    interval is put back unless someone changed it meanwhile."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, KEY_SWITCH_INTERVAL_S))
    short = sys.getswitchinterval()  # (kept in microseconds: read back, not the float passed)
    try:
        yield
    finally:
        if sys.getswitchinterval() == short:
            sys.setswitchinterval(previous)


def _pool() -> _Workers:
    with _lock:
        if not _POOL:
            _POOL.append(_Workers(max(1, worker_count())))
        return _POOL[0]


def _forget_workers() -> None:
    """In a forked child: the parent's feeding threads did not come along, and neither do its jobs."""
    _POOL.clear()
    for futures in _PENDING.values():
        for future in futures:
            if not future.done():
                future.set_result(False)
    _PENDING.clear()


os.register_at_fork(after_in_child=_forget_workers)


def _spawn() -> subprocess.Popen | None:
    """A worker process, or None where one cannot be started (its jobs then answer False at once)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="0")
    # it imports what this process imports (exactdit from a checkout added to sys.path, say)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    try:
        from triton import knobs

        env["TRITON_CACHE_DIR"] = knobs.cache.dir  # where this process looks, also when set in code
    except (ImportError, AttributeError):
        pass
    try:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    except OSError:
        return None


# --- the worker's side --------------------------------------------------------------------------


def compile_job(job: dict) -> None:
    """Compile one job's kernel into Triton's disk cache, as ``JITFunction.run`` would have
    compiled it in the sending process (Triton's ``preload`` decodes the same data, on a GPU)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn = getattr(import_file(job["module"], job["path"]), job["name"])
    data = json.loads(job["specialization"])
    target = GPUTarget(**job["target"])
    backend = make_backend(target)

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    def tupled(value):  # JSON made the tuples lists; Triton's signatures hold no lists
        return tuple(tupled(v) for v in value) if isinstance(value, list) else value

    constexprs = {tuple(k): constant(v) for k, v in zip(data["constant_keys"], data["constant_vals"])}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"]))
    signature = {k: tupled(v) for k, v in data["signature"].items()}
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    _build_launcher(kernel)


def _build_launcher(kernel) -> None:
    """Triton 3.6 loads a kernel through a C launcher it builds with the host's C compiler per
    kernel signature (0.2-1 s each on the H200 machine, kept in Triton's cache): built here too,
    so the launch only loads it. Triton 3.9 launches through one generic launcher: nothing to do."""
    from triton.backends.nvidia import driver as nvidia

    if hasattr(nvidia, "make_launcher") and hasattr(nvidia, "compile_module_from_src"):
        try:
            nvidia.CudaLauncher(kernel.src, kernel.metadata)
        except Exception:  # noqa: BLE001 - the launch builds it (the kernel itself is compiled)
            pass


def _light_packages() -> None:
    """Make ``exactdit`` and ``exactdit.engine`` importable without running their ``__init__``
    (which imports Dynamo): a worker needs only the modules generated kernels import."""
    for name in ("exactdit", "exactdit.engine"):
        spec = importlib.util.find_spec(name)
        package = importlib.util.module_from_spec(spec)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[name] = package


def serve(idle_s: float = IDLE_S) -> None:
    """A worker: one JSON job a line on stdin, one JSON reply a line on stdout, until stdin closes
    or nothing comes for ``idle_s`` seconds."""
    import select

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints goes to stderr, not into the replies
    while select.select([sys.stdin], [], [], idle_s)[0]:
        line = sys.stdin.readline()
        if not line:
            return
        try:
            compile_job(json.loads(line))
            reply = {"ok": True}
        except Exception as e:  # noqa: BLE001 - the launch compiles it again and raises what it raises
            reply = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-500:]}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules are not top-level modules
    _light_packages()
    serve()
