"""Static SASS instruction counts of exactdit's kernels at ERNIE-Image's production shapes, on a
machine without a GPU: each op's launch is intercepted, compiled for sm_90 by Triton (its bundled
ptxas) and disassembled with the bundled ``nvdisasm``.

    python benchmarks/sass_counts.py            # one line per kernel: total and top opcodes

Static counts include code that never runs (slow paths), so they rank variants of one kernel,
not kernels against each other; Nsight Compute's executed-instruction counts
(``run_on_device.sh ncu``) are the dynamic truth. libdevice comes from Triton here, not from the
CUDA toolkit the GPU path links (same instruction mix for erf, other constants).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]

import torch  # noqa: E402
import triton  # noqa: E402

from common import D, FFN, HEAD_DIM, HEADS, S  # noqa: E402
from compile_for_gpu import captured, compile_launch  # noqa: E402

from exactdit.ops.elementwise import MODULATE, RESIDUAL_GATE_ADD  # noqa: E402
from exactdit.kernels import geglu as geglu_kernels  # noqa: E402
from exactdit.ops.layer_norm import LAYER_NORM_MODULATE  # noqa: E402
from exactdit.ops.rms_norm import GATED_RMS_NORM_MODULATE, RMS_NORM_MODULATE  # noqa: E402
from exactdit.ops.rope import QK_NORM_ROPE  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
OPCODE = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def calls():
    bf = torch.bfloat16
    x, vec = torch.zeros(1, S, D, dtype=bf), torch.zeros(1, 1, D, dtype=bf)
    q, w = torch.zeros(1, S, HEADS, HEAD_DIM, dtype=bf), torch.zeros(HEAD_DIM, dtype=bf)
    tables = (torch.zeros(1, S, 1, HEAD_DIM, dtype=bf),) * 2
    gate = torch.zeros(1, S, FFN, dtype=bf)
    yield "residual_gate_add", lambda: RESIDUAL_GATE_ADD.fused(x, x, vec)
    yield "modulate (fp32 chain)", lambda: MODULATE.fused(x, vec, vec, True)
    yield "rms_norm_modulate", lambda: RMS_NORM_MODULATE.fused(x, None, 1e-6, vec, vec, True)
    yield "gated_rms_norm_modulate", lambda: GATED_RMS_NORM_MODULATE.fused(x, x, vec, None, 1e-6, vec, vec, True)
    yield "qk_norm_rope", lambda: QK_NORM_ROPE.fused(q, q, w, w, 1e-6, tables)
    yield "geglu (erf)", lambda: geglu_kernels.geglu(gate, gate, gate)
    yield "geglu (bf16 table)", lambda: geglu_kernels.geglu(gate, gate, gate, torch.zeros(2 * geglu_kernels.TABLE_WINDOW, dtype=bf))
    yield "layer_norm_modulate", lambda: LAYER_NORM_MODULATE.fused(x, 1e-6, vec, vec, None, None, False)


def opcodes(cubin: bytes) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    return collections.Counter(OPCODE.findall(sass))


def main():
    for label, call in calls():
        for kernel, signature, constexprs, options, attrs in captured(call):
            ops = opcodes(compile_launch(kernel, signature, constexprs, options, attrs, 90).asm["cubin"])
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(8))
            print(f"{label:26s} {kernel.fn.__name__:26s} {sum(ops.values()):5d} SASS  ({top})")


if __name__ == "__main__":
    main()
