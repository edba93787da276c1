"""``CpuDriver``: the driver seam (``guest.driver``) simulated on the CPU.

It holds no logic of plancache's: the guest block, handle leasing, load routing and
launches above it are ``guest.guest_backend``'s, the same code a GPU runs. It simulates
what cuDNN, CUDA and the caching allocator do where bugs hide: devices (environments, each
thread's current device, which ones the program set up), streams, captures and capture
modes (``SimulatedCuda``), the C API (``testing.library``: plans read tensors by pointer),
and the frontend's own ``deserialize`` (its warm-up capture, ``cudaMalloc`` and
``cudaFree``) and execute.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import NoGpuError, TransientLoadError
from ..key import TensorSpec
from ..store.per_process import PerProcess
from . import plans
from .device import CudaError, SimulatedCuda
from .library import ALIGNMENT, Compute, SimulatedLibrary

__all__ = ["CpuDriver", "FrontendGraph", "Handle"]

_WARMUP_BYTES = 1 << 20  # what the frontend's warm-up allocates
_MODES = {0: "global", 1: "thread_local", 2: "relaxed"}  # cudaStreamCaptureMode
_MODE_NUMBERS = {name: number for number, name in _MODES.items()}


@dataclass
class Handle:
    """A cuDNN handle of the test device: its stream (None: NULL) and its C pointer."""

    stream: int | None = None
    backend_handle: int = 0


@dataclass
class FrontendGraph:
    """A graph the frontend built or deserialized: it executes through the frontend's path."""

    payload: dict[str, Any]
    tensors: list[TensorSpec]
    device: int
    executions: int = 0


