"""Triton's compile workers (exactdit.device.compile_workers): kernels they compile ahead are the
ones the first launches look up, and a worker that cannot compile leaves the launch to compile."""

import os
import subprocess
import sys

import pytest

from exactdit.device import compile_workers
from tests.device.test_compile_for_gpu import _compiler_env

HERE = os.path.dirname(os.path.abspath(__file__))


def _ahead(tmp_path, workers: str, *args: str, **env_vars: str) -> dict:
    import json

    env = dict(_compiler_env(), EXACTDIT_COMPILE_WORKERS=workers, TRITON_CACHE_DIR=str(tmp_path / "triton"),
               EXACTDIT_CACHE=str(tmp_path / "exactdit"), **env_vars)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "compile_ahead_for_gpu.py"), *args], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_compiled_by_workers_are_found_by_their_launches(tmp_path):
    """A tiny Wan block's region kernels, sent at the rewrite with stand-ins for the captured
    layout, compiled for sm_90 by worker processes: the launches with real tensors of that layout
    (Triton's JITFunction.run) compile nothing; without workers the same launches compile."""
    ahead = _ahead(tmp_path / "a", "2")
    assert ahead["launches"] >= 5
    assert ahead["sent"] == ahead["compiled_by_workers"] == ahead["launches"]
    assert ahead["new_cache_files_at_launch"] == 0
    alone = _ahead(tmp_path / "b", "0")
    assert alone["sent"] == alone["compiled_by_workers"] == 0 and alone["launches"] == ahead["launches"]
    assert alone["new_cache_files_at_launch"] > 0  # (so the count above could have failed)


def test_a_fused_gemm_is_compiled_ahead_in_every_way_its_first_calls_time(tmp_path):
    """A GEMM region's kernel in each candidate tile configuration and its epilogue alone (the ways
    its first calls time against each other) are compiled by the workers: none compiles at launch."""
    from exactdit.engine.templates import gemm

    ahead = _ahead(tmp_path, "2", "--gemm", EXACTDIT_GEMM="fused")
    assert ahead["launches"] == len(gemm.WIDE_TILES) + 1, ahead
    assert ahead["sent"] == ahead["compiled_by_workers"] == ahead["launches"]
    assert ahead["new_cache_files_at_launch"] == 0


def test_a_job_a_worker_cannot_compile_answers_false():
    from concurrent.futures import Future

    job = {"module": "exactdit_generated_missing", "path": os.path.join(HERE, "no_such_kernel.py"),
           "name": "region_kernel", "specialization": "{}", "target": {"backend": "cuda", "arch": 90, "warp_size": 32}}
    futures = [Future(), Future()]
    for f in futures:
        compile_workers._pool().put((job, f))
    assert [f.result(timeout=120) for f in futures] == [False, False]


def test_jobs_answer_false_at_once_where_no_worker_starts(monkeypatch):
    """A worker that cannot be started (no executable, no process) must not leave a launch waiting."""
    from concurrent.futures import Future

    monkeypatch.setattr(compile_workers, "_spawn", lambda: None)
    workers, future = compile_workers._Workers(1), Future()
    workers.put(({"module": "m", "path": "p", "name": "n", "specialization": "{}", "target": {}}, future))
    assert future.result(timeout=10) is False


