"""A stored plan, loaded straight into the caller's own cuDNN Frontend graph.

A pygraph that ``build_plans()`` built keeps its plan in its lowered backend graph
(``_lowered_graph``, the compiled C++ graph that executes) and its ranked plan list
(``_plans``, the selected entry at ``_plan_index``). Adoption gives the caller's graph that
state, for a list of one plan:

* the stored blob is deserialized once, as the caller's graph runs it (``GraphLoad``, the
  ``load`` a drop-in lookup hands ``PlanCache.get``): on a hit the lookup's own load, on a
  miss the load that proves the new plan loads back before it is stored;
* its backend graph becomes the caller's lowered graph, and the plan list holds one entry
  naming the stored engine and knobs at backend plan index 0 (a deserialized backend
  graph holds exactly one plan);
* a built graph's flags are set, the dims and strides the program left unset take the
  layout the backend inferred for the plan (what ``build_operation_graph`` copies back),
  and the graph is frozen as planning freezes it.

The frontend's own ``execute``, ``get_workspace_size``, ``populate_cuda_graph`` and plan
list questions then run as on any built graph, and ``create_execution_plans`` refuses a
second planning. ``serialize`` returns the stored blob: the backend re-serializes a
deserialized graph without its nodes' pass-by-value constants, which could not be loaded.

A plan of the frontend's Python engines is a recipe its ``deserialize`` rebuilds into an
empty graph only: its load refuses it (a ``TransientLoadError``, for this lookup only, so
an entry stored by a lookup that can load it stays), and a drop-in lookup never stores it.

This reaches into the frontend's private state: ``FRONTEND_VERSIONS`` lists the versions
it was checked against, and ``frontend`` keeps the frontend's behaviour on any other. A
backend other than cuDNN (the CPU test backend) registers its way in ``ADOPTERS``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TransientLoadError
from ..formats.plan_blob import PlanBlob

if TYPE_CHECKING:
    from ..guest.backend import Backend, EngineChoice
    from ..key import TensorSpec
    from ..runtime.plan import Plan

__all__ = ["ADOPTERS", "FRONTEND_VERSIONS", "Adopter", "AdoptionError", "GraphLoad", "StoredPlanGraph", "adopt", "missing_state"]

#: cuDNN Frontend versions whose pygraph internals adoption was written and tested against.
FRONTEND_VERSIONS: tuple[str, ...] = ("1.32.0",)

#: The pygraph attributes plancache reads or sets. A frontend whose graphs lack one lays
#: them out differently: nothing is adopted there.
_STATE = (
    "_lowered_graph", "_cpp_tensors", "_cpp_bog_done", "_cpp_plans_created", "_backend_mode_spans", "_backend_entries",
    "_backend_declined", "_plans", "_planning_done", "_plan_index", "_plan_pinned", "_is_validated", "_is_built",
    "_compiled_plans", "_plan_kernel_entries", "_selected_engine_cache", "_sorted_uids", "_declared_layout_native",
    "_slot_of_uid", "_ordered_binding_schema", "_ordered_binding_uids", "_handle", "_cpp_graph_kwargs",
    "_workspace_limit", "_backend_heuristics",
)  # fmt: skip


class AdoptionError(RuntimeError):
    """A stored plan could not be put into the caller's graph (the graph is unchanged)."""


class StoredPlanGraph:
    """The lowered graph of a caller's graph that adopted a stored plan: the deserialized
    backend graph, except that ``serialize`` returns the stored blob. Methods are looked
    up once per name, then kept: the frontend reaches its lowered graph on every ``execute``."""

    def __init__(self, backend_graph: Any, blob: bytes) -> None:
        self._backend_graph = backend_graph
        self._blob = bytes(blob)

    @property
    def backend_graph(self) -> Any:
        """The deserialized backend graph itself."""
        return self._backend_graph

    def serialize(self, as_bytes: bool = False) -> Any:
        # As the backend answers: a list of byte values by default, bytes when asked.
        return self._blob if as_bytes else list(self._blob)

    def __getattr__(self, name: str) -> Any:
        if name in ("_backend_graph", "_blob"):  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        value = getattr(self._backend_graph, name)
        if callable(value):
            self.__dict__[name] = value  # a bound method of the backend graph never changes
        return value

    def __repr__(self) -> str:
        return repr(self._backend_graph)


def _is_python_plan(blob: bytes) -> bool:
    """Whether ``blob`` is the frontend's serialized Python-engine plan (not a backend plan)."""
    try:
        from cudnn import _plan_serdes
    except ImportError:  # a frontend without Python engines
        return False
    return bool(_plan_serdes.is_python_plan(blob))


