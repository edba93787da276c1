"""Timing a launch on the GPU's own clock: CUDA events, behind a hold of the stream so that
the host's launch rate is not what is measured. Only ``torch.cuda`` (passed in) is used:
no cuDNN here.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["INNER", "EventTimes", "event_times"]

INNER = 3  # launches per careful measurement
#: The hold of the stream a measurement's launches queue behind: twice the time the host
#: took for its faster warm-up launch, for each launch (a launch took the host 15-30 us on one H100
#: host and up to about 70 us on a slower one), in GPU clock cycles at 2 GHz (about the
#: H100's and H200's boost clock; a slower clock holds longer), within these bounds.
_HOLD_MARGIN = 2.0
_GPU_CYCLES_PER_SECOND = 2e9
_HOLD_CYCLES_MIN = 200_000  # 0.1 ms
_HOLD_CYCLES_MAX = 40_000_000  # 20 ms: a warm-up slowed by something else must not stall the miss
_HOLD_CYCLES_ONE_RUN = 2_000_000  # ~1 ms, per run where the host could not keep up with the above


@dataclass(frozen=True)
class EventTimes:
    """A measurement: milliseconds per launch of each run, and whether the runs had to be
    measured one by one (the host queued them more slowly than the hold lasted)."""

    times: list[float]
    one_by_one: bool


def event_times(cuda: Any, launch: Callable[[], None], runs: int, inner: int,
                clock: Callable[[], float] = time.perf_counter) -> EventTimes:  # fmt: skip
    """Milliseconds per ``launch`` on the current stream, ``runs`` measurements of ``inner``
    launches each, after warm-up launches, with CUDA events (``cuda``: ``torch.cuda``).

    The stream is held busy (``cuda._sleep``) while the host queues every run's launches
    and events behind it, so that a kernel shorter than the host's launch overhead is timed
    on the GPU alone, not on the launch rate, and the runs cost one wait, not one each. The
    hold is sized by the host's time for a warm-up launch (``clock``, in seconds). If the hold
    ended before the host had queued the last launch, the GPU may have waited for the host
    between launches: the runs are measured again one at a time, each behind a hold of its
    own.
    """
    per_launch = math.inf
    # Warm-up. A kernel's first launch may load it: the faster of two says the host's rate
    # (one launch, whose hold is the shortest anyway, is warmed up once).
    for _ in range(1 if runs * inner == 1 else 2):
        begun = clock()
        launch()
        per_launch = min(per_launch, clock() - begun)
    sleep = getattr(cuda, "_sleep", None)
    cycles = int(min(_HOLD_CYCLES_MAX, max(_HOLD_CYCLES_MIN, _HOLD_MARGIN * per_launch * runs * inner * _GPU_CYCLES_PER_SECOND)))
    if sleep is not None:
        marks = [cuda.Event(enable_timing=True) for _ in range(runs + 1)]
        held = cuda.Event()
        sleep(cycles)
        held.record()
        marks[0].record()
        for mark in marks[1:]:
            for _ in range(inner):
                launch()
            mark.record()
        hold_over = held.query()  # before the last launch was queued: the GPU may have waited
        marks[-1].synchronize()
        if not hold_over:
            return EventTimes([float(start.elapsed_time(end)) / inner for start, end in itertools.pairwise(marks)], False)
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    times = []
    for _ in range(runs):
        if sleep is not None:
            sleep(_HOLD_CYCLES_ONE_RUN)
        start.record()
        for _ in range(inner):
            launch()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / inner)
    return EventTimes(times, True)
