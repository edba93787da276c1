"""The frontend's own planning calls, served from the cache once ``plancache.install()`` is in
force: the five-step pipeline, ``build()``, ``with cudnn.graph(handle) as (g, _)`` and the
build inside ``execute()``, on the CPU test backend.

The frontend's GPU-only steps are stand-ins that record their calls (tests/frontend_cpu.py),
so each test sees what reached the frontend; the graphs run through the frontend's own
``execute``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import cudnn
import pytest
from frontend_cpu import CpuFrontend, cpu_frontend
from graphs import row_major

import plancache
import plancache.integrations.frontend as frontend
import plancache.integrations.frontend_adopt as frontend_adopt
from plancache import PlanCache, PlanCacheNotice
from plancache.formats.plan_blob import PlanBlob
from plancache.guest.backend import EngineChoice
from plancache.key import describe
from plancache.testing import CpuTestBackend, TwoDeviceCpuTestBackend

torch = pytest.importorskip("torch")
DT = cudnn.data_type
A, B, FALLBACK = cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK


@pytest.fixture(autouse=True)
def fe() -> Iterator[CpuFrontend]:
    with cpu_frontend() as stand_ins:
        yield stand_ins


@pytest.fixture
def serve(make_cache: Callable[..., PlanCache]) -> Callable[..., PlanCache]:
    """Open a cache on $PLANCACHE_DIR (a new process's, on the same directory, each call),
    make it the frontend's, and install the patch."""

    def open_and_install(backend: Any = None) -> PlanCache:
        plancache.uninstall()
        cache = make_cache(backend=backend or CpuTestBackend())
        frontend.use(cache)
        plancache.install()
        return cache

    return open_and_install


def lookups(cache: PlanCache) -> int:
    return cache.counters["memory_hits"] + cache.counters["hits"] + cache.counters["misses"]


# ---------------------------------------------------------------- graphs, the frontend's way


class Matmul:
    """A matmul + bias + relu built with ``cudnn.pygraph``, tensors without uids."""

    def __init__(self, batch: int = 2, m: int = 8, k: int = 16, n: int = 4, handle: Any = None, **graph_kwargs: Any) -> None:
        self.dims = (batch, m, k, n)
        self.g = cudnn.pygraph(io_data_type=DT.FLOAT, handle=handle, **graph_kwargs)
        self.a = self.g.tensor(name="A", dim=[batch, m, k], stride=row_major([batch, m, k]))
        self.b = self.g.tensor(name="B", dim=[batch, k, n], stride=row_major([batch, k, n]))
        self.bias = self.g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1])
        self.c = self.g.relu(self.g.bias(self.g.matmul(self.a, self.b), self.bias))
        self.c.set_output(True).set_dim([batch, m, n]).set_stride(row_major([batch, m, n]))

    def run(self, graph: Any = None) -> None:
        """Execute the graph the frontend's way (tensors keyed by the pygraph's tensors) and
        check the result against torch."""
        batch, m, k, n = self.dims
        gen = torch.Generator().manual_seed(0)
        a, b, bias = (
            torch.randn(batch, m, k, generator=gen),
            torch.randn(batch, k, n, generator=gen),
            torch.randn(1, 1, n, generator=gen),
        )
        c = torch.zeros(batch, m, n)
        built = self.g._is_built  # an unbuilt graph builds in execute(), and has no size to ask yet
        workspace = torch.empty(self.g.get_workspace_size(), dtype=torch.uint8) if built else None
        (graph or self.g).execute({self.a: a, self.b: b, self.bias: bias, self.c: c}, workspace)
        torch.testing.assert_close(c, torch.relu(a @ b + bias))


def five_steps(graph: Any, modes: Any = (A, FALLBACK)) -> None:
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(list(modes))
    graph.check_support()
    graph.build_plans()


IDIOMS: dict[str, Callable[[Matmul], None]] = {
    "five steps": lambda mm: five_steps(mm.g),
    "build()": lambda mm: mm.g.build([A, FALLBACK]),
    "execute() builds": lambda mm: None,  # mm.run() below builds lazily
}