class CpuDriver:
    """CUDA, cuDNN and the allocator, simulated on the CPU (see the module)."""

    name = "cpu-test"
    device_type = "cpu"
    transient_errors: tuple[type[BaseException], ...] = (CudaError,)

    def __init__(self, cuda: SimulatedCuda, compute: Compute, environment: Mapping[str, Any] | None,
                 devices: int | Sequence[Mapping[str, Any]], in_use: Sequence[int] | None) -> None:  # fmt: skip
        base = {
            "gpu_name": "CPU test device", "compute_capability": "0.0", "sm_count": 0, "driver_version": "none",
            "cuda_version": "none", "cudnn_backend_version": "cpu-test", "cudnn_frontend_version": "cpu-test",
            **(environment or {}),
        }  # fmt: skip
        overrides = [{}] * devices if isinstance(devices, int) else [dict(d) for d in devices]
        if not overrides:
            raise ValueError("devices must be at least 1")
        self.environments = [{**base, **extra} for extra in overrides]
        # The devices this process has set up (as a CUDA context exists once work ran there);
        # None: all of them, as in a process that already set its devices up.
        self.in_use: set[int] | None = None if in_use is None else set(in_use)
        self._local = PerProcess(threading.local)  # ``.device``: each thread's; a forked child's start on device 0
        self.cuda = cuda
        self.compute = compute
        self.simulated = SimulatedLibrary(cuda, self.current_device, compute)
        #: Called while a load's warm-up capture is open (the frontend's path).
        self.during_warmup: Callable[[], None] | None = None
        self.touched: list[tuple[str, str, int]] = []  # (thread, call, device) before the program's first use
        self.loads = 0  # plans deserialized through the frontend's path
        self.libraries_opened = 0  # calls of open_libraries (no CUDA call: never in touched)
        self.launches = 0  # graphs the frontend executed

    # ------------------------------------------------------------------ devices

    def require(self) -> None:
        if not self.environments:
            raise NoGpuError("the test backend has no device")

    def ready(self, device: int) -> None:
        self.note_touch(device, "guest")
        self.cuda.check()
        self._set_up(device)

    def note_touch(self, device: int, call: str) -> None:
        """Record a CUDA call on a device the program has not set up yet: plancache must
        make none before the program's own first use."""
        if not self.device_in_use(device):
            self.touched.append((threading.current_thread().name, call, device))

    def current_device(self) -> int:
        return int(getattr(self._local.get(), "device", 0))

    def device_getter(self) -> Callable[[], int]:
        return self.current_device

    def use_device(self, index: int) -> None:
        """This thread's current device from now on (``torch.cuda.set_device``: set up)."""
        self._set_up(index)
        self._local.get().device = index

    @contextlib.contextmanager
    def on_device(self, index: int) -> Iterator[None]:
        before = self.current_device()
        self.use_device(index)
        try:
            yield
        finally:
            self._local.get().device = before

    def device_count(self) -> int:
        self.note_touch(0, "device_count")  # cuInit, on a GPU
        return len(self.environments)

    def device_in_use(self, device: int) -> bool:
        return self.in_use is None or device in self.in_use

    def _set_up(self, device: int) -> None:
        """Refuse a device the backend lacks; work on one sets it up."""
        if not 0 <= device < len(self.environments):
            raise ValueError(f"no device {device}: the test backend has {len(self.environments)}")
        if self.in_use is not None:
            self.in_use.add(device)

    def environment(self, device: int) -> dict[str, Any]:
        self.note_touch(device, "environment")
        return dict(self.environments[device])

    # ------------------------------------------------------------------ streams and captures

    def capturing(self) -> bool:
        return self.cuda.capturing()

    def capture_getter(self) -> Callable[[], bool]:
        return self.cuda.capturing

    def exchange_capture_mode(self, mode: int) -> int | None:
        return _MODE_NUMBERS[self.cuda.exchange_mode(_MODES[mode])]

    def new_stream(self, device: int) -> int:
        return self.cuda.new_stream(blocking=False)

    def raw_stream(self, stream: Any) -> int:
        return int(stream)

    def stream_getter(self) -> Callable[[int], int]:
        current = self.cuda.current_stream
        return lambda device: current()

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager[int]:
        return self.cuda.stream(int(stream))

    def follow(self, stream: Any, device: int) -> None:
        """Nothing to queue: the test device runs each launch as it is made, in order."""

    def synchronize(self, stream: Any) -> None:
        self.cuda.check()  # a sticky error surfaces at the next synchronization, as CUDA's does

    def time(self, launch: Callable[[], None], runs: int) -> list[float]:
        """The stream's clock around each run, after one warm-up launch (as CUDA events)."""
        launch()
        times = []
        for _ in range(runs):
            begun = self.cuda.elapsed()
            launch()
            times.append(self.cuda.elapsed() - begun)
        return times

    # ------------------------------------------------------------------ handles and memory

    def create_handle(self, device: int) -> Handle:
        with self.on_device(device):
            return Handle(stream=None, backend_handle=self.simulated.create_handle())

    def set_stream(self, handle: Any, stream: int) -> None:
        self.simulated.set_stream(handle.backend_handle, stream)
        handle.stream = stream

    def tensor_device(self, device: int) -> str:
        return "cpu"

    def free_memory(self, device: int) -> int:
        return self.cuda.free_memory - self.cuda.allocated

    def hold(self, size: int) -> None:
        if size >= 0:
            self.cuda.allocate(size)
        else:
            self.cuda.release(-size, sync=False)  # back to the caching allocator's pool

    def workspace_getter(self) -> Callable[[int, int], Any]:
        import torch

        def workspace(size: int, device: int) -> Any:
            return torch.empty(size, dtype=torch.uint8)  # the caching allocator's block for this launch

        return workspace

    # ------------------------------------------------------------------ plans

    def library(self) -> SimulatedLibrary:
        return self.simulated

    def open_libraries(self) -> int:
        self.libraries_opened += 1
        return 0  # the simulated library is this process's code already

    def deserialize(self, blob: bytes, handle: Any) -> FrontendGraph:
        """The frontend's ``deserialize``: the blob read (``ValueError`` for one it cannot
        read), then its warm-up on the handle's stream."""
        payload = plans.decode(blob)
        try:
            self.warmup(handle)
        except CudaError as exc:  # a capture, memory, a sticky error: nothing about the blob
            raise TransientLoadError(f"loading the plan failed for now: {exc}") from exc
        self.loads += 1
        return FrontendGraph(payload, [TensorSpec.from_dict(t) for t in payload["tensors"]], self.current_device())

    def warmup(self, handle: Any) -> None:
        """What cuDNN Frontend's deserialize ends in: on the handle's stream (a new blocking
        one when it has none), a relaxed capture, a 1 MiB ``cudaMalloc``, the plan executed
        into the throwaway graph, the capture ended and destroyed, a ``cudaFree`` (which
        waits for the whole device), and the handle's stream restored. A failure after the
        capture began leaves the stream capturing, as the frontend's does."""
        cuda, original = self.cuda, handle.stream
        fake = original if original is not None else cuda.new_stream(blocking=True)
        if cuda.capturing(fake):
            return  # the frontend skips its warm-up there
        cuda.begin_capture(fake, "relaxed")
        cuda.allocate(_WARMUP_BYTES)
        if self.during_warmup is not None:
            self.during_warmup()
        cuda.launch(lambda: None, fake)
        cuda.end_capture(fake)
        cuda.release(_WARMUP_BYTES)
        handle.stream = original

    def frontend_launch(self, graph: FrontendGraph) -> Callable[[Mapping[int, Any], Any, Any], None]:
        """The frontend's execute of ``graph``: its tensors by uid, on the handle's stream."""

        def launch(pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
            device = self.simulated.handle_device(handle.backend_handle)
            if graph.device != device:
                raise RuntimeError(f"a plan loaded on device {graph.device} was launched on device {device}")
            for uid, tensor in pack.items():
                pointer = getattr(tensor, "data_ptr", None)
                if pointer is not None and pointer() % ALIGNMENT:
                    raise RuntimeError(f"misaligned address: tensor uid {uid} is not {ALIGNMENT}-byte aligned")
            self.compute(graph.payload["description"], graph.tensors, pack, graph.payload, workspace, handle.stream)
            graph.executions += 1
            self.launches += 1

        return launch
