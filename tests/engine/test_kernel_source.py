"""The kernel cache (:mod:`exactdit.engine.kernel_source`): generated sources are files named by
their text, which a second process imports again rather than writing, and Triton's key for a
kernel follows the device library it calls, so a changed exactdit recompiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SOURCE = '''@triton.jit
def region_kernel(in0_ptr, out0_ptr, n):
    i = tl.arange(0, 16)
    x = tl.load(in0_ptr + i, mask=i < n)
    tl.store(out0_ptr + i, round_to(x * 2.0, tl.bfloat16), mask=i < n)
'''

#: run in a fresh process without the interpreter (a JITFunction's key is computed on the host)
_PROBE = '''
import json, os, sys
import triton
import triton.language as tl
if sys.argv[2] == "changed":  # another exactdit: the same name, another body
    import exactdit.device.numerics as numerics

    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        return x.to(dtype, fp_downcast_rounding="rtz")

    numerics.round_to = round_to
from exactdit.engine import kernel_source
fn = kernel_source.load(sys.argv[1])
print(json.dumps({"file": sys.modules[fn.fn.__module__].__file__, "key": fn.cache_key,
                  "files": sorted(os.listdir(kernel_source.cache_dir()))}))
'''


def _load_in_fresh_process(tmp_path, library: str = "same") -> dict:
    probe = tmp_path / "probe.py"  # (Triton reads a jit function's source from its file)
    probe.write_text(_PROBE)
    env = dict(os.environ, EXACTDIT_CACHE=str(tmp_path / "cache"), TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, str(probe), SOURCE, library], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_reuses_the_cached_source_and_a_changed_library_does_not(tmp_path):
    first = _load_in_fresh_process(tmp_path)
    assert len(first["files"]) == 1 and first["file"].startswith(str(tmp_path / "cache"))
    again = _load_in_fresh_process(tmp_path)
    assert again == first  # the same file, nothing written, the same Triton key (its disk cache hits)
    changed = _load_in_fresh_process(tmp_path, "changed")
    assert changed["file"] == first["file"]  # the same text...
    assert changed["key"] != first["key"]  # ...calling another device function: Triton compiles it anew


#: two kernels calling the same library function (whose key folds in constexpr globals)
KERNELS = [f'''@triton.jit
def region_kernel(in0_ptr, out0_ptr, n):
    i = tl.arange(0, {width})
    x = tl.load(in0_ptr + i, mask=i < n)
    tl.store(out0_ptr + i, dtype_mul(x, x), mask=i < n)
''' for width in (16, 32)]

#: each source's Triton key, loaded in the order given (a fresh process, no interpreter)
_ORDER_PROBE = '''
import json, sys
from exactdit.engine import kernel_source
keys = {}
for k in json.loads(sys.argv[1]):
    keys[k] = kernel_source.load(json.loads(sys.argv[2])[k]).cache_key
print(json.dumps(keys))
'''


def test_a_kernels_key_does_not_depend_on_which_kernel_a_process_hashed_first(tmp_path):
    """Triton 3.6 folds a called function's constexpr globals into its caller's key only once the
    callee was hashed, so the first kernel a process hashed got another key than the same kernel
    hashed later: compile workers' first jobs were compiled again at their launch (a 2-worker run
    of a GEMM region's four tilings on Triton 3.6: one recompiled of four, two of four with three
    workers). The device library is hashed at import, in one order, in every process."""
    import json

    probe = tmp_path / "order.py"
    probe.write_text(_ORDER_PROBE)
    env = dict(os.environ, EXACTDIT_CACHE=str(tmp_path / "cache"), TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    keys = []
    for order in ([0, 1], [1, 0]):
        done = subprocess.run([sys.executable, str(probe), json.dumps(order), json.dumps(KERNELS)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        keys.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert keys[0] == keys[1]
