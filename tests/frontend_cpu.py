"""cuDNN Frontend's planning calls on a CPU, for the tests of ``plancache.integrations.frontend``.

The frontend's ``validate`` lowers the graph to its C++ backend and ``create_execution_plans``
asks that backend's heuristics, which need a GPU. ``CpuFrontend`` replaces just those steps
on ``cudnn.pygraph`` with stand-ins that leave the state the frontend leaves (IR inference
by the frontend's own ``validate``, a one-shot plan list, built flags), and records every
call, so a test sees which calls reached the frontend. Everything else is the frontend's own
code: ``build`` (which calls the others), ``execute`` (the variant pack, its checks, the
launch through the lowered graph), ``get_workspace_size``, ``serialize``...

``CpuPlanGraph`` is the lowered graph a plan of the CPU test backend becomes when plancache
puts it into a caller's graph (``frontend_adopt.ADOPTERS["cpu-test"]``: the blob loaded for
the graph by the backend's own ``load``, which counts it, then wrapped): the frontend's
``execute`` hands it raw pointers, which it reads back into CPU tensors of the plan's
layout and runs through the ``Plan``. A graph the stand-in ``build_plans`` built gets a
``FrontendBuiltGraph``, which records its launches (so a test sees the frontend's plan run).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cudnn
import pytest
from cudnn.engines.base import PlanConfig

import plancache.integrations.frontend as frontend
import plancache.integrations.frontend_adopt as frontend_adopt
import plancache.integrations.frontend_pipeline as frontend_pipeline
from plancache.guest.tensors import TORCH_DTYPES


class CpuPlanGraph:
    """A plan of the CPU test backend as a graph's lowered graph (see the module docstring)."""

    def __init__(self, plan: Any, native: Any) -> None:
        self.plan = plan
        self.native = native  # what the backend's load deserialized for this graph
        self.order = sorted(spec.uid for spec in plan.tensors)
        self.launches = 0
        self.cuda_graphs: list[Any] = []

    def _prepare_variant_pack_template(self) -> None:
        pass

    def _get_variant_pack_uids_sorted(self) -> list[int]:
        return list(self.order)

    def _execute_with_raw_ptrs(self, address: int, count: int, workspace: int, handle: int, index: int) -> None:
        import torch

        assert count == len(self.order), (count, self.order)
        pointers = (ctypes.c_void_p * count).from_address(address)
        specs = {spec.uid: spec for spec in self.plan.tensors}
        pack = {}
        for uid, pointer in zip(self.order, pointers):
            spec = specs[uid]
            dtype = getattr(torch, TORCH_DTYPES[spec.dtype][0])
            elements = 1 + sum((d - 1) * s for d, s in zip(spec.dims, spec.strides))
            size = elements * torch.empty((), dtype=dtype).element_size()
            flat = torch.frombuffer((ctypes.c_char * size).from_address(int(pointer)), dtype=dtype)
            pack[uid] = torch.as_strided(flat, spec.dims, spec.strides)
        self.plan.execute(pack)
        self.launches += 1

    def _execute_ordered(self, schema: Any, buffers: Any, uids: Any, bindings: Any, workspace: Any, *rest: Any) -> None:
        """The ordered form (``execute(buffers, ..., tensor_uids=...)``): run at once, as the
        compiled graph does when it binds every buffer itself (nothing left to finish)."""
        pack = {**dict(bindings), **dict(zip(uids, buffers))}
        self.plan.execute({uid: pack[uid] for uid in self.order})
        self.launches += 1

    def get_workspace_size_plan_at_index(self, index: int, *args: Any) -> int:
        assert index == 0
        return self.plan.workspace_size

    def get_workspace_size(self, *args: Any) -> int:
        return self.plan.workspace_size

    def get_plan_name_at_index(self, index: int) -> str:
        assert index == 0
        return self.plan.engine.name if self.plan.engine is not None else "plan"

    def serialize(self, as_bytes: bool = False) -> Any:
        raise AssertionError("the graph's serialize must return the stored blob, not the backend's re-serialization")

    def populate_cuda_graph(self, handle: Any, pack: Any, workspace: Any, cuda_graph: Any) -> None:
        self.cuda_graphs.append(cuda_graph)


class FrontendBuiltGraph:
    """The lowered graph of a graph the frontend's (stand-in) ``build_plans`` built."""

    def __init__(self) -> None:
        self.launches = 0

    def _prepare_variant_pack_template(self) -> None:
        pass

    def _get_variant_pack_uids_sorted(self) -> list[int]:
        return []  # the uid-map path

    def _execute_plan_at_index(self, *args: Any) -> None:
        self.launches += 1

    def get_workspace_size_plan_at_index(self, *args: Any) -> int:
        return 0


