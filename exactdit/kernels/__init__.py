"""Triton kernels. Each module holds one op family's kernels and launchers; numerics come from
:mod:`exactdit.numerics`, row addressing from :mod:`exactdit.kernels.rows`."""
