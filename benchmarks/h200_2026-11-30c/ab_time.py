# The one-off script behind qk_norm_rope_int32_index.log, kept as it ran (from the repository
# root, PYTHONPATH pointing at an old copy of the package, then at the new one). Its flaw: run as
# a script, its own folder (the repository root) comes first on sys.path, so both runs imported
# the working tree's exactdit. An A/B of two package versions must run from outside the tree.
import sys, os, torch, triton.testing as tt
from exactdit import ops, references
print(ops.__file__)
g = torch.Generator(device="cuda").manual_seed(0)
r = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)
S, D = 4224, 4096
x, u, vec = r(1, S, D), r(1, S, D), r(1, 1, D)
q, k = r(1, S, D).unflatten(-1, (32, -1)), r(1, S, D).unflatten(-1, (32, -1))
w = r(128)
tables = references.rope_tables(torch.rand(1, S, 1, 128, device="cuda", generator=g) * 1000, torch.bfloat16)
cases = {
 "qk_norm_rope": (lambda: ops.qk_norm_rope(q, k, w, w, 1e-6, tables), lambda: references.qk_norm_rope(q, k, w, w, 1e-6, tables)),
 "rms_norm_modulate": (lambda: ops.rms_norm_modulate(x, None, 1e-6, vec, vec, upcast=True), lambda: references.rms_norm_modulate(x, None, 1e-6, vec, vec, upcast=True)),
 "gated": (lambda: ops.gated_rms_norm_modulate(x, u, vec, None, 1e-6, vec, vec, upcast=True), lambda: references.gated_rms_norm_modulate(x, u, vec, None, 1e-6, vec, vec, upcast=True)),
}
for name, (f, ref) in cases.items():
    a, b = f(), ref()
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    eq = all(torch.equal(p, q_) for p, q_ in zip(a, b))
    os.environ["EXACTDIT_TRUST"] = "1"
    ts = [tt.do_bench_cudagraph(f, rep=100, return_mode="median") * 1e3 for _ in range(3)]
    os.environ.pop("EXACTDIT_TRUST")
    print(f"{name}: equal={eq} us={' '.join(f'{t:.1f}' for t in ts)}", flush=True)
