"""exactdit: bit-exact fused Triton kernels for diffusion transformers in diffusers."""

from exactdit import ops
from exactdit.gate import report, reset_report
from exactdit.patches import patch, unpatch

__version__ = "0.1.0"

__all__ = ["ops", "patch", "report", "reset_report", "unpatch", "__version__"]
