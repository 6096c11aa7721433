"""Silence third-party messages that tell an exactdit user nothing they can act on (issue 35, item 12).

- diffusers' multi-line advice to install ``accelerate`` on every pipeline load (without it diffusers
  loads with ``low_cpu_mem_usage=False``, which is all the advice says);
- transformers' note that an image processor falls back to its PIL backend without torchvision
  (imported by the Flux and Chroma pipelines, never used by exactdit's runs);
- diffusers' ``FluxPosEmbed`` FutureWarning, which diffusers' own Chroma transformer triggers;
- where torchao is installed (``exactdit[quant]``, ``[test]``), which diffusers imports: torch's
  warning that torchao registers enums it no longer needs to, and, with a CPU build of torch only,
  torchao's note that its CUDA extensions did not load;
- bitsandbytes' note, on a CPU, that it could not fetch an optional kernel from the kernels hub.

Only these exact messages are dropped; every other warning of either library still shows. Nothing
here imports diffusers or transformers (their loggers are named, not imported)."""

from __future__ import annotations

import logging
import warnings

#: logger name -> substrings of the messages it logs that are dropped
DROPPED = {
    "diffusers.models.modeling_utils": ("`accelerate` was not found in the environment",),
    "diffusers.pipelines.pipeline_utils": ("`accelerate` was not found in the environment",),
    "transformers.utils.import_utils": ("requires torchvision (not installed); falling back to",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
    # bitsandbytes (exactdit[quant]) on a CPU: its optional kernel hub download, which exactdit never needs
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
}


def _dropped() -> dict[str, tuple[str, ...]]:
    import torch

    if torch.version.cuda is None:  # torchao's CUDA extensions cannot load on a CPU build: nothing to act on
        return {**DROPPED, "torchao": ("Failed to load",)}
    return DROPPED


class _Drop(logging.Filter):
    def __init__(self, needles: tuple[str, ...]):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def quiet_third_party() -> None:
    """Install the filters (idempotent)."""
    for name, needles in _dropped().items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(needles))
    warnings.filterwarnings("ignore", message=r"`FluxPosEmbed` is deprecated", category=FutureWarning)
