"""The verification gate, tested with deliberately wrong kernels."""

import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import exactdit
from exactdit import gate
from exactdit.gate import ExactditMismatchWarning, FusedOp, dispatch


def _residual_gate_add(r, u, g):
    """The eager op the fake kernels below stand in for: ``r + g * u``."""
    return r + g * u


def _plus_one_ulp(t):
    bits = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
    return (bits + 1).view(t.dtype)


def _op(name, *, wrong_after=0, calls=None):
    """A residual-gate-add op whose kernel is right for its first ``wrong_after`` calls, then
    one ulp off."""
    calls = calls if calls is not None else []

    def fused(r, u, g):
        calls.append(1)
        ref = _residual_gate_add(r, u, g)
        return ref.clone() if len(calls) <= wrong_after else _plus_one_ulp(ref)

    return FusedOp(
        name=name,
        reference=_residual_gate_add,
        fused=fused,
        unsupported=lambda r, u, g: None if r.dtype != torch.float64 else "unsupported dtype torch.float64",
        signature=lambda r, u, g: (r.dtype, r.shape[-1]),
    )


def _args(dtype=torch.bfloat16, D=32):
    g = torch.Generator().manual_seed(0)
    r, u = (torch.randn(4, D, generator=g).to(dtype) for _ in range(2))
    return r, u, torch.randn(D, generator=g).to(dtype)


def _run(op, *args):
    return dispatch(op, *args)


def test_mismatch_disables_the_signature_warns_and_returns_eager():
    op = _op("wrong")
    args = _args()
    with pytest.warns(ExactditMismatchWarning, match=r"wrong failed verification .* first at index \(0, 0\)"):
        out = _run(op, *args)
    assert torch.equal(out, _residual_gate_add(*args))
    out2 = _run(op, *args)  # disabled now: eager, no second warning, kernel not called again
    assert torch.equal(out2, _residual_gate_add(*args))
    rep = exactdit.report(show=False)["wrong"]
    assert rep["fused"] == 0 and rep["eager"] == 2
    assert rep["eager_reasons"] == {"mismatch at verification": 1, "disabled after a mismatch": 1}
    assert len(rep["disabled"]) == 1 and "128 of 128 elements differ" in next(iter(rep["disabled"].values()))


def test_an_output_eager_shares_with_an_input_is_a_difference_a_fresh_copy_cannot_pass():
    # a fused output is a storage of its own: where eager's is a view of an input (or at a storage
    # offset), equal bits and strides are not enough (fuzzer finding: an alias fused as a copy)
    def view_of_input(x, y):
        return x[1:], x * y

    op = FusedOp(name="view", reference=view_of_input, fused=lambda x, y: (x[1:].clone(), x * y),
                 unsupported=lambda x, y: None, signature=lambda x, y: (x.dtype,))
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    with pytest.warns(ExactditMismatchWarning, match=r"storage offset 0 differs from eager's 4"):
        out = _run(op, x, y)
    assert out[0].data_ptr() == x[1:].data_ptr()  # eager's answer
    ref = view_of_input(x, y)
    assert gate.sharing((x, y), ref) == (("input", 0), None)
    fresh = (x[:2].clone(), ref[1])
    assert gate.sharing_difference((x, y), fresh, (x[:2], ref[1])) == (
        "output 0 shares the storage of ('input', 0) in eager, of nothing else fused")
    twice = x * y
    assert gate.sharing((x, y), (twice, twice.t())) == (None, ("output", 0))
    assert gate.sharing((x, y), (torch.empty(0), torch.empty(0))) == (None, None)  # no storage, nothing shared
    assert gate.sharing_difference((x, y), (ref[1], ref[1].clone()), (ref[1], ref[1].clone())) is None


