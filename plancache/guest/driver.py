"""The driver seam: what the guest backend (``guest.guest_backend``) needs of a machine.

It is as small as cuDNN's own C API: devices, streams and their capture state, the
calling thread's capture mode, handles, workspaces, the C library that loads and launches
plans, and the frontend's own deserialize and execute for the plans that path keeps.
Everything above it is written once (``GuestBackend``) and runs unchanged on both drivers:
``cudnn.backend.CudnnDriver`` calls CUDA, cuDNN and torch; ``testing.driver.CpuDriver``
simulates them on the CPU where bugs hide, and holds no logic of its own. So a test that
passes on the CPU says something about the code the GPU runs. No torch, cuDNN or CUDA
import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

__all__ = ["CLibrary", "Driver", "FrontendLaunch", "Handle"]

#: The frontend's own launch of a graph it loaded: ``(tensors by uid, workspace or None,
#: handle)``, on the stream the handle is set to.
FrontendLaunch = Callable[[Mapping[int, Any], Any, Any], None]


class Handle(Protocol):
    """A cuDNN handle: the stream it is set to (None: NULL) and its C pointer."""

    stream: Any
    backend_handle: int


class CLibrary(Protocol):
    """cuDNN's C API as plans are loaded and launched through it (``guest.native.plan``):
    ctypes on a GPU (``cudnn.library.Library``), simulated on the CPU
    (``testing.library.SimulatedLibrary``). Integers are C pointers and descriptors."""

    def create_handle(self) -> int: ...
    def set_stream(self, handle: int, stream: int) -> None: ...
    def destroy(self, descriptor: int) -> None: ...
    def load_plan(self, handle: int, representation: bytes) -> int: ...
    def plan_workspace(self, plan: int) -> int: ...
    def variant_pack(self, uids: Any, pointers: Any, count: int, workspace: int) -> int: ...
    def execute(self, handle: int, plan: int, pack: int) -> None: ...
    def copy_to_device(self, destination: int, source: Any, size: int, stream: int) -> None: ...
    def zero(self, destination: int, size: int, stream: int) -> None: ...


class Driver(Protocol):
    """CUDA, cuDNN and the allocator, as the guest backend uses them."""

    name: str
    #: torch device type the plan's tensors must live on ("cuda" or "cpu").
    device_type: str

    @property
    def transient_errors(self) -> tuple[type[BaseException], ...]:
        """Exceptions that are the process's, never a plan's (a sticky CUDA error, memory)."""
        ...

    # ------------------------------------------------------------------ devices

    def require(self) -> None:
        """Raise ``NoGpuError`` when no device can be used."""
        ...

    def ready(self, device: int) -> None:
        """Set CUDA up for plancache's own work on ``device`` (after the program's first
        use, or for a call the program made itself); raises when the device is unusable."""
        ...

    def current_device(self) -> int: ...

    def device_getter(self) -> Callable[[], int]:
        """The cheapest ``() -> current device`` (called on every launch)."""
        ...

    def use_device(self, index: int) -> None: ...

    def on_device(self, index: int) -> AbstractContextManager[Any]:
        """``index`` current for the block, then the caller's device again."""
        ...

    def device_count(self) -> int: ...

    def device_in_use(self, device: int) -> bool:
        """Whether this process has set ``device`` up, asked without setting anything up."""
        ...

    def environment(self, device: int) -> dict[str, Any]: ...

    # ------------------------------------------------------------------ streams and captures

    def capturing(self) -> bool:
        """Whether the calling thread's current stream captures (asked without setting CUDA up)."""
        ...

    def capture_getter(self) -> Callable[[], bool]:
        """The cheapest ``() -> whether the calling thread's current stream captures``
        (every launch asks it, with CUDA set up)."""
        ...

    def exchange_capture_mode(self, mode: int) -> int | None:
        """Set the calling thread's capture mode; the previous one (None: not changed)."""
        ...

    def new_stream(self, device: int) -> Any:
        """A new non-blocking stream on ``device`` (plancache's own)."""
        ...

    def raw_stream(self, stream: Any) -> int:
        """A stream made by ``new_stream`` as the integer cuDNN takes."""
        ...

    def stream_getter(self) -> Callable[[int], int]:
        """The cheapest ``device -> the calling thread's current raw stream`` (every launch)."""
        ...

    def on_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """``stream`` (one of ``new_stream``'s) the calling thread's current one for the block."""
        ...

    def follow(self, stream: Any, device: int) -> None:
        """Queue on ``stream`` a wait for the work queued so far on the calling thread's
        current stream of ``device`` (the caller's tensors are ready behind it)."""
        ...

    def synchronize(self, stream: Any) -> None:
        """Wait for the work queued on ``stream``."""
        ...

    def time(self, launch: Callable[[], None], runs: int) -> list[float]:
        """Milliseconds per ``launch`` on the current stream, measured ``runs`` times on the
        device's own clock (after warm-up launches)."""
        ...

    # ------------------------------------------------------------------ handles and memory

    def create_handle(self, device: int) -> Handle:
        """A new cuDNN handle on ``device`` (a ``cudaMalloc``; called in relaxed mode)."""
        ...

    def set_stream(self, handle: Handle, stream: int) -> None:
        """Point ``handle`` at ``stream`` (and remember it in ``handle.stream``)."""
        ...

    def tensor_device(self, device: int) -> str:
        """The torch device tensors of ``device`` are made on (``cuda:1``)."""
        ...

    def free_memory(self, device: int) -> int:
        """Bytes free on ``device`` for plancache's own tensors."""
        ...

    def hold(self, size: int) -> None:
        """Note ``size`` bytes (negative: given back) that plancache's own tensors took
        from the caching allocator's pool (a GPU's allocator keeps this itself)."""
        ...

    def workspace_getter(self) -> Callable[[int, int], Any]:
        """The cheapest ``(size, device) -> size bytes on device`` from the caching
        allocator, on the current stream (an object with ``data_ptr()``): a stream's
        workspace, or a capture's."""
        ...

    # ------------------------------------------------------------------ plans

    def library(self) -> CLibrary:
        """The C API plans are loaded and launched through."""
        ...

    def open_libraries(self) -> int:
        """Open now, with no CUDA call and the GIL released, the libraries a first plan
        load opens (cuDNN's engines); how many. The primer calls it before the program
        has set a device up."""
        ...

    def deserialize(self, blob: bytes, handle: Handle) -> Any:
        """The frontend's own load of ``blob`` (its warm-up capture on the handle's stream);
        raises ``TransientLoadError`` for a failure that is the process's."""
        ...

    def frontend_launch(self, graph: Any) -> FrontendLaunch:
        """How the frontend launches ``graph`` (one it built or deserialized)."""
        ...
