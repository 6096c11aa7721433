"""GPU probe: does exactdit.aten.norms reproduce eager CUDA bits?

Run on the H200 from the repository root (needs torch with CUDA and numpy
only; triton is used for one optional check if importable):

    python benchmarks/probes/probe_aten_norms.py

Sections
  (0) dispatch: which CUDA kernels F.rms_norm / F.layer_norm launch
  (i)  F.rms_norm vs rms_norm_order_model (torch.rsqrt on CUDA as rsqrt):
       fraction of rows whose rstd bits match, fraction of output elements
       whose bits match; fallback path (misaligned / N % 4 != 0); fp32-square
       FMA variant; the composite path (weight dtype != input dtype)
  (ii) F.layer_norm (native_layer_norm) vs layer_norm_order_model for every
       combine-contraction variant: mean bits, rstd bits, output bits
  (iii) GELU: all 65536 bf16 and fp16 bit patterns and 1M fp32 values,
       eager vs every candidate in gelu_candidates (erf = torch.erf on CUDA);
       optional Triton libdevice erf vs torch.erf; up * gelu(gate) in bf16
Writes $OUT/probe_aten_norms.json when $OUT is set.  Target: < 60 s.
"""

from __future__ import annotations

import json
import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from exactdit.aten.gelu import gelu_candidates  # noqa: E402
from exactdit.aten.norms import (  # noqa: E402
    layer_norm_order_model,
    rms_norm_composite_model,
    rms_norm_order_model,
    vectorized_path_ok,
)

# PROBE_DEVICE=cpu only smoke-tests the script (the numbers then mean nothing)
DEV = os.environ.get("PROBE_DEVICE", "cuda")
T0 = time.time()
RESULTS: dict = {}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit equality (NaN payloads compared as bits too)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.contiguous().view(it) == b.contiguous().view(it)


def frac(mask: torch.Tensor) -> float:
    return float(mask.float().mean().item())


def make_rows(m, n, dtype, seed, kind="mixed"):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, n, generator=g, device=DEV)
    if kind == "mixed":
        # per-row scale and offset spanning a few decades, like activations
        scale = torch.exp2(torch.randint(-6, 7, (m, 1), generator=g, device=DEV).float())
        shift = torch.randn(m, 1, generator=g, device=DEV) * 2
        x = x * scale + shift * scale
    return x.to(dtype)


def guard(name):
    def deco(fn):
        def run():
            t = time.time()
            try:
                fn()
            except Exception as e:  # keep going; report
                RESULTS.setdefault("errors", {})[name] = "".join(
                    traceback.format_exception_only(type(e), e)).strip()
                log(f"ERROR in {name}: {e!r}")
                traceback.print_exc()
            RESULTS.setdefault("section_seconds", {})[name] = round(time.time() - t, 2)
        run.__name__ = fn.__name__
        return run
    return deco


# --------------------------------------------------------------------------- (0)
@guard("dispatch")
def probe_dispatch():
    from torch.profiler import ProfilerActivity, profile

    def kernels(fn):
        if DEV != "cuda":
            fn()
            return []
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sorted(set(n[:120] for n in names))

    q = torch.randn(1, 64, 16, 128, device=DEV, dtype=torch.bfloat16)  # [B,S,heads,hd]
    wb = torch.randn(128, device=DEV, dtype=torch.bfloat16)
    wf = wb.float()
    x = torch.randn(512, 4096, device=DEV, dtype=torch.bfloat16)
    out = {
        "rms_bf16_w_bf16": kernels(lambda: F.rms_norm(q, (128,), wb, 1e-6)),
        "rms_bf16_w_fp32(composite)": kernels(lambda: F.rms_norm(q, (128,), wf, 1e-6)),
        "rms_nn_module": kernels(lambda: torch.nn.RMSNorm(128, eps=1e-6, device=DEV,
                                                           dtype=torch.bfloat16)(q)),
        "ln_noaffine_4096": kernels(lambda: F.layer_norm(x, (4096,), None, None, 1e-6)),
        "ln_noaffine_4095": kernels(lambda: F.layer_norm(x[:, :4095].contiguous(), (4095,),
                                                         None, None, 1e-6)),
        "gelu_bf16": kernels(lambda: F.gelu(x)),
    }
    try:
        F.layer_norm(x, (4096,), torch.ones(4096, device=DEV), torch.zeros(4096, device=DEV), 1e-6)
        out["ln_bf16_x_fp32_wb"] = "ran (mixed dtype accepted)"
        out["ln_bf16_x_fp32_wb_kernels"] = kernels(
            lambda: F.layer_norm(x, (4096,), torch.ones(4096, device=DEV),
                                 torch.zeros(4096, device=DEV), 1e-6))
    except Exception as e:
        out["ln_bf16_x_fp32_wb"] = f"error: {e}"[:300]
    RESULTS["dispatch"] = out
    for k, v in out.items():
        log("dispatch", k, v)