@pytest.mark.parametrize("idiom", sorted(IDIOMS))
def test_each_idiom_is_served_from_the_cache_and_a_second_process_loads_it(
    serve: Callable[..., PlanCache], fe: CpuFrontend, idiom: str
) -> None:
    for attempt in range(2):
        cache = serve()
        mm = Matmul()
        IDIOMS[idiom](mm)
        mm.run()
        plan = frontend.plan_of(mm.g)
        assert plan is not None and plan.source == ("loaded" if attempt else "built")
        assert lookups(cache) == 1
        assert (cache.counters["builds"], cache.counters["hits"]) == ((0, 1) if attempt else (1, 0))
        assert fe.count("build_plans") == 0  # the frontend built no plan: the cache's runs
        assert not any(t.uid_assigned for t in mm.g._tensor_by_uid.values())  # nothing of the caller's changed


def test_a_with_cudnn_graph_block_is_served(serve: Callable[..., PlanCache]) -> None:
    for attempt in range(2):
        cache = serve()
        with cudnn.graph(None, io_data_type=DT.FLOAT) as (g, _):
            X = g.tensor(name="X", dim=[2, 8, 6, 6], stride=[288, 1, 48, 8])
            W = g.tensor(name="W", dim=[4, 8, 3, 3], stride=[72, 1, 24, 8])
            Y = g.relu(g.conv_fprop(X, W, padding=[1, 1], stride=[1, 1], dilation=[1, 1]))
            Y.set_output(True).set_dim([2, 4, 6, 6]).set_stride([144, 1, 24, 4])
        g.build([A])
        x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
        w = torch.randn(4, 8, 3, 3).to(memory_format=torch.channels_last)
        y = torch.zeros(2, 4, 6, 6).to(memory_format=torch.channels_last)
        g.execute({X: x, W: w, Y: y}, None)
        torch.testing.assert_close(y, torch.relu(torch.nn.functional.conv2d(x, w, padding=1)), atol=1e-4, rtol=1e-4)
        assert frontend.plan_of(g).source == ("loaded" if attempt else "built") and lookups(cache) == 1


def test_a_hit_behaves_as_a_built_graph_with_one_plan(serve: Callable[..., PlanCache]) -> None:
    serve()
    five_steps(Matmul().g)
    cache = serve()
    mm = Matmul()
    five_steps(mm.g)
    plan = frontend.plan_of(mm.g)
    assert plan.source == "loaded"
    g = mm.g
    assert g.get_execution_plan_count() == 1 and g._is_built and g._plan_index == 0
    with pytest.raises(RuntimeError, match="one-shot"):
        g.create_execution_plans([A])
    assert g.get_workspace_size() == plan.workspace_size
    stored = cache.store.get(plan.key).blob
    assert g.serialize(as_bytes=True) == stored and g.serialize() == list(stored)
    g.populate_cuda_graph(None, {}, None, "a cuda graph")
    assert g._lowered_graph.backend_graph.cuda_graphs == ["a cuda graph"]
    g.build_plans()  # built already: the default build keeps the plan
    g.build()
    mm.run()
    assert lookups(cache) == 1
    with pytest.raises(RuntimeError, match="frozen"):
        g.relu(mm.c)


def test_every_graph_gets_its_own_backend_graph(serve: Callable[..., PlanCache]) -> None:
    cache = serve()
    one, two = Matmul(), Matmul()
    one.g.build()
    two.g.build()
    assert cache.counters["builds"] == 1 and cache.counters["memory_hits"] == 1
    assert one.g._lowered_graph is not two.g._lowered_graph
    assert one.g._lowered_graph.backend_graph is not two.g._lowered_graph.backend_graph
    one.run()
    two.run()


