"""Self-check: patch a few tiny registered models and hold each patched forward to eager diffusers.

Per model one eager forward, then two patched ones (the first verifies every fused region against the
ATen nodes it replaces, the second runs verified kernels), each compared bit for bit with eager; then
exactdit's report. Exit status 1 when any output differs from eager.
"""

from __future__ import annotations

import numpy as np
import torch

#: tiny configs of registered models (exactdit/harness/models/) the check patches
MODELS = ("flux", "ernie")


def _forward(models, name: str, tr, kw):  # a seam for the tests
    return models.run_forward(tr, kw)


def main(names: tuple[str, ...] = MODELS, echo=print) -> int:
    import exactdit
    from exactdit import gate
    from exactdit.harness import models

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    echo(f"exactdit {exactdit.__version__} self-check on {where} (torch {torch.__version__})")
    if device.type != "cuda":
        if gate.INTERPRET:  # what the gate decides by: CPU tensors may run fused in Triton's interpreter
            echo("No CUDA GPU, TRITON_INTERPRET=1: regions whose CPU eager rounds like their kernel run fused in "
                 "Triton's interpreter and are checked here; regions that reproduce a CUDA kernel's rounding run "
                 "eager (the report below says which).")
        else:
            echo("No CUDA GPU: every region takes its eager fallback (fused kernels need a CUDA GPU).")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    failures = 0
    exactdit.reset_report()
    # Triton's interpreter computes with numpy, which warns on the inf/NaN some checks feed on purpose
    with np.errstate(over="ignore", invalid="ignore"):
        for name in names:
            tr = models.build_transformer(name, "tiny", dtype=dtype, device=device)
            kw = models.forward_inputs(name, tr, batch=1, height=32, width=32,
                                       num_frames=5 if models.get_spec(name).video else None)
            ref = _forward(models, name, tr, kw)
            exactdit.patch(tr)
            try:
                with gate.waiting_for_kernels():  # the first call verifies every region (none eager while compiling)
                    outs = [_forward(models, name, tr, kw) for _ in range(2)]
            finally:
                restored = exactdit.unpatch(tr)
            problems = [p for p in (gate.first_difference(o, ref) for o in outs) if p is not None]
            blocks = sum(restored["restored"].values())
            if problems:
                failures += 1
                echo(f"FAIL {name}: {problems[0]}")
            else:
                echo(f"{name}: patched forward equal to eager ({blocks} blocks patched)")
    echo(str(exactdit.report(show=False)))
    echo("all results bit-identical to eager" if not failures else f"{failures} models differ from eager")
    return 1 if failures else 0
