"""Every kernel variant the ops launch compiles for sm_80 and sm_90, and its PTX has the
instructions the numerics rely on -- checked on a machine without a GPU.

The interpreter runs in the other CPU tests and does not do the compiler's checks; a kernel that
only the compiler rejects (a loop-carried variable changing shape, once) fails here in CI instead
of on the GPU. The compilation runs in a subprocess: Triton must be imported without
TRITON_INTERPRET (see tests/compile_for_gpu.py).
"""

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ARCHS = (80, 90)


def _compiler_env() -> dict:
    """The environment for a compiling subprocess: no TRITON_INTERPRET, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="module")
def compiled():
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "compile_for_gpu.py"), *map(str, ARCHS)],
        capture_output=True, text=True, timeout=1200, env=_compiler_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return rows


def test_every_variant_compiles(compiled):
    failures = [f"{r['case']} {r['dtype']} sm_{r['arch']}: {r['error']}" for r in compiled if not r["ok"]]
    assert not failures, "\n\n".join(failures)
    kernels = {r["kernel"] for r in compiled}
    assert kernels == {"residual_gate_add_kernel", "modulate_kernel", "rms_norm_kernel", "norm_rope_kernel",
                       "geglu_kernel", "layer_norm_kernel"}
    assert {r["arch"] for r in compiled} == set(ARCHS)


def _by_kernel(rows):
    out = defaultdict(list)
    for r in rows:
        if r["ok"]:
            out[r["kernel"]].append(r)
    return out


def test_no_contraction_where_eager_has_none(compiled):
    """The elementwise chains and diffusers' RMSNorm are separate eager kernels: no fp32 FMA may
    appear (LAUNCH_OPTIONS disables fusion; mul_rn/add_rn are explicit). Half-dtype ops are
    packed ``fma.rn`` with a neutral operand (numerics.dtype_mul), one rounding each."""
    by = _by_kernel(compiled)
    for name in ("residual_gate_add_kernel", "modulate_kernel", "rms_norm_kernel"):
        for r in by[name]:
            assert r["ptx"]["fma"] == 0, (r["case"], r["dtype"], r["arch"], r["ptx"])
            assert r["ptx"]["mul_rn"] + r["ptx"]["packed_half"] > 0, (r["case"], r["ptx"])
            assert (r["ptx"]["packed_half"] > 0) == (r["case"] in PACKED and r["dtype"] != "float32"), (r["case"], r["ptx"])


def test_rsqrt_and_division_are_the_ones_aten_uses(compiled):
    by = _by_kernel(compiled)
    for name in ("rms_norm_kernel", "norm_rope_kernel", "layer_norm_kernel"):
        for r in by[name]:
            assert r["ptx"]["rsqrt_approx"] > 0 and r["ptx"]["rsqrt_approx_ftz"] == 0, (r["case"], r["ptx"])
    for name in ("norm_rope_kernel", "layer_norm_kernel"):  # F.rms_norm / F.layer_norm divide with div.rn
        for r in by[name]:
            assert r["ptx"]["div_rn"] > 0, (r["case"], r["ptx"])


def test_no_flush_to_zero_outside_libdevice(compiled):
    """Eager's fp32 keeps subnormals. (GeGLU's erf comes from libdevice, whose exp uses
    ex2.approx.ftz; that path is proven exact on the GPU against ATen's erf.)"""
    for r in compiled:
        if r["ok"] and r["kernel"] != "geglu_kernel":
            assert r["ptx"]["ftz"] == 0, (r["case"], r["dtype"], r["ptx"])


#: cases whose half-dtype arithmetic is all or partly packed dtype ops
PACKED = {"residual_gate_add", "modulate native", "modulate no shift"}


def test_bf16_results_use_the_hardware_rounding(compiled):
    """Every bf16 result comes from ``cvt.rn.bf16`` or a packed bf16 op (both round to nearest
    even in hardware), never from a truncating conversion."""
    for r in compiled:
        if r["ok"] and r["dtype"] == "bfloat16" and "fp32 weight" not in r["case"]:  # that one returns fp32
            assert r["ptx"]["cvt_rn_bf16"] + r["ptx"]["packed_half"] > 0, (r["case"], r["ptx"])


def test_sass_counts_tool():
    """benchmarks/sass_counts.py disassembles every production-shape kernel without a GPU
    (Triton's bundled ptxas and nvdisasm)."""
    script = os.path.join(os.path.dirname(HERE), "benchmarks", "sass_counts.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=_compiler_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"(\w+_kernel)\s+(\d+) SASS", proc.stdout)}
    assert set(counts) >= {"rms_norm_kernel", "norm_rope_kernel", "geglu_kernel", "layer_norm_kernel"}, proc.stdout
    assert all(n > 100 for n in counts.values()), proc.stdout


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