def test_the_plan_list_names_the_stored_engine_and_knobs(
    serve: Callable[..., PlanCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("plancache.testing.candidates.CpuPlans.engine",
                        lambda self, index: EngineChoice(engine_id=40 + index, knobs={"TILE_M": 64, "STAGES": 3}, name=f"eng{index}"))  # fmt: skip
    serve()
    mm = Matmul()
    mm.g.build()
    engine = frontend.plan_of(mm.g).engine
    engine_id, knobs = mm.g.get_engine_and_knobs_at_index(0)
    assert engine_id == engine.engine_id and knobs == {cudnn.knob_type.TILE_M: 64, cudnn.knob_type.STAGES: 3}
    assert mm.g._plans[0].cpp_index == 0 and mm.g.get_plan_name_at_index(0) == engine.name
    mm.run()
    config = frontend_adopt._plan_config(EngineChoice(engine_id=None, knobs={}, name="?"))
    assert config.cpp_index is None and config.engine_id == -1  # unknown engine: the backend's own choice


# ---------------------------------------------------------------- one load per graph


def test_a_hit_is_checked_and_deserialized_once_into_the_graph(serve: Callable[..., PlanCache],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cold = CpuTestBackend()
    serve(cold)
    Matmul().g.build()
    assert cold.loads == 1, "a miss loads its plan back once, into the graph, before storing it"
    warm = CpuTestBackend()
    cache = serve(warm)  # a new process on the same store
    reads: list[str] = []
    read = cache.local.get
    monkeypatch.setattr(cache.local, "get", lambda key, *a: reads.append(key) or read(key, *a))
    mm = Matmul()
    mm.g.build()
    plan = frontend.plan_of(mm.g)
    assert plan.source == "loaded" and cache.counters["hits"] == 1
    assert warm.loads == 1 and len(reads) == 1, "the entry is read, checked and deserialized once"
    assert mm.g._lowered_graph.backend_graph.native is plan.native, "the lookup's own load runs in the graph"
    again = Matmul()
    again.g.build()  # a memory hit: this graph gets a deserialized plan of its own
    assert warm.loads == 2 and again.g._lowered_graph.backend_graph.native is not plan.native
    mm.run()
    again.run()


# ---------------------------------------------------------------- what is stored loads back


def test_a_plan_that_cannot_be_loaded_back_is_never_stored(serve: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    cache = serve(CpuTestBackend(unloadable=range(4)))  # no candidate's blob loads
    mm = Matmul()
    with pytest.warns(PlanCacheNotice, match="is not stored .it could not be loaded back from its blob"):
        mm.g.build()
    assert fe.frontend_built(mm.g) and frontend.plan_of(mm.g) is None and cache.store.keys() == []
    stats = cache.stats()
    assert stats["process"]["unloadable"] == 1
    (refused,) = stats["unstored_plans"].values()
    assert (
        refused["graph"].startswith("MATMUL") and refused["why"] == "unloadable" and "unloadable= candidate" in refused["reason"]
    )


def test_a_graph_never_runs_a_stored_plan_its_lookup_did_not_choose(serve: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    """An entry stored before outputs were compared element by element is chosen again;
    when its candidates then have no majority, the lookup answers with the frontend's own
    choice for this process. The drop-in loaded the stored entry into the graph anyway:
    the graph ran a plan nothing had confirmed, while naming another."""
    import dataclasses

    cache = serve(CpuTestBackend())
    mm = Matmul()
    mm.g.build([A])
    entry = cache.store.get(frontend.plan_of(mm.g).key)
    cache.store.put(dataclasses.replace(entry, check=None, meta_sha256=None))  # as an older plancache stored it
    cache.close()
    cache = serve(CpuTestBackend(wrong=[0, 1]))  # now 0 and 1 agree on a wrong result, 2 and 3 on the right one
    again = Matmul()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-majority warning and the drop-in's notice
        again.g.build([A])
    assert cache.counters["no_majority"] == 1
    assert frontend.plan_of(again.g) is None and fe.frontend_built(again.g)  # the frontend planned it


def test_a_python_engine_plan_is_never_stored_by_the_drop_in(serve: Callable[..., PlanCache], fe: CpuFrontend,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    serdes = pytest.importorskip("cudnn._plan_serdes")
    cache = serve()
    monkeypatch.setattr(serdes, "is_python_plan", lambda blob: True)  # every winner runs on a Python engine
    mm = Matmul()
    with pytest.warns(PlanCacheNotice, match="Python engines"):
        mm.g.build()
    assert fe.frontend_built(mm.g) and cache.store.keys() == [] and cache.counters["unloadable"] == 1


# ---------------------------------------------------------------- the program's filters hold


class Recording(CpuTestBackend):
    """Records the graphs autotuning builds candidates of (plancache's own, rebuilt)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.graphs: list[Any] = []

    def plans(self, graph: Any, options: Any, description: Any = None) -> Any:
        self.graphs.append(graph)
        return super().plans(graph, options, description)


def test_a_workspace_limit_plancache_cannot_key_is_left_to_the_frontend(serve: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    """``deselect_workspace_greater_than(-1)`` is the frontend's to judge; the patched build
    raised plancache's own ValueError from inside the caller's build()."""
    serve(CpuTestBackend())
    mm = Matmul()
    mm.g.deselect_workspace_greater_than(-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the drop-in's one notice
        mm.g.build([A])
    assert frontend.plan_of(mm.g) is None and fe.frontend_built(mm.g)


def _unfiltered_choice(serve: Callable[..., PlanCache]) -> int:
    """The candidate index autotuning chooses for ``Matmul()`` with no limit or filter."""
    serve(CpuTestBackend())
    mm = Matmul()
    mm.g.build()
    return int(frontend.plan_of(mm.g).engine.engine_id)


def test_autotuning_never_picks_a_plan_over_the_programs_workspace_limit(serve: Callable[..., PlanCache]) -> None:
    best, limit = _unfiltered_choice(serve), 64 << 10
    cache = serve(CpuTestBackend(extra_workspace={best: 1 << 20}))  # the fastest needs 1 MiB more than the program allows
    mm = Matmul()
    mm.g.deselect_workspace_greater_than(limit)
    mm.g.build()
    plan = frontend.plan_of(mm.g)
    assert plan.engine.engine_id != best and plan.workspace_size <= limit
    entry = cache.store.get(plan.key)
    assert entry.options["workspace_limit"] == limit and entry.workspace_size <= limit
    refused = entry.candidates[best]
    assert refused["status"] == "failed" and "over the limit of 64.0 KiB" in refused["error"]
    mm.run()


def test_deselected_engines_are_never_built_launched_or_chosen(serve: Callable[..., PlanCache]) -> None:
    best = _unfiltered_choice(serve)
    cache = serve()
    mm = Matmul()
    mm.g.deselect_engines([f"test_engine_{best}"])
    mm.g.build()
    plan = frontend.plan_of(mm.g)
    assert plan.engine.engine_id != best
    entry = cache.store.get(plan.key)
    assert entry.description["flags"]["deselected_engines"] == [f"test_engine_{best}"]
    assert entry.candidates[best]["status"] == "failed" and "is deselected" in entry.candidates[best]["error"]


def test_note_filters_are_set_on_the_graph_autotuning_builds(serve: Callable[..., PlanCache]) -> None:
    backend = Recording()
    cache = serve(backend)
    mm = Matmul()
    mm.g.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
    mm.g.select_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
    mm.g.build()
    (built,) = backend.graphs
    assert built is not mm.g and built._note_filters == mm.g._note_filters
    entry = cache.store.get(frontend.plan_of(mm.g).key)
    assert entry.description["flags"]["note_filters"] == [["behavior", "behavior_note.RUNTIME_COMPILATION", False],
                                                          ["numerical", "numerical_note.TENSOR_CORE", True]]  # fmt: skip
    mm.run()


# ---------------------------------------------------------------- the frontend's kernel cache


def test_dynamic_shapes_with_the_frontends_kernel_cache_are_stored_per_shape(serve: Callable[..., PlanCache]) -> None:
    """Eight batch sizes built as the frontend's dynamic-shape samples build them: one kernel
    cache shared by every graph. Autotuning builds against that same kernel cache; a fresh
    process finds every shape stored."""
    kernel_cache = object()  # cudnn.create_kernel_cache() needs a GPU: any object stands in
    backend = Recording()
    cache = serve(backend)
    for batch in range(1, 9):
        mm = Matmul(batch=batch, is_dynamic_shape_enabled=True, kernel_cache=kernel_cache)
        mm.g.build([A, FALLBACK])
        mm.run()
        assert frontend.plan_of(mm.g).source == "built"
    assert cache.counters["builds"] == 8 and len(cache.store.keys()) == 8
    assert all(g._cpp_graph_kwargs["kernel_cache"] is kernel_cache for g in backend.graphs)
    warm = serve()  # a new process: warm for every shape it has seen
    for batch in range(1, 9):
        mm = Matmul(batch=batch, is_dynamic_shape_enabled=True, kernel_cache=kernel_cache)
        mm.g.build([A, FALLBACK])
        mm.run()
        assert frontend.plan_of(mm.g).source == "loaded"
    assert warm.counters["hits"] == 8 and warm.counters["builds"] == 0


# ---------------------------------------------------------------- only the outermost call


class PipelineDrivingBackend(CpuTestBackend):
    """A backend whose miss path drives the frontend's pipeline on the graph it autotunes
    (as the cuDNN backend drives validate and planning)."""

    def plans(self, graph: Any, options: Any, description: Any = None) -> Any:
        found = super().plans(graph, options, description)
        graph._planning_done = False
        graph.build_plans()
        graph.build()
        graph.execute({}, None)
        return found


def test_only_the_outermost_call_is_served(serve: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    cache = serve(PipelineDrivingBackend())
    mm = Matmul()
    mm.g.build([A])  # the frontend's build calls build_plans: served once
    assert lookups(cache) == 1 and frontend.plan_of(mm.g) is not None
    built = [g for name, g in fe.calls if name == "build_plans"]
    assert len(built) == 2 and all(g is built[0] and g is not mm.g for g in built)  # the cache's own graph, the frontend's way
    mm.run()


def test_threads_are_served_on_their_own(serve: Callable[..., PlanCache]) -> None:
    cache = serve()
    graphs = [Matmul(batch=b) for b in (1, 2, 3, 4)]
    errors: list[BaseException] = []

    def build(mm: Matmul) -> None:
        try:
            five_steps(mm.g)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=build, args=(mm,)) for mm in graphs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(frontend.plan_of(mm.g) is not None for mm in graphs) and cache.counters["builds"] == 4
    for mm in graphs:
        mm.run()


# ---------------------------------------------------------------- left to the frontend


def _all_plans(g: Any) -> None:
    g.validate()
    g.create_execution_plans([A])
    g.build_plans(cudnn.build_plan_policy.ALL)


def _pinned(g: Any) -> None:
    g.validate()
    g.create_execution_plans([A])
    g.select_plan(1)
    g.build_plans()


def _explicit_engine(g: Any) -> None:
    g.validate()
    g.create_execution_plan(7, {})
    g.build_plans()


def _at_index(g: Any) -> None:
    g.validate()
    g.create_execution_plans([A])
    g.build_plan_at_index(2)
    g.build_plans()
    g.build()


def _counted(g: Any) -> None:
    """Reads the plan list's size before building, to choose by index after: a served graph
    has a list of one, so the program's select_plan(1) raised IndexError."""
    g.validate()
    g.create_execution_plans([A])
    count = g.get_execution_plan_count()
    g.check_support()
    g.build_plans()
    assert g.get_execution_plan_count() == count > 1


CHOOSERS = {"build_plans(ALL)": _all_plans, "select_plan": _pinned, "create_execution_plan": _explicit_engine,
            "build_plan_at_index": _at_index, "plan count read before building": _counted}  # fmt: skip


@pytest.mark.parametrize("chooser", sorted(CHOOSERS))
def test_code_that_chooses_plans_itself_is_left_to_the_frontend(
    serve: Callable[..., PlanCache], fe: CpuFrontend, chooser: str
) -> None:
    cache = serve()
    mm = Matmul()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        CHOOSERS[chooser](mm.g)
    assert fe.frontend_built(mm.g) and frontend.plan_of(mm.g) is None
    assert lookups(cache) == 0 and not caught  # nothing asked, nothing to tell


def test_the_frontends_own_questions_about_the_plan_list_leave_the_graph_served(
    serve: Callable[..., PlanCache], fe: CpuFrontend
) -> None:
    """The frontend asks for plan names itself (while it filters its list): that is not the
    program choosing by index."""
    namespace: dict[str, Any] = {"__name__": "cudnn._pygraph"}
    exec("def ask(g):\n    return g.get_execution_plan_count()\n", namespace)  # a function of the frontend's module
    serve()
    mm = Matmul()
    mm.g.validate()
    mm.g.create_execution_plans([A])
    assert namespace["ask"](mm.g) == CpuFrontend.CANDIDATES
    mm.g.build_plans()
    assert frontend.plan_of(mm.g) is not None and not fe.frontend_built(mm.g)
    assert mm.g.get_execution_plan_count() == 1  # built: the served graph's list of one
    mm.run()


# ---------------------------------------------------------------- the hard cases


def softcap(graph: Any, score: Any) -> Any:
    return graph.tanh(score)


def _sdpa_with_score_mod() -> Any:
    g = cudnn.pygraph(io_data_type=DT.HALF)
    q, k, v = (g.tensor(name=n, dim=[1, 2, 8, 16], stride=row_major([1, 2, 8, 16])) for n in "qkv")
    o, _ = g.sdpa(q, k, v, attn_scale=0.25, score_mod=softcap, generate_stats=False)
    o.set_output(True)
    return g


def _not_rebuildable(monkeypatch: pytest.MonkeyPatch) -> Any:
    def refuse(description: Any, **kwargs: Any) -> Any:
        raise plancache.InvalidGraphError("the rebuilt graph differs (stand-in)", node=None, reason="inexact replay")

    monkeypatch.setattr("plancache.cudnn.replay.rebuild_graph", refuse)
    return Matmul().g


HARD_CASES: dict[str, tuple[Callable[..., Any], str]] = {
    "unkeyable": (lambda mp: _sdpa_with_score_mod(), "callable"),
    "not rebuildable": (_not_rebuildable, "cannot be rebuilt"),
}


@pytest.mark.parametrize("case", sorted(HARD_CASES))
def test_hard_cases_keep_the_frontends_behaviour_with_one_notice(
    serve: Callable[..., PlanCache], fe: CpuFrontend, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = serve()
    build, text = HARD_CASES[case]

    def make() -> Any:
        return build(monkeypatch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = [make(), make()]
        for g in graphs:
            g.build([A])
    notices = [str(w.message) for w in caught if w.category is PlanCacheNotice]
    assert len(notices) == 1 and text in notices[0], notices
    assert caught[0].filename == __file__
    assert all(fe.frontend_built(g) for g in graphs) and lookups(cache) == 0


def test_a_capture_in_progress_keeps_the_frontends_behaviour(serve: Callable[..., PlanCache], fe: CpuFrontend,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cache = serve()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    mm = Matmul()
    with pytest.warns(PlanCacheNotice, match="capture"):
        five_steps(mm.g)
    assert fe.frontend_built(mm.g) and lookups(cache) == 0


def test_python_engine_graphs_and_plans_keep_the_frontends_behaviour(serve: Callable[..., PlanCache], fe: CpuFrontend,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cache = serve()
    with monkeypatch.context() as mp:
        mp.setattr(cudnn.pygraph, "_unlowerable_node", lambda self: self._nodes[0])
        mm = Matmul()
        with pytest.warns(PlanCacheNotice, match="Python engines"):
            mm.g.build()
        assert fe.frontend_built(mm.g) and lookups(cache) == 0
    serdes = pytest.importorskip("cudnn._plan_serdes")
    monkeypatch.setattr(serdes, "is_python_plan", lambda blob: True)  # the winner runs on a Python engine
    mm = Matmul()
    with pytest.warns(PlanCacheNotice, match="Python engines"):
        mm.g.build()
    assert fe.frontend_built(mm.g) and frontend.plan_of(mm.g) is None


def test_a_heuristic_mode_plancache_does_not_autotune_keeps_the_frontends_behaviour(
    serve: Callable[..., PlanCache], fe: CpuFrontend
) -> None:
    cache = serve()
    mm = Matmul()
    with pytest.warns(PlanCacheNotice, match="OPENSOURCE"):
        five_steps(mm.g, modes=[cudnn.heur_mode.OPENSOURCE])
    assert fe.frontend_built(mm.g) and lookups(cache) == 0


def test_a_rejection_is_the_frontends_own(serve: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    """A graph the frontend rejects raises the frontend's error from the caller's call; one
    no plan builds for falls back to the frontend, whose rejection the caller catches."""
    serve()
    fe.reject = cudnn.cudnnGraphNotSupportedError("rejected at validation (stand-in)")
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="stand-in"):
        Matmul().g.build()
    fe.reject = None
    cache = serve(CpuTestBackend(unbuildable=range(4)))
    fe.refuse_build = True
    caught_it = False
    with pytest.warns(PlanCacheNotice, match="not persisting"):
        try:
            Matmul().g.build()
        except cudnn.cudnnGraphNotSupportedError:  # what frontend code catches to skip a graph
            caught_it = True
    assert caught_it and cache.counters["misses"] == 1


# ---------------------------------------------------------------- what goes into the key


def test_heuristic_modes_and_the_workspace_limit_are_keyed(serve: Callable[..., PlanCache]) -> None:
    cache = serve()
    plans = {}
    for label, modes, limit in (("A", [A], None), ("A+B", [A, B], None), ("A, 4 KiB", [A], 4096), ("default", None, None)):
        mm = Matmul()
        if limit is not None:
            mm.g.deselect_workspace_greater_than(limit)
        mm.g.validate()
        mm.g.build_operation_graph()
        mm.g.create_execution_plans(modes)
        mm.g.build_plans()
        plans[label] = frontend.plan_of(mm.g)
    assert len({p.key for p in plans.values()}) == 4
    options = {label: cache.store.get(p.key).options for label, p in plans.items()}
    assert options["A, 4 KiB"]["workspace_limit"] == 4096 and options["A"]["workspace_limit"] is None
    assert options["A+B"]["heuristic_modes"] == ["A", "B"] and options["default"]["heuristic_modes"] == ["A", "FALLBACK"]
    mm = Matmul()
    mm.g.build(None)  # the frontend's default modes: the same key as naming them
    assert frontend.plan_of(mm.g).key == plans["default"].key


def test_tensors_without_uids_are_keyed_as_they_are(serve: Callable[..., PlanCache]) -> None:
    serve()
    mm = Matmul()
    before = describe(mm.g, auto_uids=True)
    mm.g.build()
    assert not any(t.uid_assigned for t in mm.g._tensor_by_uid.values())
    explicit = Matmul()
    for t in (explicit.a, explicit.b, explicit.bias, explicit.c):
        t.set_uid(t.get_uid())
    assert describe(explicit.g) == before  # the uids the frontend numbered, as if set
    explicit.g.build()
    assert frontend.plan_of(explicit.g).key == frontend.plan_of(mm.g).key


def test_a_hit_runs_on_the_graphs_own_device(serve: Callable[..., PlanCache]) -> None:
    backend = TwoDeviceCpuTestBackend()
    serve(backend)
    mm = Matmul(handle=cudnn.Handle(None, 1))  # a handle made on device 1
    mm.g.build()
    assert frontend.plan_of(mm.g).device == 1 and backend.current_device() == 0
    backend.use_device(1)  # the plan launches on its device
    mm.run()


def test_the_cudnn_load_deserializes_the_blob_once_with_the_graphs_own_handle_and_kernel_cache(
    serve: Callable[..., PlanCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cuDNN backend's load for a caller graph and its adoption, through the frontend's
    own ``deserialize`` and ``execute``: one backend graph per caller graph, made with that
    graph's handle and kernel cache, deserialized once, run at its plan index 0 with the
    caller's pointers in uid order."""
    import ctypes
    import types

    from plancache.runtime.plan import Plan

    made: list[Any] = []

    class BackendGraph:  # what cudnn._pybind_module.backend_graph makes, minus the GPU
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs, self.blobs, self.launches = kwargs, [], []
            made.append(self)

        def deserialize(self, blob: bytes) -> None:
            self.blobs.append(bytes(blob))

        def _prepare_variant_pack_template(self) -> None:
            pass

        def _get_variant_pack_uids_sorted(self) -> list[int]:
            return order

        def _execute_with_raw_ptrs(self, address: int, count: int, workspace: int, handle: int, index: int) -> None:
            self.launches.append((list((ctypes.c_void_p * count).from_address(address)), handle, index))

        def get_workspace_size_plan_at_index(self, index: int) -> int:
            assert index == 0
            return 4096

    serve()
    other = Matmul()
    other.g.build()
    stored = frontend.plan_of(other.g)
    monkeypatch.setattr(cudnn._pybind_module, "backend_graph", BackendGraph)
    handle, kernel_cache = cudnn.Handle(0x1234, 0), object()
    mm = Matmul(handle=handle, is_dynamic_shape_enabled=True, kernel_cache=kernel_cache)
    order = sorted(t.uid for t in (mm.a, mm.b, mm.bias, mm.c))
    mm.g.validate()
    load = frontend_adopt.GraphLoad(mm.g, types.SimpleNamespace(name="cudnn"))
    native = load(b"stored blob", stored.tensors, 0)
    plan = Plan(key=stored.key, backend=CpuTestBackend(), native=native, tensors=stored.tensors, workspace_size=4096,
                engine=EngineChoice(engine_id=5, knobs={"TILE_M": 128}, name="eng5"), source="loaded", device=0)  # fmt: skip
    frontend_adopt.adopt(load, plan, native, PlanBlob(b"stored blob"))
    assert len(made) == 1 and made[0].blobs == [b"stored blob"]  # deserialized once, for this graph
    assert made[0].kwargs == {"name": mm.g._cpp_graph_kwargs["name"], "handle": 0x1234, "kernel_cache": kernel_cache}
    assert mm.g._lowered_graph.backend_graph is made[0] is native._lowered_graph
    assert mm.g.get_execution_plan_count() == 1 and mm.g.get_workspace_size() == 4096
    assert mm.g.get_engine_and_knobs_at_index(0) == (5, {cudnn.knob_type.TILE_M: 128})
    assert mm.g.serialize(as_bytes=True) == b"stored blob"
    tensors = {
        mm.a: torch.zeros(2, 8, 16),
        mm.b: torch.zeros(2, 16, 4),
        mm.bias: torch.zeros(1, 1, 4),
        mm.c: torch.zeros(2, 8, 4),
    }
    workspace = torch.empty(4096, dtype=torch.uint8)
    mm.g.execute(tensors, workspace, handle=handle)
    pointers, launched_on, index = made[0].launches[0]
    by_uid = {t.uid: tensor.data_ptr() for t, tensor in tensors.items()}
    assert pointers == [by_uid[uid] for uid in order] and launched_on == 0x1234 and index == 0


def test_an_adopted_graph_takes_the_layouts_the_backend_inferred_for_what_the_program_left_unset(
    serve: Callable[..., PlanCache],
) -> None:
    """The frontend's build_operation_graph copies the backend's layout inference (a
    convolution's output follows a channels-last input) into the tensors the program left
    unset; an adopted graph never runs it, so its output kept validation's row-major
    strides while the plan wrote the inferred layout: a program that allocates the output
    from get_stride() read it wrongly."""
    import types

    from ubjson_writer import ubjson

    from plancache.runtime.plan import Plan

    class Loaded:  # the deserialized graph of a stored plan, minus the GPU
        def __init__(self) -> None:
            self._lowered_graph = object()

    serve()
    g = cudnn.pygraph(io_data_type=DT.FLOAT, compute_data_type=DT.FLOAT)
    a = g.tensor(name="A", dim=[2, 8, 16], stride=row_major([2, 8, 16]), uid=1)
    b = g.tensor(name="B", dim=[2, 16, 4], stride=row_major([2, 16, 4]), uid=2)
    c = g.matmul(a, b)
    c.set_output(True).set_uid(3)  # dims and strides left to inference
    g.validate()
    assert c.get_stride() == row_major([2, 8, 4])
    blob = ubjson({"json_version": "2.0", "cudnn_backend_data": "{}", "tensors": [
        {"uid": 1, "dim": [2, 8, 16], "stride": [128, 1, 8], "is_virtual": False},  # assigned: never changed
        {"uid": 3, "dim": [2, 8, 4], "stride": [32, 1, 8], "is_virtual": False},  # the backend's column-major output
        {"uid": 2, "dim": [9, 9], "stride": [9, 1], "is_virtual": True},  # a virtual tensor's uid says nothing here
    ]})  # fmt: skip
    load = frontend_adopt.GraphLoad(g, types.SimpleNamespace(name="cudnn"))
    load.adopter = frontend_adopt.Adopter(lambda *args: Loaded(), lambda graph, plan, native: native._lowered_graph)
    native = load(blob, [], 0)
    plan = Plan(key="k" * 64, backend=CpuTestBackend(), native=native, tensors=[], workspace_size=0,
                engine=EngineChoice(engine_id=5, knobs={}, name="eng5"), source="loaded", device=0)  # fmt: skip
    frontend_adopt.adopt(load, plan, native, PlanBlob(blob))
    assert c.get_stride() == [32, 1, 8] and c.get_dim() == [2, 8, 4]
    assert a.get_stride() == row_major([2, 8, 16]) and b.get_dim() == [2, 16, 4]


def test_a_drop_in_load_warms_up_on_plancaches_own_stream_and_gives_the_callers_handle_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The frontend's deserialize ends in a warm-up capture on its handle's stream: on the
    # caller's (a fresh handle's NULL stream makes the frontend capture on a new blocking
    # stream, which another thread's legacy-stream work breaks) it is not a guest's.
    import sys
    import types

    from plancache.integrations import frontend_adopt

    backend = CpuTestBackend()
    seen: dict[str, Any] = {}

    class Handle:
        stream: int | None = None

    def set_stream(*, handle: Any, stream: int) -> None:
        handle.stream = stream

    class Fresh:
        def __init__(self, handle: Any, **kwargs: Any) -> None:
            self.handle = handle

        def deserialize(self, blob: bytes) -> None:
            seen["stream during the load"] = self.handle.stream
            self._lowered_graph = object()

    caller = types.SimpleNamespace(_cpp_graph_kwargs={}, _handle=Handle())
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(pygraph=Fresh, set_stream=set_stream))
    monkeypatch.setattr("plancache.cudnn.backend.frontend_failures", contextlib.nullcontext)
    with backend.guest(0):
        own = backend.own_stream(0)
        frontend_adopt._load_cudnn(caller, backend, b"blob", [], 0)
    assert seen["stream during the load"] == own != 0
    assert caller._handle.stream == 0, "the caller's handle is back on its own (NULL) stream"
