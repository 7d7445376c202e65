"""Times inside one step, on the device that does the work.

On CPU the host does the work, so a mark is ``time.perf_counter()`` when the mark is taken. On
CUDA the host only queues kernels and runs ahead: a host clock around an action times its launch,
not its execution. There a mark is a CUDA event recorded on the current stream; the GPU stamps it
when it reaches that point of the stream, and the marks are read once, after one synchronise at
the step's end, as milliseconds since the step's origin event. A reader of the pipeline timeline
or of ``step_time_s`` therefore gets device time on a GPU, host time on CPU, from the same calls::

    clock = StepClock(device)
    clock.start()                  # origin (after the pipeline's barrier)
    a = clock.mark(); work(); b = clock.mark()
    seconds = clock.seconds(b) - clock.seconds(a)     # synchronises once on CUDA
"""
from __future__ import annotations

import time
from typing import Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class StepClock:
    """Marks on the host clock (CPU) or CUDA events on the current stream (GPU)."""

    def __init__(self, device: torch.device | str):
        self.cuda = torch.device(device).type == "cuda"
        self._origin: Mark = 0.0

    def start(self) -> None:
        """Set the origin every later mark is measured from."""
        self._origin = self.mark() if self.cuda else time.perf_counter()

    def mark(self) -> Mark:
        """Now: seconds since the origin on CPU; a recorded (not yet read) event on CUDA."""
        if not self.cuda:
            return time.perf_counter() - self._origin
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def seconds(self, mark: Mark) -> float:
        """A mark as seconds since the origin (on CUDA: waits for the device to pass the mark)."""
        if not self.cuda:
            return float(mark)
        mark.synchronize()  # returns at once when the device has passed it already
        return self._origin.elapsed_time(mark) / 1e3

    def elapsed(self) -> float:
        """Seconds from the origin to now, on the device's clock."""
        return self.seconds(self.mark())
