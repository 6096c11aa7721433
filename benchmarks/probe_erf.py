"""Does Triton's erf match ATen's CUDA erff, with and without FMA contraction?

``python benchmarks/probe_erf.py`` on a GPU: runs the GeGLU kernel over every bf16 and fp16 gate
value and 1M random fp32 gates (up = 1) with contraction on and off, and counts outputs that
differ from eager ``up * F.gelu(gate)``.
"""

import torch
import torch.nn.functional as F

from exactdit.kernels import geglu as k


def main():
    gates = {
        "bf16": torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
        "fp16": torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16),
        "fp32": torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 3,
    }
    for name, g in gates.items():
        g = g.cuda().reshape(1, -1)
        g = g[:, torch.isfinite(g.float())[0]]
        up = torch.ones_like(g)
        ref = up * F.gelu(g)
        for contraction in (False, True):
            k.ERF_CONTRACTION = contraction
            out = k.geglu(g, up, torch.empty_like(g))
            bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
            bad = int((out.view(bits) != ref.view(bits)).sum())
            print(f"erf probe {name}: contraction={contraction}: {bad} of {g.numel()} differ")


if __name__ == "__main__":
    main()
