"""GPU probe: does eager ``x.mean(-1)`` add a row in the same order whether the rows are
contiguous or permuted (last dim contiguous, the other dims in any order)?

Old-style diffusers attention processors (SD3, PixArt, HunyuanDiT, CogVideoX, ...) normalise q and
k after ``view(B, S, H, D).transpose(1, 2)``: the decomposed RMSNorm's ``pow(2).mean(-1)`` then
reads permuted rows. ATen's reduction configuration depends on the row count, the row width and
the reduced dim's stride, not on how the rows are laid out, so the per-row order should be the
contiguous one (which :mod:`exactdit.aten.reduce` models). This checks it bit for bit over many
shapes and layouts. Prints one line per case and writes ``$OUT/probe_permuted_mean.json``.

    python3 benchmarks/probes/probe_permuted_mean.py
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def layouts(B: int, S: int, H: int, D: int, g: torch.Generator):
    """(name, permuted fp32 rows as the RMSNorm's mean reads them)."""
    h = torch.randn(B, S, H * D, generator=g, device="cuda") * torch.exp2(
        torch.randint(-8, 9, (B, S, 1), generator=g, device="cuda").float())
    h = h.to(torch.bfloat16)
    yield "view(B,S,H,D).transpose(1,2)", h.view(B, S, H, D).transpose(1, 2).float().pow(2)
    yield "view(B,S,H,D).permute(2,0,1,3)", h.view(B, S, H, D).permute(2, 0, 1, 3).float().pow(2)
    yield "(S,B,H*D) as transpose(0,1)", h.transpose(0, 1).float().pow(2)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = [(1, 1, 1, 64), (2, 7, 3, 64), (1, 333, 24, 64), (2, 4096, 24, 64), (1, 4429, 38, 64),
              (2, 77, 2, 16), (1, 1024, 16, 72), (1, 257, 8, 100), (1, 4096, 24, 128), (2, 300, 12, 128),
              (1, 1000, 4, 256), (1, 64, 2, 3072), (1, 513, 1, 5120), (3, 33, 5, 32)]
    for B, S, H, D in shapes:
        for name, x in layouts(B, S, H, D, g):
            permuted = x.mean(-1, keepdim=True)
            contiguous = x.contiguous().mean(-1, keepdim=True)
            equal = torch.equal(permuted.contiguous().view(-1), contiguous.contiguous().view(-1))
            rows.append(dict(shape=[B, S, H, D], layout=name, strides=list(x.stride()), equal=equal,
                             out_strides=list(permuted.stride())))
            print(f"{str((B, S, H, D)):22s} {name:32s} equal={equal} out strides {tuple(permuted.stride())}")
    print(f"all equal: {all(r['equal'] for r in rows)} ({len(rows)} cases)", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_permuted_mean.json"), "w") as f:
            json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), cases=rows), f, indent=1)


if __name__ == "__main__":
    main()
