"""Self-check: run every fused op on fresh random inputs and hold it to its eager reference.

On a CUDA GPU this verifies the fused paths (the gate checks each new signature bit for bit);
on CPU under ``TRITON_INTERPRET=1`` the ops whose CPU eager rounds like their kernel run fused in
Triton's interpreter; elsewhere every op takes the eager fallback and the report says why. Run with
``python -m exactdit.selfcheck``; exits non-zero if any result differs from eager.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import exactdit
from exactdit import gate, ops, references
from exactdit.gate import first_difference


def _cases(device: torch.device):
    """(name, op, reference, args, kwargs) for every op, in the layouts ERNIE-Image uses."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    S, B, D, H, hd = 77, 2, 320, 4, 64
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, update = rnd(S, B, D, dtype=dtype), rnd(S, B, D, dtype=dtype)
        w = rnd(D, dtype=dtype)
        # six [1, B, D] modulation views of one projection, as the patched ERNIE-Image block has them
        shift, scale, gate, shift2, scale2, gate2 = (m.unsqueeze(0) for m in rnd(B, 6 * D, dtype=dtype).chunk(6, dim=-1))
        yield "residual_gate_add", ops.residual_gate_add, references.residual_gate_add, (x, update, gate), {}
        for upcast in (False, True):
            kw = {"upcast": upcast}
            yield "modulate", ops.modulate, references.modulate, (x, scale, shift), kw
            yield "modulate", ops.modulate, references.modulate, (x.permute(1, 0, 2), scale2[0][:, None], None), kw
            yield "rms_norm_modulate", ops.rms_norm_modulate, references.rms_norm_modulate, (x, w, 1e-6, scale, shift), kw
            yield ("gated_rms_norm_modulate", ops.gated_rms_norm_modulate, references.gated_rms_norm_modulate,
                   (x, update, gate, w, 1e-6, scale2, shift2), kw)
            yield "layer_norm_modulate", ops.layer_norm_modulate, references.layer_norm_modulate, (x, 1e-6, scale, shift), kw
        yield "rms_norm", ops.rms_norm, references.rms_norm, (x, w, 1e-6), {}
        q, k = rnd(B, S, H * hd, dtype=dtype).unflatten(-1, (H, hd)), rnd(B, S, H * hd, dtype=dtype).unflatten(-1, (H, hd))
        wq, wk = rnd(hd, dtype=dtype), rnd(hd, dtype=dtype)
        freqs = rnd(B, S, 1, hd, dtype=torch.float32) * 3
        yield "qk_norm_rope", ops.qk_norm_rope, references.qk_norm_rope, (q, k, wq, wk, 1e-6, freqs), {}
        yield "geglu", ops.geglu, references.geglu, (rnd(S, B, 2 * D, dtype=dtype),), {}
        yield "geglu", ops.geglu, references.geglu, (rnd(S, B, D, dtype=dtype), rnd(S, B, D, dtype=dtype)), {}


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"exactdit {exactdit.__version__} self-check on {where} (torch {torch.__version__})")
    if device.type != "cuda":
        if gate.INTERPRET:  # what the gate decides by: CPU tensors may run fused in Triton's interpreter
            print("No CUDA GPU, TRITON_INTERPRET=1: ops whose CPU eager rounds like their kernel run fused in "
                  "Triton's interpreter and are checked here; ops that reproduce a CUDA kernel's rounding run eager "
                  "(the table below says which).")
        else:
            print("No CUDA GPU: every op takes its eager fallback (fused kernels need a CUDA GPU).")
    failures = 0
    # Triton's interpreter computes with numpy, which warns on the inf/NaN that checks feed on purpose
    # (geglu's table check covers every bf16 value); the results are compared bit for bit anyway.
    with np.errstate(over="ignore", invalid="ignore"):
        for name, op, ref, args, kwargs in _cases(device):
            problem = first_difference(op(*args, **kwargs), ref(*args, **kwargs))
            if problem is not None:
                failures += 1
                print(f"FAIL {name}: {problem}")
    exactdit.report(show=True)
    for table_device, status in ops.gelu_table_status().items():
        if not table_device.startswith("cuda"):
            continue  # the table serves the GPU kernel; off the GPU geglu runs eager (CUDA's erf differs)
        how = "table, checked on all 2^16 inputs" if status == "table" else f"erf ({status})"
        print(f"geglu: bf16 GELU on {table_device} by {how}")
    print("all results bit-identical to eager" if not failures else f"{failures} results differ from eager")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