# --------------------------------------------------------------------------- (i)
RMS_NS = [64, 128, 256, 1000, 1536, 3072, 4096, 6144, 4095, 30]


@guard("rms_norm")
def probe_rms():
    res = []
    eps = 1e-6
    fused = torch.ops.aten._fused_rms_norm
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for n in RMS_NS:
            if dtype == torch.float16 and n not in (128, 4096, 4095):
                continue
            m = 4096 if n <= 256 else 1024
            x = make_rows(m, n, dtype, seed=n)
            for with_w in (True, False):
                w = (torch.randn(n, device=DEV) * 0.3 + 1).to(dtype) if with_w else None
                y_e, r_e = fused(x, [n], w, eps)
                y_e2 = F.rms_norm(x, (n,), w, eps)
                entry = {"dtype": str(dtype), "N": n, "M": m, "weight": with_w,
                         "vectorized": vectorized_path_ok(x, w),
                         "F.rms_norm==_fused_rms_norm": bool(torch.equal(y_e, y_e2))}
                variants = {"default": {}}
                if dtype == torch.float32:
                    variants["square_nofma"] = {"square_fma": False}
                for vname, kw in variants.items():
                    y_m, r_m = rms_norm_order_model(x, w, eps, rsqrt=torch.rsqrt,
                                                    return_rstd=True, **kw)
                    entry[vname] = {
                        "rstd_rows_match": frac(bits_equal(r_m.reshape(-1), r_e.reshape(-1))),
                        "out_elems_match": frac(bits_equal(y_m, y_e)),
                        "out_rows_all_match": frac(bits_equal(y_m, y_e).all(dim=-1)),
                    }
                res.append(entry)
                log("rms", dtype, n, "w" if with_w else "-", entry["vectorized"],
                    {k: v for k, v in entry.items() if isinstance(v, dict)})
    # forced fallback: misaligned (2-byte / 4-byte offset) contiguous rows
    for dtype in (torch.bfloat16, torch.float32):
        n, m = 1024, 1024
        buf = make_rows(1, m * n + 1, dtype, seed=77).reshape(-1)
        x = buf[1:].view(m, n)
        w = (torch.randn(n, device=DEV) * 0.3 + 1).to(dtype)
        y_e, r_e = fused(x, [n], w, eps)
        y_m, r_m = rms_norm_order_model(x, w, eps, return_rstd=True)
        e = {"dtype": str(dtype), "N": n, "M": m, "misaligned": True,
             "vectorized": vectorized_path_ok(x, w),
             "default": {"rstd_rows_match": frac(bits_equal(r_m.reshape(-1), r_e.reshape(-1))),
                         "out_elems_match": frac(bits_equal(y_m, y_e))}}
        # also the vectorised model on the same data, to see the paths differ
        y_v, r_v = rms_norm_order_model(x.clone(), w, eps, vectorized=True, return_rstd=True)
        e["vectorized_model_on_misaligned"] = {
            "rstd_rows_match": frac(bits_equal(r_v.reshape(-1), r_e.reshape(-1)))}
        res.append(e)
        log("rms misaligned", dtype, e)
    # composite path: weight dtype != input dtype; mean via torch on CUDA (same kernel)
    comp = []
    for (xd, wd) in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        for n, m in ((128, 4096), (4096, 1024)):
            x = make_rows(m, n, xd, seed=5 + n)
            w = (torch.randn(n, device=DEV) * 0.3 + 1).to(wd)
            y_e = F.rms_norm(x, (n,), w, eps)
            y_m = rms_norm_composite_model(x, w, eps, rsqrt=torch.rsqrt,
                                           mean_fn=lambda s: s.mean(dim=-1, keepdim=True))
            c = {"x": str(xd), "w": str(wd), "N": n, "M": m,
                 "out_elems_match": frac(bits_equal(y_m, y_e))}
            comp.append(c)
            log("rms composite", c)
    RESULTS["rms_norm"] = res
    RESULTS["rms_norm_composite"] = comp


