"""The device library: the ``@triton.jit`` functions generated kernels call (rounding where eager
rounds, ATen's reduction trees, Welford, lane moves) and the launch plans that call kernels.
Imports only :mod:`exactdit.aten`."""


def hash_in_one_order(*modules) -> None:
    """Compute Triton's cache key of every ``@triton.jit`` function of ``modules``, in one fixed
    order, before any kernel's. Triton 3.6 folds the constexpr globals a called function reads
    into its caller's key only if the callee's key was computed first, so a kernel's key depended
    on which kernel a process hashed first: a compile worker's first job and the launch that
    looked for it disagreed, and so could a fresh process and the disk cache it meant to reuse.
    Hashed up front (at import, in every process alike), the keys are the same everywhere.
    Triton 3.9 hashes the callee first; nothing changes there."""
    from triton.runtime.jit import JITFunction

    for module in modules:
        for name in sorted(vars(module)):
            fn = vars(module)[name]
            if isinstance(fn, JITFunction):
                fn.cache_key  # noqa: B018 - computed and kept by Triton


from exactdit.device import gemm, numerics, rows, trees, vectorized_norm, welford  # noqa: E402

hash_in_one_order(numerics, rows, trees, welford, vectorized_norm, gemm)
