"""CPU or GPU probe: does Triton's compiler run region kernels in parallel on threads?

Captures tiny models' blocks on the CPU, takes the first ``--kernels`` region kernels the engine
generates, and compiles them for ``sm_90`` through Triton's normal pipeline (no device needed)
one after another and on ``--threads`` threads, each in a fresh process with an empty Triton
cache, so that ``EXACTDIT_COMPILE_AHEAD``'s premise (the compiler spends most of its time
outside the GIL) is measured, not assumed:

    python3 benchmarks/probes/probe_compile_threads.py [--kernels 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = __file__.rsplit("/benchmarks/", 1)[0]


def compile_kernels(n: int, threads: int) -> float:
    """Seconds to compile the first ``n`` region kernels for sm_90 on ``threads`` threads (1: in turn)."""
    sys.path.insert(0, ROOT)
    from concurrent.futures import ThreadPoolExecutor

    from tests.device import compile_for_gpu as aot  # sets TRITON_INTERPRET=0 before Triton loads

    launches = []
    for item in aot.engine_launches():
        launches.append(item)
        if len(launches) >= n:
            break

    def one(item):
        _, fn, signature, constexprs, options = item[:5]
        return aot.compile_launch(fn, signature, constexprs, options, {}, 90)

    start = time.perf_counter()
    if threads == 1:
        for item in launches:
            one(item)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, launches))
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--run", type=int, help=argparse.SUPPRESS)  # (a child process: threads to use)
    args = ap.parse_args()
    if args.run is not None:
        print(f"{compile_kernels(args.kernels, args.run):.2f}")
        return
    for threads in (1, args.threads):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="exactdit-probe-triton-"), TRITON_INTERPRET="0")
        out = subprocess.run([sys.executable, __file__, "--kernels", str(args.kernels), "--run", str(threads)],
                             env=env, capture_output=True, text=True, check=True).stdout.split()[-1]
        print(f"{args.kernels} region kernels for sm_90 on {threads} thread(s): {out} s", flush=True)


if __name__ == "__main__":
    main()