# --------------------------------------------------------------------------- (ii)
LN_NS = [64, 1000, 1536, 3072, 4096, 6144, 4095]


@guard("layer_norm")
def probe_ln():
    res = []
    eps = 1e-6
    variants = [(mf, sf) for mf in ("first", "second", "none") for sf in (True, False)]
    for dtype in (torch.bfloat16, torch.float32):
        for n in LN_NS:
            m = 4096 if n <= 256 else 1024
            x = make_rows(m, n, dtype, seed=100 + n)
            y_e, mean_e, rstd_e = torch.native_layer_norm(x, [n], None, None, eps)
            mean_e, rstd_e = mean_e.float(), rstd_e.float()  # fp32 on CUDA already
            entry = {"dtype": str(dtype), "N": n, "M": m, "vectorized": vectorized_path_ok(x),
                     "stats": {}}
            fallback = not entry["vectorized"]
            best = None
            for mf, sf in (variants[:1] if fallback else variants):
                y_m, mean_m, rstd_m = layer_norm_order_model(
                    x, None, None, eps, rsqrt=torch.rsqrt, mean_fma=mf, sigma_fma=sf,
                    return_stats=True)
                st = {"mean_rows_match": frac(bits_equal(mean_m.reshape(-1), mean_e.reshape(-1))),
                      "rstd_rows_match": frac(bits_equal(rstd_m.reshape(-1), rstd_e.reshape(-1))),
                      "out_elems_match": frac(bits_equal(y_m, y_e))}
                entry["stats"][f"mean_fma={mf},sigma_fma={sf}"] = st
                score = st["mean_rows_match"] + st["rstd_rows_match"]
                if best is None or score > best[0]:
                    best = (score, mf, sf)
            # affine variants with the best combine variant
            _, mf, sf = best
            aff = {}
            for name, use_w, use_b in (("w+b", True, True), ("w", True, False), ("b", False, True)):
                w = (torch.randn(n, device=DEV) * 0.3 + 1).to(dtype) if use_w else None
                b = (torch.randn(n, device=DEV) * 0.3).to(dtype) if use_b else None
                y_e = F.layer_norm(x, (n,), w, b, eps)
                y_m = layer_norm_order_model(x, w, b, eps, rsqrt=torch.rsqrt, mean_fma=mf,
                                             sigma_fma=sf)
                aff[name] = frac(bits_equal(y_m, y_e))
            entry["affine_out_elems_match(best variant)"] = aff
            entry["best_variant"] = f"mean_fma={mf},sigma_fma={sf}"
            res.append(entry)
            log("ln", dtype, n, entry["vectorized"], entry["best_variant"],
                entry["stats"][entry["best_variant"]], aff)
    RESULTS["layer_norm"] = res


