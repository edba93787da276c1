"""``CpuTestBackend``: the backend seam on the CPU, faithful to cuDNN where cache bugs hide."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import BuildError, InvalidGraphError, UntaggedCallableError
from ..guest.backend import BuiltPlan, EngineChoice
from ..guest.guest_backend import GuestBackend
from ..key import BuildOptions, TensorSpec, describe, tensor_table
from . import plans
from .candidates import CpuPlans, candidate_workspace
from .device import SimulatedCuda
from .driver import CpuDriver, FrontendGraph, Handle
from .kernels import Behaviour, evaluate, fault, scratch_bytes, stage_outputs

__all__ = ["CpuTestBackend", "TwoDeviceCpuTestBackend", "summary_of_ops"]

_WRONG_BY = 1.25  # what a wrong engine's results are off by
_RIGHT = Behaviour()


def summary_of_ops(description: Mapping[str, Any]) -> str:
    """What a kernel is compiled for, regardless of shapes: the op types in order."""
    return "+".join(node["type"] for node in description["nodes"])


class CpuTestBackend(GuestBackend):
    """The backend seam on the CPU: the guest backend (``guest.guest_backend``, the very
    loads, handles and launches a GPU runs) over the simulated driver (``testing.driver``),
    with candidates and kernels in PyTorch (see ``plancache.testing``).

    It behaves like cuDNN exactly where cache bugs hide:

    * a graph is planned once: ``candidates`` and ``rebuild`` freeze the pygraph and refuse
      one that was already planned, as cuDNN Frontend does;
    * candidates are launched for real; ``wrong`` ones compute a wrong result (25% off) and
      ``wrong_band`` ones are wrong only on a band of values (0 where the right result lies
      inside ``(low, high)``, as an engine that ignores a clip), both the fastest, as some
      cuDNN engines are; right ones of odd index round every third element one ulp the
      other way, as right engines differ;
    * bad steering values fault: a launch through misaligned or out-of-range ragged
      offsets, sequence lengths, page tables or MoE offsets poisons the backend for the
      rest of the process (every later call fails), as a sticky CUDA error does;
    * memory is finite (``memory`` bytes free; what autotuning allocates is tracked), and
      streams and captures are modelled (``cuda``, a ``SimulatedCuda``);
    * kernels stage outputs in the workspace: two launches sharing one give wrong results;
    * devices differ: ``devices`` environments, ``use_device(i)`` per thread (like
      ``torch.cuda.set_device``), and a plan launched on another device than the one it
      was loaded on raises;
    * a tensor whose data pointer is not 16-byte aligned is refused;
    * a stored plan loads through the C API (simulated, ``testing.library``) and reads its
      tensors at the addresses of its variant pack.

    ``candidates``: how many candidate plans each graph has. ``unbuildable``,
    ``unlaunchable``, ``unloadable``: indices whose builds fail, whose launches raise, whose
    plans cannot be loaded back. ``engine_ids``: the engine id of each index (default: the
    index; equal ids stand for knob variants of one engine). ``native``: loads take the
    native path (cuDNN's C API: no capture), as the cuDNN backend's do; False takes the
    frontend's (its warm-up capture), as for a blob the native path was not tested on.
    ``load_delay``: seconds a native load's finalize takes. ``extra_workspace``: workspace
    bytes of an index beyond its output scratch (a program's workspace limit excludes it).
    ``build_delay``: seconds each candidate build sleeps; ``runtime_compiled`` ones (say so
    in ``compiles``) sleep ``compile_factor`` times longer, as runtime compilation takes
    hundreds of milliseconds where other builds take a few. ``build_log``: a file that gets
    one line per finished build. ``environment``: replaces fields of every device's
    fingerprint; ``devices``: how many devices, or one dict of replaced fields per device.
    ``in_use``: the devices already set up (default: all).
    """

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
        self.cuda = SimulatedCuda(free_memory=memory)
        super().__init__(CpuDriver(self.cuda, self.compute, environment, devices, in_use), native=native)
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
        self.driver.simulated.load_delay = load_delay
        # Simulated kernel cache: descriptions of the dynamic-shape graphs "compiled" so far.
        self.kernels: set[str] = set()

    driver: CpuDriver

    # ------------------------------------------------------------------ what tests watch and steer

    @property
    def during_warmup(self) -> Callable[[], None] | None:
        """Called while a load's warm-up capture is open (the frontend's path): tests put the
        program's work there."""
        return self.driver.during_warmup

    @during_warmup.setter
    def during_warmup(self, hook: Callable[[], None] | None) -> None:
        self.driver.during_warmup = hook

    @property
    def during_load(self) -> Callable[[], None] | None:
        """Called while a native load finalizes (no capture open): the program's work."""
        return self.driver.simulated.during_load

    @during_load.setter
    def during_load(self, hook: Callable[[], None] | None) -> None:
        self.driver.simulated.during_load = hook

    @property
    def loads(self) -> int:
        """Plans loaded, by either path."""
        return self.driver.simulated.loads + self.driver.loads

    @property
    def launches(self) -> int:
        """Plans launched, by either path."""
        return self.driver.simulated.launches + self.driver.launches

    @property
    def touched(self) -> list[tuple[str, str, int]]:
        """CUDA calls made on devices the program had not set up: ``(thread, call, device)``."""
        return self.driver.touched

    def warmup(self, handle: Handle) -> None:
        """The frontend's warm-up alone (``CpuDriver.warmup``)."""
        self.driver.warmup(handle)

    # ------------------------------------------------------------------ building

    def _plan_once(self, graph: Any) -> tuple[dict[str, Any], list[TensorSpec]]:
        """The graph's description and tensor table, its outputs shaped as a reference run of the
        description computes them (a pygraph may leave them to be inferred at planning); the graph
        is marked planned and frozen, and one planned before is refused, as the frontend refuses
        a second planning, on a device that still works (``cuda.check``)."""
        import torch

        self.cuda.check()
        if getattr(graph, "_planning_done", False):
            why = "the graph was already planned (create_execution_plans or build ran); pass a fresh pygraph"
            raise InvalidGraphError(why, node=None, reason="already planned")
        try:
            description = describe(graph)
        except UntaggedCallableError:
            # A graph the caller tagged (get(graph, tag=...)) and keyed so: planning needs its
            # shapes, not its key. The kernels refuse what they cannot compute as cuDNN does
            # (attention with a score_mod): a BuildError that says so, not a plea for a tag.
            description = describe(graph, tag="plancache.testing: callables not run")
        table = tensor_table(graph)
        values: dict[str, Any] = {}
        for spec in table:
            if spec.is_output:
                continue
            if not spec.dims:
                raise InvalidGraphError(f"input tensor {spec.name!r} has no dims", node=None, reason="no dims")
            values[f"u{spec.uid}"] = torch.zeros(spec.dims) if not spec.is_pass_by_value else 1.0
        try:
            evaluate(description, values)
        except NotImplementedError as exc:
            raise BuildError(f"the CPU test backend cannot run {exc}", reason="unsupported by test backend") from exc
        except (RuntimeError, ValueError, KeyError, IndexError) as exc:
            raise InvalidGraphError(f"the graph is invalid: {exc}", node=None, reason=str(exc)) from exc
        freeze = getattr(graph, "_freeze", None)
        if callable(freeze):
            freeze()
        with contextlib.suppress(AttributeError):
            graph._planning_done = True
        inferred = []
        for spec in table:
            if spec.is_output and not spec.dims:
                out = values[f"u{spec.uid}"]
                spec = dataclasses.replace(spec, dims=tuple(out.shape), strides=tuple(out.contiguous().stride()))
            inferred.append(spec)
        return description, inferred

    def plans(self, graph: Any, options: BuildOptions, description: Mapping[str, Any] | None = None) -> CpuPlans:
        self.handles.ensure(self.current_device())  # as cuDNN's: plans built here launch from any thread later
        described, tensors = self._plan_once(graph)
        if described["flags"].get("dynamic_shape") and options.kernel_cache:
            self.kernels.add(summary_of_ops(described))
        return CpuPlans(self, described, tensors)

    def kernel_cache_blob(self) -> bytes | None:
        return json.dumps(sorted(self.kernels)).encode() if self.kernels else None

    def restore_kernel_cache(self, blob: bytes) -> None:
        self.kernels.update(json.loads(blob))

    def behaviour(self, engine: int | None) -> Behaviour:
        """How candidate ``engine`` computes (an index; a rebuild passes its engine id, which
        equals the index unless ``engine_ids`` says otherwise)."""
        if engine in self.wrong_band:
            return Behaviour(band=self.wrong_band[engine])
        if engine in self.wrong:
            return Behaviour(scale=_WRONG_BY)
        return Behaviour(nudges=engine is not None and engine % 2 == 1)

    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice,
                  behaviour: Behaviour = _RIGHT, index: int | None = None) -> BuiltPlan:  # fmt: skip
        """The plan of candidate ``index`` (default: the one of ``engine``'s id), computing as
        ``behaviour`` says: the frontend's graph as built, and its blob."""
        index = engine.engine_id if index is None else index
        workspace = candidate_workspace(self, index, tensors)
        stored = behaviour.to_dict() if behaviour != _RIGHT else None
        blob = plans.encode(description, tensors, engine, behaviour=stored, unloadable=index in self.unloadable,
                            workspace=workspace)  # fmt: skip
        plans.note_build(self.build_log, description)
        built = plans.payload(description, tensors, engine, behaviour=stored)
        native = FrontendGraph(built, list(tensors), self.current_device())
        return BuiltPlan(native, blob, tensors, workspace, engine)

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        description, tensors = self._plan_once(graph)
        return self.make_plan(description, tensors, engine, self.behaviour(engine.engine_id))

    # ------------------------------------------------------------------ computing

    def compute(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], payload: Any,
                workspace: Any, stream: int | None) -> None:  # fmt: skip
        """How a plan computes on the test device (both drivers' launches end here): as its
        stored engine does, staging outputs in the launch's own ``workspace``, on ``stream``."""
        behaviour = Behaviour(scale=_WRONG_BY) if payload.get("wrong") else Behaviour.from_dict(payload.get("behaviour"))
        self.run(description, tensors, pack, behaviour=behaviour, workspace=workspace, stream=stream)

    def run(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], *,
            behaviour: Behaviour = _RIGHT, workspace: Any = None, stream: int | None = None, took: float = 0.0) -> None:  # fmt: skip
        """Evaluate the graph on ``pack`` on ``stream`` (default: the current one), as a
        kernel would, taking ``took`` milliseconds of the stream's clock: a bad steering
        value poisons the device; on a capturing stream the work is recorded, not run.
        ``workspace``: the launch's own (default: scratch of this launch alone)."""
        import torch

        reason = fault(description, tensors, pack)
        if reason is not None:
            self.cuda.poison(reason)

        def work() -> None:
            scratch = workspace if workspace is not None else torch.empty(scratch_bytes(tensors), dtype=torch.uint8)
            values = {f"u{uid}": tensor for uid, tensor in pack.items()}
            with torch.no_grad():
                evaluate(description, values)
                stage_outputs(torch, tensors, values, pack, scratch, behaviour)

        self.cuda.launch(work, stream, took)


class TwoDeviceCpuTestBackend(CpuTestBackend):
    """``CpuTestBackend`` with two identical devices unless told otherwise. A class that
    needs no arguments can be named (``PLANCACHE_BACKEND=plancache.testing:TwoDeviceCpuTestBackend``)
    and rebuilt by name in the worker processes of ``prewarm --devices``."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("devices", 2)
        super().__init__(**options)
