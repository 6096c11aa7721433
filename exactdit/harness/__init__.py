"""Benchmark / A-B harness for exactdit.

Submodules (imported lazily so that ``exactdit --help`` stays fast):

- :mod:`exactdit.harness.models`    the model registry: diffusers DiTs from embedded configs, seeded weights
- :mod:`exactdit.harness.tiny`      the tiny offline ERNIE-Image pipeline of ``exactdit tiny-pipeline``
- :mod:`exactdit.harness.metrics`   md5 / max_abs / PSNR / SSIM
- :mod:`exactdit.harness.ab`        A/B report and side-by-side PNGs
- :mod:`exactdit.harness.perf`      perf JSON records and ``compare`` (Markdown table)
- :mod:`exactdit.harness.outputs`   output folders a run fills completely or leaves as they were
- :mod:`exactdit.harness.quiet`     the third-party messages the CLI drops
"""