@guard("layer_norm bias only")
def probe_ln_bias_only():
    """Bias without weight: which output expression eager uses, with ATen's own mean and rstd
    (``torch.native_layer_norm`` returns them), fp32 and bf16 inputs."""
    res = []
    eps = 1e-6
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1000, 4096):
            x = make_rows(1024, n, dtype, seed=300 + n)
            b = (torch.randn(n, device=DEV) * 0.3).to(dtype)
            y_e = F.layer_norm(x, (n,), None, b, eps)
            y_n, mean, rstd = torch.native_layer_norm(x, [n], None, b, eps)
            d = x.float() - mean.float().reshape(-1, 1)
            r = rstd.float().reshape(-1, 1)
            b32 = b.float()
            t = r * d
            candidates = {
                "fma(rstd, d, b)": (r.double() * d.double() + b32.double()).float(),
                "fl(rstd * d) + b": t + b32,
                "fl(d * rstd) + b, d * rstd rounded separately": d * r + b32,
                "fl(fl(rstd * d) -> dtype) + b in dtype": t.to(dtype) + b,
                "fma(rstd, x, fma(-rstd, mean, b))": (
                    r.double() * x.double() + (-(r * mean.float().reshape(-1, 1))).double() + b32.double()).float(),
                "fma(rstd, x - mean unrounded, b)": (
                    r.double() * (x.double() - mean.double().reshape(-1, 1)) + b32.double()).float(),
                "fl(x * rstd) - fl(mean * rstd) + b": (x.float() * r - mean.float().reshape(-1, 1) * r) + b32,
                "fma(x, rstd, b - fl(mean * rstd))": (
                    x.double() * r.double() + (b32 - mean.float().reshape(-1, 1) * r).double()).float(),
            }
            first = candidates["fma(rstd, d, b)"].to(dtype)
            miss = ~bits_equal(first, y_e)
            ulps = (first.float().view(torch.int32) - y_e.float().view(torch.int32)).abs()[miss] if dtype == torch.float32 else None
            entry = {"dtype": str(dtype), "N": n, "F.layer_norm == native_layer_norm": bool(bits_equal(y_e, y_n).all()),
                     "out_elems_match": {k: frac(bits_equal(v.to(dtype), y_e)) for k, v in candidates.items()},
                     "fma_misses_max_ulps": None if ulps is None or not ulps.numel() else int(ulps.max()),
                     "fma_misses_rows": int(miss.any(dim=1).sum()),
                     "fma_miss_examples": [
                         {"x": float(x[i, j]), "mean": float(mean.reshape(-1)[i]), "rstd": float(rstd.reshape(-1)[i]),
                          "b": float(b[j]), "eager": float(y_e[i, j]), "fma": float(first[i, j])}
                         for i, j in miss.nonzero()[:4].tolist()]}
            res.append(entry)
            log("ln bias-only", entry)
    RESULTS["layer_norm_bias_only"] = res


# --------------------------------------------------------------------------- (iii)
def _all_16bit(dtype):
    return torch.arange(-32768, 32768, dtype=torch.int32, device=DEV).to(torch.int16).view(dtype)