def test_a_kernel_that_raises_is_disabled_and_eager_answers():
    """A kernel that cannot compile or launch for a signature must not break the model."""
    calls = []

    def broken(r, u, g):
        calls.append(1)
        raise RuntimeError("CompilationError at 106:8:\nLoop-carried variable c changes shape")

    op = FusedOp("broken", _residual_gate_add, broken, lambda r, u, g: None, lambda r, u, g: (r.dtype,))
    args = _args()
    with pytest.warns(ExactditMismatchWarning, match="raised RuntimeError: Loop-carried variable c changes shape"):
        out = _run(op, *args)
    assert torch.equal(out, _residual_gate_add(*args))
    assert torch.equal(_run(op, *args), _residual_gate_add(*args))
    assert len(calls) == 1  # disabled after the first failure
    rep = exactdit.report(show=False)["broken"]
    assert rep["eager_reasons"] == {"mismatch at verification": 1, "disabled after a mismatch": 1}


def test_other_signatures_stay_enabled_after_a_mismatch():
    op = _op("partly_wrong", wrong_after=1)
    _run(op, *_args(D=32))  # verified
    with pytest.warns(ExactditMismatchWarning):
        _run(op, *_args(D=48))  # second call is wrong: this signature is disabled
    _run(op, *_args(D=32))  # still trusted, kernel runs unchecked
    rep = exactdit.report(show=False)["partly_wrong"]
    assert rep["fused"] == 2 and rep["eager"] == 1 and len(rep["verified"]) == 1


def test_verified_signature_is_not_checked_again():
    calls = []
    op = _op("trusted", wrong_after=1, calls=calls)
    args = _args()
    first = _run(op, *args)
    second = _run(op, *args)  # the kernel is now wrong, but a verified signature is trusted
    assert torch.equal(first, _residual_gate_add(*args))
    assert not torch.equal(second, first) and len(calls) == 2


def test_verify_all_checks_every_call(monkeypatch):
    monkeypatch.setenv("EXACTDIT_VERIFY_ALL", "1")
    op = _op("checked", wrong_after=1)
    args = _args()
    _run(op, *args)
    with pytest.warns(ExactditMismatchWarning):
        out = _run(op, *args)
    assert torch.equal(out, _residual_gate_add(*args))


def test_trust_never_checks(monkeypatch):
    monkeypatch.setenv("EXACTDIT_TRUST", "1")
    op = _op("raw")
    args = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _run(op, *args)
    assert torch.equal(out, _plus_one_ulp(_residual_gate_add(*args)))
    assert exactdit.report(show=False)["raw"]["verified"] == []


def test_disable_switch_runs_everything_eager(monkeypatch):
    monkeypatch.setenv("EXACTDIT_DISABLE", "1")
    calls = []
    op = _op("off", calls=calls)
    out = _run(op, *_args())
    assert torch.equal(out, _residual_gate_add(*_args())) and not calls
    assert exactdit.report(show=False)["off"]["eager_reasons"] == {"disabled by EXACTDIT_DISABLE": 1}


def test_unsupported_inputs_run_eager_with_the_reason():
    calls = []
    op = _op("picky", calls=calls)
    _run(op, *_args(dtype=torch.float64))
    assert not calls
    assert exactdit.report(show=False)["picky"]["eager_reasons"] == {"unsupported dtype torch.float64": 1}


def test_no_verification_while_compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    calls = []
    op = _op("compiling", calls=calls)
    out = _run(op, *_args())
    assert torch.equal(out, _residual_gate_add(*_args())) and not calls
    assert exactdit.report(show=False)["compiling"]["eager_reasons"] == {
        "unverified signature during compile or graph capture": 1
    }


def test_report_prints_a_table(capsys):
    _run(_op("tabled", wrong_after=5), *_args())
    rep = exactdit.report()
    printed = capsys.readouterr().out
    assert "tabled" in printed and "fused" in printed.splitlines()[0]
    assert rep["tabled"]["fused"] == 1 and str(rep) in printed
    exactdit.reset_report()
    assert exactdit.report(show=False)["tabled"]["fused"] == 0
    assert len(exactdit.report(show=False)["tabled"]["verified"]) == 1


def test_counts_are_thread_safe():
    op = _op("threads", wrong_after=10**9)
    args = _args()

    def work():
        for _ in range(50):
            _run(op, *args)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rep = exactdit.report(show=False)["threads"]
    assert rep["fused"] + rep["eager"] == 200 and rep["eager"] == 0


