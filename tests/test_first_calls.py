"""The first calls' time account: phases timed exclusively, per block class, filled by a model's
first call through the engine, untouched by a repeated call, cleared by the state's reset."""

import time

import pytest
import torch

import exactdit
from exactdit import first_calls, state
from exactdit.engine import make_backend
from exactdit.harness import models
from tests.helpers import run_benchmark


def test_a_phase_inside_another_is_taken_out_of_it():
    with first_calls.phase("verify", "M.Block#0.r1"):
        time.sleep(0.02)
        with first_calls.phase("compile", "M.Block#0.r1") as timed:
            time.sleep(0.05)
            timed.count = 3
    account = first_calls.snapshot()
    assert set(account) == {"M.Block"}
    (verify_s, verify_n), (compile_s, compile_n) = account["M.Block"]["verify"], account["M.Block"]["compile"]
    assert (verify_n, compile_n) == (1, 3)
    assert compile_s >= 0.05 and 0.02 <= verify_s < 0.05, account


def test_start_and_stop_time_like_a_phase_and_an_unstopped_frame_closes_with_its_outer_one():
    with first_calls.phase("plans", "M.A"):
        first_calls.start("verify", "M.A")  # never stopped (an error in between)
        timed = first_calls.start("layout", "M.B")
        first_calls.stop(timed)
    account = first_calls.snapshot()
    assert "verify" not in account["M.A"] and account["M.A"]["plans"][1] == 1 and account["M.B"]["layout"][1] == 1
    with first_calls.phase("verify", "M.A"):
        pass
    assert first_calls.snapshot()["M.A"]["verify"][1] == 1


def test_lines_sum_the_phases_then_show_each_block_class():
    account = {"M.A": {"capture": (1.0, 1), "compile": (2.0, 4)}, "M.B": {"capture": (0.5, 1)}}
    assert first_calls.totals(account) == {"capture": (1.5, 2), "compile": (2.0, 4)}
    lines = first_calls.lines(account)
    assert lines[0] == "first calls: capture 1.50 s (2 graphs), compile 2.00 s (4 kernels); total 3.50 s"
    assert lines[1:] == ["  M.A: capture 1.00 s (1 graphs), compile 2.00 s (4 kernels)", "  M.B: capture 0.50 s (1 graphs)"]
    assert first_calls.lines({}) == []


def test_dynamo_capture_through_the_backend_is_timed_once_per_graph():
    def f(x, y):
        return torch.nn.functional.gelu(x * y + 1.0) * 2.0

    compiled = torch.compile(f, backend=make_backend("Toy.Block"), fullgraph=True, dynamic=False)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        compiled(x, y)
        after_first = first_calls.snapshot()
        compiled(x, y)
        assert first_calls.snapshot() == after_first
    phases = after_first["Toy.Block"]
    assert phases["capture"][1] == 1 and phases["capture"][0] > 0
    assert phases["partition"][1] == 1


def test_kernels_sent_to_the_compile_workers_are_timed_apart_from_the_partition(monkeypatch):
    """On the GPU each region's kernels are specialised for the compile workers while the graph is
    rewritten; the first of a process waits for Triton's key and driver: not the partition's time."""
    from exactdit.engine import runtime

    def sent(self):
        time.sleep(0.1)
        return 2

    monkeypatch.setattr(runtime.RegionOp, "compile_ahead", sent)
    compiled = torch.compile(lambda x: torch.nn.functional.gelu(x * 3.0) * 2.0, backend=make_backend("Toy.Block"),
                             fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(torch.randn(4, 8, dtype=torch.bfloat16))  # (fused: GELU's tables are bf16 / fp16)
    phases = first_calls.snapshot()["Toy.Block"]
    regions = phases["ahead"][1] // 2
    assert regions >= 1 and phases["ahead"][0] >= 0.1 * regions, phases
    assert phases["partition"][0] < 0.1, phases
    monkeypatch.setattr(runtime.RegionOp, "compile_ahead", lambda self: 0)  # off CUDA: nothing sent, nothing shown
    state.reset()
    with torch.no_grad():
        torch.compile(lambda x: torch.nn.functional.gelu(x * 5.0), backend=make_backend("Toy.Other"), fullgraph=True,
                      dynamic=False)(torch.randn(4, 8, dtype=torch.bfloat16))
    assert "partition" in first_calls.snapshot()["Toy.Other"] and "ahead" not in first_calls.snapshot()["Toy.Other"]


def test_a_models_first_call_fills_the_account_a_repeated_call_leaves_it_and_reset_clears_it():
    tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, seed=6)
    kw = models.forward_inputs("flux", tr, batch=1, height=32, width=32, seed=7)
    torch._dynamo.reset()
    exactdit.patch(tr)
    try:
        with torch.no_grad():
            start = time.perf_counter()
            tr(**kw, return_dict=False)
            wall = time.perf_counter() - start
            first = first_calls.snapshot()
            tr(**kw, return_dict=False)
            assert first_calls.snapshot() == first
    finally:
        exactdit.unpatch(tr)
    block = first["FluxTransformer2DModel.FluxTransformerBlock"]
    # ("layout" is not among them: the verification's reference run leaves each output layout)
    for phase in ("capture", "partition", "codegen", "verify", "other"):
        assert block[phase][0] > 0 and block[phase][1] > 0, (phase, block)
    assert "FluxTransformer2DModel.FluxSingleTransformerBlock" in first
    assert sum(s for s, _ in first_calls.totals(first).values()) <= wall  # phases are exclusive
    text = str(exactdit.report(show=False))
    assert "first calls: capture " in text and "  FluxTransformer2DModel.FluxTransformerBlock: capture " in text
    state.reset()
    assert first_calls.snapshot() == {} and "first calls" not in str(exactdit.report(show=False))


@pytest.mark.slow
def test_the_first_call_profile_runs_on_the_cpu(tmp_path):
    """benchmarks/models/profile_first_call.py (the device's first-calls stage) on the tiny Flux in
    the interpreter: a row per resolution with the phases of the account, so a device session is
    not spent on the script's own errors; each call's output held to eager's at its resolution, and
    each first call's Python profile written (``--cprofile``) with the engine's frames in it."""
    rows = run_benchmark("models/profile_first_call.py", "--model", "flux", "--config", "tiny", "--device", "cpu",
                         "--resolutions", "32x32", "48x32", "--cprofile", out_dir=tmp_path)
    assert [r["shape"] for r in rows] == ["32x32 B=1", "48x32 B=1"]
    assert all(r["first_call_s"] > 0 and r["phases_s"]["capture"] > 0 and r["equal"] is True for r in rows), rows
    profile = (tmp_path / "first_call_cprofile_flux_static_cold.txt").read_text()
    assert [line.split(" first call")[0] for line in profile.splitlines() if line.startswith("## ")] == ["## 32x32", "## 48x32"]
    assert "exactdit/patches/engine.py" in profile and "Ordered by: internal time" in profile
