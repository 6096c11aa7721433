"""Benchmark / A-B harness for exactdit.

Submodules (imported lazily so that ``exactdit --help`` stays fast):

- :mod:`exactdit.harness.tiny`      embedded ERNIE-Image transformer configs and seeded random weights,
                                    plus a tiny offline ERNIE-Image pipeline builder (for tests)
- :mod:`exactdit.harness.sampling`  short flow-matching sampling loop driving the bare transformer
- :mod:`exactdit.harness.metrics`   md5 / max_abs / PSNR / SSIM
- :mod:`exactdit.harness.ab`        A/B report and side-by-side PNGs
- :mod:`exactdit.harness.perf`      perf JSON records and ``compare`` (Markdown table)
- :mod:`exactdit.harness.outputs`   output folders a run fills completely or leaves as they were
- :mod:`exactdit.harness.quiet`     the third-party messages the CLI drops
"""
