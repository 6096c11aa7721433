"""Benchmark scripts that only a device session runs for real, run on the CPU on a tiny model, so
that a device session is not spent on their own errors (slow: each starts a fresh interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from exactdit.harness import models
from tests.helpers import run_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_the_energy_floor_runs_on_the_cpu(tmp_path):
    """benchmarks/models/energy_floor.py: every GEMM and attention call of the block graphs
    counted as often as the forward runs it, and a row per forward (no energy off the GPU)."""
    rows = run_benchmark("models/energy_floor.py", "--model", "flux", "--config", "tiny", "--height", "64",
                         "--width", "64", out_dir=tmp_path)
    assert [r["path"] for r in rows] == ["eager", "exactdit"]
    kinds = rows[0]["by_kind"]
    cfg = models.get_spec("flux").resolve_config("tiny")
    double, single = cfg["num_layers"], cfg["num_single_layers"]
    # a double block: 7 linears per stream (modulation, q, k, v, out, FFN up and down); a single
    # block: modulation, q, k, v, MLP in, out; one attention each
    assert kinds["gemm"]["calls"] == 14 * double + 6 * single, kinds
    assert kinds["attention"]["calls"] == double + single, kinds
    assert all(r["ms"] > 0 and r["energy_j"] is None for r in rows), rows


@pytest.mark.slow
def test_the_bytes_probe_counts_fused_gemms_only_when_on(tmp_path):
    """benchmarks/probes/probe_bytes.py: with fused GEMMs off nothing is counted as a fused GEMM
    region, and turning them on never moves more bytes."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "probes", "probe_bytes.py"), "--model",
                           "flux", "--config", "tiny", "--size", "64"], capture_output=True, text=True, timeout=900,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sections = proc.stdout.split("EXACTDIT_GEMM=")[1:]
    assert [s.split(":")[0] for s in sections] == ["off", "auto"]
    totals = [float(s.split(":")[1].split("GB")[0]) for s in sections]
    assert "fused GEMM" not in sections[0] and totals[1] <= totals[0], proc.stdout


@pytest.mark.slow
def test_the_first_gemm_candidate_compiles_for_sm90_without_spills():
    """benchmarks/kernels/gemm_registers.py: the configuration a fused GEMM runs untimed, compiled
    for the H200 by Triton and ptxas on this machine, holds its epilogue in registers (a tile of
    pointers spilled 1.6-2.5 KB per thread) and fits in shared memory."""
    from exactdit.engine.templates import gemm

    first = gemm.WIDE_TILES[0]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernels", "gemm_registers.py"),
                           "--tiles", first.spec], capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "x" in line
            and "case" not in line]
    assert len(rows) == 4, proc.stdout  # scale, gated, gelu, cat-gated
    for case, tiles, registers, spills, shared in rows:
        assert spills.strip() == "0 / 0" and int(shared) <= 227 * 1024, (case, tiles, registers, spills, shared)
