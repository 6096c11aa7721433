"""Host time per call: a fused region through the gate, its bare Triton launches, eager ATen, and
one CUDA-graph replay of a whole (tiny) transformer.

    python3 benchmarks/kernels/bench_host_overhead.py [--calls 3000]

Tensors are tiny ([1, 64] bf16) so the GPU never holds the host up: the wall time per call of a
back-to-back loop is the host's cost. Everywhere, also the parts that need no GPU: the gate's bookkeeping
on a verified signature (a kernel that does nothing) and the CUDA-graph mode's per-call check of
a full-size Flux model built on the meta device; without a GPU it says which parts it skipped. Rows go to ``$OUT/results.jsonl``.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import pstats
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from benchmarks.runner import append_results, fused_from_the_first_call  # noqa: E402

aten = torch.ops.aten


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t) / calls * 1e6


def gated_residual_region(device):
    """The engine's region for ``x + g * u`` (bf16), taken out of its rewritten graph."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from exactdit.engine.backend import rewrite

    def f(x, u, g):
        return x + g * u

    x, u, g = (torch.randn(1, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    gm = make_fx(f)(x, u, g)
    rewrite(gm, "host")
    region = next(n.target.exactdit_region for n in gm.graph.nodes if hasattr(n.target, "exactdit_region"))
    return region, (x, u, g), f


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    fused_from_the_first_call()
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []

    def row(what: str, us: float, shape: str = "[1, 64] bf16") -> None:
        rows.append(dict(model_or_op=f"host time per call: {what}", shape=shape, dtype="bf16", path=what, ms=us / 1e3,
                         ratio=None, ratio_kind=None, equal=None))
        print(f"{what:55s} {us:8.1f} us", flush=True)

    if cuda:
        region, inputs, f = gated_residual_region("cuda")
        out = region(*inputs)  # verifies the signature
        assert torch.equal(out[0], f(*inputs))
        row("region through the gate (verified signature)", per_call_us(lambda: region(*inputs), args.calls, sync))
        fast = region._specialize(*inputs)
        if fast is not None:
            row("its launch plan alone (compiled launchers)", per_call_us(lambda: fast(*inputs), args.calls, sync))
        else:
            print("no launch plan: this Triton's launch convention is not the one exactdit.device.launch knows", flush=True)
        outs = region._fused(*inputs)
        bare = [(ln.fn[ln.grid], list(args), ln.kwargs)
                for ln, args in region._arguments(inputs[0].device, inputs, outs, [o.stride() for o in outs])]

        def launch_only():
            for fn, a, kw in bare:
                fn(*a, **kw)

        row("its Triton JIT launches alone (fn[grid])", per_call_us(launch_only, args.calls, sync))
        row("eager ATen x + g * u (two kernels)", per_call_us(lambda: f(*inputs), args.calls, sync))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            region(*inputs)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue()[-2500:])

        import exactdit
        from exactdit.harness import models

        tr = models.build_transformer("flux", "tiny", dtype=torch.bfloat16, device="cuda", seed=1)
        kw = models.forward_inputs("flux", tr, batch=1, height=64, width=64, seed=2)
        exactdit.patch(tr, cuda_graphs=True)
        with torch.no_grad():
            row("tiny Flux forward, CUDA-graph replay", per_call_us(lambda: tr(**kw), 300, sync), "tiny flux 64x64")
        exactdit.unpatch(tr)
    else:
        print("no GPU: region launches and graph replays skipped", flush=True)

    # the gate's own bookkeeping on a verified signature, with a kernel that does nothing
    from exactdit import gate

    x = torch.zeros(1, 64, dtype=torch.bfloat16, device="cuda" if cuda else "cpu")
    noop = gate.FusedOp(name="host.noop", reference=lambda *a: a[0], fused=lambda *a: a[0],
                        unsupported=lambda *a: None, signature=lambda *a: ("noop",))
    planned = dataclasses.replace(noop, name="host.noop.planned",
                                  specialize=lambda *a: (lambda *b, poisoned=False: b[0]))
    supported, gate.backend_support = gate.backend_support, lambda tensors: None  # the CPU too
    try:
        for op, what in ((noop, "no launch plan"), (planned, "launch plan")):
            gate.dispatch(op, x, x, x)  # verifies
            row(f"gate bookkeeping per call (verified, {what}, no kernel)",
                per_call_us(lambda: gate.dispatch(op, x, x, x), args.calls, lambda: None))
    finally:
        gate.backend_support = supported

    # the CUDA-graph mode's per-call check of the model's state on a full-size Flux.1-dev
    from exactdit.harness import models
    from exactdit.patches.cuda_graphs import _ModelWatch

    spec = models.get_spec("flux")
    with torch.device("meta"):
        full = spec.transformer_cls(**spec.config("full"))
    watch = _ModelWatch(full)
    with torch.no_grad():
        row("CUDA-graph mode: model state check (Flux.1-dev, 1,160 tensors)",
            per_call_us(watch.state, 300, lambda: None), "flux full")
    append_results(rows, "benchmarks/kernels/bench_host_overhead.py")


if __name__ == "__main__":
    main()
