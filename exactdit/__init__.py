"""exactdit: bit-exact fused Triton kernels for diffusion transformers in diffusers."""

from exactdit import ops
from exactdit.gate import report, reset_report

__version__ = "0.1.0"

__all__ = ["ops", "report", "reset_report", "__version__"]