@guard("gelu")
def probe_gelu():
    cands = gelu_candidates(erf=torch.erf)
    out = {}
    g = torch.Generator(device=DEV).manual_seed(0)
    x32 = torch.cat([
        torch.randn(500_000, generator=g, device=DEV) * 3,
        torch.randn(250_000, generator=g, device=DEV) * 0.01,
        (torch.rand(250_000, generator=g, device=DEV) * 2 - 1)
        * torch.exp2(torch.randint(-30, 30, (250_000,), generator=g, device=DEV).float()),
    ])
    inputs = {"bfloat16": _all_16bit(torch.bfloat16), "float16": _all_16bit(torch.float16),
              "float32(1M random)": x32}
    for name, x in inputs.items():
        fin = torch.isfinite(x)
        y_e = F.gelu(x)
        d = {"n": x.numel(), "nonfinite_inputs": int((~fin).sum().item())}
        ne = ~fin
        for cname, fn in cands.items():
            y_c = fn(x.float()).to(x.dtype)
            eq = bits_equal(y_c, y_e) | (torch.isnan(y_c) & torch.isnan(y_e))
            d[cname] = {"mismatch_finite": int((~eq & fin).sum().item()),
                        "mismatch_nonfinite": int((~eq & ne).sum().item())}
        # how many inputs separate the candidates at all (fp32 level)
        ref = cands["src"](x.float())
        d["fp32_level_diff_vs_src"] = {
            c: int((~(bits_equal(fn(x.float()), ref) | torch.isnan(ref))).sum().item())
            for c, fn in cands.items() if c != "src"}
        out[name] = d
        log("gelu", name, {k: v for k, v in d.items() if k != "fp32_level_diff_vs_src"})
        log("gelu", name, "fp32-level differences vs src:", d["fp32_level_diff_vs_src"])

    # up * gelu(gate) in bf16: product rounded once from exact fp32?
    ga = torch.randn(2048, 2048, generator=g, device=DEV).to(torch.bfloat16) * 2
    up = torch.randn(2048, 2048, generator=g, device=DEV).to(torch.bfloat16)
    y_e = up * F.gelu(ga)
    gb = F.gelu(ga)
    y_two = (up.float() * gb.float()).to(torch.bfloat16)
    y_fused = (up.float() * cands["src"](ga.float())).to(torch.bfloat16)
    out["up_mul_gelu_bf16"] = {
        "eager_eq_bf16(up*bf16(gelu))": frac(bits_equal(y_e, y_two)),
        "eager_eq_single_rounding_of_fp32_gelu(should be <1)": frac(bits_equal(y_e, y_fused)),
    }
    log("up*gelu", out["up_mul_gelu_bf16"])

    # torch.erf on CUDA vs Triton libdevice erf (what a Triton kernel would call)
    try:
        import triton
        import triton.language as tl
        try:
            from triton.language.extra import libdevice
        except Exception:  # older layout
            from triton.language.extra.cuda import libdevice

        @triton.jit
        def _erf_kernel(X, Y, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            msk = offs < n
            v = tl.load(X + offs, mask=msk)
            tl.store(Y + offs, libdevice.erf(v), mask=msk)

        u = torch.cat([_all_16bit(torch.bfloat16).float(), _all_16bit(torch.float16).float(),
                       x32, x32 * 0.70710677]).contiguous()
        yt = torch.empty_like(u)
        _erf_kernel[(triton.cdiv(u.numel(), 1024),)](u, yt, u.numel(), BLOCK=1024)
        yr = torch.erf(u)
        eq = bits_equal(yt, yr) | (torch.isnan(yt) & torch.isnan(yr))
        out["triton_libdevice_erf_vs_torch_erf"] = {"triton": triton.__version__,
                                                    "n": u.numel(),
                                                    "mismatch": int((~eq).sum().item())}
    except Exception as e:
        out["triton_libdevice_erf_vs_torch_erf"] = f"skipped: {e!r}"[:300]
    log("erf", out["triton_libdevice_erf_vs_torch_erf"])
    RESULTS["gelu"] = out


def main():
    if DEV == "cuda":
        assert torch.cuda.is_available(), "needs a CUDA device"
        RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                          "device": torch.cuda.get_device_name(0),
                          "capability": list(torch.cuda.get_device_capability(0))}
    else:
        RESULTS["env"] = {"torch": torch.__version__, "device": DEV, "smoke_test_only": True}
    log(RESULTS["env"])
    probes = [probe_dispatch, probe_rms, probe_ln, probe_ln_bias_only, probe_gelu]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probes", nargs="*", help="probe function names, e.g. probe_ln_bias_only; none: all")
    wanted = ap.parse_args().probes
    for probe in probes:
        if not wanted or probe.__name__ in wanted:
            probe()
    RESULTS["total_seconds"] = round(time.time() - T0, 1)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "probe_aten_norms.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        log("wrote", os.path.join(out, "probe_aten_norms.json"))
    log("done")


if __name__ == "__main__":
    main()
