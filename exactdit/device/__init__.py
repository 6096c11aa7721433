"""The device library: the ``@triton.jit`` functions generated kernels call (rounding where eager
rounds, ATen's reduction trees, Welford, lane moves) and the launch plans that call kernels.
Imports only :mod:`exactdit.aten`."""