def test_workers_that_die_without_answering_are_given_up(monkeypatch):
    """An interpreter whose workers cannot even import exactdit: after a few silent deaths the
    pool starts no more of them, and jobs answer False at once."""
    import subprocess
    from concurrent.futures import Future

    started = []

    def dying():
        started.append(1)
        return subprocess.Popen([sys.executable, "-c", "pass"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    monkeypatch.setattr(compile_workers, "_spawn", dying)
    workers = compile_workers._Workers(1)
    futures = [Future() for _ in range(5)]
    for f in futures:
        workers.put(({"module": "m", "path": "p", "name": "n", "specialization": "{}", "target": {}}, f))
    assert [f.result(timeout=60) for f in futures] == [False] * 5
    assert len(started) <= compile_workers._Workers.GIVE_UP + 1


@pytest.mark.parametrize("value,expected", [("0", 0), ("3", 3), (None, None), ("", None), ("two", ValueError),
                                            ("-1", ValueError)])
def test_worker_count(monkeypatch, value, expected):
    if expected is ValueError:
        monkeypatch.setenv("EXACTDIT_COMPILE_WORKERS", value)
        with pytest.raises(ValueError, match="EXACTDIT_COMPILE_WORKERS must be a whole number"):
            compile_workers.worker_count()
        return
    if expected is None:  # unset or empty: the default
        monkeypatch.delenv("EXACTDIT_COMPILE_WORKERS", raising=False)
        if value is not None:
            monkeypatch.setenv("EXACTDIT_COMPILE_WORKERS", value)
        expected = max(0, min(8, (os.cpu_count() or 1) - 1))
    else:
        monkeypatch.setenv("EXACTDIT_COMPILE_WORKERS", value)
    assert compile_workers.worker_count() == expected


def test_nothing_is_sent_off_cuda():
    """RegionOp.compile_ahead sends nothing for CPU graphs (no compiled launches there)."""
    import torch

    from exactdit.engine.partition import find_regions
    from exactdit.engine.runtime import RegionOp
    from tests.engine_helpers import GraphBuilder

    b = GraphBuilder()
    x = b.input(torch.randn(4, 8, dtype=torch.bfloat16))
    gm = b.module(b.op(torch.ops.aten.mul.Tensor, b.op(torch.ops.aten.add.Tensor, x, x), 2.0))
    ops = [RegionOp(r) for r in find_regions(gm, "cpu").regions]
    assert ops and all(op.compile_ahead() == 0 for op in ops) and not compile_workers._PENDING


def test_a_forked_child_forgets_the_parents_workers_and_jobs(monkeypatch):
    """A child forked while jobs are pending has no thread feeding them: it must not wait for them."""
    from concurrent.futures import Future

    pending = Future()
    monkeypatch.setattr(compile_workers, "_PENDING", {"kernel": [pending]})
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports whether it still thinks a compile is under way
        os.write(write, b"1" if compile_workers.compiling("kernel") or compile_workers._POOL else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"0"
    assert compile_workers.compiling("kernel")  # the parent's job is still its own


def test_workers_import_what_this_process_imports(monkeypatch, tmp_path):
    """A module importable here only through sys.path (a checkout not installed) is importable in
    a worker too."""
    import subprocess

    (tmp_path / "only_here_mod.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spawned = []
    with monkeypatch.context() as m:
        m.setattr(subprocess, "Popen", lambda cmd, **kw: spawned.append(kw["env"]) or None)
        compile_workers._spawn()
    out = subprocess.run([sys.executable, "-c", "import only_here_mod; print(only_here_mod.VALUE)"],
                         env=spawned[0], capture_output=True, text=True)
    assert out.stdout.strip() == "7", out.stderr


def test_a_worker_that_never_answers_is_given_up_after_the_wait(monkeypatch):
    """A hung worker: its job answers False after ``WAIT_S`` (the launch compiles the kernel), so
    the region it compiles for does not stay "compiling" (and eager) for ever."""
    from concurrent.futures import Future

    hung = []

    def spawn():
        hung.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True))
        return hung[-1]

    monkeypatch.setattr(compile_workers, "_spawn", spawn)
    monkeypatch.setattr(compile_workers, "WAIT_S", 0.5)
    workers, future = compile_workers._Workers(1), Future()
    workers.put(({"module": "m", "path": "p", "name": "n", "specialization": "{}", "target": {}}, future))
    try:
        assert future.result(timeout=30) is False
    finally:
        for p in hung:
            p.kill()
    assert all(p.wait(timeout=10) is not None for p in hung)


def test_a_pool_that_cannot_start_leaves_nothing_pending(monkeypatch):
    """Threads that cannot start (a process limit): submit raises before a job is pending, so no
    region waits for an answer that never comes; a feeding thread whose first worker cannot be
    started answers its jobs."""
    import json
    import threading
    from concurrent.futures import Future

    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    fn = JITFunction(kernel)
    monkeypatch.setattr(compile_workers, "_specialization", lambda *a, **k: (json.dumps({}), {"arch": 90}))
    monkeypatch.setattr(compile_workers, "_POOL", [])
    monkeypatch.setenv("EXACTDIT_COMPILE_WORKERS", "1")

    def cannot_start(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", cannot_start)
    with pytest.raises(RuntimeError):
        compile_workers.submit(fn, (1,), (), {}, None)
    monkeypatch.undo()
    assert not compile_workers.pending(fn) and not compile_workers.compiling(fn)

    def broken():
        raise TypeError("sys.path holds bytes")

    monkeypatch.setattr(compile_workers, "_spawn", broken)
    workers, future = compile_workers._Workers(1), Future()
    workers.put(({"module": "m", "path": "p", "name": "n", "specialization": "{}", "target": {}}, future))
    assert future.result(timeout=30) is False


def test_start_computes_tritons_key_in_a_thread(monkeypatch):
    from triton.runtime.cache import triton_key

    monkeypatch.setenv("EXACTDIT_COMPILE_WORKERS", "0")
    monkeypatch.setattr(compile_workers, "_KEYED", [])
    triton_key.cache_clear()
    compile_workers.start()
    compile_workers._KEYED[0].join(timeout=60)
    assert triton_key.cache_info().currsize == 1
    compile_workers.start()  # once per process
    assert len(compile_workers._KEYED) == 1


def test_the_key_thread_hashes_with_a_short_switch_interval_and_puts_it_back(monkeypatch):
    """Triton's key hashes 415 MB in 1 MB reads; with the default 5 ms switch interval each read
    waits for a busy main thread (Dynamo tracing) to hand the GIL back."""
    import sys

    import triton.runtime.cache

    seen = []
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: seen.append(sys.getswitchinterval()))
    before = sys.getswitchinterval()
    compile_workers._triton_key()
    assert seen == [pytest.approx(compile_workers.KEY_SWITCH_INTERVAL_S)] and sys.getswitchinterval() == before

    def changed_meanwhile():
        sys.setswitchinterval(0.002)

    monkeypatch.setattr(triton.runtime.cache, "triton_key", changed_meanwhile)
    try:
        compile_workers._triton_key()
        assert sys.getswitchinterval() == pytest.approx(0.002)  # someone else's setting is left alone
    finally:
        sys.setswitchinterval(before)


def test_a_specialisation_waits_for_the_key_thread_rather_than_computing_tritons_key_beside_it(monkeypatch):
    import threading
    import time

    done = []
    thread = threading.Thread(target=lambda: (time.sleep(0.3), done.append(True)), daemon=True)
    monkeypatch.setattr(compile_workers, "_KEYED", [thread])
    thread.start()
    compile_workers._await_key()
    assert done == [True]
    compile_workers._await_key()  # a finished thread (or none, or the thread itself) is not waited for
    monkeypatch.setattr(compile_workers, "_KEYED", [])
    compile_workers._await_key()
