"""Whether a forward's block graphs pay: timed against the same forward without them.

A block graph (:mod:`cuda_graphs`' block runs) copies the block's tensors into its static buffers and
its outputs out of them on every call: about two copies of the hidden states per block. That pays
where the host launches a block's kernels slower than the GPU runs them, and costs where it does not:
on an H200, Qwen-Image 1328² (mask of ones) 265.3 ms per forward with block graphs against 260.7
without, Chroma 1024² B=2 (padded text) 315.5 against 299.7. So a signature that runs as block runs
alternates its calls with and without the graphs, times each forward on the GPU (events read once
they are done: no call waits for the GPU), and keeps the faster way once :data:`SAMPLES` of each are
in. Both ways give the same bits (the graphs replay the verified calls' kernels).
"""

from __future__ import annotations

import statistics

import torch

#: timed forwards of each way before the choice
SAMPLES = 3


class BlockGraphTimer:
    """The way each call of one block-runs signature takes (:meth:`graphed`) until the choice.

    ``clock()`` gives an event with ``record()``, ``query()`` and ``elapsed_time(end)`` (ms), or
    None where nothing can be timed: then every call replays the graphs, as before timing existed."""

    def __init__(self, clock):
        self.clock = clock
        self.times: dict[bool, list[float]] = {True: [], False: []}
        self.pending: list[tuple[bool, object, object]] = []
        self.choice: bool | None = None
        self.recorded = False  # the first call with graphs records them: not timed
        self.calls = 0

    def graphed(self) -> bool:
        """Whether this call replays the block graphs."""
        if self.choice is not None or self.clock is None:
            return self.choice is not False
        self._read()
        if all(len(t) >= SAMPLES for t in self.times.values()):
            self.choice = self.ms(True) <= self.ms(False)
            return self.choice
        self.calls += 1
        return self.calls % 2 == 1  # graphs first (they are recorded), then each way in turn

    def timing(self, graphed: bool):
        """A context that times this call's forward (the recording call and calls after the choice: not)."""
        return _Timed(self, graphed)

    def ms(self, graphed: bool) -> float:
        return statistics.median(self.times[graphed])

    def why_not(self) -> str:
        return (f"block graphs timed slower than the blocks without them ({self.ms(True):.1f} against "
                f"{self.ms(False):.1f} ms per forward, medians of {len(self.times[True])} and "
                f"{len(self.times[False])} forwards)")

    def _read(self) -> None:
        while self.pending and self.pending[0][2].query():
            graphed, start, end = self.pending.pop(0)
            self.times[graphed].append(start.elapsed_time(end))


class _Timed:
    def __init__(self, timer: BlockGraphTimer, graphed: bool):
        self.timer, self.graphed, self.start = timer, graphed, None

    def __enter__(self):
        timer = self.timer
        if timer.clock is not None and timer.choice is None and (not self.graphed or timer.recorded):
            self.start = timer.clock()
            self.start.record()
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:  # (a call that raised is neither timed nor a recording)
            return False
        self.timer.recorded = self.timer.recorded or self.graphed
        if self.start is not None:
            end = self.timer.clock()
            end.record()
            self.timer.pending.append((self.graphed, self.start, end))
        return False


def cuda_clock(device: torch.device):
    """A clock for :class:`BlockGraphTimer`: events recorded on ``device``'s current stream (the
    model's device, which need not be the current one)."""
    return lambda: _StreamEvent(device)


class _StreamEvent:
    def __init__(self, device):
        self.device, self.event = device, torch.cuda.Event(enable_timing=True)

    def record(self) -> None:
        self.event.record(torch.cuda.current_stream(self.device))

    def query(self) -> bool:
        return self.event.query()

    def elapsed_time(self, end: "_StreamEvent") -> float:
        return self.event.elapsed_time(end.event)
