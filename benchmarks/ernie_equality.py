"""GPU proof: exactdit.patch leaves ERNIE-Image's output bit-identical.

For the full-size transformer (hidden 4096, 36 layers, bf16, seeded random weights) and the small and
tiny configs (configs, weights, inputs and the sampling loop are exactdit.harness's: tiny.build_transformer,
sampling.forward_inputs / make_inputs / sample): one forward at 1024x1024 and 848x1264, batch 1 and 2 (CFG, padded text), unpatched
vs patched (first patched call verifies new signatures, the second runs verified kernels with no
checks), a CUDA-graph capture of the verified patched forward, and the pipeline's sampling loop
(FlowMatchEulerDiscreteScheduler, CFG) for 8 and 50 steps with md5 of the final latents.

Run from the repository root on a CUDA GPU: ``python benchmarks/ernie_equality.py``. Prints
exactdit.report() and a summary table; writes ``ernie_equality.json`` to $OUT. A time guard skips
the longest optional runs past ~200 s (they are listed as skipped).

Without a CUDA GPU it runs a short CPU smoke version (tiny config, small images, 3 steps); with
TRITON_INTERPRET=1 the fused kernels then run in Triton's interpreter, else everything falls back to eager.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, table, write_json  # noqa: E402
import exactdit  # noqa: E402
from exactdit.gate import first_difference  # noqa: E402
from exactdit.harness.metrics import md5_tensor as md5  # noqa: E402
from exactdit.harness.sampling import forward, forward_inputs, latent_hw_for, make_inputs, sample, synchronize  # noqa: E402
from exactdit.harness.tiny import build_transformer, dtype_from_name  # noqa: E402

#: CPU only for a smoke run of this script (tiny config); the proof is for the GPU.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SAMPLE_TEXT_LENS = (96, 41)  # prompt, negative prompt (CFG batch of 2, the shorter one padded)

T0 = time.time()
BUDGET_S = float(os.environ.get("ERNIE_EQ_BUDGET_S", 200))

FORWARD_CASES = [  # (label, height, width, text_lens)
    ("1024x1024", 1024, 1024, [128]),
    ("1024x1024", 1024, 1024, [128, 37]),
    ("848x1264", 848, 1264, [77]),
    ("848x1264", 848, 1264, [101, 64]),
]


def elapsed() -> float:
    return time.time() - T0


def build(name):
    """``config`` or ``config@dtype`` (bf16 unless named)."""
    config, _, dtype = name.partition("@")
    return build_transformer(config, seed=0, dtype=dtype_from_name(dtype or "bf16"), device=DEVICE)


def inputs(model, height, width, text_lens):
    return forward_inputs(model, latent_hw=latent_hw_for(height, width), text_lens=text_lens, device=DEVICE)


def tokens(height, width, text_lens) -> int:
    h, w = latent_hw_for(height, width)
    return h * w + max(text_lens)


def timed(fn):
    synchronize(DEVICE)
    t = time.perf_counter()
    out = fn()
    synchronize(DEVICE)
    return out, (time.perf_counter() - t) * 1e3


def compare(out, ref) -> tuple[bool, str]:
    problem = first_difference(out, ref)
    if problem is None:
        return True, ""
    return False, f"{problem}; max_abs {float((out.float() - ref.float()).abs().max()):.3g}"


def forward_checks(name, model, rows):
    for label, h, w, lens in FORWARD_CASES:
        kw = inputs(model, h, w, lens)
        S = tokens(h, w, lens)
        exactdit.unpatch(model)
        ref, eager_ms = timed(lambda: forward(model, kw))
        exactdit.patch(model)
        first, first_ms = timed(lambda: forward(model, kw))  # verifies this shape's signatures
        second, second_ms = timed(lambda: forward(model, kw))  # verified: kernels only
        ok1, why1 = compare(first, ref)
        ok2, why2 = compare(second, ref)
        rows.append({
            "config": name, "run": f"forward {label}", "B": len(lens), "S": S, "text_lens": str(lens),
            "eager_ms": eager_ms, "patched_first_ms": first_ms, "patched_ms": second_ms,
            "equal": ok1 and ok2, "detail": why1 or why2,
            "out_rms": float(ref.float().pow(2).mean().sqrt()), "finite": bool(torch.isfinite(ref).all()),
        })
        print(f"[{elapsed():6.1f}s] {name} {label} B={len(lens)}: equal={ok1 and ok2} {why1 or why2}", flush=True)


def cuda_graph_check(name, model, rows):
    """Capture the patched forward (signatures verified above) in a CUDA graph and replay it."""
    kw = inputs(model, 1024, 1024, [128, 37])
    exactdit.unpatch(model)
    ref = forward(model, kw)
    exactdit.patch(model)
    forward(model, kw)  # verified already; warm
    row = {"config": name, "run": "cuda graph 1024x1024", "B": 2, "S": tokens(1024, 1024, [128, 37]),
           "text_lens": "[128, 37]"}
    try:
        static = {k: v.clone() for k, v in kw.items()}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            forward(model, static)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        exactdit.reset_report()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = forward(model, static)
        captured = exactdit.report(show=False)
        graph.replay()
        torch.cuda.synchronize()
        ok, why = compare(out, ref)
        eager_in_capture = {op: e["eager_reasons"] for op, e in captured.items() if e["eager"]}
        row.update(equal=ok, detail=why or f"eager during capture: {eager_in_capture or 'none'}")
        del graph
    except Exception as e:  # report, do not hide
        row.update(equal=False, detail=f"capture failed: {type(e).__name__}: {e}")
        traceback.print_exc()
    rows.append(row)
    print(f"[{elapsed():6.1f}s] {name} cuda graph: {row['equal']} {row['detail']}", flush=True)


def sampling_check(name, model, rows, height, width, steps):
    text_len, neg_text_len = SAMPLE_TEXT_LENS
    kw = make_inputs(model, latent_hw=latent_hw_for(height, width), text_len=text_len, neg_text_len=neg_text_len,
                     seed=0, guidance_scale=4.0, device=DEVICE)
    exactdit.unpatch(model)
    ref, eager_ms = timed(lambda: sample(model, kw, steps).latents)
    exactdit.patch(model)
    out, patched_ms = timed(lambda: sample(model, kw, steps).latents)
    ok, why = compare(out, ref)
    rows.append({
        "config": name, "run": f"sample {height}x{width} {steps} steps", "B": 2,
        "S": tokens(height, width, SAMPLE_TEXT_LENS), "text_lens": str(kw.text_lens.tolist()), "eager_ms": eager_ms, "patched_ms": patched_ms, "equal": ok, "detail": why,
        "md5_eager": md5(ref), "md5_patched": md5(out),
    })
    print(f"[{elapsed():6.1f}s] {name} sample {height}x{width} {steps} steps: md5 eager {md5(ref)} patched {md5(out)} "
          f"equal={ok}", flush=True)


def main():
    torch.backends.cuda.matmul.allow_tf32 = False  # defaults, stated
    rows, skipped, summaries = [], [], {}
    plan = {  # config -> sampling runs (height, width, steps), most important first
        "full": [(1024, 1024, 8), (512, 512, 50), (1024, 1024, 50)],
        "small": [(1024, 1024, 8), (1024, 1024, 50)],
        "tiny": [(1024, 1024, 8), (1024, 1024, 50)],
        "diffusers_test": [(256, 256, 8), (256, 256, 50)],
        "diffusers_test@fp32": [(256, 256, 8)],
    }
    if DEVICE != "cuda":  # smoke run of this script on a CPU machine
        plan = {"tiny": [(256, 256, 3)]}
        FORWARD_CASES[:] = [("256x384", 256, 384, [9]), ("272x208", 272, 208, [9, 4])]
    for name, runs in plan.items():
        model = build(name)
        print(f"[{elapsed():6.1f}s] built {name}", flush=True)
        summaries[name] = exactdit.patch(model)
        print(summaries[name])
        forward_checks(name, model, rows)
        if name == "full" and DEVICE == "cuda":
            cuda_graph_check(name, model, rows)
        for i, (h, w, steps) in enumerate(runs):
            if i > 0 and elapsed() > BUDGET_S:
                skipped.append(f"{name} sample {h}x{w} {steps} steps (time guard)")
                continue
            sampling_check(name, model, rows, h, w, steps)
        exactdit.unpatch(model)
        del model
        torch.cuda.empty_cache()

    print("\nexactdit.report() over the whole run:")
    rep = exactdit.report()
    cols = ["config", "run", "B", "S", "eager_ms", "patched_ms", "equal", "detail"]
    for r in rows:
        for c in cols:
            r.setdefault(c, "")
    print("\n" + table(rows, cols))
    for r in rows:
        if "md5_eager" in r:
            print(f"{r['config']:5s} {r['run']:28s} eager {r['md5_eager']}  patched {r['md5_patched']}")
    if skipped:
        print("skipped:", "; ".join(skipped))
    all_equal = all(r["equal"] is True for r in rows)
    print(f"\nALL EQUAL: {all_equal}   ({elapsed():.0f} s)")
    path = write_json("ernie_equality.json", {
        "environment": environment() if DEVICE == "cuda" else {"device": "cpu smoke run"}, "patch": summaries, "rows": rows, "skipped": skipped,
        "report": {k: dict(v) for k, v in rep.items()}, "all_equal": all_equal, "seconds": elapsed(),
    })
    print("wrote", path)


if __name__ == "__main__":
    main()
