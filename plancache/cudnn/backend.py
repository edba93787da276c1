"""The cuDNN Frontend backend: the only module that imports ``cudnn``.

Both ``cudnn`` and ``torch`` are imported inside functions, so importing plancache stays
cheap and works without a GPU.

``CudnnDriver`` is the driver seam (``guest.driver``) on CUDA, cuDNN and torch: devices
and streams through torch, the capture mode and device state through the CUDA driver
(``cudnn.library``), handles made through cuDNN's C API and wrapped as the
frontend's own ``Handle``, workspaces from torch's caching allocator on the launching
stream (as PyTorch does for its own cuDNN calls: stream-ordered reuse, never one buffer
shared by two streams, inside a capture from the capture's private pool), and the
frontend's ``deserialize`` and execute for the plans the native path leaves to it.

``CudnnBackend`` is the guest backend (``guest.guest_backend``: the guest block,
handles, load routing, launches, written once) over that driver, plus what only cuDNN
does: a graph's plans as cuDNN lists them (``_Plans``; ``autotuning.candidates`` launches,
checks and times them, as it does the CPU test backend's), rebuilds from an engine id and
knobs, and the shared kernel cache of dynamic-shape builds.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import BuildError, InvalidGraphError, NoGpuError, TransientLoadError
from ..guest.backend import BuiltPlan, EngineChoice
from ..guest.driver import FrontendLaunch
from ..guest.guest_backend import GuestBackend
from ..key import BuildOptions, mark_shared_kernel_cache, tensor_table
from ..store.per_process import PerProcess
from .library import libcuda, library, open_beside
from .timing import INNER, event_times

__all__ = ["CudnnBackend", "CudnnDriver", "cudnn_module", "frontend_failures", "probe_environment"]

log = logging.getLogger("plancache")

_NODE_IN_MESSAGE = re.compile(r"[Nn]ode '([^']+)'")


def _process_errors() -> tuple[type[BaseException], ...]:
    """torch's exceptions that are the process's, never a plan's: a CUDA error (sticky or
    not) and running out of device memory."""
    torch = _torch()
    return tuple(t for t in (getattr(torch, "AcceleratorError", None), torch.cuda.OutOfMemoryError, MemoryError) if t)


@contextlib.contextmanager
def frontend_failures() -> Iterator[None]:
    """A frontend ``deserialize`` in the block that failed for a reason that is not the
    blob's raises ``TransientLoadError`` (the entry is kept and loaded again later).

    The frontend's binding raises one exception type of its own,
    ``cudnnGraphNotSupportedError``, for a plan cuDNN does not support: the library's word
    on the blob. Everything else it raises is a bare ``RuntimeError`` (its warm-up capture
    refused beside another thread's capture, memory, a CUDA error), or one of torch's
    CUDA errors: the process's. The blob itself was read by the native path's parser
    before it came here (``GuestBackend.route``)."""
    try:
        yield
    except TransientLoadError:
        raise
    except Exception as exc:
        if isinstance(exc, _cudnn().cudnnGraphNotSupportedError):
            raise
        if isinstance(exc, (RuntimeError, *_process_errors())):
            raise TransientLoadError(f"loading the plan failed for now: {type(exc).__name__}: {str(exc)[:300]}") from exc
        raise


def _cudnn() -> Any:
    import cudnn

    return cudnn


def cudnn_module() -> Any:
    """The ``cudnn`` module, imported on first use (graph templates and replay build pygraphs with it)."""
    return _cudnn()


def _torch() -> Any:
    import torch

    return torch


def driver_version() -> str:
    """The NVIDIA kernel driver version (``580.159.04``), else the CUDA driver API version."""
    for path in ("/sys/module/nvidia/version", "/proc/driver/nvidia/version"):
        with contextlib.suppress(OSError):
            text = Path(path).read_text()
            match = re.search(r"\d+\.\d+(\.\d+)?", text)
            if match:
                return match.group(0)
    cuda = libcuda()
    version = cuda.driver_version() if cuda is not None else None
    return f"cuda-api-{version}" if version is not None else "unknown"


def _gpu_available() -> bool:
    """Seam for tests: whether a CUDA device can be used."""
    try:
        torch = _torch()
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def probe_environment() -> dict[str, Any]:
    """What can be known of the environment on this machine; never raises.

    On a machine without a GPU, the GPU fields are None and ``gpu`` says why.
    """
    info: dict[str, Any] = {}
    try:
        info["cudnn_frontend_version"] = _cudnn().__version__
    except Exception as exc:
        info["cudnn_frontend_version"] = f"unavailable ({type(exc).__name__})"
    try:
        torch = _torch()
        info["torch_version"] = torch.__version__
        info["cuda_version"] = torch.version.cuda
    except ImportError:
        info["torch_version"] = None
    if _gpu_available():
        try:
            backend = CudnnBackend()
            info.update(backend.environment(backend.current_device()))
            info["gpu"] = "available"
        except Exception as exc:
            info["gpu"] = f"unusable: {exc}"
    else:
        info.update(gpu_name=None, compute_capability=None, sm_count=None, cudnn_backend_version=None)
        info["driver_version"] = driver_version()
        info["gpu"] = "none: no CUDA device is visible; plans can be inspected but not built or run here"
    return info


# ---------------------------------------------------------------------- candidates


def _raise_invalid(exc: BaseException, stage: str, graph: Any = None) -> None:
    match = _NODE_IN_MESSAGE.search(str(exc))
    node = match.group(1) if match else None
    where = f"node {node!r}: " if node else ""
    hint = ""
    if (getattr(graph, "_cpp_graph_kwargs", None) or {}).get("is_dynamic_shape_enabled"):
        hint = " (dynamic shapes are enabled: cuDNN may build this graph only as a static one; retry with is_dynamic_shape_enabled=False)"
    raise InvalidGraphError(f"cuDNN rejected the graph at {stage}: {where}{exc}{hint}", node=node, reason=str(exc)) from exc


def _knobs_to_json(knobs: Mapping[Any, int]) -> dict[str, int]:
    return {getattr(k, "name", str(k)): int(v) for k, v in knobs.items()}


def _knobs_from_json(knobs: Mapping[str, int]) -> dict[Any, int]:
    knob_type = _cudnn().knob_type
    return {knob_type[name]: int(value) for name, value in knobs.items()}


class _Plans:
    """The candidate plans of one cuDNN graph (``guest.backend.GraphPlans``), de-duplicated
    across heuristic modes; ``autotuning.candidates`` launches, checks and times them."""

    def __init__(self, graph: Any, description: Mapping[str, Any]) -> None:
        self.graph = graph
        self.description = description
        self.tensors = tensor_table(graph)
        self.indices: list[int] = []  # position -> index in the graph's plan list
        names: set[str] = set()
        for index in range(graph.get_execution_plan_count()):
            name = graph.get_plan_name_at_index(index)
            if name not in names:  # modes A and B often propose the same engine config
                names.add(name)
                self.indices.append(index)
        self._compiles: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self.indices)

    def engine(self, position: int) -> EngineChoice:
        index = self.indices[position]
        name = self.graph.get_plan_name_at_index(index)
        try:
            engine_id, knobs = self.graph.get_engine_and_knobs_at_index(index)
        except Exception:
            return EngineChoice(engine_id=None, knobs={}, name=name)
        return EngineChoice(engine_id=int(engine_id), knobs=_knobs_to_json(knobs or {}), name=name)

    def compiles(self, position: int) -> bool:
        found = self._compiles.get(position)
        if found is None:
            try:
                notes = self.graph.get_behavior_notes_for_plan_at_index(self.indices[position])
            except Exception:  # a plan of the frontend's own Python engines, say: no backend notes
                notes = []
            found = self._compiles[position] = _cudnn().behavior_note.RUNTIME_COMPILATION in list(notes or [])
        return found

    def build(self, position: int) -> int:
        index = self.indices[position]
        try:
            self.graph.build_plan_at_index(index)
            return int(self.graph.get_workspace_size_plan_at_index(index))
        except (_cudnn().cudnnGraphNotSupportedError, RuntimeError, ValueError) as exc:
            raise BuildError(f"{type(exc).__name__}: {str(exc)[:300]}", reason="not built") from exc

    def launch(self, position: int, pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
        self.graph.execute_plan_at_index(pack, workspace, self.indices[position], handle)

    def finish(self, position: int) -> BuiltPlan:
        index = self.indices[position]
        self.graph.build_plan_at_index(index)  # selects it: serialize() writes the selected plan
        blob = bytes(self.graph.serialize(as_bytes=True))
        workspace = int(self.graph.get_workspace_size_plan_at_index(index))
        return BuiltPlan(self.graph, blob, self.tensors, workspace, self.engine(position))


# ---------------------------------------------------------------------- kernel caches


class _KernelCaches:
    """The one shared cuDNN kernel cache of each device, made on first use."""

    def __init__(self) -> None:
        self._by_device: dict[int, Any] = {}

    def get(self, device: int) -> Any:
        """The device's shared kernel cache, or None before its first use."""
        return self._by_device.get(device)

    def ensure(self, device: int) -> Any:
        cache = self._by_device.get(device)
        if cache is None:
            cache = self._by_device[device] = _cudnn().create_kernel_cache()
            # attached after the graph was keyed: the key must not see it as the caller's
            mark_shared_kernel_cache(cache)
        return cache


# ---------------------------------------------------------------------- the driver


class CudnnDriver:
    """The driver seam (``guest.driver.Driver``) on CUDA, cuDNN and torch."""

    name = "cudnn"
    device_type = "cuda"

    def __init__(self) -> None:
        self._environments: dict[int, dict[str, Any]] = {}
        self._gpu = PerProcess(lambda: _gpu_available())  # asked again in a forked child, where CUDA may not be usable
        self._transient: tuple[type[BaseException], ...] | None = None
        self._library: Any = None  # cudnn.library.Library, once cuDNN is loaded (launches ask it without a lock)

    @property
    def transient_errors(self) -> tuple[type[BaseException], ...]:
        if self._transient is None:
            self._transient = _process_errors()
        return self._transient

    # ------------------------------------------------------------------ devices

    def require(self) -> None:
        if not self._gpu.get():
            raise NoGpuError("no CUDA device is visible: building, loading and running plans need an NVIDIA GPU (without "
                             "one, the CPU test backend runs the cache end to end: PlanCache(backend=plancache.testing."
                             "CpuTestBackend()), or PLANCACHE_BACKEND=plancache.testing:CpuTestBackend for the command)")  # fmt: skip

    def ready(self, device: int) -> None:
        _torch().cuda.init()  # a no-op once CUDA is set up

    def current_device(self) -> int:
        return int(_torch().cuda.current_device())

    def device_getter(self) -> Callable[[], int]:
        """torch's own query (``current_device`` is it behind a Python frame that checks,
        on every call, that CUDA is set up: the launches that ask have set it up)."""
        torch = _torch()
        query = getattr(torch._C, "_cuda_getDevice", None)
        found: Callable[[], int] = query if callable(query) else torch.cuda.current_device
        return found

    def use_device(self, index: int) -> None:
        """Make ``index`` this thread's current device (new threads start on device 0)."""
        _torch().cuda.set_device(index)

    def on_device(self, index: int) -> Any:
        return _torch().cuda.device(index)

    def device_count(self) -> int:
        """Visible CUDA devices (``CUDA_VISIBLE_DEVICES`` applies); 0 without a GPU. Asked
        of the driver when it answers, without importing torch: ``prewarm --devices all``
        counts devices in a process that then only hands out work."""
        cuda = libcuda()
        count = cuda.device_count() if cuda is not None else None
        return count if count is not None else int(_torch().cuda.device_count())

    def device_in_use(self, device: int) -> bool:
        """Whether the program has set ``device`` up, making no CUDA call before the
        program's own first one: False until torch has initialized CUDA (a flag of
        torch's, read without calling CUDA); then asked of the driver (torch and cuDNN run
        on the primary context), whose ``cuInit`` is by then a no-op."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False
        cuda = libcuda()
        active = cuda.primary_context_active(device) if cuda is not None else None
        return active if active is not None else True

    def environment(self, device: int) -> dict[str, Any]:
        env = self._environments.get(device)
        if env is None:
            torch = _torch()
            cudnn = _cudnn()
            props = torch.cuda.get_device_properties(device)
            env = {
                "gpu_name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": int(props.multi_processor_count),
                # MIG slices and partitioned GPUs differ in memory as well as SM count.
                "total_memory": int(props.total_memory),
                "driver_version": driver_version(),
                "cuda_version": torch.version.cuda,
                "cudnn_backend_version": cudnn.backend_version_string(),
                "cudnn_frontend_version": cudnn.__version__,
            }
            self._environments[device] = env
        return env

    # ------------------------------------------------------------------ streams and captures

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph."""
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())

    def capture_getter(self) -> Callable[[], bool]:
        """torch's own query of the current stream (a runtime call, no Python frame of
        torch's; a ctypes driver call costs ten times as much)."""
        torch = _torch()
        query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
        found: Callable[[], bool] = query if callable(query) else torch.cuda.is_current_stream_capturing
        return found

    def exchange_capture_mode(self, mode: int) -> int | None:
        cuda = libcuda()
        return cuda.exchange_capture_mode(mode) if cuda is not None else None

    def new_stream(self, device: int) -> Any:
        return _torch().cuda.Stream(device=device)  # non-blocking: never ordered with the legacy stream

    def raw_stream(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    def stream_getter(self) -> Callable[[int], int]:
        return _raw_stream_getter(_torch())

    def on_stream(self, stream: Any) -> Any:
        return _torch().cuda.stream(stream)

    def follow(self, stream: Any, device: int) -> None:
        stream.wait_stream(_torch().cuda.current_stream(device))

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def time(self, launch: Callable[[], None], runs: int) -> list[float]:
        """CUDA events (``event_times``): a single run (the pruning pass) times one launch,
        careful runs ``INNER`` each."""
        return event_times(_torch().cuda, launch, runs, 1 if runs == 1 else INNER).times

    # ------------------------------------------------------------------ handles and memory

    def create_handle(self, device: int) -> Any:
        """A cuDNN handle on ``device``, made through the C API (the GIL released while
        cuDNN sets itself up, which takes hundreds of milliseconds the first time) and
        wrapped as the frontend's own ``Handle`` so that its paths take it too."""
        torch = _torch()
        with torch.cuda.device(device):
            raw = self.library().create_handle()
        return _cudnn().Handle(raw, device, 0)

    def set_stream(self, handle: Any, stream: int) -> None:
        self.library().set_stream(handle.backend_handle, stream)
        handle.stream = stream  # the frontend's Handle remembers it, as cudnn.set_stream does

    def tensor_device(self, device: int) -> str:
        return f"cuda:{device}"

    def free_memory(self, device: int) -> int:
        return int(_torch().cuda.mem_get_info(device)[0])

    def hold(self, size: int) -> None:
        """Nothing to note: torch's caching allocator keeps its own account."""

    def workspace_getter(self) -> Callable[[int, int], Any]:
        torch = _torch()
        empty, uint8 = torch.empty, torch.uint8  # resolved once: a launch pays only the allocation

        def workspace(size: int, device: int) -> Any:
            return empty(size, dtype=uint8, device=device)

        return workspace

    # ------------------------------------------------------------------ plans

    def open_libraries(self) -> int:
        self.library()  # cuDNN itself, loaded by the frontend when nothing has yet
        return open_beside()

    def library(self) -> Any:
        found = self._library
        if found is None:
            found = self._library = library(load_cudnn=lambda: _cudnn().backend_version())
        return found

    def deserialize(self, blob: bytes, handle: Any) -> Any:
        """The frontend's ``deserialize``, whose warm-up captures the plan on the handle's
        stream while it loads the kernels."""
        graph = _cudnn().pygraph(handle=handle)
        with frontend_failures():
            graph.deserialize(blob)
        return graph

    def frontend_launch(self, graph: Any) -> FrontendLaunch:
        """The frontend's compiled graph behind ``graph`` called directly when it runs on
        the backend (what its ``execute`` ends in), else its ``execute``."""
        lowered = _loaded_backend_graph(graph)
        if lowered is not None:
            run = lowered._execute

            def launch_lowered(pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
                ptrs = {uid: tensor.data_ptr() for uid, tensor in pack.items()}
                run(ptrs, workspace.data_ptr() if workspace is not None else 0, handle.backend_handle, None, None, None)

            return launch_lowered
        uids: tuple[int, ...] | None = None  # the frontend's ordered form

        def launch_graph(pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
            nonlocal uids
            if uids is None:
                uids = tuple(pack)
            graph.execute(tuple(pack[u] for u in uids), workspace, handle=handle, tensor_uids=uids)

        return launch_graph


# ---------------------------------------------------------------------- launches


def _loaded_backend_graph(native: Any) -> Any:
    """The frontend's compiled graph behind ``native`` when ``native`` was loaded from a
    blob and runs on the cuDNN backend; None otherwise (a freshly autotuned graph, a
    plan of one of the frontend's Python engines, or a frontend that lays graphs out
    differently).

    For such a graph the frontend's own ``execute`` ends in exactly this call, after
    resolving plan selection, Python engines and auto-bound inputs in Python (about 8 us
    per launch on an H200 host), none of which a loaded backend plan has. Every condition
    is checked here, once per plan; anything unexpected keeps the frontend's path."""
    state = getattr(native, "__dict__", {})
    lowered = state.get("_lowered_graph")
    if (
        lowered is None
        or not callable(getattr(lowered, "_execute", None))
        or state.get("_plans", None) != []  # plans of its own: selection must go through the frontend
        or state.get("_data_bindings", None) != {}  # inputs the frontend fills in
        or not state.get("_is_built", False)
    ):
        return None
    try:
        if native.selected_engine is not None:  # a Python engine executes it, not the backend
            return None
    except Exception:
        return None
    return lowered


def _raw_stream_getter(torch: Any) -> Callable[[int], int]:
    """``device -> current stream`` as the integer cuDNN takes. torch's own compiled code
    reads it through ``torch._C._cuda_getCurrentRawStream`` (0.1 us); the public
    ``current_stream(device).cuda_stream`` builds a Stream object first (1.6 us)."""
    raw: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if callable(raw):
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------- backend


class CudnnBackend(GuestBackend):
    """Builds, times, serializes, loads and executes cuDNN Frontend graphs: the guest
    backend over ``CudnnDriver``, with cuDNN's plans of a graph and rebuilds."""

    driver: CudnnDriver

    def __init__(self) -> None:
        super().__init__(CudnnDriver())
        # Per process, as the handles and streams (GuestBackend): a forked child (a
        # DataLoader worker, say) must not reuse the parent's.
        self._kernel_caches = PerProcess(_KernelCaches)

    # ------------------------------------------------------------------ kernel cache

    def attach_kernel_cache(self, graph: Any) -> bool:
        """Give a dynamic-shape graph the shared kernel cache, unless it brought its own.
        Returns whether the graph builds against the shared one."""
        kwargs = getattr(graph, "_cpp_graph_kwargs", None)
        if kwargs is None or not kwargs.get("is_dynamic_shape_enabled"):
            return False
        device = self.current_device()
        if kwargs.get("kernel_cache") is None:
            # The pygraph forwards these keyword arguments to the backend graph when it
            # lowers, which has not happened yet: setting it now equals passing it at
            # construction.
            kwargs["kernel_cache"] = self._kernel_caches.get().ensure(device)
        return kwargs["kernel_cache"] is self._kernel_caches.get().get(device)

    def kernel_cache_blob(self) -> bytes | None:
        """The shared kernel cache of the current device, serialized; None if unused."""
        cache = self._kernel_caches.get().get(self.current_device())
        return None if cache is None else str(cache.serialize()).encode()

    def restore_kernel_cache(self, blob: bytes) -> None:
        """Fill the shared kernel cache from a stored blob (same environment only)."""
        self._kernel_caches.get().ensure(self.current_device()).deserialize(blob.decode())

    # ------------------------------------------------------------------ building

    def _plan_graph(self, graph: Any, options: BuildOptions) -> None:
        cudnn = _cudnn()
        if getattr(graph, "_planning_done", False):
            raise InvalidGraphError(
                "the graph was already planned (create_execution_plans or build ran); pass a fresh pygraph",
                node=None,
                reason="already planned",
            )
        try:
            graph.validate()
            graph.build_operation_graph()
        except (ValueError, TypeError, RuntimeError, cudnn.cudnnGraphNotSupportedError) as exc:
            _raise_invalid(exc, "validation", graph)
        if options.workspace_limit is not None:
            graph.deselect_workspace_greater_than(options.workspace_limit)

    def plans(self, graph: Any, options: BuildOptions, description: Mapping[str, Any]) -> _Plans:
        self.driver.require()
        cudnn = _cudnn()
        self.handles.ensure(self.current_device())  # plans built here launch from any thread later
        if options.kernel_cache:
            self.attach_kernel_cache(graph)
        self._plan_graph(graph, options)
        modes = [getattr(cudnn.heur_mode, m) for m in options.heuristic_modes]
        try:
            graph.create_execution_plans(modes)
            graph.check_support()
        except (cudnn.cudnnGraphNotSupportedError, ValueError, RuntimeError) as exc:
            _raise_invalid(exc, "planning", graph)
        return _Plans(graph, description)

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        self.driver.require()
        if engine.engine_id is None:
            raise BuildError(f"engine {engine.name!r} has no engine id to rebuild from", reason="no engine id")
        self.handles.ensure(self.current_device())
        if options.kernel_cache:
            self.attach_kernel_cache(graph)
        self._plan_graph(graph, options)
        graph.create_execution_plan(engine.engine_id, _knobs_from_json(engine.knobs))
        index = graph.get_execution_plan_count() - 1
        graph.build_plan_at_index(index)
        blob = bytes(graph.serialize(as_bytes=True))
        workspace = int(graph.get_workspace_size_plan_at_index(index))
        return BuiltPlan(graph, blob, tensor_table(graph), workspace, engine)
