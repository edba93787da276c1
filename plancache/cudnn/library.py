"""cuDNN's C API and the CUDA driver calls a launch needs, through ctypes: the one module
that owns the C libraries.

Why not the frontend's binding: it holds the GIL through every call (a plan's finalize
takes tens of milliseconds, which stalled the program's main thread) and its
``deserialize`` ends in a warm-up capture that breaks the device-wide synchronizations
of other threads. A foreign call through ``ctypes.CDLL`` releases the GIL for its
duration, and loading a plan here is only host work and cuDNN's finalize: no capture, no
allocation, no synchronization.

The library is the one the process already loaded (found in ``/proc/self/maps``, after
asking the frontend to load it if nothing had yet): two copies of cuDNN in one process
would not share handles or plans. Every function is declared once (``argtypes``,
``restype``), every status is checked and turned into ``NativeError`` naming the call,
the status and cuDNN's own last message.

Enumeration values are cuDNN 9's (``cudnn_graph.h``); they are ABI-stable across 9.x.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import NativeError, NativeLibrary
from ..store.per_process import PerProcess

__all__ = ["Libcuda", "Library", "libcuda", "library", "open_beside"]

# cudnnBackendDescriptorType_t
EXECUTION_PLAN = 5
VARIANT_PACK = 16
# cudnnBackendAttributeName_t
PLAN_HANDLE = 400
PLAN_WORKSPACE_SIZE = 402
PLAN_JSON = 405
PACK_UIDS = 1000
PACK_POINTERS = 1001
PACK_WORKSPACE = 1003
# cudnnBackendAttributeType_t
TYPE_HANDLE = 0
TYPE_INT64 = 3
TYPE_VOID_PTR = 6
TYPE_CHAR = 24

_c_void_p_p = ctypes.POINTER(ctypes.c_void_p)
_c_int64_p = ctypes.POINTER(ctypes.c_int64)


_NAMES = ("libcudnn_graph.so", "libcudnn.so")


def loaded_path(names: Sequence[str], maps: str = "/proc/self/maps") -> str | None:
    """The path of the first of ``names`` (``libcudnn_graph.so``) this process has mapped."""
    try:
        with open(maps) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for name in names:
        for line in lines:
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if os.path.basename(path).startswith(name):
                return path
    return None


_opened: list[int] = []  # handles of the libraries open_beside opened: kept open, as cuDNN keeps them
_opened_lock = PerProcess(threading.Lock)  # the handles are kept in a forked child; the lock is not


def open_beside(names: Sequence[str] = _NAMES, maps: str = "/proc/self/maps") -> int:
    """Open every cuDNN library beside the loaded one (its engines, heuristics and
    operations, which cuDNN opens at its first plan load) now, once per process: reading
    and relocating them is host work, no CUDA call. ``dlopen`` is called through ctypes as
    a foreign function, which releases the GIL for the call (``ctypes.CDLL`` holds it
    through its own ``dlopen``). Returns how many were opened; 0 without a loaded cuDNN."""
    path = loaded_path(names, maps)
    with _opened_lock.get():
        if path is None or _opened:
            return 0
        libc = ctypes.CDLL(None)
        dlopen = getattr(libc, "dlopen", None) or ctypes.CDLL("libdl.so.2").dlopen  # in libc from glibc 2.34
        dlopen.argtypes, dlopen.restype = [ctypes.c_char_p, ctypes.c_int], ctypes.c_void_p
        folder = os.path.dirname(path)
        for name in sorted(os.listdir(folder)):
            if name.startswith("libcudnn") and ".so" in name:
                handle = dlopen(os.path.join(folder, name).encode(), os.RTLD_LAZY | os.RTLD_LOCAL)
                if handle:
                    _opened.append(handle)
        return len(_opened)


class Libcuda:
    """The CUDA driver calls plancache makes, declared once: device counts and context
    state asked without creating anything (``cuInit`` creates no context), the calling
    thread's capture mode, and the copies, zeroing and capture query of a launch."""

    def __init__(self, cuda: Any) -> None:
        self._cuda = cuda
        int_p, uint_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint)
        Library._declare(cuda.cuInit, [ctypes.c_uint], ctypes.c_int)
        Library._declare(cuda.cuDriverGetVersion, [int_p], ctypes.c_int)
        Library._declare(cuda.cuDeviceGetCount, [int_p], ctypes.c_int)
        Library._declare(cuda.cuDeviceGet, [int_p, ctypes.c_int], ctypes.c_int)
        Library._declare(cuda.cuDevicePrimaryCtxGetState, [ctypes.c_int, uint_p, int_p], ctypes.c_int)
        Library._declare(cuda.cuThreadExchangeStreamCaptureMode, [int_p], ctypes.c_int)
        Library._declare(
            cuda.cuMemcpyHtoDAsync_v2, [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int
        )
        Library._declare(cuda.cuMemsetD8Async, [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p], ctypes.c_int)
        self._initialized: bool | None = None

    def _init(self) -> bool:
        if self._initialized is None:
            self._initialized = self._cuda.cuInit(0) == 0
        return self._initialized

    def driver_version(self) -> int | None:
        """The CUDA driver API version (12080, say); None when the driver cannot answer."""
        version = ctypes.c_int()
        return int(version.value) if self._cuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None

    def device_count(self) -> int | None:
        """``cuDeviceGetCount`` (``CUDA_VISIBLE_DEVICES`` applied); None when it cannot answer."""
        count = ctypes.c_int()
        if self._init() and self._cuda.cuDeviceGetCount(ctypes.byref(count)) == 0:
            return int(count.value)
        return None

    def primary_context_active(self, device: int) -> bool | None:
        """Whether this process's primary context of ``device`` exists, asked without
        creating anything; None when the driver cannot answer."""
        handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if (
            self._init()
            and self._cuda.cuDeviceGet(ctypes.byref(handle), int(device)) == 0
            and self._cuda.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)) == 0
        ):
            return bool(active.value)
        return None

    def exchange_capture_mode(self, mode: int) -> int | None:
        """Set the calling thread's stream-capture interaction mode; the previous one, or
        None when the driver refused (then nothing changed)."""
        value = ctypes.c_int(mode)
        if self._cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(value)) != 0:
            return None
        return int(value.value)

    def copy_to_device(self, destination: int, source: Any, size: int, stream: int) -> None:
        _check_driver(self._cuda.cuMemcpyHtoDAsync_v2(destination, source, size, stream), "cuMemcpyHtoDAsync")

    def zero(self, destination: int, size: int, stream: int) -> None:
        _check_driver(self._cuda.cuMemsetD8Async(destination, 0, size, stream), "cuMemsetD8Async")