def _load_cpu(graph: Any, backend: Any, blob: bytes, tensors: Any, device: int) -> Any:
    return backend.load(blob, tensors, device)


def _backend_graph_cpu(graph: Any, plan: Any, native: Any) -> CpuPlanGraph:
    return CpuPlanGraph(plan, native)


class CpuFrontend:
    """Installs the stand-ins (see the module docstring); ``calls`` lists ``(method, graph)``
    for each stand-in call, ``frontend_builds`` the graphs the frontend's build_plans built."""

    CANDIDATES = 3

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.reject: BaseException | None = None  # raised by the stand-in validate when set
        self.refuse_build = False  # the stand-in build_plans finds no plan (cudnnGraphNotSupportedError)
        mp = monkeypatch
        pygraph = cudnn.pygraph
        mp.setattr(pygraph, "_backend_lowerable", lambda self: False)  # validate() infers, never lowers
        original_validate = pygraph.validate

        def validate(graph: Any) -> None:
            self.calls.append(("validate", graph))
            if self.reject is not None:
                raise self.reject
            original_validate(graph)

        def create_execution_plans(graph: Any, heuristics: Any = None) -> None:
            self.calls.append(("create_execution_plans", graph))
            if not graph._is_validated:
                graph.validate()
            if graph._planning_done:
                raise RuntimeError("create_execution_plans() was already called on this graph; planning is one-shot")
            graph._backend_heuristics = heuristics
            graph._freeze()
            graph._plans = [PlanConfig(i, {}, cpp_index=i) for i in range(self.CANDIDATES)]
            graph._planning_done = True
            graph._plan_index = 0

        def check_support(graph: Any) -> None:
            self.calls.append(("check_support", graph))

        def build_plans(graph: Any, *args: Any, ctx: Any = None, **kwargs: Any) -> None:
            self.calls.append(("build_plans", graph))
            if not graph._planning_done:
                graph.create_execution_plans()
            if self.refuse_build:
                raise cudnn.cudnnGraphNotSupportedError("no plan in the list could be built (CPU stand-in)")
            graph._lowered_graph, graph._cpp_bog_done = FrontendBuiltGraph(), True
            graph._is_built = True

        def build_plan_at_index(graph: Any, index: int) -> Any:
            self.calls.append(("build_plan_at_index", graph))
            graph._lowered_graph, graph._cpp_bog_done = FrontendBuiltGraph(), True
            graph._plan_index, graph._is_built = index, True
            return graph

        def create_execution_plan(graph: Any, engine_id: int, knobs: Any = None) -> Any:
            self.calls.append(("create_execution_plan", graph))
            graph._plans = [*graph._plans, PlanConfig(engine_id, knobs, cpp_index=len(graph._plans))]
            graph._planning_done = True
            graph._freeze()
            return graph

        for name, function in (("validate", validate), ("create_execution_plans", create_execution_plans),
                               ("check_support", check_support), ("build_plans", build_plans),
                               ("build_plan_at_index", build_plan_at_index), ("create_execution_plan", create_execution_plan)):  # fmt: skip
            mp.setattr(pygraph, name, function)
        mp.setitem(frontend_adopt.ADOPTERS, "cpu-test", frontend_adopt.Adopter(_load_cpu, _backend_graph_cpu))

    def count(self, method: str, graph: Any = None) -> int:
        return sum(1 for name, g in self.calls if name == method and (graph is None or g is graph))

    def frontend_built(self, graph: Any) -> bool:
        return isinstance(graph.__dict__.get("_lowered_graph"), FrontendBuiltGraph)


@contextmanager
def cpu_frontend() -> Iterator[CpuFrontend]:
    """The stand-ins in place, the frontend unpatched and no notice remembered, before and
    after (``plancache.install()`` inside captures the stand-ins as the frontend's)."""
    frontend.uninstall()
    frontend._warned.clear()
    previous = frontend.use(None)
    with pytest.MonkeyPatch.context() as mp:
        try:
            yield CpuFrontend(mp)
        finally:
            frontend.uninstall()  # before the stand-ins go: it restores what install() saw
    frontend.use(previous)
    frontend._warned.clear()


def adopted_lowered(graph: Any) -> Any:
    """The lowered graph a graph that adopted a plan runs."""
    lowered = graph.__dict__.get("_lowered_graph")
    assert frontend_pipeline.plan_of(graph) is not None, "the graph carries no plan of the cache"
    return lowered
