"""Where a model's first call through the engine spends its time, and a new resolution's after it.

    python3 benchmarks/models/profile_first_call.py --mini hunyuan-video --resolutions 544x960x17 480x848x33
    python3 benchmarks/models/profile_first_call.py --model flux --config full --resolutions 1024x1024 768x1360
    python3 benchmarks/models/profile_first_call.py --model flux --config tiny --device cpu --resolutions 32x32 48x32

Builds the model with seeded random weights (``--model``/``--config`` from ``exactdit.harness.models``,
or ``--mini``: a mini's released model, its inputs at the given resolutions), runs one eager forward
per resolution (so that neither CUDA's, cuBLAS's nor attention's own first calls are counted), then
``exactdit.patch`` and, per resolution in order, the first call and a second one, wall clock (synced).
For each first call it prints the engine's own account (:mod:`exactdit.first_calls`: Dynamo capture,
partition, kernel source generation, Triton compile, out-layout probing, launch plans, verification,
the rest of the new graphs' first runs), summed and per block class, what the account leaves
(``unaccounted``: the model's code outside its blocks, and phases the engine does not time), Triton's
own compile count (its post-compile hook) and Dynamo's captured graphs. ``--compile``: the same first
calls through diffusers' regional torch.compile afterwards (``torch._dynamo.reset()`` between; with
``--caches cold`` Inductor's cache is fresh too), the baseline the first calls are held against.

``--caches cold`` (default) points exactdit's kernel cache, Triton's and Inductor's at an empty
temporary directory; ``warm`` keeps the environment's. Rows go to ``$OUT/results.jsonl`` (the
results file's schema, benchmarks/runner.py); a JSON with the account to ``$OUT``.
Off the GPU (``--device cpu``) kernels run in Triton's interpreter: nothing is compiled, and regions
whose bits follow CUDA's kernels run eager unverified, so only the shape of the account is shown.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])


def parse_args(argv=None):
    from benchmarks.runner import add_model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap)
    ap.add_argument("--resolutions", nargs="+", default=None,
                    help="HxW[xF] in a row (default: --height/--width/--frames, or the model's production size, "
                         "then the same again: a replayed first resolution)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: tiny configs)")
    ap.add_argument("--caches", choices=["cold", "warm"], default="cold",
                    help="cold: exactdit's, Triton's and Inductor's caches in an empty temporary directory")
    ap.add_argument("--compile", action="store_true", help="also diffusers' regional torch.compile's first calls")
    ap.add_argument("--no-eager-warmup", action="store_true", help="skip the eager forward per resolution first (and the comparison with it)")
    ap.add_argument("--dynamic", choices=["auto", "first", "static"], default="static",
                    help="exactdit.patch's dynamic: auto (None: symbolic from a block's second shape), first (True), "
                         "static (False)")
    ap.add_argument("--cprofile", action="store_true",
                    help="run each first call under cProfile (its times grow) and write the functions by cumulative "
                         "and own time to $OUT/first_call_cprofile_<model>_<dynamic>_<caches>.txt")
    return ap.parse_args(argv)


#: --dynamic -> exactdit.patch's ``dynamic``
DYNAMIC = {"auto": None, "first": True, "static": False}


def resolutions_of(args) -> list[str]:
    if args.resolutions:
        return list(args.resolutions)
    if args.height and args.width:
        return [f"{args.height}x{args.width}" + (f"x{args.frames}" if args.frames else "")]
    return [""]  # the model's production size


def parse_resolution(text: str) -> tuple[int | None, int | None, int | None]:
    if not text:
        return None, None, None
    parts = [int(p) for p in text.split("x")]
    return parts[0], parts[1], (parts[2] if len(parts) > 2 else None)


def mini_grid(name: str, height: int | None, width: int | None, frames: int | None):
    """A mini's production grid for ``height`` x ``width`` (x ``frames``) pixels: the latent scale
    factors are read off its production grid and the pixels it stands for (``480x848, 33 frames``
    for 9 latent frames of 60x106: 8x spatial, 4x temporal); text tokens stay the production's."""
    import dataclasses

    from tests import minis

    prod = minis.production_of(name)
    if height is None:
        return prod.grid
    pixels = prod.pixels.replace(",", " ").split()
    ph, pw = (int(p) for p in pixels[0].split("x"))
    spatial_h, spatial_w = ph // prod.grid.height, pw // prod.grid.width
    grid = dataclasses.replace(prod.grid, height=height // spatial_h, width=width // spatial_w)
    if frames is not None and prod.grid.frames > 1:
        temporal = (int(pixels[1]) - 1) // (prod.grid.frames - 1)
        grid = dataclasses.replace(grid, frames=(frames - 1) // temporal + 1)
    return grid


def build(args, device: str):
    import torch

    from exactdit.harness import models
    from tests import minis

    if args.mini:
        return minis.build(args.mini, dtype=torch.bfloat16, device=device, production=args.config != "tiny")
    return models.build_transformer(args.model, args.config, dtype=torch.bfloat16, device=device)


def inputs_at(args, tr, resolution: str, device: str) -> dict:
    from exactdit.harness import models
    from tests import minis

    h, w, f = parse_resolution(resolution)
    if args.mini:
        grid = mini_grid(args.mini, h, w, f) if args.config != "tiny" else None
        return minis.forward_inputs(args.mini, tr, batch=args.batch, device=device, grid=grid)
    return models.forward_inputs(args.model, tr, height=h, width=w, num_frames=f, batch=args.batch)


class TritonCompiles:
    """Triton's own count of compiled kernels (its ``jit_post_compile_hook``; None where this Triton
    has no such knob), a compile served by Triton's disk cache included."""

    def __init__(self):
        self.count, self.available = 0, False
        try:
            from triton import knobs
        except ImportError:
            return
        runtime = knobs.runtime
        if not hasattr(runtime, "jit_post_compile_hook"):
            return
        before = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            self.count += 1
            return before(*args, **kwargs) if before else None

        runtime.jit_post_compile_hook = hook
        self.available = True

    def value(self):
        return self.count if self.available else None


def dynamo_graphs() -> int:
    import torch

    return int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))


