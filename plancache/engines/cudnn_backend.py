"""The cuDNN Frontend backend: the only module that imports ``cudnn`` or touches CUDA.

Both imports happen inside functions, so importing plancache stays cheap and works
without a GPU.

Loading: a stored plan loads through cuDNN's own C API (``engines.native``): no GIL held
through the finalize, nothing captured, allocated or synchronized. A blob that path was
not tested on (a format version, a field) loads through the frontend's ``deserialize``
instead, as a guest (``_load_through_frontend``), and is counted in ``native_fallbacks``.
Plans built here by autotuning run through the frontend's path.

Handles (``engines.handles``): a pool per device, made through the C API and wrapped as
the frontend's own ``Handle``; a launch leases one for the few microseconds it takes to
enqueue, pointed at the caller's current stream.

Workspaces: allocated per launch from torch's caching allocator on the launching stream,
as PyTorch does for its own cuDNN calls: stream-ordered reuse, never one buffer shared by
two streams, and inside a capture they come from the capture's private pool.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import MemoryBudget, format_size
from ..errors import BuildError, InvalidGraphError, NoGpuError, TransientLoadError
from ..key import BuildOptions, TensorSpec, mark_shared_kernel_cache, tensor_table
from .backend import BuiltPlan, EngineChoice, load_failure
from .bounds import Bound, bounds
from .filters import outside_filters
from .guest import refuse_while_capturing, relaxed
from .handles import Handles
from .inputs import materialize, timing_inputs
from .native import NativePlan, RecordError, library, parse, refusal
from .tensors import checked_inputs

__all__ = ["CudnnBackend", "cudnn_module", "probe_environment", "transient_load_failures"]

log = logging.getLogger("plancache")

#: Frontend graphs launched while their stream was capturing (the frontend's path): a CUDA
#: graph may replay them at any time, so they live as long as the process.
_CAPTURED_GRAPHS: list[Any] = []
_INNER = 3  # launches per careful measurement
_SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU clock: enough for the host to queue _INNER launches
#: Load failures that say nothing about the blob: captures, memory. Anything else is the
#: library refusing the plan itself (a version mismatch, a damaged blob).
#: A sticky CUDA error is the process's, not the entry's: every entry would fail to load.
_TRANSIENT = re.compile(r"captur|out of memory|ALLOC_FAILED|MemoryAllocation|not permitted|timed out|cuda ?error", re.IGNORECASE)
_NODE_IN_MESSAGE = re.compile(r"[Nn]ode '([^']+)'")


@contextlib.contextmanager
def transient_load_failures() -> Iterator[None]:
    """A load in the block that failed for a reason saying nothing about the blob (a
    capture, memory, a sticky CUDA error) raises ``TransientLoadError``: the entry is kept,
    and loaded again later. Any other failure is the library refusing the plan itself."""
    try:
        yield
    except Exception as exc:
        if _TRANSIENT.search(str(exc)):
            raise TransientLoadError(f"loading the plan failed for now: {exc}") from exc
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
    with contextlib.suppress(OSError, AttributeError):
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return f"cuda-api-{version.value}"
    return "unknown"


@functools.lru_cache(maxsize=1)
def _initialized_driver() -> Any:
    """The CUDA driver library after ``cuInit`` (which creates no context), loaded once; None
    when there is none. The primer asks it every few milliseconds while it waits."""
    with contextlib.suppress(OSError, AttributeError):
        libcuda = ctypes.CDLL("libcuda.so.1")
        if libcuda.cuInit(0) == 0:
            return libcuda
    return None


def _driver_device_count() -> int | None:
    """``cuDeviceGetCount`` through the driver library (None when it cannot answer)."""
    libcuda = _initialized_driver()
    count = ctypes.c_int()
    if libcuda is not None and libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0:
        return int(count.value)
    return None


def _primary_context_active(device: int) -> bool | None:
    """Whether this process's primary CUDA context of ``device`` (an index as the process
    sees it, ``CUDA_VISIBLE_DEVICES`` applied) exists, asked of the driver without creating
    anything; None when the driver cannot answer."""
    libcuda = _initialized_driver()
    handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if (
        libcuda is not None
        and libcuda.cuDeviceGet(ctypes.byref(handle), int(device)) == 0
        and libcuda.cuDevicePrimaryCtxGetState(handle, ctypes.byref(flags), ctypes.byref(active)) == 0
    ):
        return bool(active.value)
    return None


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


class _Candidates:
    """Candidates of one cuDNN graph, de-duplicated across heuristic modes.

    Launches run on a stream of plancache's own (non-blocking), never on the caller's, and
    never while the calling thread captures a CUDA graph; what they allocate comes from
    that stream's pool of torch's caching allocator and is synchronized before returning.
    """

    def __init__(self, backend: CudnnBackend, graph: Any, options: BuildOptions, description: Mapping[str, Any],
                 inputs: Mapping[int, Any] | None) -> None:  # fmt: skip
        self.backend = backend
        self.graph = graph
        self.options = options
        self.description = description
        self.given = dict(inputs or {})
        self.indices: list[int] = []  # position -> index in the graph's plan list
        names: set[str] = set()
        for index in range(graph.get_execution_plan_count()):
            name = graph.get_plan_name_at_index(index)
            if name not in names:  # modes A and B often propose the same engine config
                names.add(name)
                self.indices.append(index)
        self.tensors = tensor_table(graph)
        self.device = int(_torch().cuda.current_device())
        self.caller_stream = _torch().cuda.current_stream(self.device)  # made before any guest block
        self.outputs_of: list[int] = []
        self.pack: dict[int, Any] | None = None
        self.stream: Any = None
        self.spare = 0  # bytes of the budget left for a candidate's workspace
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

    def build(self, position: int) -> str | None:
        cudnn = _cudnn()
        index = self.indices[position]
        try:
            self.graph.build_plan_at_index(index)
            plan, workspace = self.graph.get_plan_name_at_index(index), int(self.graph.get_workspace_size_plan_at_index(index))
        except (cudnn.cudnnGraphNotSupportedError, RuntimeError, ValueError) as exc:
            return f"{type(exc).__name__}: {str(exc)[:300]}"
        return outside_filters(plan, workspace, self.description, self.options)  # the program's workspace limit and filters

    def bounds(self) -> Mapping[int, Bound]:
        torch = _torch()
        with torch.cuda.stream(self.stream):
            found = bounds(self.description, self.tensors, self._ready(torch))
        self.stream.synchronize()
        return found

    def prepare(self, budget: MemoryBudget) -> str | None:
        torch = _torch()
        if torch.cuda.is_current_stream_capturing():
            return "a CUDA-graph capture is in progress on this thread"
        given = checked_inputs(self.given, self.tensors, "cuda", self.device)
        found = timing_inputs(self.description, self.tensors, given, budget, int(torch.cuda.mem_get_info(self.device)[0]))
        if isinstance(found, str):
            return found
        plan, _need, spare = found
        stream = self.backend.own_stream(self.device)  # non-blocking: never ordered with the legacy stream
        stream.wait_stream(self.caller_stream)  # the caller's tensors are ready
        # A generator of our own: autotuning must not move the caller's random number
        # stream (a miss would otherwise change every random tensor the program draws next).
        generator = torch.Generator(device=f"cuda:{self.device}")
        generator.manual_seed(0)
        try:
            with torch.cuda.stream(stream):
                pack = materialize(plan, torch, f"cuda:{self.device}", generator)
            stream.synchronize()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            return f"allocating the inputs to launch candidates on failed: {type(exc).__name__}: {str(exc)[:200]}"
        self.pack, self.stream, self.spare = pack, stream, spare
        self.outputs_of = [s.uid for s in plan.outputs]
        return None

    def _workspace(self, torch: Any, index: int) -> Any:
        size = int(self.graph.get_workspace_size_plan_at_index(index))
        if size > self.spare:
            raise MemoryError(
                f"its workspace of {format_size(size)} is over what is left of the timing budget ({format_size(self.spare)})"
            )
        return torch.empty(size, dtype=torch.uint8, device=f"cuda:{self.device}") if size > 0 else None

    def outputs(self, position: int) -> dict[int, Any]:
        torch = _torch()
        index, pack = self.indices[position], self._ready(torch)
        with torch.cuda.stream(self.stream), self.backend.handles.lease(self.device) as handle:
            _cudnn().set_stream(handle=handle, stream=self.stream.cuda_stream)
            workspace = self._workspace(torch, index)
            for uid in self.outputs_of:
                pack[uid].zero_()  # a region no candidate writes compares equal
            self.graph.execute_plan_at_index(pack, workspace, index, handle)
            copies = {uid: pack[uid].clone(memory_format=torch.contiguous_format) for uid in self.outputs_of}
        self.stream.synchronize()
        return copies

    def _ready(self, torch: Any) -> dict[int, Any]:
        if self.pack is None:
            raise RuntimeError("candidates launched before their inputs were prepared")
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA-graph capture began on this thread")
        return self.pack

    def time(self, position: int, runs: int) -> list[float]:
        """Milliseconds per launch, ``runs`` times, measured with CUDA events.

        Before each measurement the stream is held busy (``torch.cuda._sleep``) while the
        host queues the launches, so a kernel shorter than the host's launch overhead
        (tens of microseconds) is timed on the GPU alone, not on the launch rate. A single
        run (the pruning pass) times one launch; careful runs time ``_INNER`` each.
        """
        torch = _torch()
        pack = self._ready(torch)
        with torch.cuda.stream(self.stream), self.backend.handles.lease(self.device) as handle:
            _cudnn().set_stream(handle=handle, stream=self.stream.cuda_stream)
            return self._time(torch, handle, self.indices[position], pack, runs)

    def _time(self, torch: Any, handle: Any, index: int, pack: dict[int, Any], runs: int) -> list[float]:
        launch = self.graph.execute_plan_at_index
        workspace = self._workspace(torch, index)
        launch(pack, workspace, index, handle)  # warm-up
        inner = 1 if runs == 1 else _INNER
        sleep = getattr(torch.cuda, "_sleep", None)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(runs):
            if sleep is not None:
                sleep(_SLEEP_CYCLES)
            start.record()
            for _ in range(inner):
                launch(pack, workspace, index, handle)
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)) / inner)
        return times

    def finish(self, position: int) -> BuiltPlan:
        index = self.indices[position]
        self.graph.build_plan_at_index(index)  # selects it: serialize() writes the selected plan
        blob = bytes(self.graph.serialize(as_bytes=True))
        workspace = int(self.graph.get_workspace_size_plan_at_index(index))
        return BuiltPlan(self.graph, blob, tensor_table(self.graph), workspace, self.engine(position))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # nothing of ours is in flight when the caller goes on
        self.pack = None
        self.stream = None


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
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if callable(raw):
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


# ---------------------------------------------------------------------- backend


def _forget_in_child(ref: weakref.ref[CudnnBackend]) -> None:
    backend = ref()
    if backend is not None:
        backend.after_fork()


class CudnnBackend:
    """Builds, times, serializes, loads and executes cuDNN Frontend graphs."""

    name = "cudnn"
    device_type = "cuda"

    def __init__(self) -> None:
        self.handles = Handles(self._create_handle, self.capturing)
        #: Plans loaded through the frontend's path instead of the native one, by reason
        #: (``PlanCache.stats`` shows them as ``native_fallbacks``).
        self.native_fallbacks: collections.Counter[str] = collections.Counter()
        self._frontend_loads = threading.Lock()
        self._environments: dict[int, dict[str, Any]] = {}
        self._kernel_caches = _KernelCaches()
        self._gpu: bool | None = None
        self._streams: dict[int, Any] = {}  # device -> plancache's own non-blocking stream
        # A forked child (a DataLoader worker, say) must not reuse the parent's handles. The
        # hook holds the backend weakly: registering it must not keep every backend alive.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))

    def _create_handle(self, device: int) -> Any:
        """A cuDNN handle on ``device``, made through the C API (the GIL released while
        cuDNN sets itself up, which takes hundreds of milliseconds the first time) and
        wrapped as the frontend's own ``Handle`` so that its paths take it too."""
        torch = _torch()
        with torch.cuda.device(device):
            raw = self._library().create_handle()
        return _cudnn().Handle(raw, device, 0)

    def _library(self) -> Any:
        return library(load_cudnn=lambda: _cudnn().backend_version())

    def after_fork(self) -> None:
        self.handles.forget()
        self._streams = {}
        self._kernel_caches = _KernelCaches()
        self._gpu = None

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
            kwargs["kernel_cache"] = self._kernel_caches.ensure(device)
        return kwargs["kernel_cache"] is self._kernel_caches.get(device)

    def kernel_cache_blob(self) -> bytes | None:
        """The shared kernel cache of the current device, serialized; None if unused."""
        cache = self._kernel_caches.get(self.current_device())
        return None if cache is None else str(cache.serialize()).encode()

    def restore_kernel_cache(self, blob: bytes) -> None:
        """Fill the shared kernel cache from a stored blob (same environment only)."""
        self._kernel_caches.ensure(self.current_device()).deserialize(blob.decode())

    # ------------------------------------------------------------------ devices

    def _require_gpu(self) -> None:
        if self._gpu is None:
            self._gpu = _gpu_available()
        if not self._gpu:
            raise NoGpuError("no CUDA device is visible: building, loading and running plans need an NVIDIA GPU")

    def current_device(self) -> int:
        self._require_gpu()
        return int(_torch().cuda.current_device())

    def use_device(self, index: int) -> None:
        """Make ``index`` this thread's current device (new threads start on device 0)."""
        _torch().cuda.set_device(index)

    def device_count(self) -> int:
        """Visible CUDA devices (``CUDA_VISIBLE_DEVICES`` applies); 0 without a GPU. Asked
        of the driver when it answers, without importing torch: ``prewarm --devices all``
        counts devices in a process that then only hands out work."""
        count = _driver_device_count()
        return count if count is not None else int(_torch().cuda.device_count())

    def device_in_use(self, device: int) -> bool:
        """Whether the program has set ``device`` up, making no CUDA call before the
        program's own first one: False until torch has initialized CUDA (a flag of
        torch's, read without calling CUDA); then asked of the driver (torch and cuDNN run
        on the primary context), whose ``cuInit`` is by then a no-op."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return False
        active = _primary_context_active(device)
        return active if active is not None else True

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph."""
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing())

    @contextlib.contextmanager
    def guest(self, device: int) -> Iterator[Any]:
        """plancache's own CUDA work on ``device`` (``engines.guest``): refused while this
        thread captures; relaxed capture mode; the device set, then restored; yields the
        non-blocking stream of plancache's own on that device."""
        self._require_gpu()
        torch = _torch()
        refuse_while_capturing(self.capturing(), "loading or building a plan")
        torch.cuda.init()  # a no-op once CUDA is set up; the capture mode can only be set after
        with relaxed(), torch.cuda.device(device):
            yield self.own_stream(device)

    def own_stream(self, device: int) -> Any:
        """plancache's own stream on ``device`` (made inside a guest block): non-blocking,
        from torch's pool, never the caller's."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _torch().cuda.Stream(device=device)
        return stream

    def environment(self, device: int | None = None) -> dict[str, Any]:
        self._require_gpu()
        device = self.current_device() if device is None else device
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
        return dict(env)

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

    def candidates(self, graph: Any, options: BuildOptions, description: Mapping[str, Any],
                   inputs: Mapping[int, Any] | None = None) -> _Candidates:  # fmt: skip
        self._require_gpu()
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
        return _Candidates(self, graph, options, description, inputs)

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        self._require_gpu()
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

    # ------------------------------------------------------------------ loading, launching

    def load(self, blob: bytes, tensors: Sequence[TensorSpec], device: int | None = None) -> Any:
        """Load a stored plan onto ``device``: through cuDNN's C API (``engines.native``:
        no GIL held through the finalize, nothing captured, allocated or synchronized; the
        kernels load at the first launch), or, for a blob the native path was not tested
        on, through the frontend's ``deserialize`` (counted in ``native_fallbacks``)."""
        self._require_gpu()
        torch = _torch()
        device = torch.cuda.current_device() if device is None else device
        try:
            record = parse(blob)
            why = refusal(record, {spec.uid for spec in tensors})
        except RecordError as exc:
            why = str(exc)
        if why is None:
            with self.guest(device), self.handles.lease(device) as handle, transient_load_failures():
                return NativePlan(self._library(), record, handle.backend_handle, device)
        self.native_fallbacks[why.split(":")[0]] += 1
        with self._frontend_loads:  # two warm-ups on one stream would capture each other's work
            return self._load_through_frontend(blob, device)

    def _load_through_frontend(self, blob: bytes, device: int) -> Any:
        """The frontend's ``deserialize``, whose warm-up captures the plan on the handle's
        stream while it loads the kernels: the handle is pointed at plancache's own
        non-blocking stream first (never NULL, where the frontend would create a blocking
        stream, and never the caller's), and the thread is in relaxed mode (``guest``)."""
        cudnn = _cudnn()
        with self.guest(device) as stream, self.handles.lease(device) as handle:
            cudnn.set_stream(handle=handle, stream=stream.cuda_stream)
            graph = cudnn.pygraph(handle=handle)
            with transient_load_failures():
                graph.deserialize(blob)
        return graph

    def load_back(self, blob: bytes, tensors: Sequence[TensorSpec], device: int) -> str | None:
        """Load the plan back as a later lookup will (the loaded graph is dropped): why that failed."""
        return load_failure(self.load, blob, tensors, device)

    def prepare(self, device: int) -> None:
        with self.guest(device):
            self.handles.ensure(device)

    def launcher(self, native: Any, workspace_size: int, device: int) -> Callable[[Mapping[int, Any]], None]:
        """What ``Plan.execute`` calls for each launch, with everything that does not
        change between launches resolved once."""
        if isinstance(native, NativePlan):
            return self._native_launcher(native, workspace_size, device)
        return self._frontend_launcher(native, workspace_size, device)

    def _native_launcher(self, native: NativePlan, workspace_size: int, device: int) -> Callable[[Mapping[int, Any]], None]:
        torch = _torch()
        current_device = torch.cuda.current_device
        raw_stream = _raw_stream_getter(torch)
        set_stream = self._library().set_stream
        take, give = self.handles.take, self.handles.give
        empty, uint8 = torch.empty, torch.uint8
        size = max(int(workspace_size), native.workspace_size)
        uids = native.user_uids
        run = native.launch

        def launch(pack: Mapping[int, Any]) -> None:
            if current_device() != device:
                with torch.cuda.device(device):  # the plan's device, with that device's current stream
                    launch(pack)
                return
            # Per launch, on the current stream, from torch's caching allocator (inside a
            # capture, from the capture's pool): never shared by two streams.
            workspace = empty(size, dtype=uint8, device=device) if size > 0 else None
            stream = raw_stream(device)
            handle = take(device)
            try:
                if handle.stream != stream:
                    set_stream(handle.backend_handle, stream)
                    handle.stream = stream  # the frontend's Handle remembers it, as cudnn.set_stream does
                run([pack[u].data_ptr() for u in uids], workspace.data_ptr() if workspace is not None else 0,
                    handle.backend_handle, stream)  # fmt: skip
            finally:
                give(device, handle)

        return launch

    def _frontend_launcher(self, native: Any, workspace_size: int, device: int) -> Callable[[Mapping[int, Any]], None]:
        torch = _torch()
        cudnn = _cudnn()
        current_device = torch.cuda.current_device
        raw_stream = _raw_stream_getter(torch)
        set_stream = cudnn.set_stream
        take, give = self.handles.take, self.handles.give
        empty, uint8 = torch.empty, torch.uint8
        size = int(workspace_size)
        lowered = _loaded_backend_graph(native)
        run = lowered._execute if lowered is not None else None
        uids: tuple[int, ...] | None = None  # the frontend's ordered form, for graphs it runs itself
        capturing = torch.cuda.is_current_stream_capturing
        pinned = False

        def launch(pack: Mapping[int, Any]) -> None:
            nonlocal uids, pinned
            if current_device() != device:
                with torch.cuda.device(device):  # the plan's device, with that device's current stream
                    launch(pack)
                return
            if not pinned and capturing():
                # A CUDA graph now points at this plan's kernels, which cuDNN releases with the
                # plan: kept for the rest of the process, as NativePlan keeps its own.
                pinned = True
                _CAPTURED_GRAPHS.append(native)
            workspace = empty(size, dtype=uint8, device=device) if size > 0 else None
            stream = raw_stream(device)
            handle = take(device)
            try:
                if handle.stream != stream:
                    set_stream(handle=handle, stream=stream)
                if run is not None:
                    ptrs = {uid: tensor.data_ptr() for uid, tensor in pack.items()}
                    run(ptrs, workspace.data_ptr() if workspace is not None else 0, handle.backend_handle, None, None, None)
                else:
                    if uids is None:
                        uids = tuple(pack)
                    native.execute(tuple(pack[u] for u in uids), workspace, handle=handle, tensor_uids=uids)
            finally:
                give(device, handle)

        return launch
