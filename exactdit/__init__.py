"""exactdit: bit-exact fused Triton kernels for diffusion transformers in diffusers."""

from exactdit.reporting import report, reset_report
from exactdit.patches import patch, unpatch

__version__ = "0.1.0"

__all__ = ["enable_context_parallel", "patch", "report", "reset_report", "unpatch", "__version__"]


def __getattr__(name):
    # exactdit.parallel imports diffusers; `import exactdit` does not
    if name == "enable_context_parallel":
        from exactdit.parallel import enable_context_parallel

        return enable_context_parallel
    raise AttributeError(f"module 'exactdit' has no attribute {name!r}")
