"""plancache's own CUDA work, done as a guest in a program it did not write.

Loading a plan is not a read: cuDNN Frontend's ``deserialize`` ends in a warm-up that
captures the plan into a throwaway CUDA graph on its handle's stream (creating a *blocking*
stream when the handle has none), ``cudaMalloc``s and ``cudaFree``s. On an H200 that broke
the program's own work three ways: legacy-stream work of another thread failed with
``cudaErrorStreamCaptureImplicit``; a ``torch.cuda.graph`` capture on another thread was
invalidated by the ``cudaMalloc``/``cudaFree``; and a handle that carried the program's
stream captured, and so silently dropped, the program's own work on it. Creating a cuDNN
handle (a ``cudaMalloc``) during another thread's capture invalidated that capture too.

So every piece of CUDA work plancache does for itself (loading, building and timing
candidates, creating handles) runs inside ``guest``:

* on a stream of plancache's own, non-blocking, one per device, that no program work is
  ordered with (the caller's current stream is never used nor changed);
* with the calling thread in *relaxed* capture mode (``cuThreadExchangeStreamCaptureMode``),
  restored after, so that nothing it calls is refused by, or invalidates, another
  thread's global-mode capture;
* never while the calling thread's own stream is capturing: that is refused with
  ``CaptureInProgressError`` before anything is called;
* with the caller's current device as it was, afterwards.

``known_captures`` counts the captures plancache itself runs (``plancache.capture``): no
handle is created while one is running.

The thread's capture mode is set through the driver (``guest.driver``): the same code
runs over cuDNN's driver on a GPU and over the CPU test driver in the test suite.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CaptureInProgressError
from ..store.per_process import PerProcess

__all__ = ["RELAXED", "KnownCaptures", "known_captures", "refuse_while_capturing", "relaxed"]

#: ``CU_STREAM_CAPTURE_MODE_RELAXED``: this thread's unsafe calls (cudaMalloc, cudaFree,
#: synchronization) are neither refused by nor invalidating other threads' captures.
RELAXED = 2


@contextlib.contextmanager
def relaxed(driver: Any) -> Iterator[None]:
    """This thread in relaxed capture mode for the block, then as it was (``driver``: an
    ``guest.driver.Driver``)."""
    previous = driver.exchange_capture_mode(RELAXED)
    try:
        yield
    finally:
        if previous is not None:
            driver.exchange_capture_mode(previous)


class _Captures:
    """The captures of this process's threads, and who watches them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.watchers: list[weakref.WeakMethod[Callable[[], None]]] = []


class KnownCaptures:
    """How many captures plancache runs now (``plancache.capture``), process-wide, and who
    waits for the last one to end (``watch``). Per process: a child forked while a thread
    of the parent captured runs no capture (and that thread may have held the lock)."""

    def __init__(self) -> None:
        self._captures = PerProcess(_Captures)

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (a bound method, held weakly) each time a capture ends: a handle
        pool's waiters, which wait on a condition of their own for a handle or for no
        capture, must hear that the capture is over."""
        captures = self._captures.get()
        with captures.lock:
            captures.watchers = [w for w in captures.watchers if w() is not None]
            captures.watchers.append(weakref.WeakMethod(wake))

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        captures = self._captures.get()
        with captures.lock:
            captures.active += 1
        try:
            yield
        finally:
            with captures.lock:
                captures.active -= 1
                watchers = list(captures.watchers)
            for watcher in watchers:
                wake = watcher()
                if wake is not None:
                    wake()

    @property
    def active(self) -> int:
        return self._captures.get().active


known_captures = KnownCaptures()


def refuse_while_capturing(capturing: bool, what: str, key: str = "") -> None:
    """Raise ``CaptureInProgressError`` when the calling thread's stream is capturing."""
    if capturing:
        raise CaptureInProgressError(
            f"{what} while this thread is capturing a CUDA graph would break the capture; nothing was done. "
            "Look plans up (or call plan.prepare()) before capturing",
            key=key,
        )