#: What the caller's graph carries into the graph its plan is deserialized into, as the
#: frontend's own ``deserialize`` forwards them: its name, its kernel cache (shared with the
#: program's other dynamic-shape builds) and its CUDA-graph retention.
_CARRIED = ("name", "kernel_cache", "cuda_graph_retention")


def _load_cudnn(graph: Any, backend: Backend, blob: bytes, tensors: Sequence[TensorSpec], device: int) -> Any:
    """The cuDNN backend's load for ``graph``: the blob deserialized by a fresh pygraph with
    the caller's graph's handle (or the frontend's default one of this thread and device),
    which is the plan's native.

    The frontend's ``deserialize`` ends in a warm-up capture on its handle's stream (a new
    blocking stream when that is NULL): the caller's handle is pointed at plancache's own
    non-blocking stream for the load, then back. On the caller's stream the warm-up would
    capture the program's work; on a blocking stream another thread's legacy-stream work
    breaks the capture."""
    from ..cudnn.backend import frontend_failures

    cudnn = sys.modules["cudnn"]
    kwargs = graph._cpp_graph_kwargs
    handle = graph._handle
    fresh = cudnn.pygraph(handle=handle, **{k: kwargs[k] for k in _CARRIED if k in kwargs})
    with _on_own_stream(cudnn, handle, backend, device), frontend_failures():
        fresh.deserialize(blob)
    if fresh.__dict__.get("_lowered_graph") is None or fresh.__dict__.get("_plans"):
        raise AdoptionError("the frontend deserialized the plan into something other than one backend graph")
    return fresh


@contextlib.contextmanager
def _on_own_stream(cudnn: Any, handle: Any, backend: Backend, device: int) -> Iterator[None]:
    """The caller's ``handle`` on plancache's own stream of ``device`` for the block, then on
    the stream it had (a fresh handle's is 0); nothing changes without one."""
    own, driver = getattr(backend, "own_stream", None), getattr(backend, "driver", None)
    if handle is None or own is None or driver is None or not hasattr(handle, "stream"):
        yield
        return
    previous = handle.stream
    cudnn.set_stream(handle=handle, stream=driver.raw_stream(own(device)))
    try:
        yield
    finally:
        cudnn.set_stream(handle=handle, stream=previous if previous is not None else 0)


def _backend_graph_cudnn(graph: Any, plan: Plan, native: Any) -> Any:
    return native.__dict__["_lowered_graph"]


@dataclass(frozen=True)
class Adopter:
    """How plans of one backend go into a caller's graph. ``load(graph, backend, blob,
    tensors, device)``: the blob deserialized as ``graph`` runs it, a ``Plan``'s native
    (``TransientLoadError`` for a failure that is not the blob's). ``backend_graph(graph,
    plan, native)``: the backend graph that executes ``plan`` in ``graph``, which becomes
    its lowered graph (inside a ``StoredPlanGraph``)."""

    load: Callable[[Any, Backend, bytes, Sequence[TensorSpec], int], Any]
    backend_graph: Callable[[Any, Plan, Any], Any]


#: Backend name -> how its plans go into a caller's graph.
ADOPTERS: dict[str, Adopter] = {"cudnn": Adopter(_load_cudnn, _backend_graph_cudnn)}


class GraphLoad:
    """The ``load`` of a drop-in lookup (``PlanCache.get(load=...)``): deserializes stored
    plans for one caller graph, as it will run them, and remembers the last one: the graph
    adopts what the lookup loaded (or loaded back before storing), with no second load."""

    def __init__(self, graph: Any, backend: Backend) -> None:
        adopter = ADOPTERS.get(backend.name)
        if adopter is None:
            raise AdoptionError(f"plans of the {backend.name!r} backend cannot be put into a cuDNN Frontend graph")
        self.graph, self.backend, self.adopter = graph, backend, adopter
        self.last: tuple[Any, PlanBlob] | None = None  # (native, blob) of the latest load

    def __call__(self, blob: PlanBlob | bytes, tensors: Sequence[TensorSpec], device: int) -> Any:
        blob = PlanBlob.of(blob)
        if _is_python_plan(blob.data):  # not the entry's fault: a lookup that can load it keeps it
            raise TransientLoadError("the plan runs on one of cuDNN Frontend's Python engines, whose plans load only into an "
                                     "empty graph, never into the program's own")  # fmt: skip
        native = self.adopter.load(self.graph, self.backend, blob.data, tensors, device)
        self.last = (native, blob)
        return native


