"""A simulated CUDA device state: what makes plan loads and autotuning hazardous on a GPU.

The CPU test backend is only useful where it behaves like the GPU. These are the behaviours
plancache must never trip over inside a program it did not write (each seen on an H200):

* **Streams and captures.** Each thread has a current stream (the legacy stream, 0, unless
  set). A stream can be capturing a CUDA graph; work launched on a capturing stream is
  recorded into the capture, not run: another thread's work there is silently lost.
* **The legacy stream.** Work on it while a *blocking* stream captures fails with
  ``cudaErrorStreamCaptureImplicit`` and invalidates that capture.
* **Capture modes.** A thread in global or thread-local mode that calls ``cudaMalloc``,
  ``cudaFree`` or a synchronization while any thread holds a global-mode capture fails
  and invalidates that capture; a thread in relaxed mode does not.
* **Sticky errors.** A kernel that reads through a bad address poisons the context: every
  later call fails, as after "CUDA error: misaligned address".
* **Memory.** A device has so much free memory; what autotuning allocates is tracked.
* **Device synchronization.** ``cudaFree`` waits for every stream.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

__all__ = ["LEGACY", "Capture", "CudaError", "SimulatedCuda"]

LEGACY = 0  # the legacy default stream


class CudaError(RuntimeError):
    """What a failing CUDA call raises on the simulated device."""


@dataclass
class Capture:
    """A CUDA-graph capture of one stream: what was recorded, whether it still holds."""

    stream: int
    mode: str  # "global" | "thread_local" | "relaxed"
    thread: int
    recorded: int = 0
    invalidated: str | None = None


@dataclass
class _Stream:
    blocking: bool
    capture: Capture | None = None
    clock: float = 0.0  # milliseconds of work run on it


@dataclass
class SimulatedCuda:
    """The process-wide CUDA state of the CPU test backend (all its devices share it)."""

    free_memory: int = 64 << 30
    poisoned: str | None = None
    allocated: int = 0
    peak: int = 0
    errors: list[str] = field(default_factory=list)  # every CUDA error raised, in order

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._streams: dict[int, _Stream] = {LEGACY: _Stream(blocking=True)}
        self._local = threading.local()

    # ---------------------------------------------------------------- streams and modes

    def new_stream(self, *, blocking: bool) -> int:
        with self._lock:
            sid = next(self._ids)
            self._streams[sid] = _Stream(blocking=blocking)
            return sid

    def current_stream(self) -> int:
        return int(getattr(self._local, "stream", LEGACY))

    @contextlib.contextmanager
    def stream(self, sid: int) -> Iterator[int]:
        """Make ``sid`` this thread's current stream for the block (``torch.cuda.stream``)."""
        before = self.current_stream()
        self._local.stream = sid
        try:
            yield sid
        finally:
            self._local.stream = before

    def mode(self) -> str:
        return str(getattr(self._local, "mode", "global"))

    def exchange_mode(self, mode: str) -> str:
        """``cuThreadExchangeStreamCaptureMode``: set this thread's mode, return the old one."""
        before, self._local.mode = self.mode(), mode
        return before

    # ---------------------------------------------------------------- captures

    def begin_capture(self, sid: int, mode: str = "global") -> Capture:
        with self._lock:
            self._check()
            stream = self._streams[sid]
            if sid == LEGACY or stream.capture is not None:
                raise self._error(f"cudaErrorStreamCaptureUnsupported: cannot capture stream {sid}")
            stream.capture = Capture(stream=sid, mode=mode, thread=threading.get_ident())
            return stream.capture

    def end_capture(self, sid: int) -> Capture:
        with self._lock:
            capture = self._streams[sid].capture
            if capture is None:
                raise self._error(f"cudaErrorStreamCaptureNotStarted: stream {sid} is not capturing")
            self._streams[sid].capture = None
            if capture.invalidated is not None:
                raise self._error(f"cudaErrorStreamCaptureInvalidated: {capture.invalidated}")
            return capture

    def capturing(self, sid: int | None = None) -> bool:
        """Whether ``sid`` (default: this thread's current stream) is capturing."""
        return self._streams.get(self.current_stream() if sid is None else sid, _Stream(True)).capture is not None

    # ---------------------------------------------------------------- work

    def launch(self, work: Callable[[], object], sid: int | None = None, took: float = 0.0) -> None:
        """Run ``work`` on ``sid`` (default: the current stream) as a kernel would, ``took``
        milliseconds on the stream's clock: recorded (not run) on a capturing stream,
        refused on the legacy stream beside a capture of a blocking stream."""
        sid = self.current_stream() if sid is None else sid
        with self._lock:
            self._check()
            capture = self._streams[sid].capture
            if capture is not None:
                capture.recorded += 1
                return
            if sid == LEGACY:
                for other in self._streams.values():
                    if other.capture is not None and other.blocking:
                        other.capture.invalidated = "the legacy stream was used during the capture"
                        raise self._error(
                            "cudaErrorStreamCaptureImplicit: work on the legacy stream while a blocking stream captures"
                        )
            self._streams[sid].clock += took
        work()

    def elapsed(self) -> float:
        """Milliseconds of work run so far on this thread's current stream (what two CUDA
        events around it measure)."""
        return self._streams[self.current_stream()].clock

    def unsafe(self, call: str) -> None:
        """A call that a global-mode capture forbids (``cudaMalloc``, ``cudaFree``, a sync):
        refused, and the capture invalidated, unless this thread is in relaxed mode."""
        with self._lock:
            self._check()
            mode, me = self.mode(), threading.get_ident()
            if mode == "relaxed":
                return
            for stream in self._streams.values():
                capture = stream.capture
                if capture is None:
                    continue
                # This thread's own capture, unless begun relaxed; another thread's global-mode
                # capture, unless this thread is in thread-local mode (CUDA's rules).
                own = capture.thread == me
                if (own and capture.mode != "relaxed") or (not own and mode == "global" and capture.mode == "global"):
                    capture.invalidated = f"{call} was called during the capture"
                    raise self._error(f"cudaErrorStreamCaptureUnsupported: {call} during a capture")

    def synchronize_device(self) -> None:
        """A device-wide synchronization (``cudaDeviceSynchronize``, the one in ``cudaFree``):
        outside relaxed mode it fails while any capture is open, of any thread and mode,
        and breaks that capture (seen on an H200 beside the frontend's relaxed warm-up)."""
        with self._lock:
            self._check()
            if self.mode() != "relaxed":
                for stream in self._streams.values():
                    if stream.capture is not None:
                        stream.capture.invalidated = "a device synchronization during the capture"
                        raise self._error("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")

    # ---------------------------------------------------------------- memory and faults

    def allocate(self, size: int) -> None:
        self.unsafe("cudaMalloc")
        with self._lock:
            if size > self.free_memory - self.allocated:
                raise self._error(f"cudaErrorMemoryAllocation: out of memory allocating {size} bytes")
            self.allocated += size
            self.peak = max(self.peak, self.allocated)

    def release(self, size: int, *, sync: bool = True) -> None:
        """``cudaFree`` (``sync``: it waits for the whole device), or
        a block handed back to a caching allocator's pool (no CUDA call)."""
        if sync:
            self.synchronize_device()
        with self._lock:
            self.allocated -= size

    def poison(self, reason: str) -> None:
        with self._lock:
            self.poisoned = self.poisoned or reason
        raise self._error(f"CUDA error: {reason}")

    def check(self) -> None:
        with self._lock:
            self._check()

    def _check(self) -> None:
        if self.poisoned is not None:
            raise self._error(f"CUDA error: {self.poisoned} (a sticky error: the context is unusable)")

    def _error(self, message: str) -> CudaError:
        self.errors.append(message)
        return CudaError(message)
