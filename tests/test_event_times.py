"""How a candidate is timed on the GPU (``cudnn.backend.event_times``), on a model of
one CUDA stream: the host queues work and records events; the GPU runs each piece of work
when it is queued and the work before it is done; an event completes when the stream
reaches it. A hold (``_sleep``) keeps the stream busy while the host queues.

The model shows what the timing must get right: a kernel shorter than the host's launch
overhead is timed on the GPU alone (not on the launch rate), the runs of a measurement wait
behind one hold (not one each) sized by the host's time for a launch, and a host slower
than that is caught and measured again run by run.
"""

from __future__ import annotations

import pytest

from plancache.cudnn.backend import event_times

GHZ = 2.0  # the modelled GPU clock: cycles per nanosecond


class Stream:
    """One stream and the host that queues on it; times in milliseconds."""

    def __init__(self, host_per_launch: float, kernel: float, later_per_launch: float | None = None) -> None:
        self.host = 0.0  # the host's clock
        self.busy_until = 0.0  # when the stream's queued work ends
        self.host_per_launch, self.kernel = host_per_launch, kernel
        self.later_per_launch = host_per_launch if later_per_launch is None else later_per_launch  # after the first
        self.holds: list[int] = []
        self.waits = 0  # host synchronizations

    def _sleep(self, cycles: int) -> None:
        self.holds.append(cycles)
        self.busy_until = max(self.busy_until, self.host) + cycles / (GHZ * 1e6)

    def launch(self) -> None:
        self.host += self.host_per_launch
        self.host_per_launch = self.later_per_launch
        self.busy_until = max(self.busy_until, self.host) + self.kernel

    def clock(self) -> float:
        """The host's clock in seconds, as ``time.perf_counter``."""
        return self.host / 1e3

    def Event(self, enable_timing: bool = False) -> Event:
        return Event(self)


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.at: float | None = None

    def record(self) -> None:
        self.at = max(self.stream.busy_until, self.stream.host)

    def query(self) -> bool:
        assert self.at is not None
        return self.at <= self.stream.host

    def synchronize(self) -> None:
        assert self.at is not None
        self.stream.host = max(self.stream.host, self.at)
        self.stream.waits += 1

    def elapsed_time(self, end: Event) -> float:
        assert self.at is not None and end.at is not None
        return end.at - self.at


def test_a_short_kernel_is_timed_on_the_gpu_behind_one_hold() -> None:
    stream = Stream(host_per_launch=0.025, kernel=0.010)  # a launch costs the host more than the kernel runs
    measured = event_times(stream, stream.launch, runs=7, inner=3, clock=stream.clock)
    assert measured.times == pytest.approx([0.010] * 7) and not measured.one_by_one
    assert len(stream.holds) == 1 and stream.waits == 1
    assert stream.host < 1.5  # one hold of about a millisecond, not seven


def test_without_a_hold_the_launch_rate_would_be_timed() -> None:
    """What the hold prevents: the same stream timed with no ``_sleep`` reads the host's rate."""

    class NoHold:
        def __init__(self, stream: Stream) -> None:
            self.Event = stream.Event

    stream = Stream(host_per_launch=0.025, kernel=0.010)
    measured = event_times(NoHold(stream), stream.launch, runs=3, inner=3, clock=stream.clock)
    assert min(measured.times) > 0.015  # a launch's host time, not the kernel's 0.010
    assert stream.holds == [] and stream.waits == 3


def test_the_hold_is_sized_by_the_host_s_launch_so_a_slow_host_waits_once() -> None:
    # A host that takes 80 us per launch (an H100 host read 70 us): the hold covers its 21
    # launches, and the runs still cost one wait.
    stream = Stream(host_per_launch=0.080, kernel=0.010)
    measured = event_times(stream, stream.launch, runs=7, inner=3, clock=stream.clock)
    assert measured.times == pytest.approx([0.010] * 7) and not measured.one_by_one
    assert len(stream.holds) == 1 and stream.waits == 1
    assert stream.host < 0.080 * 22 * 2 + 0.5  # the launches and a hold of twice their time, not seven holds
    fast = Stream(host_per_launch=0.015, kernel=0.010)
    event_times(fast, fast.launch, runs=7, inner=3, clock=fast.clock)
    assert fast.holds[0] < stream.holds[0] / 4  # a fast host is held for less


def test_a_host_slower_than_its_warm_up_is_measured_again_run_by_run() -> None:
    stream = Stream(host_per_launch=0.020, kernel=0.010, later_per_launch=0.120)  # slowed after the warm-up
    measured = event_times(stream, stream.launch, runs=7, inner=3, clock=stream.clock)
    assert measured.times == pytest.approx([0.010] * 7) and measured.one_by_one  # each run behind a hold of its own
    assert len(stream.holds) == 1 + 7 and stream.waits == 1 + 7


def test_one_run_of_one_launch_holds_briefly() -> None:
    stream = Stream(host_per_launch=0.025, kernel=2.0)
    assert event_times(stream, stream.launch, runs=1, inner=1, clock=stream.clock).times == pytest.approx([2.0])
    assert len(stream.holds) == 1 and stream.holds[0] / (GHZ * 1e6) <= 0.2  # a tenth of a millisecond, not one


def test_a_first_launch_that_loads_its_kernel_does_not_size_the_hold() -> None:
    stream = Stream(host_per_launch=5.0, kernel=0.010, later_per_launch=0.020)  # the first launch loaded a module
    measured = event_times(stream, stream.launch, runs=7, inner=3, clock=stream.clock)
    assert measured.times == pytest.approx([0.010] * 7) and not measured.one_by_one
    assert stream.holds[0] / (GHZ * 1e6) < 2 * 0.020 * 21 + 0.1  # sized by the second launch, not the first


def test_a_warm_up_slowed_by_something_else_holds_the_stream_at_most_20_ms() -> None:
    stream = Stream(host_per_launch=50.0, kernel=0.010)  # every launch took 50 ms (another process, say)
    event_times(stream, stream.launch, runs=7, inner=3, clock=stream.clock)
    assert stream.holds[0] / (GHZ * 1e6) <= 20.0
