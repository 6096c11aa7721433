"""GPU proof that ``exactdit.patch`` (the engine) leaves a model's output bit-identical.

    python3 benchmarks/models/engine_equality.py --model flux --config full \\
        --forward 1024x1024x1 768x1360x2 --sample-steps 28 --test-configs
    python3 benchmarks/models/engine_equality.py --model qwen --edit --forward 1024x1024x1   # Qwen-Image-Edit-2511
    python3 benchmarks/models/engine_equality.py --model qwen --forward 1328x1328x2 --text-len 128 37  # padded text

For the registered model (``exactdit.harness.models``, seeded random weights, bf16):
* ``--forward HxWxB``: one transformer forward at that size, eager vs patched (``torch.equal``;
  the first patched call verifies each region, the second runs verified kernels only);
* ``--sample-steps N``: diffusers' own pipeline (tiny offline text encoders / VAE, the
  model-size transformer) sampling N steps at production size, md5 of the final latents, eager
  vs patched;
* ``--test-configs``: diffusers' own test config of the transformer, bf16 and fp32, one forward.
Prints one line per case and ALL EQUAL / DIFFERENT; writes ``engine_equality_<model>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import exactdit  # noqa: E402
from benchmarks.runner import environment, fused_from_the_first_call, write_json  # noqa: E402
from exactdit.harness import models  # noqa: E402
from exactdit.harness.models import qwen  # noqa: E402
from exactdit.harness.metrics import md5_tensor, outputs_equal  # noqa: E402


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


_forward = models.run_forward
_equal = outputs_equal


def forward_case(name, tr, height, width, batch, cuda_graphs=False, edit=False, text_len=None) -> dict:
    kw = models.forward_inputs(name, tr, height=height, width=width, batch=batch, text_len=text_len)
    if edit:
        kw = qwen.with_condition_image(kw)
    ref = _forward(tr, kw)
    exactdit.patch(tr, cuda_graphs=cuda_graphs)
    try:  # with CUDA graphs: the first call records, the others replay
        outs = [_forward(tr, kw) for _ in range(3)]
    finally:
        exactdit.unpatch(tr)
    return dict(case=f"forward {height}x{width} B={batch}" + (" + condition image" if edit else "")
                + (f" prompts of {text_len} tokens" if text_len else "")
                + (" (CUDA graphs)" if cuda_graphs else ""),
                equal=all(_equal(out, ref) for out in outs))


def _result(output):
    """A pipeline output's latents: ``images`` for image pipelines, ``frames`` for video ones."""
    return output.frames if hasattr(output, "frames") else output.images


def sample_case(name, config, steps, cuda_graphs=False) -> dict:
    pipe = models.build_pipeline(name, config, dtype=torch.bfloat16, device=DEVICE)
    kw = lambda: models.pipeline_call_kwargs(name, steps=steps)  # noqa: E731 (a fresh generator per run)
    with torch.no_grad():
        t = time.perf_counter()
        eager = _result(pipe(**kw()))
        t_eager = time.perf_counter() - t
        exactdit.patch(pipe, cuda_graphs=cuda_graphs)
        try:
            t = time.perf_counter()
            patched = _result(pipe(**kw()))
            t_patched = time.perf_counter() - t
        finally:
            exactdit.unpatch(pipe)
    eager, patched = (x if isinstance(x, torch.Tensor) else torch.stack(list(x)) for x in (eager, patched))
    return dict(case=f"sampling {steps} steps" + (" (CUDA graphs)" if cuda_graphs else ""), equal=_equal(eager, patched), md5_eager=md5_tensor(eager),
                md5_patched=md5_tensor(patched), eager_s=t_eager, patched_s=t_patched)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flux")
    ap.add_argument("--config", default="full")
    ap.add_argument("--forward", nargs="*", default=[])
    ap.add_argument("--sample-steps", type=int, default=0)
    ap.add_argument("--test-configs", action="store_true")
    ap.add_argument("--cuda-graphs", action="store_true", help="also every forward and sampling case in CUDA-graph mode")
    ap.add_argument("--edit", action="store_true",
                    help="qwen only: Qwen-Image-Edit-2511 (zero_cond_t, a condition image stream) for --forward")
    ap.add_argument("--text-len", type=int, nargs="*", default=None,
                    help="prompt tokens per row of the --forward cases (rows of different lengths: padded text)")
    args = ap.parse_args()
    fused_from_the_first_call()
    if args.edit and args.model != "qwen":
        ap.error("--edit applies to --model qwen")
    rows = []
    if args.forward:
        config = models.get_spec(args.model).resolve_config(args.config)
        if args.edit:
            config.update(qwen.EDIT_CONFIG)
        tr = models.build_transformer(args.model, config, dtype=torch.bfloat16, device=DEVICE)
        for spec in args.forward:
            h, w, b = (int(v) for v in spec.split("x"))
            lens = None if not args.text_len else args.text_len[0] if len(args.text_len) == 1 else args.text_len[:b]
            for graphs in (False, True) if args.cuda_graphs else (False,):
                rows.append(forward_case(args.model, tr, h, w, b, graphs, args.edit, lens))
                print(rows[-1], flush=True)
        del tr
        torch.cuda.empty_cache()
    if args.test_configs:
        for dtype in (torch.bfloat16, torch.float32):
            tr = models.build_transformer(args.model, "diffusers_test", dtype=dtype, device=DEVICE)
            kw = models.forward_inputs(args.model, tr, batch=2, height=64, width=64)
            ref = _forward(tr, kw)
            exactdit.patch(tr)
            out = _forward(tr, kw)
            exactdit.unpatch(tr)
            rows.append(dict(case=f"diffusers test config {dtype}", equal=_equal(out, ref)))
            print(rows[-1], flush=True)
    if args.sample_steps:
        for graphs in (False, True) if args.cuda_graphs else (False,):
            rows.append(sample_case(args.model, args.config, args.sample_steps, graphs))
            print(rows[-1], flush=True)
    report = exactdit.report(show=False)
    disabled = {k: v["disabled"] for k, v in report.items() if v["disabled"]}
    verdict = "ALL EQUAL" if all(r["equal"] for r in rows) else "DIFFERENT"
    print(verdict, "disabled:", disabled or "none")
    write_json(f"engine_equality_{args.model}.json", {"rows": rows, "verdict": verdict, "disabled": disabled,
                                                      **environment()})


if __name__ == "__main__":
    main()
