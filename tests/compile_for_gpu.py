"""Compile the kernel variants exactdit's ops launch for a real GPU target, on a machine without
a GPU (Triton's compiler and ptxas need no device), and report what the PTX contains.

Triton's interpreter, which the CPU tests use, executes kernels as NumPy: it does not check what
the compiler checks (loop-carried variables keeping their type, for one). This script runs each
op's launcher on CPU tensors with the launch intercepted, compiles every intercepted
(kernel, specialization) for ``sm_90`` through Triton's normal pipeline, and prints one JSON object
per launch: kernel name, target, ok/error, and counts of the PTX instructions the numerics rely
on. Run as a script (``python tests/compile_for_gpu.py [arch ...]``): TRITON_INTERPRET must be
unset before Triton is imported, so tests call it in a subprocess (tests/test_compile_for_gpu.py).
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
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "enable_reflect_ftz", "extern_libs")

launches: list[tuple[JITFunction, dict, dict, dict, dict]] = []


def _capture(self, *args, grid, warmup, **kwargs):
    """Stands in for JITFunction.run: records the launch instead of running it, specialised as
    the JIT would specialise it (ints equal to 1 become constants; ints divisible by 16 and
    16-byte aligned tensors are marked divisible, unless the kernel opts out)."""
    bound = dict(zip(self.arg_names, args))
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound.update(kwargs)
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, name) in enumerate(zip(self.params, self.arg_names)):
        value = bound[name]
        divisible = False
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _DTYPES[value.dtype]
            divisible = value.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int) and value == 1 and not param.do_not_specialize:
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            divisible = value % 16 == 0 and not param.do_not_specialize
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{self.fn.__name__}: cannot type argument {name}={value!r}")
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    launches.append((self, signature, constexprs, options, attrs))


def cases():
    """One call per kernel variant the ops launch (dtypes, layouts, paths)."""
    from exactdit.ops.elementwise import MODULATE, RESIDUAL_GATE_ADD
    from exactdit.kernels import geglu as geglu_kernels
    from exactdit.ops.layer_norm import LAYER_NORM, LAYER_NORM_MODULATE
    from exactdit.ops.rms_norm import GATED_RMS_NORM_MODULATE, RMS_NORM, RMS_NORM_MODULATE
    from exactdit.ops.rope import QK_NORM_ROPE

    eps = 1e-6
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.zeros(6, 2, 4096, dtype=dt)
        vec = torch.zeros(1, 2, 4096, dtype=dt)
        yield "residual_gate_add", dt, lambda: RESIDUAL_GATE_ADD.fused(x, x, vec)
        yield "modulate fp32 chain", dt, lambda: MODULATE.fused(x, vec, vec, True)
        yield "modulate native", dt, lambda: MODULATE.fused(x, vec, vec, False)
        yield "modulate no shift", dt, lambda: MODULATE.fused(x, vec, None, False)
        for D in (4096, 64, 100, 1001):  # vectorized, scalar (chunk-unrolled), misaligned rows
            xd, vd = torch.zeros(300, D, dtype=dt), torch.zeros(D, dtype=dt)  # 300 rows: 32 lanes per row
            yield f"rms_norm D={D}", dt, lambda: RMS_NORM.fused(xd, vd, eps)
            yield f"rms_norm D={D} no weight", dt, lambda: RMS_NORM.fused(xd, None, eps)
            yield f"rms_norm_modulate D={D}", dt, lambda: RMS_NORM_MODULATE.fused(xd, vd, eps, vd, vd, True)
            yield f"gated_rms_norm_modulate D={D}", dt, lambda: GATED_RMS_NORM_MODULATE.fused(
                xd, xd, vd, vd, eps, vd, vd, True)
        yield "rms_norm fp32 weight", dt, lambda: RMS_NORM.fused(x, torch.zeros(4096), eps)
        for head_dim in (128, 96):  # rotate-half fast path, general path
            q = torch.zeros(1, 7, 4, head_dim, dtype=dt)
            w = torch.zeros(head_dim, dtype=dt)
            tables = (torch.zeros(1, 7, 1, head_dim, dtype=dt), torch.zeros(1, 7, 1, head_dim, dtype=dt))
            yield f"qk_norm_rope head_dim={head_dim}", dt, lambda: QK_NORM_ROPE.fused(q, q, w, w, eps, tables)
        gate, projection = torch.zeros(5, 2, 3072, dtype=dt), torch.zeros(5, 2, 6144, dtype=dt)
        # the launcher directly: the op would first build (here: capture) the bf16 table check
        yield "geglu erf", dt, lambda: geglu_kernels.geglu(gate, gate, gate)
        yield "geglu erf fused [.., 2F]", dt, lambda: geglu_kernels.geglu(*projection.chunk(2, -1), gate)
        if dt == torch.bfloat16:
            table = torch.zeros(2 * geglu_kernels.TABLE_WINDOW, dtype=dt)
            yield "geglu table", dt, lambda: geglu_kernels.geglu(gate, gate, gate, table)
            yield "geglu table fused [.., 2F]", dt, lambda: geglu_kernels.geglu(*projection.chunk(2, -1), gate, table)
        yield "layer_norm", dt, lambda: LAYER_NORM.fused(x, eps, None, None)
        yield "layer_norm affine", dt, lambda: LAYER_NORM.fused(x, eps, vec[0, 0], vec[0, 0])
        yield "layer_norm_modulate native", dt, lambda: LAYER_NORM_MODULATE.fused(x, eps, vec, vec, None, None, False)


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


def captured(call) -> list[tuple[JITFunction, dict, dict, dict, dict]]:
    """The launches ``call()`` makes, intercepted (nothing runs)."""
    JITFunction.run = _capture
    del launches[:]
    call()
    return list(launches)


def engine_launches():
    """(label, kernel, signature, constexprs, options) of every kernel the engine generates for the
    captured blocks of tiny Flux.1, Qwen-Image, ERNIE-Image and Wan graphs on the CPU (views, cats,
    pieces, tables, complex RoPE, the LayerNorm and mean templates) and for a hand-built
    ``_fused_rms_norm`` + RoPE graph (CPU captures decompose F.rms_norm); strides typed as the JIT
    types the real launch (1 -> constant)."""
    import operator

    import torch.fx as fx

    from exactdit.engine.capture import capture_graphs
    from exactdit.harness import minis, models

    graphs = []
    mini_names = sys.argv[sys.argv.index("--minis") + 1].split(",") if "--minis" in sys.argv else []
    for name in ("flux", "qwen", "ernie", "wan") if not mini_names else ():
        tr = models.build_transformer(name, "tiny", dtype=torch.bfloat16)
        video = dict(num_frames=5) if models.get_spec(name).video else {}
        kw = models.forward_inputs(name, tr, batch=2, height=32, width=32, **video)
        graphs += [(name, gm) for _, gm, _ in capture_graphs(tr, kw)]
    for name in mini_names:  # mini models in both dtypes (tests/test_minis.py)
        for dtype in (torch.bfloat16, torch.float32):
            tr = minis.build(name, dtype=dtype)
            graphs += [(name, gm) for _, gm, _ in capture_graphs(tr, minis.forward_inputs(name, tr))]
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
    from exactdit.numerics import LAUNCH_OPTIONS

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


def main(archs: list[int]) -> None:
    if "--engine" in sys.argv:
        for label, fn, sig, consts, options in engine_launches():
            row = {"case": label, "kernel": "region_kernel", "arch": 90}
            try:
                ptx = compile_launch(fn, sig, consts, options, {}, 90).asm["ptx"]
                row.update(ok=True, ptx={k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()})
            except Exception as e:  # noqa: BLE001 - reported to the test
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
            print(json.dumps(row), flush=True)
        return
    for label, dtype, call in cases():
        for kernel, signature, constexprs, options, attrs in captured(call):
            for arch in archs:
                row = {"case": label, "dtype": str(dtype).replace("torch.", ""), "kernel": kernel.fn.__name__,
                       "arch": arch}
                try:
                    ptx = compile_launch(kernel, signature, constexprs, options, attrs, arch).asm["ptx"]
                    row.update(ok=True, ptx={k: len(re.findall(p, ptx)) for k, p in PTX_COUNTS.items()})
                except Exception as e:  # noqa: BLE001 - reported to the test
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[-2000:]}")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:] if a.isdigit()] or [90])