def _check_driver(status: int, call: str) -> None:
    if status != 0:
        raise NativeError(f"{call} failed: CUDA driver error {status}", call=call, status=status, library=NativeLibrary.CUDA)


_libcuda_lock = PerProcess(threading.Lock)  # as _opened_lock
_libcuda: list[Libcuda | None] = []


def libcuda() -> Libcuda | None:
    """The CUDA driver library, declared once; None on a machine without one. Loading it
    creates nothing: every call that needs ``cuInit`` makes it first."""
    with _libcuda_lock.get():
        if not _libcuda:
            try:
                _libcuda.append(Libcuda(ctypes.CDLL("libcuda.so.1")))
            except (OSError, AttributeError):
                _libcuda.append(None)
        return _libcuda[0]


class Library:
    """cuDNN's backend API and the few driver calls launches need, declared once."""

    def __init__(self, cudnn: Any, cuda: Libcuda) -> None:
        self._cudnn = cudnn
        self._cuda = cuda
        c = cudnn
        self._declare(c.cudnnGetVersion, [], ctypes.c_size_t)
        self._declare(c.cudnnGetErrorString, [ctypes.c_int], ctypes.c_char_p)
        self._declare(c.cudnnGetLastErrorString, [ctypes.c_char_p, ctypes.c_size_t], None)
        self._declare(c.cudnnCreate, [_c_void_p_p], ctypes.c_int)
        self._declare(c.cudnnSetStream, [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)
        self._declare(c.cudnnBackendCreateDescriptor, [ctypes.c_int, _c_void_p_p], ctypes.c_int)
        self._declare(c.cudnnBackendDestroyDescriptor, [ctypes.c_void_p], ctypes.c_int)
        self._declare(c.cudnnBackendFinalize, [ctypes.c_void_p], ctypes.c_int)
        self._declare(c.cudnnBackendSetAttribute,
                      [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)  # fmt: skip
        self._declare(c.cudnnBackendGetAttribute,
                      [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, _c_int64_p, ctypes.c_void_p],
                      ctypes.c_int)  # fmt: skip
        self._declare(c.cudnnBackendExecute, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int)
        # The hot calls, bound once: an attribute lookup on a CDLL costs a dict probe.
        self._execute = c.cudnnBackendExecute
        self._set_stream = c.cudnnSetStream

    @staticmethod
    def _declare(function: Any, argtypes: list[Any], restype: Any) -> None:
        function.argtypes = argtypes
        function.restype = restype

    # ------------------------------------------------------------------ errors

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise self._error(status, call)

    def _error(self, status: int, call: str) -> NativeError:
        name = (self._cudnn.cudnnGetErrorString(status) or b"").decode(errors="replace")
        detail = ctypes.create_string_buffer(1024)
        self._cudnn.cudnnGetLastErrorString(detail, len(detail))
        said = detail.value.decode(errors="replace").strip()
        return NativeError(f"{call} failed: {name} ({status}){': ' + said if said else ''}", call=call, status=status)

    # ------------------------------------------------------------------ handles

    def version(self) -> int:
        return int(self._cudnn.cudnnGetVersion())

    def create_handle(self) -> int:
        """A new cuDNN handle on the calling thread's current device (a ``cudaMalloc``:
        call it in relaxed capture mode, outside any capture)."""
        handle = ctypes.c_void_p()
        self._check(self._cudnn.cudnnCreate(ctypes.byref(handle)), "cudnnCreate")
        return int(handle.value or 0)

    def set_stream(self, handle: int, stream: int) -> None:
        status = self._set_stream(handle, stream)
        if status:
            raise self._error(status, "cudnnSetStream")

    # ------------------------------------------------------------------ descriptors

    def create(self, kind: int) -> int:
        descriptor = ctypes.c_void_p()
        self._check(self._cudnn.cudnnBackendCreateDescriptor(kind, ctypes.byref(descriptor)), "cudnnBackendCreateDescriptor")
        return int(descriptor.value or 0)

    def destroy(self, descriptor: int) -> None:
        self._check(self._cudnn.cudnnBackendDestroyDescriptor(descriptor), "cudnnBackendDestroyDescriptor")

    def set(self, descriptor: int, name: int, kind: int, count: int, values: Any, what: str) -> None:
        status = self._cudnn.cudnnBackendSetAttribute(descriptor, name, kind, count, values)
        self._check(status, f"cudnnBackendSetAttribute({what})")

    def finalize(self, descriptor: int, what: str) -> None:
        self._check(self._cudnn.cudnnBackendFinalize(descriptor), f"cudnnBackendFinalize({what})")

    def load_plan(self, handle: int, representation: bytes) -> int:
        """An execution plan finalized from its JSON representation (what the frontend
        serializes as ``cudnn_backend_data``); the caller owns it (``destroy``). The GIL is
        released through the finalize, the long part."""
        plan = self.create(EXECUTION_PLAN)
        try:
            raw = ctypes.c_void_p(handle)
            self.set(plan, PLAN_HANDLE, TYPE_HANDLE, 1, ctypes.byref(raw), "EXECUTION_PLAN_HANDLE")
            # The bytes themselves (their buffer outlives the finalize): no copy of a plan's JSON.
            self.set(plan, PLAN_JSON, TYPE_CHAR, len(representation), representation, "EXECUTION_PLAN_JSON_REPRESENTATION")
            self.finalize(plan, "EXECUTION_PLAN")
        except BaseException:
            self.destroy(plan)
            raise
        return plan

    def plan_workspace(self, plan: int) -> int:
        size, count = ctypes.c_int64(), ctypes.c_int64()
        status = self._cudnn.cudnnBackendGetAttribute(plan, PLAN_WORKSPACE_SIZE, TYPE_INT64, 1, ctypes.byref(count),
                                                      ctypes.byref(size))  # fmt: skip
        self._check(status, "cudnnBackendGetAttribute(EXECUTION_PLAN_WORKSPACE_SIZE)")
        return int(size.value)

    def variant_pack(self, uids: Any, pointers: Any, count: int, workspace: int) -> int:
        """A finalized variant pack (``uids``: a ctypes int64 array, ``pointers``: a ctypes
        void* array, ``count`` of each); the caller owns it."""
        pack = self.create(VARIANT_PACK)
        try:
            self.set(pack, PACK_UIDS, TYPE_INT64, count, uids, "VARIANT_PACK_UNIQUE_IDS")
            self.set(pack, PACK_POINTERS, TYPE_VOID_PTR, count, pointers, "VARIANT_PACK_DATA_POINTERS")
            raw = ctypes.c_void_p(workspace or None)
            self.set(pack, PACK_WORKSPACE, TYPE_VOID_PTR, 1, ctypes.byref(raw), "VARIANT_PACK_WORKSPACE")
            self.finalize(pack, "VARIANT_PACK")
        except BaseException:
            self.destroy(pack)
            raise
        return pack

    def execute(self, handle: int, plan: int, pack: int) -> None:
        status = self._execute(handle, plan, pack)
        if status:
            raise self._error(status, "cudnnBackendExecute")

    # ------------------------------------------------------------------ driver

    def copy_to_device(self, destination: int, source: Any, size: int, stream: int) -> None:
        self._cuda.copy_to_device(destination, source, size, stream)

    def zero(self, destination: int, size: int, stream: int) -> None:
        self._cuda.zero(destination, size, stream)


_lock = PerProcess(threading.Lock)  # as _opened_lock
_loaded: list[Library] = []


def library(load_cudnn: Callable[[], None] | None = None) -> Library:
    """The process's cuDNN, declared once. ``load_cudnn`` makes the frontend load cuDNN when
    nothing has yet. Raises ``OSError`` when there is no cuDNN or CUDA driver to use."""
    with _lock.get():
        if not _loaded:
            path = loaded_path(_NAMES)
            if path is None and load_cudnn is not None:
                load_cudnn()  # the frontend loads cuDNN on first use
                path = loaded_path(_NAMES)
            if path is None:
                raise OSError("cuDNN is not loaded in this process (no libcudnn_graph.so or libcudnn.so in /proc/self/maps)")
            cuda = libcuda()
            if cuda is None:
                raise OSError("the CUDA driver library (libcuda.so.1) cannot be loaded")
            _loaded.append(Library(ctypes.CDLL(path), cuda))
        return _loaded[0]