def difference(after: dict, before: dict) -> dict:
    """block class -> phase -> (seconds, count) added between two account snapshots."""
    out = {}
    for block, phases in after.items():
        for phase, (s, n) in phases.items():
            s0, n0 = before.get(block, {}).get(phase, (0.0, 0))
            if n != n0 or s != s0:
                out.setdefault(block, {})[phase] = (s - s0, n - n0)
    return out


def timed_call(tr, kw, outputs: list | None = None) -> float:
    from benchmarks.runner import first_call_s

    return first_call_s(tr, kw, outputs)  # (synced before and after)


def profile_calls(tr, calls: list[tuple[str, dict]], triton: TritonCompiles, eager: list | None = None,
                  cprofile: str | None = None) -> list[dict]:
    """First and second call per resolution, with the account's part of each; each output held to
    eager's at that resolution (``eager``: one output per call, None: not compared). ``cprofile``:
    a file the first calls' Python profile is appended to."""
    from benchmarks.runner import kernels_ready_s
    from exactdit import first_calls
    from exactdit.harness.metrics import outputs_equal

    rows = []
    for k, (resolution, kw) in enumerate(calls):
        for which in ("first", "second"):
            before, compiles, graphs = first_calls.snapshot(), triton.count, dynamo_graphs()
            out: list = []
            profiler = cProfile.Profile() if cprofile and which == "first" else None
            with profiler or contextlib.nullcontext():
                wall = timed_call(tr, kw, out)
            if profiler is not None:
                write_profile(profiler, cprofile, f"{resolution} first call ({wall:.2f} s under cProfile)")
            ready = kernels_ready_s()  # (its regions ran eager where their kernels were compiling)
            added = difference(first_calls.snapshot(), before)
            phases = first_calls.totals(added)
            accounted = sum(s for s, _ in phases.values())
            row = {"resolution": resolution or "production", "call": which, "wall_s": wall, "kernels_ready_s": ready,
                   "accounted_s": accounted,
                   "unaccounted_s": wall - accounted, "phases": {p: list(v) for p, v in phases.items()},
                   "per_block": {b: {p: list(v) for p, v in ph.items()} for b, ph in added.items()},
                   "triton_compiles": (triton.count - compiles) if triton.available else None,
                   "dynamo_graphs": dynamo_graphs() - graphs,
                   "equal": None if eager is None else outputs_equal(out[0], eager[k])}
            del out
            rows.append(row)
            show(row)
    return rows


def write_profile(profiler, path: str, title: str) -> None:
    """Append ``profiler``'s functions by cumulative and by own time to ``path``."""
    text = io.StringIO()
    for order, count in (("cumulative", 60), ("tottime", 30)):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(count)
    with open(path, "a") as f:
        f.write(f"## {title}\n{text.getvalue()}\n")


def show(row: dict) -> None:
    from exactdit import first_calls

    head = (f"{row['resolution']} {row['call']} call: {row['wall_s']:.2f} s; accounted {row['accounted_s']:.2f} s, "
            f"unaccounted {row['unaccounted_s']:.2f} s; Triton compiles {row['triton_compiles']}, "
            f"Dynamo graphs {row['dynamo_graphs']}")
    if row["equal"] is not None:
        head += "; equal to eager" if row["equal"] else "; NOT EQUAL to eager"
    if row["kernels_ready_s"] > 0.005:
        head += f"; its last kernels compiled {row['kernels_ready_s']:.2f} s after it returned"
    print(head, flush=True)
    if row["phases"]:
        print("  " + first_calls.describe({p: tuple(v) for p, v in row["phases"].items()}), flush=True)
        for block, phases in sorted(row["per_block"].items()):
            print(f"    {block}: " + first_calls.describe({p: tuple(v) for p, v in phases.items()}), flush=True)


