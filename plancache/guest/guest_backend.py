"""The backend written once, as a guest, over a driver (``guest.driver``).

Everything a stored plan goes through between the cache and the machine lives here, and
runs unchanged over cuDNN's driver on a GPU and over the CPU test driver in the suite:

* **the guest block** (``guest``, ``guest.block``);
* **handle leasing** (``guest.handles``): a pool per device, filled at load, so that a
  launch inside a capture creates nothing;
* **load routing** (``load``): cuDNN's C API (``guest.native``) for a blob the native path
  reads and was tested on, the frontend's own deserialize for any other, one at a time;
* **launch composition** (``launcher``): the plan's device, a workspace, a leased handle
  and the caller's pointers, resolved once per plan.

What differs between machines, a graph's candidate plans (``plans``) and rebuilding one,
is the subclass's (``CudnnBackend``, ``CpuTestBackend``); the candidates are launched,
checked and timed over the driver by ``autotuning.candidates``, the same code on both.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import NativeError, TransientLoadError
from ..formats.plan_blob import PlanBlob
from ..key import TensorSpec
from ..store.per_process import PerProcess
from .backend import Launch
from .block import refuse_while_capturing, relaxed
from .driver import Driver
from .handles import Handles
from .native import NativePlan, RecordError, parse, refusal
from .native.record import OUT_OF_BOUNDS, Fallback, keep, kept_form, workspace_fits

__all__ = ["GuestBackend", "pinned_plans"]

#: Plans launched while their stream was capturing: a CUDA graph may replay them at any
#: time, and cuDNN releases a plan's code with the plan, so they live as long as the process.
_PINNED: list[Any] = []
_PINNED_LOCK = threading.Lock()


def pinned_plans() -> int:
    """How many plans are kept for CUDA graphs that may replay them."""
    return len(_PINNED)


def _pin(native: Any) -> None:
    with _PINNED_LOCK:
        if not any(kept is native for kept in _PINNED):
            _PINNED.append(native)


class _Process:
    """What a forked child of the backend's process starts without: the parent's handles
    and streams, of a CUDA context the child cannot use, the workspaces of its threads, and
    the lock of its frontend loads (another thread of the parent may have held it)."""

    def __init__(self, driver: Driver) -> None:
        self.handles = Handles(driver.create_handle, driver.capturing, lambda: relaxed(driver))
        self.streams: dict[int, Any] = {}  # device -> plancache's own non-blocking stream
        #: .held, per thread: (device, raw stream) -> (bytes, workspace), as large as the
        #: largest plan this thread launched on that stream needs. One thread's launches on
        #: one stream are queued one after another and run in that order, so they share it
        #: safely; two threads' launches on one stream may interleave their kernels, so
        #: each thread has its own. A replaced one goes back to the caching allocator on its
        #: stream, which hands it out again only behind the work already queued there.
        self.workspaces = threading.local()
        self.frontend_loads = threading.Lock()  # two warm-ups on one stream would capture each other's work


class GuestBackend:
    """The backend seam (``guest.backend.Backend``) over a ``Driver``: the guest block,
    handles, loads and launches. Subclasses add a graph's plans and rebuilds."""

    def __init__(self, driver: Driver, *, native: bool = True) -> None:
        self.driver = driver
        self.native = native  # False: every plan loads through the frontend's path
        self.name = driver.name
        self.device_type = driver.device_type
        #: Plans loaded through the frontend's path instead of the native one, by kind
        #: (``PlanCache.stats`` shows them as ``native_fallbacks``).
        self.native_fallbacks: collections.Counter[str] = collections.Counter()
        self._process = PerProcess(functools.partial(_Process, driver))
        self._inside = threading.local()  # .device: that of the guest block this thread is in, if any

    @property
    def handles(self) -> Handles:
        """This process's cuDNN handles (``guest.handles``)."""
        return self._process.get().handles

    # ------------------------------------------------------------------ devices

    def current_device(self) -> int:
        self.driver.require()
        return self.driver.current_device()

    def use_device(self, index: int) -> None:
        self.driver.use_device(index)

    def device_count(self) -> int:
        return self.driver.device_count()

    def device_in_use(self, device: int) -> bool:
        return self.driver.device_in_use(device)

    def environment(self, device: int | None = None) -> dict[str, Any]:
        self.driver.require()
        return dict(self.driver.environment(self.driver.current_device() if device is None else device))

    def capturing(self) -> bool:
        return self.driver.capturing()

    # ------------------------------------------------------------------ the guest block

    @contextlib.contextmanager
    def guest(self, device: int) -> Iterator[None]:
        """plancache's own CUDA work on ``device``: refused while this thread captures;
        relaxed capture mode; the device current, then the caller's again. Work queued on
        a stream goes on ``own_stream(device)``. A block inside this thread's block on the
        same device is that block (a lookup opens one; the load inside it opens none)."""
        inside = self._inside
        outer = getattr(inside, "device", None)
        if outer == device:  # this thread's block on this device already (a lookup's, around its load): one block
            yield
            return
        driver = self.driver
        driver.require()
        refuse_while_capturing(driver.capturing(), "loading or building a plan")
        driver.ready(device)  # the capture mode can only be set once CUDA is set up
        with relaxed(driver), driver.on_device(device):
            inside.device = device
            try:
                yield
            finally:
                inside.device = outer

    def own_stream(self, device: int) -> Any:
        """plancache's own stream on ``device`` (asked inside a guest block, made at the
        first need: a native load queues nothing): non-blocking, never the caller's."""
        streams = self._process.get().streams
        stream = streams.get(device)
        if stream is None:
            stream = streams[device] = self.driver.new_stream(device)
        return stream

    def prepare(self, device: int) -> None:
        with self.guest(device):
            self.handles.ensure(device)

    def open_libraries(self) -> int:
        return self.driver.open_libraries()

    # ------------------------------------------------------------------ loading

    def route(self, blob: PlanBlob, tensors: Sequence[TensorSpec], memory: int | None) -> tuple[Any, Fallback | None]:
        """``(record, None)`` for a blob the native path loads on a device of ``memory`` bytes, else ``(None, why)``."""
        if not self.native:
            return None, Fallback.OFF
        try:
            record = parse(blob)
        except RecordError:
            return None, Fallback.UNREADABLE
        return record, refusal(record, {spec.uid: spec for spec in tensors}, memory)

    def read_ahead(self, blob: PlanBlob) -> None:
        if self.native:
            with contextlib.suppress(RecordError):  # the load meets the same error and falls back
                parse(blob)

    def kept_record(self, blob: PlanBlob) -> Mapping[str, Any] | None:
        return kept_form(blob) if self.native else None

    def keep_record(self, blob: PlanBlob, kept: Mapping[str, Any]) -> bool:
        if not self.native:
            return False
        try:
            keep(blob, kept)
        except RecordError:
            return False
        return True

    def _memory(self, device: int) -> int | None:
        """The device's memory in bytes, where its environment says (the bound of a workspace)."""
        memory = self.driver.environment(device).get("total_memory")
        return memory if isinstance(memory, int) else None

    def load(self, blob: PlanBlob | bytes, tensors: Sequence[TensorSpec], device: int | None = None) -> Any:
        """Load a stored plan onto ``device`` (default: the current one): through the C API
        (no GIL held through the finalize; nothing captured, allocated or synchronized),
        else through the frontend's ``deserialize`` (counted in ``native_fallbacks``).
        ``blob``: a ``PlanBlob`` the store's judge read (its decoding is the load's), or
        bytes. Runs inside the caller's guest block where there is one (``guest``).
        Raises ``TransientLoadError`` for a failure that is not the blob's, and
        ``RecordError`` for a blob whose launches no tensor or workspace bounds
        (``OUT_OF_BOUNDS``, counted too: the frontend's path would launch it as it is)."""
        device = self.current_device() if device is None else device
        blob = PlanBlob.of(blob)
        with self._transient(), self.guest(device):  # a device that cannot be set up is the process's too
            memory = self._memory(device)
            record, why = self.route(blob, tensors, memory)
            if why is None:
                with self.handles.lease(device) as handle:
                    native = NativePlan(self.driver.library(), record, handle.backend_handle, device)
                if workspace_fits(native.workspace_size, memory):  # the backend's part is known once finalized
                    return native
                why = Fallback.WORKSPACE
            self.native_fallbacks[why.value] += 1
            if why in OUT_OF_BOUNDS:
                raise RecordError(f"the plan blob is refused: {why.value} (a damaged or hostile blob: never launched)")
            with self._process.get().frontend_loads, self.handles.lease(device) as handle:
                # Never NULL (the frontend would make a blocking stream) and never the caller's.
                self.driver.set_stream(handle, self.driver.raw_stream(self.own_stream(device)))
                return self.driver.deserialize(blob.data, handle)

    @contextlib.contextmanager
    def _transient(self) -> Iterator[None]:
        """A failure in the block that is the process's, not the blob's, raises ``TransientLoadError``."""
        try:
            yield
        except TransientLoadError:
            raise
        except NativeError as exc:
            if exc.transient:
                raise TransientLoadError(f"loading the plan failed for now: {exc}") from exc
            raise
        except self.driver.transient_errors as exc:
            raise TransientLoadError(f"loading the plan failed for now: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ launching

    def pointer_order(self, native: Any) -> Sequence[int] | None:
        return native.user_uids if isinstance(native, NativePlan) else None

    def launcher(self, native: Any, workspace_size: int, device: int) -> Launch:
        """What ``Plan.execute`` calls for each launch (tensors by uid and their pointers,
        already checked), with everything that does not change between launches resolved
        once."""
        driver = self.driver
        current_device, raw_stream, capturing = driver.device_getter(), driver.stream_getter(), driver.capture_getter()
        set_stream, allocate = driver.set_stream, driver.workspace_getter()
        process = self._process.get()  # a plan is launched in the process that loaded it (CUDA: never in a forked child)
        take, give, workspaces = process.handles.take, process.handles.give, process.workspaces
        if isinstance(native, NativePlan):
            size = max(int(workspace_size), native.workspace_size)
            run_native = native.launch

            def run(pack: Mapping[int, Any], pointers: Sequence[int], workspace: Any, handle: Any, stream: int) -> None:
                run_native(pointers, workspace.data_ptr() if workspace is not None else 0, handle.backend_handle, stream)
        else:
            size = int(workspace_size)
            run_frontend = driver.frontend_launch(native)

            def run(pack: Mapping[int, Any], pointers: Sequence[int], workspace: Any, handle: Any, stream: int) -> None:
                run_frontend(pack, workspace, handle)

        pinned = False

        def launch(pack: Mapping[int, Any], pointers: Sequence[int]) -> None:
            nonlocal pinned
            if current_device() != device:
                with driver.on_device(device):  # the plan's device, with that device's current stream
                    launch(pack, pointers)
                return
            stream = raw_stream(device)
            if capturing():
                if not pinned:  # a CUDA graph now points at this plan's code and buffers: kept for good
                    pinned = True
                    _pin(native)
                # From the capture's own pool: the graph's replays use it, and nothing else.
                workspace = allocate(size, device) if size > 0 else None
            elif size > 0:
                # This thread's on this stream, reused: its launches there run one after another.
                held = getattr(workspaces, "held", None)
                if held is None:
                    held = workspaces.held = {}
                found = held.get((device, stream))
                if found is None or found[0] < size:
                    found = held[(device, stream)] = (size, allocate(size, device))
                workspace = found[1]
            else:
                workspace = None
            handle = take(device)
            try:
                if handle.stream != stream:
                    set_stream(handle, stream)
                run(pack, pointers, workspace, handle, stream)
            finally:
                give(device, handle)

        return launch
