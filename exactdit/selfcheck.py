"""Self-check: run every fused op on fresh random inputs and hold it to its eager reference.

On a CUDA GPU this verifies the fused paths (the gate checks each new signature bit for bit);
elsewhere every op takes the eager fallback and the report says why. Run with
``python -m exactdit.selfcheck``; exits non-zero if any result differs from eager.
"""

from __future__ import annotations

import sys

import torch

import exactdit
from exactdit import ops, references
from exactdit.gate import first_difference


def _cases(device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        S, B, D = 77, 2, 320
        x = rnd(S, B, D, dtype=dtype)
        vec = rnd(B, D, dtype=dtype)
        mods = rnd(B, 3 * D, dtype=dtype).chunk(3, dim=-1)
        yield "residual_gate_add", ops.residual_gate_add, references.residual_gate_add, (x, rnd(S, B, D, dtype=dtype), vec), {}
        for upcast in (False, True):
            yield "modulate", ops.modulate, references.modulate, (x, mods[0], mods[1]), {"upcast": upcast}
            yield "modulate", ops.modulate, references.modulate, (x.permute(1, 0, 2), mods[2][:, None], None), {"upcast": upcast}


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"exactdit {exactdit.__version__} self-check on {where} (torch {torch.__version__})")
    if device.type != "cuda":
        print("No CUDA GPU: every op takes its eager fallback (fused kernels need a CUDA GPU).")
    failures = 0
    for name, op, ref, args, kwargs in _cases(device):
        problem = first_difference(op(*args, **kwargs), ref(*args, **kwargs))
        if problem is not None:
            failures += 1
            print(f"FAIL {name}: {problem}")
    exactdit.report(show=True)
    print("all results bit-identical to eager" if not failures else f"{failures} results differ from eager")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
