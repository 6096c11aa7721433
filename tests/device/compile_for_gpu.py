"""Compile the kernels exactdit's engine generates for a real GPU target, on a machine without
a GPU (Triton's compiler and ptxas need no device), and report what the PTX contains.

Triton's interpreter, which the CPU tests use, executes kernels as NumPy: it does not check what
the compiler checks (loop-carried variables keeping their type, for one). This script captures
tiny models' blocks on the CPU, compiles every region kernel the engine generates for ``sm_90``
through Triton's normal pipeline, and prints one JSON object per kernel: ok/error and counts of
the PTX instructions the numerics rely on. Run as a script (``python tests/compile_for_gpu.py
[--minis name,...]``): TRITON_INTERPRET must be
unset before Triton is imported, so tests call it in a subprocess (tests/device/test_compile_for_gpu.py).
"""

from __future__ import annotations

import json
import os
import re
import sys

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

#: PTX instructions whose presence or absence the kernels' numerics depend on.
PTX_COUNTS = {
    "fma": r"\bfma\.rn(\.ftz)?\.f32\b",
    "mul_rn": r"\bmul\.rn\.f32\b",
    "add_rn": r"\badd\.rn\.f32\b",
    "rsqrt_approx": r"\brsqrt\.approx\.f32\b",
    "rsqrt_approx_ftz": r"\brsqrt\.approx\.ftz\.f32\b",
    "div_rn": r"\bdiv\.rn\.f32\b",
    "cvt_rn_bf16": r"\bcvt\.rn\.bf16(x2)?\.f32\b",
    "packed_half": r"\bfma\.rn\.(bf16x2|f16x2)\b",  # numerics.dtype_mul/add/sub
    "ftz": r"\.ftz\.",
}

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.int16: "i16", torch.uint8: "u8", torch.bool: "i1"}
def compile_launch(kernel: JITFunction, signature: dict, constexprs: dict, options: dict, attrs: dict, arch: int):
    """Compile one intercepted launch for ``sm_<arch>`` through Triton's normal pipeline."""
    opts = dict(options)
    if isinstance(opts.get("extern_libs"), dict):
        libs = {k: v for k, v in opts["extern_libs"].items() if v}
        opts["extern_libs"] = tuple(libs.items()) or None
        if not libs:
            opts.pop("extern_libs")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def engine_launches():
    """(label, kernel, signature, constexprs, options) of every kernel the engine generates for the
    captured blocks of tiny Flux.1, Qwen-Image, ERNIE-Image and Wan graphs on the CPU (views, cats,
    pieces, tables, complex RoPE, the LayerNorm and mean templates) and for a hand-built
    ``_fused_rms_norm`` + RoPE graph (CPU captures decompose F.rms_norm); strides typed as the JIT
    types the real launch (1 -> constant)."""
    import operator

    import torch.fx as fx

    from exactdit.engine.capture import capture_graphs
    from exactdit.harness import models
    from exactdit.patches.engine import repeated_blocks
    from tests import minis

    graphs = []
    mini_names = sys.argv[sys.argv.index("--minis") + 1].split(",") if "--minis" in sys.argv else []
    for name in ("flux", "qwen", "ernie", "wan") if not mini_names else ():
        tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16)
        video = dict(num_frames=5) if models.get_spec(name).video else {}
        kw = models.forward_inputs(name, tr, batch=2, height=32, width=32, **video)
        graphs += [(name, gm) for _, gm, _ in capture_graphs(tr, kw, repeated_blocks(tr))]
    for name in mini_names:  # mini models in both dtypes (tests/minis/test_minis.py)
        for dtype in (torch.bfloat16, torch.float32):
            tr = minis.build(name, dtype=dtype)
            kw = minis.forward_inputs(name, tr)
            graphs += [(name, gm) for _, gm, _ in capture_graphs(tr, kw, repeated_blocks(tr))]
    # F.rms_norm per head on two streams, cat, interleaved RoPE (Flux's QK path on CUDA)
    aten, g = torch.ops.aten, fx.Graph()

    def node(target, *args, val):
        n = g.call_function(target, args) if target else g.placeholder(f"x{len(g.nodes)}")
        n.meta["val"] = val
        return n

    bf = torch.bfloat16
    txt, img = node(None, val=torch.empty(1, 3, 256, dtype=bf)), node(None, val=torch.empty(1, 5, 256, dtype=bf))
    w = node(None, val=torch.empty(128, dtype=bf))
    normed = []
    for x, s in ((txt, 3), (img, 5)):
        v = node(aten.view.default, x, [1, s, 2, 128], val=torch.empty(1, s, 2, 128, dtype=bf))
        r = node(aten._fused_rms_norm.default, v, [128], w, 1e-6, val=(torch.empty(1, s, 2, 128, dtype=bf),))
        normed.append(node(operator.getitem, r, 0, val=torch.empty(1, s, 2, 128, dtype=bf)))
    cat = node(aten.cat.default, normed, 1, val=torch.empty(1, 8, 2, 128, dtype=bf))
    out = node(aten.mul.Tensor, cat, 2.0, val=torch.empty(1, 8, 2, 128, dtype=bf))
    g.output((out,))
    graphs.append(("fused_rms_norm", fx.GraphModule(torch.nn.Module(), g)))
    for name, gm in graphs:
        yield from region_launches(name, gm)


def region_launches(name: str, gm):
    """(label, kernel, signature, constexprs, options) of every kernel the engine generates for
    the regions of the captured graph ``gm`` (strides typed as the JIT types the real launch)."""
    from exactdit.engine import kernel_source, tables
    from exactdit.engine.partition import find_regions
    from exactdit.device.numerics import LAUNCH_OPTIONS

    spec = tables.TableSpec(15179, 2048, 65536, 65536, 0, 163840, 281472820903935, 32640)
    for region in find_regions(gm, name).regions:
        for k in region.kernels:
            fn = kernel_source.load(k.source)
            sig, consts = {}, dict(k.constexprs)
            for j in range(len(region.tables)):
                consts.update(spec.constexprs(f"tab{j}"))
            for p, arg in zip(k.params, fn.arg_names):
                if p[0] in ("in", "out"):
                    node_ = k.inputs[p[1]] if p[0] == "in" else region.outputs[p[1]]
                    dt = node_.meta["val"].dtype
                    sig[arg] = "*" + _DTYPES[torch.float32 if dt == torch.complex64 else dt]
                elif p[0] == "tab":
                    sig[arg] = "*i16"
                elif p[0] == "int":  # a per-row integer: not specialised (do_not_specialize)
                    sig[arg] = "i32"
                else:
                    node_ = k.inputs[p[1]] if p[0] == "in_stride" else region.outputs[p[1]]
                    v = node_.meta["val"]
                    if v.dtype == torch.complex64:
                        v = torch.view_as_real(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta"))
                    sig[arg] = "constexpr" if v.stride()[p[2]] == 1 else "i32"
                    if v.stride()[p[2]] == 1:
                        consts[arg] = 1
            for arg in fn.arg_names:
                if arg in consts:
                    sig[arg] = "constexpr"
            options = dict(num_warps=k.num_warps, **LAUNCH_OPTIONS)
            yield f"engine {region.name} {region.describe()}", fn, sig, consts, options


def main() -> None:
    for label, fn, sig, consts, options in engine_launches():
        row = {"case": label, "kernel": "region_kernel", "arch": 90}
        try:
            ptx = compile_launch(fn, sig, consts, options, {}, 90).asm["ptx"]
            row.update(ok=True, ptx={k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()})
        except Exception as e:  # noqa: BLE001 - reported to the test
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
