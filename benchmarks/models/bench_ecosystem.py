"""The compatibility matrix of issue 34: exactdit on a transformer as users run it (LoRA, fp8
layerwise casting, torchao, GGUF, offloading, attention backends), each configuration against
itself unpatched.

    python3 benchmarks/models/bench_ecosystem.py --model flux --height 1024 --width 1024 [--configs lora fp8-cast ...]
    python3 benchmarks/models/bench_ecosystem.py --model wan --height 480 --width 832 --frames 33 --configs all
    python3 benchmarks/models/bench_ecosystem.py --list

For each configuration: the production model with seeded random weights is built on the GPU and
the configuration applied; eager (the configuration unpatched) is timed (CUDA-event median of
``--repeat`` forwards); then ``exactdit.patch`` (first call wall clock, output ``torch.equal`` to
eager's, time); then, unless ``--no-compile``, diffusers' regional ``torch.compile`` of the same
configuration. Each row says how the blocks were captured (whole / in parts / eager, with the
reasons from ``exactdit.report()``), the share of region calls that ran fused, and what ran
unfused and why. A configuration whose package is missing (peft, torchao, gguf, flash-attn,
sageattention) or that fails is a row with ``skipped`` / ``error`` and the reason. Rows go to
``$OUT/results.jsonl`` (``benchmarks/runner.py``) and ``$OUT/bench_ecosystem_<model>.json``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import tempfile
import traceback

import torch

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import exactdit  # noqa: E402
from benchmarks.runner import (append_results, environment, first_call_s, forward_ms,  # noqa: E402
                               outputs_equal, settle_graphs, write_json)
from tests.ecosystem import in_blocks, load_gguf, lora_state_dict, to_nf4, write_gguf  # noqa: E402


class Skip(Exception):
    """A configuration that cannot run here (a package missing, a GPU feature absent)."""


def _need(module: str, extra: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise Skip(f"{module} not installed ({extra})")


# --- configurations: name -> (description, apply(tr, args) -> tr) --------------------------------

def _lora(tr, args):
    _need("peft", "exactdit[lora]")
    tr.load_lora_adapter(lora_state_dict(tr, 1, args.rank), adapter_name="a", prefix=None)
    return tr


def _lora2(tr, args):
    _need("peft", "exactdit[lora]")
    tr.load_lora_adapter(lora_state_dict(tr, 1, args.rank), adapter_name="a", prefix=None)
    tr.load_lora_adapter(lora_state_dict(tr, 2, args.rank), adapter_name="b", prefix=None)
    tr.set_adapters(["a", "b"], weights=[0.7, 0.4])
    return tr


def _lora_fused(tr, args):
    _lora(tr, args)
    tr.fuse_lora(lora_scale=0.8)
    return tr


def _lora_hotswap(tr, args):
    _need("peft", "exactdit[lora]")
    tr.enable_lora_hotswap(target_rank=args.rank)
    tr.load_lora_adapter(lora_state_dict(tr, 1, args.rank // 2), adapter_name="a", prefix=None)
    return tr


def _fp8_cast(tr, args):
    tr.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    return tr


def _torchao(config_name):
    def apply(tr, args):
        _need("torchao", "exactdit[quant]")
        import torchao.quantization as q

        config = getattr(q, config_name)()
        q.quantize_(tr, config, filter_fn=lambda m, n: isinstance(m, torch.nn.Linear) and in_blocks(n))
        return tr
    return apply


def _gguf(qtype):
    def apply(tr, args):
        _need("gguf", "exactdit[quant]")
        import gguf
        import numpy as np

        kind = getattr(gguf.GGMLQuantizationType, qtype)
        try:
            gguf.quants.quantize(np.zeros((1, 256), np.float32), kind)
        except NotImplementedError:
            raise Skip(f"the gguf package has no {qtype} quantizer (gguf-py dequantizes K-quants only)") from None
        with tempfile.TemporaryDirectory(prefix="exactdit-gguf-", dir=args.tmp) as folder:
            path = write_gguf(tr, folder, kind, arch=args.model)
            cls = type(tr)
            del tr
            gc.collect()
            torch.cuda.empty_cache()
            out = load_gguf(cls, path, folder)
        return out.to(args.device)
    return apply


def _bnb_nf4(tr, args):
    _need("bitsandbytes", "exactdit[quant]")
    return to_nf4(tr)


def _model_cpu_offload(tr, args):
    """What ``pipe.enable_model_cpu_offload()`` installs on the transformer: accelerate's hook that
    moves it to the GPU for its forward (and leaves it there until the next model is called)."""
    _need("accelerate", "exactdit[test]")
    from accelerate import cpu_offload_with_hook

    tr, _ = cpu_offload_with_hook(tr.to("cpu"), torch.device(args.device))
    return tr


def _group_offload(offload_type):
    def apply(tr, args):
        from diffusers.hooks import apply_group_offloading

        extra = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
        apply_group_offloading(tr.to("cpu"), onload_device=torch.device(args.device),
                               offload_device=torch.device("cpu"), offload_type=offload_type,
                               use_stream=args.device == "cuda", **extra)
        return tr
    return apply


def _attention(backend, module=None):
    def apply(tr, args):
        if module:
            _need(module, f"pip install {module}")
        tr.set_attention_backend(backend)
        return tr
    return apply


CONFIGS = {
    "plain": ("bf16, nothing added", lambda tr, args: tr),
    "lora": ("peft LoRA, one adapter, unfused", _lora),
    "lora-2": ("peft LoRA, two adapters, set_adapters weights 0.7 / 0.4", _lora2),
    "lora-fused": ("peft LoRA fused (fuse_lora, scale 0.8)", _lora_fused),
    "lora-hotswap": ("enable_lora_hotswap, then load_lora_adapter(hotswap=True) of a second adapter", _lora_hotswap),
    "fp8-cast": ("enable_layerwise_casting(float8_e4m3fn storage, bf16 compute)", _fp8_cast),
    "torchao-int8wo": ("torchao quantize_ Int8WeightOnlyConfig on the blocks' linears",
                       _torchao("Int8WeightOnlyConfig")),
    "torchao-fp8wo": ("torchao quantize_ Float8WeightOnlyConfig on the blocks' linears",
                      _torchao("Float8WeightOnlyConfig")),
    "torchao-fp8dq": ("torchao quantize_ Float8DynamicActivationFloat8WeightConfig on the blocks' linears",
                      _torchao("Float8DynamicActivationFloat8WeightConfig")),
    "gguf-q8_0": ("GGUF Q8_0 (blocks' linears) through from_single_file + GGUFQuantizationConfig", _gguf("Q8_0")),
    "gguf-q4_k": ("GGUF Q4_K (blocks' linears)", _gguf("Q4_K")),
    "gguf-q4_0": ("GGUF Q4_0 (blocks' linears; the 4-bit type gguf-py can write)", _gguf("Q4_0")),
    "bnb-nf4": ("bitsandbytes NF4 4-bit on the blocks' linears (BitsAndBytesConfig's layers), bf16 compute",
                _bnb_nf4),
    "model-cpu-offload": ("accelerate cpu_offload_with_hook (enable_model_cpu_offload's hook)", _model_cpu_offload),
    "group-offload-block": ("apply_group_offloading block_level, 1 block per group, use_stream",
                            _group_offload("block_level")),
    "group-offload-leaf": ("apply_group_offloading leaf_level, use_stream", _group_offload("leaf_level")),
    "attn-native-flash": ("set_attention_backend('_native_flash')", _attention("_native_flash")),
    "attn-native-efficient": ("set_attention_backend('_native_efficient')", _attention("_native_efficient")),
    "attn-native-cudnn": ("set_attention_backend('_native_cudnn')", _attention("_native_cudnn")),
    "attn-flash": ("set_attention_backend('flash') (flash-attn)", _attention("flash", "flash_attn")),
    "attn-flash-varlen": ("set_attention_backend('flash_varlen') (flash-attn)",
                          _attention("flash_varlen", "flash_attn")),
    "attn-sage": ("set_attention_backend('sage') (sageattention)", _attention("sage", "sageattention")),
}


# --- measuring -------------------------------------------------------------------------------------

def fresh_state() -> None:
    from exactdit import state

    torch._dynamo.reset()
    state.reset()


def capture_summary(tr) -> dict:
    """How the blocks ran under exactdit: whole / in parts / eager with the reasons, the share of
    region calls that ran fused (of those made once a region's kernels were compiled), what ran
    unfused and why, graphs captured per block class."""
    from exactdit.engine import coverage
    from exactdit.patches import engine

    from exactdit.gate import COMPILING

    report = exactdit.report(show=False)
    regions = {k: v for k, v in report.items() if ".r" in k and "#" in k}
    fused = sum(v["fused"] for v in regions.values())
    # (calls made while a region's kernels were still compiling run eager by design: not counted)
    calls = fused + sum(v["eager"] - v["eager_reasons"].get(COMPILING, 0) for v in regions.values())
    unfused: dict = {}
    for k, v in report.items():
        for why, n in v["eager_reasons"].items():
            if why == COMPILING:
                continue
            key = f"{k.split('#')[0]}: {why}" if k.startswith("engine.") else why
            unfused[key] = unfused.get(key, 0) + n
    in_parts = coverage.in_parts()
    engine_eager = {k: v["eager_reasons"] for k, v in report.items() if k.startswith("engine.") and v["eager"]}
    capture = ("eager" if engine_eager and not fused else "in parts" if in_parts else "whole" if fused else "none")
    if engine_eager and fused:
        capture += " + some blocks eager"
    return {"capture": capture, "in_parts": in_parts, "engine_eager": engine_eager,
            "fused_share": fused / calls if calls else 0.0, "region_calls": calls,
            "graphs": {label: s.graphs for label, s in engine._states.items()},
            "disabled": {k: v["disabled"] for k, v in report.items() if v["disabled"]},
            "unfused": dict(sorted(unfused.items(), key=lambda kv: -kv[1])[:12])}


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:300] if lines else ""


def build(args):
    from exactdit.harness import models

    tr = models.build_transformer(args.model, args.config, dtype=torch.bfloat16, device=args.device, seed=args.seed)
    kw = models.forward_inputs(args.model, tr, height=args.height, width=args.width, num_frames=args.frames,
                               batch=args.batch, seed=args.seed + 1, device=args.device)
    return tr, kw


def _profile(tr, kw) -> dict:
    """One forward's kernel time by kind, idle gaps, heaviest kernels, SM clock and power (printed)."""
    from benchmarks.models.bench_engine import breakdown
    from exactdit.harness import models

    return breakdown(lambda: models.run_forward(tr, kw))


def run_config(name: str, args) -> dict:
    from benchmarks.models.bench_engine import compile_regions

    desc, apply = CONFIGS[name]
    row = {"config": name, "description": desc}
    tr = None
    try:
        fresh_state()
        tr, kw = build(args)
        tr = apply(tr, args)
        eager_ms, ref = forward_ms(tr, kw, args.repeat)
        row["eager_ms"] = eager_ms
        print(f"[{name}] eager {eager_ms:.2f} ms", flush=True)
        exactdit.patch(tr)
        row["first_call_s"] = first_call_s(tr, kw)
        ms, out = forward_ms(tr, kw, args.repeat)
        row.update(exactdit_ms=ms, equal=outputs_equal(out, ref), **capture_summary(tr))
        if args.profile and torch.cuda.is_available():
            row["exactdit_profile"] = _profile(tr, kw)
        if name == "lora-hotswap":
            graphs = dict(row["graphs"])
            tr.load_lora_adapter(lora_state_dict(tr, 2, args.rank), adapter_name="a", prefix=None, hotswap=True)
            ms, out = forward_ms(tr, kw, args.repeat)
            row["recaptured_after_hotswap"] = capture_summary(tr)["graphs"] != graphs
            row["exactdit_ms_after_hotswap"] = ms
            exactdit.unpatch(tr)
            _, ref_b = forward_ms(tr, kw, 1)
            row["equal_after_hotswap"] = outputs_equal(out, ref_b) and not torch.equal(ref, ref_b)
            row["equal"] = row["equal"] and row["equal_after_hotswap"]
        else:
            exactdit.unpatch(tr)
        print(f"[{name}] exactdit {ms:.2f} ms equal={row['equal']} capture={row['capture']} "
              f"fused {row['fused_share']:.0%} in_parts={row['in_parts']} eager={row['engine_eager']}", flush=True)
        if args.graphs:
            exactdit.patch(tr, cuda_graphs=True)
            settle_graphs(tr, kw)
            ms, out = forward_ms(tr, kw, args.repeat)
            graphed = exactdit.report(show=False).get(f"cuda_graphs.{type(tr).__name__}", {})
            exactdit.unpatch(tr)
            _, now = forward_ms(tr, kw, 1)  # (after a hot-swap the reference is the second adapter's)
            row.update(graphs_ms=ms, graphs_equal=outputs_equal(out, now), graphed=graphed.get("graphed"),
                       graphed_why=graphed.get("graphed_why"))
            print(f"[{name}] exactdit + CUDA graphs {ms:.2f} ms equal={row['graphs_equal']} "
                  f"graphed={row['graphed']} ({row['graphed_why']})", flush=True)
        if args.compile:
            torch._dynamo.reset()
            try:
                try:
                    compile_regions(tr)
                    row["compile_first_call_s"] = first_call_s(tr, kw)
                    row["compile_fullgraph"] = True
                except Exception as e:  # noqa: BLE001 - hooks Dynamo cannot trace: as users would, with breaks
                    row["compile_fullgraph"] = f"{type(e).__name__}: {_first_line(e)}"
                    for m in tr.modules():
                        m._compiled_call_impl = None
                    torch._dynamo.reset()
                    tr.compile_repeated_blocks(fullgraph=False)
                    row["compile_first_call_s"] = first_call_s(tr, kw)
                row["compile_ms"], cout = forward_ms(tr, kw, args.repeat)
                row["compile_equal"] = outputs_equal(cout, ref)
                if args.profile and torch.cuda.is_available():
                    row["compile_profile"] = _profile(tr, kw)
                print(f"[{name}] regional compile {row['compile_ms']:.2f} ms", flush=True)
            except Exception as e:  # noqa: BLE001 - fullgraph compile may refuse hooks: a row, not a crash
                row["compile_error"] = f"{type(e).__name__}: {_first_line(e)}"
                print(f"[{name}] regional compile failed: {row['compile_error']}", flush=True)
        row["status"] = "ok"
    except Skip as e:
        row.update(status="skipped", reason=str(e))
        print(f"[{name}] skipped: {e}", flush=True)
    except Exception as e:  # noqa: BLE001 - one configuration failing is a row with the reason
        row.update(status="error", reason=f"{type(e).__name__}: {str(e).strip()[:400]}")
        print(f"[{name}] error: {row['reason']}\n{traceback.format_exc()[-2000:]}", flush=True)
    finally:
        del tr
        gc.collect()
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="flux", help="flux or wan (any name of exactdit.harness.models)")
    ap.add_argument("--config", default="full")
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", nargs="+", default=["all"], help=f"some of: {' '.join(CONFIGS)}, or all")
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank (hot-swap: the first adapter has half)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true",
                    help="one forward's kernel profile (by kind, idle, heaviest kernels, clock, power) for exactdit and compile")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip regional torch.compile")
    ap.add_argument("--graphs", action="store_true", help="also exactdit.patch(..., cuda_graphs=True)")
    ap.add_argument("--tmp", default=None, help="folder for the GGUF files (default: the system's)")
    ap.add_argument("--list", action="store_true", help="print the configurations and exit")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (tiny config, interpreter)")
    args = ap.parse_args()
    if args.list:
        for name, (desc, _) in CONFIGS.items():
            print(f"{name:22s} {desc}")
        return
    names = list(CONFIGS) if args.configs == ["all"] else args.configs
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configurations {unknown}; choose from {list(CONFIGS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the matrix times GPU forwards); --device cpu --config tiny to try the script")
    env = environment()
    frames = f"x{args.frames}" if args.frames else ""
    model, shape = f"{args.model} transformer forward ({args.config})", f"{args.height}x{args.width}{frames} B={args.batch}"
    rows = [run_config(name, args) for name in names]
    results = []
    for r in rows:
        base = dict(model_or_op=f"{model} [{r['config']}]", shape=shape, dtype="bf16", config=r["config"],
                    description=r["description"], status=r.get("status"), reason=r.get("reason"))
        if r.get("status") != "ok":
            results.append(dict(base, path="exactdit", ms=None, ratio=None, ratio_kind=None, equal=None))
            continue
        extra = {k: r[k] for k in ("capture", "in_parts", "engine_eager", "fused_share", "unfused", "graphs",
                                   "first_call_s", "disabled", "recaptured_after_hotswap", "equal_after_hotswap")
                 if k in r}
        results.append(dict(base, path="eager", ms=r["eager_ms"], ratio=1.0, ratio_kind="eager_ms/ms", equal=True))
        results.append(dict(base, path="exactdit", ms=r["exactdit_ms"], ratio=r["eager_ms"] / r["exactdit_ms"],
                            ratio_kind="eager_ms/ms", equal=r["equal"], **extra))
        if "graphs_ms" in r:
            results.append(dict(base, path="exactdit + CUDA graphs", ms=r["graphs_ms"],
                                ratio=r["eager_ms"] / r["graphs_ms"], ratio_kind="eager_ms/ms",
                                equal=r["graphs_equal"], graphed=r["graphed"], graphed_why=r["graphed_why"]))
        if "compile_ms" in r:
            results.append(dict(base, path="regional torch.compile", ms=r["compile_ms"],
                                ratio=r["eager_ms"] / r["compile_ms"], ratio_kind="eager_ms/ms",
                                equal=r["compile_equal"], first_call_s=r["compile_first_call_s"],
                                fullgraph=r["compile_fullgraph"]))
        elif "compile_error" in r:
            results.append(dict(base, path="regional torch.compile", ms=None, ratio=None, ratio_kind=None,
                                equal=None, status="error", reason=r["compile_error"]))
    append_results(results, "benchmarks/models/bench_ecosystem.py")
    write_json(f"bench_ecosystem_{args.model}_{'_'.join(names) if len(names) < 4 else 'many'}.json",
               {"env": env, "rows": rows})
    print("| config | eager ms | exactdit ms | x eager | compile ms | equal | capture | fused | unfused (top) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("status") != "ok":
            print(f"| {r['config']} | {r.get('status')}: {r.get('reason')} |||||||")
            continue
        top = "; ".join(f"{k} x{v}" for k, v in list(r["unfused"].items())[:3]) or "-"
        comp = f"{r['compile_ms']:.1f}" if "compile_ms" in r else r.get("compile_error", "-")[:60]
        if "compile_ms" in r and r.get("compile_fullgraph") is not True:
            comp += " (graph breaks)"
        print(f"| {r['config']} | {r['eager_ms']:.1f} | {r['exactdit_ms']:.1f} | {r['eager_ms'] / r['exactdit_ms']:.2f} "
              f"| {comp} | {r['equal']} | {r['capture']} | {r['fused_share']:.0%} | {top} |")


if __name__ == "__main__":
    main()