def compile_first_calls(tr, calls: list[tuple[str, dict]]) -> list[dict]:
    import torch

    from benchmarks.models.bench_engine import compile_regions

    torch._dynamo.reset()
    compile_regions(tr)
    rows = []
    for resolution, kw in calls:
        for which in ("first", "second"):
            rows.append({"resolution": resolution or "production", "call": which, "wall_s": timed_call(tr, kw)})
            print(f"regional torch.compile {rows[-1]['resolution']} {which} call: {rows[-1]['wall_s']:.2f} s", flush=True)
    return rows


def set_environment(argv=None) -> None:
    """What must be set before Triton or exactdit is imported (benchmarks.runner imports exactdit):
    the caches' directories, and Triton's interpreter off the GPU."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--device", default="cuda")
    early.add_argument("--caches", default="cold")
    known, _ = early.parse_known_args(argv)
    if known.caches == "cold":
        root = tempfile.mkdtemp(prefix="first-call-")
        os.environ.update(EXACTDIT_CACHE=os.path.join(root, "exactdit"), TRITON_CACHE_DIR=os.path.join(root, "triton"),
                          TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"))
    if known.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def main(argv=None) -> None:
    set_environment(argv)
    args = parse_args(argv)

    import exactdit
    from benchmarks.runner import append_results, environment, model_label, write_json
    from exactdit import first_calls
    from exactdit.engine import capture_cache
    from exactdit.state import STATE

    triton = TritonCompiles()
    t = time.perf_counter()
    tr = build(args, args.device)
    resolutions = resolutions_of(args)
    calls = [(r, inputs_at(args, tr, r, args.device)) for r in resolutions]
    model = f"{args.mini} mini (tiny) transformer forward" if args.mini and args.config == "tiny" else model_label(args)[0]
    print(f"built {model} in {time.perf_counter() - t:.1f} s; resolutions {resolutions}; caches {args.caches}", flush=True)
    eager = None if args.no_eager_warmup else []
    if eager is not None:
        for r, kw in calls:
            print(f"eager {r or 'production'}: {timed_call(tr, kw, eager):.2f} s (warm-up)", flush=True)

    t = time.perf_counter()
    summary = exactdit.patch(tr, dynamic=DYNAMIC[args.dynamic])
    patch_s = time.perf_counter() - t
    print(f"patch {patch_s:.2f} s {summary}", flush=True)
    cprofile = None
    if args.cprofile:
        out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.dirname(__file__)), "results")
        os.makedirs(out_dir, exist_ok=True)
        cprofile = os.path.join(out_dir, f"first_call_cprofile_{args.mini or args.model}_{args.dynamic}_{args.caches}.txt")
    rows = profile_calls(tr, calls, triton, eager, cprofile)
    del eager
    report = exactdit.report(show=False)
    print("\n".join(first_calls.lines(report.first_calls)), flush=True)
    lowered = {"enabled": capture_cache.enabled(), **STATE.captures}
    print("\n".join(capture_cache.lines() or ["lowered graphs: none loaded or stored"]), flush=True)
    exactdit.unpatch(tr)
    compiled = compile_first_calls(tr, calls) if args.compile else []

    env = environment()
    results = []
    for r in rows:
        if r["call"] != "first":
            continue
        order = "first call" if r is rows[0] else f"new resolution {rows.index(r) // 2 + 1}"
        results.append(dict(model_or_op=model, shape=f"{r['resolution']} B={args.batch}", dtype="bf16",
                            path=f"exactdit {order} ({args.caches} caches, dynamic={args.dynamic}"
                                 + ("" if lowered["enabled"] else ", EXACTDIT_CAPTURE_CACHE=0") + "), profiled",
                            ms=r["wall_s"] * 1e3, ratio=None,
                            ratio_kind=None, equal=r["equal"], first_call_s=r["wall_s"], kernels_ready_s=r["kernels_ready_s"],
                            patch_s=patch_s,
                            phases_s={p: round(v[0], 3) for p, v in r["phases"].items()},
                            phase_counts={p: v[1] for p, v in r["phases"].items()},
                            per_block_s={b: {p: round(v[0], 3) for p, v in ph.items()} for b, ph in r["per_block"].items()},
                            unaccounted_s=r["unaccounted_s"], triton_compiles=r["triton_compiles"],
                            dynamo_graphs=r["dynamo_graphs"], lowered_graphs=lowered, device=args.device))
    for r in compiled:
        if r["call"] == "first":
            order = "first call" if r is compiled[0] else "new resolution"
            results.append(dict(model_or_op=model, shape=f"{r['resolution']} B={args.batch}", dtype="bf16",
                                path=f"regional torch.compile {order} ({args.caches} caches)", ms=r["wall_s"] * 1e3,
                                ratio=None, ratio_kind=None, equal=None, first_call_s=r["wall_s"], device=args.device))
    print(append_results(results, "benchmarks/models/profile_first_call.py"), flush=True)
    name = args.mini or args.model
    print(write_json(f"profile_first_call_{name}_{args.config}.json",
                     {"args": vars(args), "env": env, "patch_s": patch_s, "exactdit": rows, "compile": compiled,
                      "account": {b: {p: list(v) for p, v in ph.items()} for b, ph in report.first_calls.items()}}))


if __name__ == "__main__":
    main()
