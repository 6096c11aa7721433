"""What deploying a model with exactdit costs and gives: first calls, new resolutions, CUDA-graph
coverage, memory.

    python3 benchmarks/models/bench_deploy.py --models flux qwen chroma [--config full] [--compile]
        [--resolutions 1024x1024 768x1360 512x512]
    python3 benchmarks/models/bench_deploy.py --models qwen --resolutions 1328x1328 --batch 2 --text-len 128 37 \
        --skip-first-calls     # graphs with a padded text mask: time, equality, memory, coverage only

Per model of the registry (``exactdit.harness.models``, production config, seeded random weights),
each measurement in a fresh Python process so that only the disk caches carry over:

- first calls: ``exactdit.patch`` then the first forward at three resolutions in a row (capture,
  kernel generation, compilation, verification), wall clock; once with empty caches (exactdit's
  kernel cache ``$EXACTDIT_CACHE``, Triton's, Inductor's: a temporary directory) and once more in
  a fresh process with the caches the first left ("warm"). ``--compile``: the same for diffusers'
  regional torch.compile (Inductor), the baseline the first calls are held against.
- steady state and memory at the first resolution, one process: eager, ``exactdit.patch``,
  ``exactdit.patch(cuda_graphs=True)``: median ms, ``torch.equal`` against eager, peak memory
  allocated and reserved beyond the weights and inputs (the graphs' pool counted: it is reserved),
  what the graphs cover (``exactdit.report()``: whole forward / block runs / nothing, and why),
  then the memory left once the patched model and its inputs are deleted.

Rows go to ``$OUT/results.jsonl`` (the results file's schema, see benchmarks/runner.py), a JSON
per model to ``$OUT/bench_deploy_<model>.json``; a table is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

#: three resolutions in a row per model (height x width [x frames]): production first
RESOLUTIONS = {
    "qwen": ["1328x1328", "1024x1024", "928x1664"],
    "wan": ["480x832x33", "544x960x33", "480x832x17"],
    "wan-1.3b": ["480x832x33", "544x960x33", "480x832x17"],
}
IMAGE_RESOLUTIONS = ["1024x1024", "768x1360", "512x512"]
GIB = 2**30


def parse_resolution(text: str) -> tuple[int, int, int | None]:
    parts = [int(p) for p in text.split("x")]
    return parts[0], parts[1], (parts[2] if len(parts) > 2 else None)


def _inputs(name, tr, resolution, args):
    import torch

    from exactdit.harness import models

    h, w, f = parse_resolution(resolution)
    kw = models.forward_inputs(name, tr, height=h, width=w, num_frames=f, batch=args.batch,
                               text_len=args.text_len or None)
    if args.mask_ones:  # Qwen-Image with a text mask of all ones (what its pipeline passes for one prompt)
        text = kw["encoder_hidden_states"]
        kw["encoder_hidden_states_mask"] = torch.ones(text.shape[:2], dtype=torch.long, device=text.device)
    return kw


def _build(args):
    import torch

    from exactdit.harness import models

    t = time.perf_counter()
    tr = models.build_transformer(args.model, args.config, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    return tr, time.perf_counter() - t


# --- children: one measurement each, in a fresh process ----------------------------------------------


def child_first_calls(args) -> dict:
    """First call at each resolution in a row, through exactdit (or regional compile)."""
    import torch

    import exactdit
    from benchmarks.runner import first_call_s, kernels_ready_s

    tr, build_s = _build(args)
    calls = [_inputs(args.model, tr, r, args) for r in args.resolutions]
    t = time.perf_counter()
    if args.path == "compile":
        from benchmarks.models.bench_engine import compile_regions

        compile_regions(tr)
    else:
        exactdit.patch(tr)
    patch_s = time.perf_counter() - t
    first = [first_call_s(tr, kw) for kw in calls]
    # until every kernel is compiled (regions run eager meanwhile), so that the warm process finds them all
    ready = kernels_ready_s()
    second = [first_call_s(tr, kw) for kw in calls]  # (a second call of each: verifies what compiled since)
    del tr, calls
    gc.collect()
    torch.cuda.empty_cache()
    return {"build_s": build_s, "patch_s": patch_s, "first_call_s": first, "kernels_ready_s": ready,
            "second_call_s": second}


def _peaks(fn) -> tuple[dict, object]:
    """(peak memory allocated / reserved beyond what was allocated before ``fn``, in GiB; fn's result)."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return {"peak_allocated_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
            "peak_reserved_gib": (torch.cuda.max_memory_reserved() - base) / GIB}, out


