"""What the process remembers, in one object with one :meth:`ProcessState.reset`.

* ``signatures``: the gate's per-op (per-region) state: call counters, verified and disabled
  signatures, launch plans (:mod:`exactdit.gate`);
* ``graphs``, ``in_parts``: what the engine did to each captured graph, and the blocks captured in
  parts (:mod:`exactdit.engine.coverage`);
* ``block_classes``: per patched block class, its capture state (backend, failures, recaptures;
  :mod:`exactdit.patches.engine`);
* ``details``: fields a patch shows with its report entry (what a model's CUDA graphs cover,
  :func:`exactdit.gate.describe`);
* ``first_calls``: per block class and phase, the seconds the engine's first calls spent
  (capture, partition, codegen, Triton compile, verification, ...: :mod:`exactdit.first_calls`);
* ``captures``: lowered graphs loaded from and stored to the disk cache, and why others were not
  (:mod:`exactdit.engine.capture_cache`).

The modules that own each part keep a reference to its container and mutate it in place, so
``reset`` (tests, or a long-lived process that wants a clean slate) clears everything at once. Not
kept here: caches that hold no decision (compiled kernels, GELU tables checked on the device).
Imports nothing of exactdit, so every layer may use it.
"""

from __future__ import annotations


class ProcessState:
    def __init__(self) -> None:
        self.signatures: dict = {}
        self.graphs: list = []
        self.in_parts: dict = {}
        self.block_classes: dict = {}
        self.details: dict = {}
        self.first_calls: dict = {}
        self.captures: dict = {}

    def reset(self) -> None:
        """Forget everything: verified and disabled signatures, counters, coverage reports, the
        block classes' capture state, the first calls' time account."""
        self.signatures.clear()
        self.graphs.clear()
        self.in_parts.clear()
        self.block_classes.clear()
        self.details.clear()
        self.first_calls.clear()
        self.captures.clear()


STATE = ProcessState()


def reset() -> None:
    """``STATE.reset()``."""
    STATE.reset()
