"""Every kernel the engine generates for tiny models compiles for sm_90, and its PTX has the
instructions the numerics rely on -- checked on a machine without a GPU.

The interpreter runs in the other CPU tests and does not do the compiler's checks; a kernel that
only the compiler rejects (a loop-carried variable changing shape, once) fails here in CI instead
of on the GPU. The compilation runs in a subprocess: Triton must be imported without
TRITON_INTERPRET (see tests/compile_for_gpu.py).
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _compiler_env() -> dict:
    """The environment for a compiling subprocess: no TRITON_INTERPRET, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(HERE)), env.get("PYTHONPATH", "")])
    return env


def _engine_rows(*args: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "compile_for_gpu.py"), "--engine", *args],
        capture_output=True, text=True, timeout=1200, env=_compiler_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_mini_model_kernels_compile():
    """The kernels the engine generates for mini models in bf16 and fp32 compile for sm_90: SD3's
    RMSNorm of permuted q/k, HunyuanVideo's token refiner (whose fp32 cat once generated
    ``tl.where(None, ...)``, which the interpreter ran and the compiler refused)."""
    rows = _engine_rows("--minis", "sd3,hunyuan-video")
    assert len(rows) >= 40
    failures = [f"{r['case']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failures, "\n\n".join(failures)
    assert any("mean" in r["case"] for r in rows)


def test_engine_kernels_compile_without_flush_to_zero():
    """Every kernel the engine generates for tiny Flux.1, Qwen-Image, ERNIE-Image and Wan blocks
    (and an F.rms_norm + RoPE graph) compiles for sm_90; none flushes subnormals (ATen does not)
    and ``rsqrt`` is the non-ftz approximation."""
    rows = _engine_rows()
    assert len(rows) >= 20
    failures = [f"{r['case']}: {r['error']}" for r in rows if not r["ok"]]
    assert not failures, "\n\n".join(failures)
    assert any("fused_rms_norm" in r["case"] for r in rows) and any("layer_norm" in r["case"] for r in rows)
    for r in rows:
        assert r["ptx"]["ftz"] == 0 and r["ptx"]["rsqrt_approx_ftz"] == 0, r["case"]
