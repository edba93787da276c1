"""``CpuTestBackend``: the backend seam on the CPU, faithful to cuDNN where cache bugs hide."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engines.backend import BuiltPlan, EngineChoice
from ..engines.guest import known_captures, refuse_while_capturing
from ..errors import TransientLoadError
from ..key import BuildOptions, TensorSpec
from . import plans
from .candidates import CpuCandidates, candidate_workspace
from .device import CudaError, SimulatedCuda
from .kernels import Behaviour, evaluate, fault, scratch_bytes, stage_outputs
from .planning import plan_once

__all__ = ["CpuTestBackend", "TwoDeviceCpuTestBackend", "summary_of_ops"]

_WARMUP_BYTES = 1 << 20  # what the frontend's warm-up allocates
_HANDLE_BYTES = 4 << 20  # cuDNN's persistent buffer, allocated when a handle is created
_WRONG_BY = 1.25  # what a wrong engine's results are off by
_RIGHT = Behaviour()


def summary_of_ops(description: Mapping[str, Any]) -> str:
    """What a kernel is compiled for, regardless of shapes: the op types in order."""
    return "+".join(node["type"] for node in description["nodes"])


class _Native:
    """A 'loaded plan' of the test backend: the description it evaluates, on one device."""

    def __init__(self, description: dict[str, Any], tensors: Sequence[TensorSpec], engine: dict[str, Any], device: int,
                 behaviour: Behaviour = _RIGHT) -> None:  # fmt: skip
        self.description = description
        self.tensors = list(tensors)
        self.engine = engine
        self.device = device
        self.behaviour = behaviour
        self.executions = 0


@dataclass
class _Handle:
    """A cuDNN handle of the test device: the stream it runs on (None: NULL)."""

    stream: int | None = None


class _Handles:
    """A pool of handles per device, as the cuDNN backend keeps one; creating a handle is a
    ``cudaMalloc`` (refused beside a global capture unless in relaxed mode)."""

    def __init__(self, cuda: SimulatedCuda) -> None:
        self.cuda = cuda
        self.free: dict[int, list[_Handle]] = {}
        self.created = 0

    def take(self, device: int) -> _Handle:
        free = self.free.setdefault(device, [])
        if free:
            return free.pop()
        if not known_captures.wait_idle(timeout=30.0):  # never created beside a capture plancache runs
            raise RuntimeError("a capture kept running for 30 s: no cuDNN handle was created")
        self.cuda.allocate(_HANDLE_BYTES)
        self.created += 1
        return _Handle()

    def give(self, device: int, handle: _Handle) -> None:
        self.free.setdefault(device, []).append(handle)

    def ensure(self, device: int) -> None:
        if not self.free.get(device):
            self.give(device, self.take(device))


class _Devices:
    """The test devices: their environments, each thread's current device, and which ones
    this process has set up (as a CUDA context exists once work ran there)."""

    def __init__(self, environment: Mapping[str, Any] | None, devices: int | Sequence[Mapping[str, Any]],
                 in_use: Sequence[int] | None) -> None:  # fmt: skip
        base = {
            "gpu_name": "CPU test device", "compute_capability": "0.0", "sm_count": 0, "driver_version": "none",
            "cuda_version": "none", "cudnn_backend_version": "cpu-test", "cudnn_frontend_version": "cpu-test",
            **(environment or {}),
        }  # fmt: skip
        overrides = [{}] * devices if isinstance(devices, int) else [dict(d) for d in devices]
        if not overrides:
            raise ValueError("devices must be at least 1")
        self.environments = [{**base, **extra} for extra in overrides]
        # None: all of them, as in a process that already set its devices up.
        self.in_use: set[int] | None = None if in_use is None else set(in_use)
        self.local = threading.local()

    def check(self, device: int) -> None:
        """Refuse a device the backend lacks; work on one sets it up."""
        if not 0 <= device < len(self.environments):
            raise ValueError(f"no device {device}: the test backend has {len(self.environments)}")
        if self.in_use is not None:
            self.in_use.add(device)


class CpuTestBackend:
    """The backend seam implemented on the CPU with PyTorch (see ``plancache.testing``).

    It behaves like cuDNN exactly where cache bugs hide:

    * a graph is planned once: ``candidates`` and ``rebuild`` freeze the pygraph and refuse
      one that was already planned, as cuDNN Frontend does;
    * candidates are launched for real, and ``wrong`` ones compute a wrong result (25% off)
      while being the fastest, as some cuDNN engines do; ``wrong_band`` ones are wrong only
      on a band of values (0 where the right result lies inside ``(low, high)``), as an
      engine that ignores a clip is, and are the fastest too; right candidates of odd
      index round every third element one ulp the other way, as right engines differ;
    * bad steering values fault: a launch that reads through misaligned or out-of-range
      ragged offsets, sequence lengths, page tables or MoE offsets poisons the backend for
      the rest of the process (every later call fails), as a sticky CUDA error does;
    * memory is finite: ``memory`` bytes free, and what autotuning allocates is tracked;
    * streams and captures are modelled (``cuda``, a ``SimulatedCuda``);
    * kernels use the workspace as scratch: outputs are staged in it, so two launches that
      share one workspace give wrong results;
    * devices differ: ``devices`` environments, one per device, ``use_device(i)`` per thread
      (like ``torch.cuda.set_device``), and a plan launched on another device than the one
      it was loaded on raises;
    * alignment matters: a tensor whose data pointer is not 16-byte aligned is refused.

    ``candidates``: how many candidate plans each graph has. ``unbuildable``: indices whose
    build fails. ``unlaunchable``: indices whose launches raise. ``engine_ids``: the engine
    id of each index (default: the index; equal ids stand for knob variants of one engine).
    ``native``: loads take the native path (cuDNN's C API: no capture), as the cuDNN backend's
    do; False, or a plan stored with ``"fallback"``, takes the frontend's (its warm-up
    capture). ``load_delay``: seconds a native load's finalize takes. ``extra_workspace``:
    workspace bytes of an index beyond its output scratch (a program's workspace limit
    excludes it). ``unloadable``: indices whose plans cannot be loaded back. ``build_delay``:
    seconds each candidate build sleeps; ``runtime_compiled`` ones (say so in
    ``compiles``) sleep ``compile_factor`` times longer, as runtime compilation takes hundreds
    of milliseconds where other builds take a few. ``build_log``: a file that gets one
    line per finished build. ``environment``: replaces fields of every device's fingerprint;
    ``devices``: how many devices, or one dict of replaced fields per device. ``in_use``:
    the devices already set up (default: all).
    """

    name = "cpu-test"
    device_type = "cpu"

    def __init__(
        self,
        *,
        candidates: int = 4,
        unbuildable: Sequence[int] = (),
        unlaunchable: Sequence[int] = (),
        wrong: Sequence[int] = (),
        wrong_band: Mapping[int, tuple[float, float]] | None = None,
        engine_ids: Sequence[int] = (),
        runtime_compiled: Sequence[int] = (),
        compile_factor: float = 50.0,
        extra_workspace: Mapping[int, int] | None = None,
        unloadable: Sequence[int] = (),
        memory: int = 64 << 30,
        build_delay: float = 0.0,
        build_log: str | os.PathLike[str] | None = None,
        environment: Mapping[str, Any] | None = None,
        devices: int | Sequence[Mapping[str, Any]] = 1,
        in_use: Sequence[int] | None = None,
        native: bool = True,
        load_delay: float = 0.0,
    ) -> None:
        if candidates < 1:
            raise ValueError("candidates must be >= 1")
        self.candidate_count = candidates
        self.unbuildable = frozenset(unbuildable)
        self.unlaunchable = frozenset(unlaunchable)
        self.wrong = frozenset(wrong) | frozenset(wrong_band or {})
        self.wrong_band = dict(wrong_band or {})
        self.engine_ids = list(engine_ids)
        self.runtime_compiled = frozenset(runtime_compiled)
        self.compile_factor = compile_factor
        self.extra_workspace = dict(extra_workspace or {})
        self.unloadable = frozenset(unloadable)
        self.build_delay = build_delay
        self.build_log = os.fspath(build_log) if build_log is not None else None
        self.devices = _Devices(environment, devices, in_use)
        self.cuda = SimulatedCuda(free_memory=memory)
        self.handles = _Handles(self.cuda)
        self._streams: dict[int, int] = {}  # device -> plancache's own stream
        #: Called while a load's warm-up capture is open (the frontend's path): tests put the
        #: program's work there.
        self.during_warmup: Callable[[], None] | None = None
        #: Called while a native load finalizes (no capture open): the program's work.
        self.during_load: Callable[[], None] | None = None
        self.native = native
        self.load_delay = load_delay
        self.native_fallbacks: collections.Counter[str] = collections.Counter()
        self._frontend_loads = threading.Lock()  # two warm-ups on one stream would capture each other
        self.touched: list[tuple[str, str, int]] = []  # (thread, call, device) before the program's first use
        self.loads = 0
        self.launches = 0
        # Simulated kernel cache: descriptions of the dynamic-shape graphs "compiled" so far.
        self.kernels: set[str] = set()

    # ------------------------------------------------------------------ devices

    def environment(self, device: int | None = None) -> dict[str, Any]:
        device = self.current_device() if device is None else device
        self._note_touch(device, "environment")
        return dict(self.devices.environments[device])

    def _note_touch(self, device: int, call: str) -> None:
        """Record a CUDA call on a device the program has not set up yet (``touched``):
        plancache must make none before the program's own first use."""
        if not self.device_in_use(device):
            self.touched.append((threading.current_thread().name, call, device))

    def current_device(self) -> int:
        return int(getattr(self.devices.local, "device", 0))

    def device_count(self) -> int:
        if not self.device_in_use(0):
            self.touched.append((threading.current_thread().name, "device_count", 0))  # cuInit, on a GPU
        return len(self.devices.environments)

    def use_device(self, index: int) -> None:
        """This thread's current device from now on (like ``torch.cuda.set_device``, which
        sets the device up for this process)."""
        self.devices.check(index)
        self.devices.local.device = index

    def device_in_use(self, device: int) -> bool:
        return self.devices.in_use is None or device in self.devices.in_use

    def after_fork(self) -> None:
        self.devices.local = threading.local()

    def prepare(self, device: int) -> None:
        with self.guest(device):
            self.handles.ensure(device)

    def capturing(self) -> bool:
        return self.cuda.capturing()

    @contextlib.contextmanager
    def guest(self, device: int) -> Iterator[int]:
        """As the cuDNN backend's: refused while this thread captures; relaxed capture
        mode; ``device`` current for the block, then the caller's again; plancache's own
        non-blocking stream."""
        refuse_while_capturing(self.cuda.capturing(), "loading or building a plan")
        self._note_touch(device, "guest")
        self.cuda.check()
        self.devices.check(device)
        mode = self.cuda.exchange_mode("relaxed")
        before = self.current_device()
        self.devices.local.device = device
        try:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = self.cuda.new_stream(blocking=False)
            yield stream
        finally:
            self.devices.local.device = before
            self.cuda.exchange_mode(mode)

    # ------------------------------------------------------------------ building

    def _plan_once(self, graph: Any) -> tuple[dict[str, Any], list[TensorSpec]]:
        """``planning.plan_once`` on this backend's simulated device."""
        return plan_once(graph, self.cuda)

    def candidates(self, graph: Any, options: BuildOptions, description: Mapping[str, Any] | None = None,
                   inputs: Mapping[int, Any] | None = None) -> CpuCandidates:  # fmt: skip
        described, tensors = self._plan_once(graph)
        if described["flags"].get("dynamic_shape") and options.kernel_cache:
            self.kernels.add(summary_of_ops(described))
        return CpuCandidates(self, described, tensors, inputs, options)

    def kernel_cache_blob(self) -> bytes | None:
        return json.dumps(sorted(self.kernels)).encode() if self.kernels else None

    def restore_kernel_cache(self, blob: bytes) -> None:
        self.kernels.update(json.loads(blob))

    def behaviour(self, engine: int | None) -> Behaviour:
        """How candidate ``engine`` (an index; a rebuild passes its engine id, which equals
        the index unless ``engine_ids`` says otherwise) computes: right, wrong everywhere,
        or wrong on a band of values; right ones of odd index round some elements the
        other way."""
        if engine in self.wrong_band:
            return Behaviour(band=self.wrong_band[engine])
        if engine in self.wrong:
            return Behaviour(scale=_WRONG_BY)
        return Behaviour(nudges=engine is not None and engine % 2 == 1)

    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice,
                  behaviour: Behaviour = _RIGHT, index: int | None = None) -> BuiltPlan:  # fmt: skip
        """The plan of candidate ``index`` (default: the one of ``engine``'s id), computing as
        ``behaviour`` says."""
        index = engine.engine_id if index is None else index
        blob = plans.encode(description, tensors, engine, behaviour=behaviour.to_dict() if behaviour != _RIGHT else None,
                            unloadable=index in self.unloadable)  # fmt: skip
        plans.note_build(self.build_log, description)
        native = _Native(description, tensors, engine.to_dict(), self.current_device(), behaviour)
        return BuiltPlan(native, blob, tensors, candidate_workspace(self, index, tensors), engine)

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        description, tensors = self._plan_once(graph)
        return self.make_plan(description, tensors, engine, self.behaviour(engine.engine_id))

    # ------------------------------------------------------------------ loading, launching

    def load(self, blob: bytes, tensors: Sequence[TensorSpec], device: int | None = None) -> _Native:
        """As the cuDNN backend loads: through the native path (host work only: no capture,
        nothing allocated, ``during_load`` runs meanwhile, ``load_delay`` seconds of
        finalize), or, with ``native=False`` or for a plan stored with ``"fallback"``,
        through the frontend's path: inside ``guest``, the handle on plancache's own
        stream, then the frontend's warm-up capture (``warmup``), one such load at a time."""
        payload = plans.decode(blob)
        device = self.current_device() if device is None else device
        missing = sorted({t["uid"] for t in payload["tensors"]} - {spec.uid for spec in tensors})
        why = payload.get("fallback") or (f"the plan reads uids the tensor table lacks: {missing}" if missing else None)
        try:
            if self.native and why is None:
                with self.guest(device):
                    self.cuda.check()
                    if self.during_load is not None:
                        self.during_load()
                    if self.load_delay:
                        time.sleep(self.load_delay)
            else:
                self.native_fallbacks[(why or "native path off").split(":")[0]] += 1
                with self._frontend_loads, self.guest(device) as stream:
                    handle = self.handles.take(device)
                    try:
                        handle.stream = stream
                        self.warmup(handle)
                    finally:
                        self.handles.give(device, handle)
        except CudaError as exc:  # a capture, memory, a sticky error: nothing about the blob
            raise TransientLoadError(f"loading the plan failed for now: {exc}") from exc
        self.loads += 1
        behaviour = Behaviour(scale=_WRONG_BY) if payload.get("wrong") else Behaviour.from_dict(payload.get("behaviour"))
        return _Native(payload["description"], [TensorSpec.from_dict(t) for t in payload["tensors"]], payload["engine"], device,
                       behaviour)  # fmt: skip

    def load_back(self, blob: bytes, tensors: Sequence[TensorSpec], device: int) -> str | None:
        """As the cuDNN backend's, without the warm-up: why ``load`` would refuse the blob."""
        return plans.refusal(blob)

    def warmup(self, handle: _Handle) -> None:
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

    def launcher(self, native: _Native, workspace_size: int, device: int) -> Callable[[Mapping[int, Any]], None]:
        def launch(pack: Mapping[int, Any]) -> None:
            self.execute(native, pack, workspace_size, device)

        return launch

    def execute(self, native: _Native, pack: Mapping[int, Any], workspace_size: int, device: int) -> None:
        """One launch (what ``launcher``'s function does): refuses another device's plan
        and misaligned pointers, and stages outputs in a workspace of its own."""
        if native.device != device:
            raise RuntimeError(f"a plan loaded on device {native.device} was launched on device {device}")
        for uid, tensor in pack.items():
            pointer = getattr(tensor, "data_ptr", None)
            if pointer is not None and pointer() % 16:
                raise RuntimeError(f"misaligned address: tensor uid {uid} is not 16-byte aligned")
        self.run(native.description, native.tensors, pack, behaviour=native.behaviour, workspace_size=workspace_size)
        native.executions += 1
        self.launches += 1

    def run(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], *,
            behaviour: Behaviour = _RIGHT, workspace_size: int | None = None) -> None:  # fmt: skip
        """Evaluate the graph on ``pack`` on the current stream, as a kernel would: a bad
        steering value poisons the device; on a capturing stream the work is recorded, not run."""
        import torch

        reason = fault(description, tensors, pack)
        if reason is not None:
            self.cuda.poison(reason)
        size = scratch_bytes(tensors) if workspace_size is None else workspace_size

        def work() -> None:
            workspace = torch.empty(max(size, 0), dtype=torch.uint8)  # scratch of this launch alone
            values = {f"u{uid}": tensor for uid, tensor in pack.items()}
            with torch.no_grad():
                evaluate(description, values)
                stage_outputs(torch, tensors, values, pack, workspace, behaviour)

        self.cuda.launch(work)


class TwoDeviceCpuTestBackend(CpuTestBackend):
    """``CpuTestBackend`` with two identical devices unless told otherwise. A class that
    needs no arguments can be named (``PLANCACHE_BACKEND=plancache.testing:TwoDeviceCpuTestBackend``)
    and rebuilt by name in the worker processes of ``prewarm --devices``."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("devices", 2)
        super().__init__(**options)