def child_memory(args) -> dict:
    """Steady-state time, equality, peak memory and graph coverage at the first resolution; the
    memory left after the patched model is deleted."""
    import torch

    import exactdit
    from benchmarks.runner import first_call_s, forward_ms, settle_graphs
    from exactdit.harness.metrics import outputs_equal
    from exactdit.patches import cuda_graphs

    tr, _ = _build(args)
    kw = _inputs(args.model, tr, args.resolutions[0], args)
    weights_gib = torch.cuda.memory_allocated() / GIB
    result = {"weights_and_inputs_gib": weights_gib}

    mem, (eager_ms, ref) = _peaks(lambda: forward_ms(tr, kw, args.repeat))
    result["eager"] = {"ms": eager_ms, **mem}

    exactdit.patch(tr)
    first_call_s(tr, kw)  # compiles (its peak is the first call's, reported apart)
    mem, (ms, out) = _peaks(lambda: forward_ms(tr, kw, args.repeat))
    result["exactdit"] = {"ms": ms, "equal": outputs_equal(out, ref), **mem}
    del out
    exactdit.unpatch(tr)

    exactdit.reset_report()
    exactdit.patch(tr, cuda_graphs=True)
    # the first call runs normally, the second records (the whole forward or its blocks), block graphs are timed
    mem, (ms, out) = _peaks(lambda: (settle_graphs(tr, kw), forward_ms(tr, kw, args.repeat))[-1])
    graphed = cuda_graphs.graphed(tr).summary()
    report = exactdit.report(show=False)
    entry = report.get(f"cuda_graphs.{type(tr).__name__}", {})
    blocks = report.get(f"cuda_graphs.{type(tr).__name__}.blocks", {})
    result["graphs"] = {"ms": ms, "equal": outputs_equal(out, ref), **mem,
                        "pool_gib": graphed["memory_bytes"] / GIB, "graphed": entry.get("graphed"),
                        "graphed_why": entry.get("graphed_why"), "whole_graphs": graphed["graphs"],
                        "block_graphs": graphed["block_graphs"], "block_replays": blocks.get("fused", 0),
                        "blocks_not_graphed": blocks.get("eager_reasons", {}), "failed": graphed["failed"][:4]}
    del out, ref, graphed

    # released: the model deleted as it is (patched, with its graphs), then the inputs
    before = torch.cuda.memory_allocated()
    del tr, kw
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    result["released"] = {"left_allocated_gib": torch.cuda.memory_allocated() / GIB,
                          "left_reserved_gib": torch.cuda.memory_reserved() / GIB,
                          "freed_gib": (before - torch.cuda.memory_allocated()) / GIB}
    return result


CHILDREN = {"first-calls": child_first_calls, "memory": child_memory}


# --- the parent ----------------------------------------------------------------------------------------


def run_child(args, kind: str, path: str, cache: str, timeout: int) -> dict:
    env = dict(os.environ, EXACTDIT_CACHE=os.path.join(cache, "exactdit"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    cmd = [sys.executable, __file__, "--child", kind, "--path", path, "--models", args.model, "--config", args.config,
           "--batch", str(args.batch), "--repeat", str(args.repeat), "--resolutions", *args.resolutions]
    cmd += ["--text-len", *map(str, args.text_len)] if args.text_len else []
    cmd += ["--mask-ones"] if args.mask_ones else []
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:400]}
    out = json.loads(lines[-1][len("RESULT "):])
    out["process_s"] = time.perf_counter() - t
    return out


def measure(args) -> dict:
    model = args.model
    result = {"model": model, "config": args.config, "batch": args.batch, "resolutions": args.resolutions,
              "text_len": args.text_len, "mask_ones": args.mask_ones}
    paths = [] if args.skip_first_calls else ["exactdit"] + (["compile"] if args.compile else [])
    with tempfile.TemporaryDirectory(prefix=f"deploy-{model}-") as root:
        for path in paths:
            cache = os.path.join(root, path)  # empty for the cold process, what it left for the warm one
            for temperature in ("cold", "warm"):
                result[f"{path} {temperature}"] = run_child(args, "first-calls", path, cache, args.timeout)
                print(f"{model} {path} {temperature}: {result[f'{path} {temperature}']}", flush=True)
        result["memory"] = run_child(args, "memory", "exactdit", os.path.join(root, "exactdit"), args.timeout)
    print(f"{model} memory: {result['memory']}", flush=True)
    return result


