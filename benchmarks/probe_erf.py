"""Does Triton's erf match ATen's CUDA erff? Triton's bundled libdevice vs the CUDA toolkit's.

``python benchmarks/probe_erf.py`` on a GPU: runs the GeGLU kernel over every bf16 and fp16 gate
value and 1M random fp32 gates (up = 1), linking Triton's bundled libdevice and then the
toolkit's (``numerics.cuda_libdevice``), and counts outputs that differ from eager
``up * F.gelu(gate)``. (H200, torch 2.11+cu130, Triton 3.6: bundled 11 / 151 / 95,498
differ for bf16 / fp16 / fp32, toolkit 0 / 0 / 0.)
"""

import torch
import torch.nn.functional as F

from exactdit import numerics
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
        for label, lib in (("toolkit libdevice", numerics.cuda_libdevice()), ("Triton's libdevice", None)):
            k.cuda_libdevice = lambda lib=lib: lib  # None: Triton links its bundled one
            out = k.geglu(g, up, torch.empty_like(g))
            bits = {2: torch.int16, 4: torch.int32}[g.element_size()]
            bad = int((out.view(bits) != ref.view(bits)).sum())
            print(f"erf probe {name}: {label} ({lib}): {bad} of {g.numel()} differ")


if __name__ == "__main__":
    main()