def test_cpu_without_interpreter_runs_eager():
    code = (
        "import torch\n"
        "from exactdit import gate\n"
        "print(gate.backend_support([torch.randn(4, 8, dtype=torch.bfloat16)]))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "cpu device (fused kernels need a CUDA GPU)" in out.stdout


def test_inputs_that_require_grad_run_eager():
    calls = []
    op = _op("autograd", wrong_after=10, calls=calls)
    r, u, g = _args(dtype=torch.float32)
    u.requires_grad_(True)
    out = _run(op, r, u, g)
    out.sum().backward()  # eager result keeps its graph
    assert u.grad is not None and not calls
    with torch.no_grad():
        _run(op, r, u, g)
    assert calls
    assert exactdit.report(show=False)["autograd"]["eager_reasons"] == {"autograd is recording (fused kernels have no backward)": 1}


def test_a_nan_mismatch_shows_the_bit_patterns():
    """Two NaNs print alike; the warning must show which bits differ (issue 17, item 7)."""

    def other_nan(r, u, g):
        out = _residual_gate_add(r, u, g).clone()
        out.view(torch.int16)[0, 0] = 0x7FA5  # a NaN eager never gives
        return out

    op = FusedOp("nan_payload", _residual_gate_add, other_nan, lambda r, u, g: None, lambda r, u, g: (r.dtype,))
    r, u, g = _args()
    r[0, 0] = float("nan")  # eager's result there is a NaN too
    with pytest.warns(ExactditMismatchWarning, match=r"fused nan \(0x7fa5\) vs eager nan \(0x[0-9a-f]{4}\)"):
        _run(op, r, u, g)
    assert gate.first_difference(torch.tensor([-0.0]), torch.tensor([0.0])).endswith(
        "fused -0.0 (0x80000000) vs eager 0.0 (0x00000000)"
    )


def _specialized_op(name, *, launcher_wrong=False, no_launcher=False):
    """An op with a specialised launcher per layout (``no_launcher``: it has none to give);
    ``log`` records which route served each call."""
    log = []

    def specialize(r, u, g):
        log.append("specialize")
        if no_launcher:
            return None

        def fast(r, u, g, poisoned=False):
            log.append("fast")
            out = _residual_gate_add(r, u, g).clone()
            return _plus_one_ulp(out) if launcher_wrong else out

        return fast

    def fused(r, u, g):
        log.append("fused")
        return _residual_gate_add(r, u, g).clone()

    op = FusedOp(name=name, reference=_residual_gate_add, fused=fused, unsupported=lambda *a: None,
                 signature=lambda r, u, g: (r.dtype, r.shape[-1]), specialize=specialize)
    return op, log


def test_a_specialised_launcher_is_verified_then_serves_its_layout():
    op, log = _specialized_op("specialised")
    args = _args()
    for _ in range(3):
        assert torch.equal(_run(op, *args), _residual_gate_add(*args))
    assert log == ["specialize", "fast", "fast", "fast"]  # built once, verified, then straight to it
    assert exactdit.report(show=False)["specialised"]["fused"] == 3


def test_a_layout_without_a_specialised_launcher_is_not_asked_again():
    op, log = _specialized_op("specialised.none", no_launcher=True)
    args = _args()
    for _ in range(3):
        assert torch.equal(_run(op, *args), _residual_gate_add(*args))
    assert log == ["specialize", "fused", "fused", "fused"]
    assert exactdit.report(show=False)["specialised.none"]["fused"] == 3


def test_a_wrong_specialised_launcher_is_caught_by_verification():
    op, log = _specialized_op("specialised.wrong", launcher_wrong=True)
    args = _args()
    with pytest.warns(ExactditMismatchWarning):
        out = _run(op, *args)
    assert torch.equal(out, _residual_gate_add(*args))
    _run(op, *args)
    assert log == ["specialize", "fast"]  # disabled: never served again
    assert exactdit.report(show=False)["specialised.wrong"]["eager_reasons"] == {
        "mismatch at verification": 1, "disabled after a mismatch": 1}


def test_switches_and_autograd_bypass_the_specialised_launcher(monkeypatch):
    op, log = _specialized_op("specialised.switches")
    r, u, g = _args(dtype=torch.float32)
    _run(op, r, u, g)
    monkeypatch.setenv("EXACTDIT_DISABLE", "1")
    _run(op, r, u, g)
    monkeypatch.delenv("EXACTDIT_DISABLE")
    u.requires_grad_(True)
    _run(op, r, u, g).sum().backward()
    assert u.grad is not None
    assert log == ["specialize", "fast"]
    reasons = exactdit.report(show=False)["specialised.switches"]["eager_reasons"]
    assert reasons == {"disabled by EXACTDIT_DISABLE": 1, "autograd is recording (fused kernels have no backward)": 1}


def test_verify_all_disabling_a_signature_retires_its_launcher(monkeypatch):
    op, log = _specialized_op("specialised.retired")
    args = _args()
    _run(op, *args)
    monkeypatch.setenv("EXACTDIT_VERIFY_ALL", "1")
    log.clear()
    _run(op, *args)
    assert log == ["specialize", "fast"]  # each checked call verifies its launcher again
    op_wrong, _ = _specialized_op("x", launcher_wrong=True)
    object.__setattr__(op, "specialize", op_wrong.specialize)
    with pytest.warns(ExactditMismatchWarning):
        _run(op, *args)
    monkeypatch.delenv("EXACTDIT_VERIFY_ALL")
    assert torch.equal(_run(op, *args), _residual_gate_add(*args))  # eager, not the old launcher
    assert exactdit.report(show=False)["specialised.retired"]["eager_reasons"]["disabled after a mismatch"] == 1


def test_a_signature_whose_kernels_compile_runs_eager_until_they_are_compiled(monkeypatch):
    """The first calls do not wait for a compile worker: they return eager's result, counted with
    the reason, and the signature is verified (kernel run and compared) at the first call after
    the kernel is compiled; CUDA-graph mode (waiting_for_kernels) and EXACTDIT_WAIT_FOR_KERNELS=1
    wait instead."""
    import dataclasses

    monkeypatch.delenv("EXACTDIT_WAIT_FOR_KERNELS", raising=False)
    compiled, calls = [False], []
    op = dataclasses.replace(_op("still compiling", wrong_after=99, calls=calls), compiling=lambda: not compiled[0])
    args = _args()
    for _ in range(2):
        assert torch.equal(_run(op, *args), _residual_gate_add(*args))
    assert not calls  # the kernel never ran
    rep = exactdit.report(show=False)["still compiling"]
    assert rep["eager_reasons"] == {gate.COMPILING: 2} and not rep["verified"]
    compiled[0] = True
    _run(op, *args)
    assert calls and exactdit.report(show=False)["still compiling"]["verified"]  # verified, then fused

    in_graph_mode, by_env = (dataclasses.replace(_op(name, wrong_after=99), compiling=lambda: True)
                              for name in ("graphs", "env"))
    with gate.waiting_for_kernels():
        _run(in_graph_mode, *args)
    monkeypatch.setenv("EXACTDIT_WAIT_FOR_KERNELS", "1")
    _run(by_env, *args)
    for name in ("graphs", "env"):
        rep = exactdit.report(show=False)[name]
        assert gate.COMPILING not in rep["eager_reasons"] and rep["verified"], name


def test_an_op_whose_compile_state_cannot_be_read_is_verified_and_fails_there(monkeypatch):
    """Asking whether a region's kernels still compile loads their source (an unwritable cache
    raises there): the error must not reach the caller; verification meets it, and the signature
    runs eager with the reason, as when waiting for kernels."""
    import dataclasses

    monkeypatch.delenv("EXACTDIT_WAIT_FOR_KERNELS", raising=False)

    def unreadable():
        raise NotADirectoryError("the kernel cache")

    op = dataclasses.replace(_op("unreadable"), compiling=unreadable)
    op = dataclasses.replace(op, fused=lambda *a: unreadable())
    args = _args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExactditMismatchWarning)
        assert torch.equal(_run(op, *args), _residual_gate_add(*args))
    rep = exactdit.report(show=False)["unreadable"]
    assert rep["eager_reasons"] == {"mismatch at verification": 1} and "NotADirectoryError" in str(rep["disabled"])