def rows_of(result: dict) -> list[dict]:
    """The results file's rows of one model's measurements."""
    text = (f", text {'/'.join(map(str, result['text_len']))}" if result.get("text_len") else "") + \
        (", mask of ones" if result.get("mask_ones") else "")
    label = f"{result['model']} transformer deploy ({result['config']}{text})"
    batch = result["batch"]
    rows = []
    for key, value in result.items():
        if not (key.startswith("exactdit ") or key.startswith("compile ")) or "error" in value:
            continue
        path, temperature = key.split(" ")
        name = "exactdit" if path == "exactdit" else "regional torch.compile"
        for i, (res, first, second) in enumerate(zip(result["resolutions"], value["first_call_s"],
                                                      value["second_call_s"])):
            rows.append(dict(model_or_op=label, shape=f"{res} B={batch}", dtype="bf16",
                             path=f"{name} first call, {temperature} caches", ms=first * 1000, ratio=None,
                             ratio_kind=None, equal=None, first_call_s=first, second_call_s=second,
                             resolution_order=i + 1, patch_s=value["patch_s"], build_s=value["build_s"],
                             kernels_ready_s=value.get("kernels_ready_s")))
    memory = result.get("memory", {})
    if "error" not in memory:
        eager_ms = memory["eager"]["ms"]
        shape = f"{result['resolutions'][0]} B={batch}"
        for path, name in (("eager", "eager"), ("exactdit", "exactdit"), ("graphs", "exactdit + CUDA graphs")):
            m = memory[path]
            extra = {k: v for k, v in m.items() if k not in ("ms", "equal")}
            rows.append(dict(model_or_op=label, shape=shape, dtype="bf16", path=f"{name} (steady, memory)",
                             ms=m["ms"], ratio=eager_ms / m["ms"], ratio_kind="eager_ms/ms",
                             equal=m.get("equal", True), weights_and_inputs_gib=memory["weights_and_inputs_gib"],
                             **extra))
        rows.append(dict(model_or_op=label, shape=shape, dtype="bf16", path="released (patched with graphs, deleted)",
                         ms=None, ratio=None, ratio_kind=None, equal=None, **memory["released"]))
    return rows


def print_table(result: dict) -> None:
    lines = [f"\n## {result['model']} ({result['config']}), B={result['batch']}",
             "| path | caches | " + " | ".join(result["resolutions"]) + " |",
             "|---|---|" + "---|" * len(result["resolutions"])]
    for key, value in result.items():
        if key.startswith(("exactdit ", "compile ")):
            cells = (["error: " + value["error"]] if "error" in value
                     else [f"{s:.1f} s" for s in value["first_call_s"]])
            lines.append(f"| {key.split(' ')[0]} first call | {key.split(' ')[1]} | " + " | ".join(cells) + " |")
    memory = result.get("memory", {})
    if "error" in memory:
        lines.append(f"memory: error: {memory['error']}")
    elif memory:
        lines.append("\n| path | ms | equal | peak allocated GiB | peak reserved GiB |\n|---|---|---|---|---|")
        for path in ("eager", "exactdit", "graphs"):
            m = memory[path]
            lines.append(f"| {path} | {m['ms']:.2f} | {m.get('equal', True)} | {m['peak_allocated_gib']:.2f} | "
                         f"{m['peak_reserved_gib']:.2f} |")
        g = memory["graphs"]
        lines.append(f"graphs: {g['graphed']} ({g['graphed_why'] or '-'}); pool {g['pool_gib']:.2f} GiB, "
                     f"{g['whole_graphs']} whole, {g['block_graphs']} block graphs, not graphed: "
                     f"{g['blocks_not_graphed'] or '-'}")
        lines.append(f"released: {memory['released']['left_allocated_gib']:.3f} GiB left allocated")
    print("\n".join(lines), flush=True)


def main() -> None:
    from exactdit.harness import models

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, help="registered names (default: all)")
    ap.add_argument("--config", default="full")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--resolutions", nargs="+", default=None,
                    help="HxW[xF] in a row (default: per model, production first)")
    ap.add_argument("--text-len", type=int, nargs="+", default=None,
                    help="real prompt tokens per row (rows of different lengths: Qwen-Image / Chroma pad with a mask)")
    ap.add_argument("--mask-ones", action="store_true", help="Qwen-Image: pass a text mask of all ones")
    ap.add_argument("--repeat", type=int, default=5, help="timed forwards per steady-state median")
    ap.add_argument("--compile", action="store_true", help="also regional torch.compile's first calls")
    ap.add_argument("--skip-first-calls", action="store_true", help="only the steady-state / memory process")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per child process")
    ap.add_argument("--child", choices=sorted(CHILDREN), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--path", default="exactdit", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        args.model = args.models[0]
        print("RESULT " + json.dumps(CHILDREN[args.child](args)), flush=True)
        return

    from benchmarks.runner import append_results, write_json

    names = args.models or models.model_names()
    for name in names:
        args.model = name
        chosen = args.resolutions
        args.resolutions = chosen or RESOLUTIONS.get(name, IMAGE_RESOLUTIONS)
        result = measure(args)
        print_table(result)
        append_results(rows_of(result), "benchmarks/models/bench_deploy.py")
        write_json(f"bench_deploy_{name}_{args.config}_b{args.batch}.json", result)
        args.resolutions = chosen


if __name__ == "__main__":
    main()