def missing_state(graph: Any) -> list[str]:
    """The attributes adoption needs that ``graph`` lacks (none on a supported frontend)."""
    state = getattr(graph, "__dict__", {})
    return [name for name in _STATE if name not in state]


def _plan_config(engine: EngineChoice | None) -> Any:
    """The plan-list entry of the adopted plan: its engine id and knobs at backend plan
    index 0. Without a usable engine record: the frontend's delegating entry, which runs
    whatever plan the backend graph selected (the only one it has)."""
    from cudnn.engines.base import PlanConfig
    from cudnn.engines.engine_ids import BACKEND_HEURISTIC_ENGINE_ID, is_backend_engine

    knob_type = sys.modules["cudnn"].knob_type
    # Not a backend engine, or knobs of another frontend's backend:
    if (engine is None or engine.engine_id is None or not is_backend_engine(int(engine.engine_id))
            or not all(name in knob_type.__members__ for name in engine.knobs)):  # fmt: skip
        return PlanConfig(BACKEND_HEURISTIC_ENGINE_ID)
    knobs = {knob_type.__members__[name]: int(value) for name, value in engine.knobs.items()}
    return PlanConfig(int(engine.engine_id), knobs, cpp_index=0)


def _inferred_layouts(graph: Any, blob: PlanBlob) -> list[tuple[Any, str, tuple[int, ...]]]:
    """What ``build_operation_graph`` would copy into ``graph``'s non-virtual tensors from
    the backend's layout inference, which an adopted graph never runs: the dims and strides
    the program left unset (a convolution's output follows its input's channels-last
    layout, where validation alone says row-major), from the plan's lowered tensors. A
    program that allocates an output from ``get_stride()`` must see the layout the plan
    writes. As ``(tensor, field, value)``, applied once adoption cannot fail any more."""
    from ..guest.native.record import lowered_layouts

    by_uid = getattr(graph, "_tensor_by_uid", None) or {}
    changes: list[tuple[Any, str, tuple[int, ...]]] = []
    for uid, (dims, strides) in lowered_layouts(blob).items():
        tensor = by_uid.get(uid)
        if tensor is None or getattr(tensor, "is_virtual", True) or not hasattr(tensor, "stride_assigned"):
            continue
        if tensor.dim_assigned and tuple(tensor.dim or ()) != dims:
            continue  # not the tensor the plan was lowered with: nothing of it is taken
        if not tensor.dim_assigned and tuple(tensor.dim or ()) != dims:
            changes.append((tensor, "dim", dims))
        if not tensor.stride_assigned and tuple(tensor.stride or ()) != strides:
            changes.append((tensor, "stride", strides))
    return changes


_READ_WHEN_NEEDED = ("_sorted_uids", "_declared_layout_native", "_slot_of_uid", "_ordered_binding_schema",
                     "_ordered_binding_uids")  # fmt: skip


def adopt(load: GraphLoad, plan: Plan, native: Any, blob: PlanBlob) -> None:
    """Make the graph of ``load`` (validated, not built) carry ``plan``, stored as ``blob``
    and deserialized for it as ``native``; ``AdoptionError`` leaves the graph unchanged."""
    graph = load.graph
    missing = missing_state(graph)
    if missing:
        raise AdoptionError(f"this frontend's graphs have no {', '.join(missing)}")
    lowered = StoredPlanGraph(load.adopter.backend_graph(graph, plan, native), blob.data)  # nothing of the graph touched yet
    config = _plan_config(plan.engine)
    layouts = _inferred_layouts(graph, blob)
    vars(graph).update(
        _lowered_graph=lowered,
        _cpp_tensors={},  # the lowered tensors of the graph's own lowering, which is dropped
        _cpp_bog_done=True,
        _cpp_plans_created=True,
        _backend_mode_spans=[],
        _backend_entries=[config],
        _backend_declined=None,
        _plans=[config],
        _planning_done=True,
        _plan_index=0,
        _plan_pinned=False,
        _is_validated=True,
        _is_built=True,
        _compiled_plans={},
        _plan_kernel_entries={},
        _selected_engine_cache=None,
        # the operand order and layouts are read from the new lowered graph when first needed
        **dict.fromkeys(_READ_WHEN_NEEDED),
    )
    for tensor, field, value in layouts:
        object.__setattr__(tensor, field, value)  # the graph is frozen after validation, as the frontend's own sync finds it
    graph._freeze()  # as planning freezes it: a planned graph takes no more nodes
