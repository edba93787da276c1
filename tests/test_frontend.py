"""plancache.integrations.frontend's decorators and install, on the CPU test backend: builders written the
cuDNN Frontend way (``with cudnn.graph(handle) as (g, _): ... return g, [X, W, Y]``, no uids
set) decorated with ``plancache.jit`` and ``plancache.graph_cache``.

The frontend's GPU-only steps are stand-ins (tests/frontend_cpu.py); the returned graphs
run through the frontend's own ``execute``, which launches the cache's plan through the
lowered graph plancache gave the caller's graph. tests/test_gpu_frontend.py runs the same
on a GPU.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import cudnn
import pytest
from cudnn.graph import graph_cache as frontends_graph_cache  # the frontend's own, before any patch
from frontend_cpu import CpuFrontend, cpu_frontend
from graphs import row_major

import plancache
import plancache.integrations.frontend as frontend
from plancache import PlanCache, PlanCacheNotice
from plancache.key import describe, make_key
from plancache.testing import CpuTestBackend

torch = pytest.importorskip("torch")
DT = cudnn.data_type


@pytest.fixture(autouse=True)
def fe() -> Iterator[CpuFrontend]:
    with cpu_frontend() as stand_ins:
        yield stand_ins


def open_cache(make_cache: Callable[..., PlanCache], **kwargs: Any) -> PlanCache:
    cache = make_cache(backend=CpuTestBackend(), **kwargs)
    frontend.use(cache)
    return cache


def lookups(cache: PlanCache) -> int:
    return cache.counters["memory_hits"] + cache.counters["hits"] + cache.counters["misses"]


# ---------------------------------------------------------------- builders, frontend style


def conv_bias_relu(n: int = 2, c: int = 8, hw: int = 6, k: int = 4) -> tuple[Any, list[Any]]:
    with cudnn.graph(None, io_data_type=DT.FLOAT) as (g, _):
        X = g.tensor(name="X", dim=[n, c, hw, hw], stride=[c * hw * hw, 1, c * hw, c])
        W = g.tensor(name="W", dim=[k, c, 3, 3], stride=[c * 9, 1, c * 3, c])
        B = g.tensor(name="B", dim=[1, k, 1, 1], stride=[k, 1, k, k])
        conv = g.conv_fprop(X, W, padding=[1, 1], stride=[1, 1], dilation=[1, 1])
        Y = g.relu(g.bias(conv, B))
        Y.set_output(True).set_data_type(DT.FLOAT).set_dim([n, k, hw, hw]).set_stride([k * hw * hw, 1, k * hw, k])
        return g, [X, W, B, Y]


def conv_inputs(n: int = 2, c: int = 8, hw: int = 6, k: int = 4) -> tuple[list[Any], Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, hw, hw, generator=gen).to(memory_format=torch.channels_last)
    w = torch.randn(k, c, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    b = torch.randn(1, k, 1, 1, generator=gen).to(memory_format=torch.channels_last)
    y = torch.zeros(n, k, hw, hw).to(memory_format=torch.channels_last)
    expected = torch.relu(torch.nn.functional.conv2d(x, w, padding=1) + b)
    return [x, w, b, y], expected


def matmul_bias_relu(batch: int = 2, m: int = 8, k: int = 16, n: int = 4) -> tuple[Any, list[Any]]:
    with cudnn.graph(None, io_data_type=DT.FLOAT) as (g, _):
        A = g.tensor(name="A", dim=[batch, m, k], stride=row_major([batch, m, k]))
        Bm = g.tensor(name="B", dim=[batch, k, n], stride=row_major([batch, k, n]))
        bias = g.tensor(name="bias", dim=[1, 1, n], stride=[n, n, 1])
        C = g.relu(g.bias(g.matmul(A, Bm), bias))
        C.set_output(True).set_data_type(DT.FLOAT).set_dim([batch, m, n]).set_stride(row_major([batch, m, n]))
        return g, [A, Bm, bias, C]


def matmul_inputs(batch: int = 2, m: int = 8, k: int = 16, n: int = 4) -> tuple[list[Any], Any]:
    gen = torch.Generator().manual_seed(1)
    a, b, bias = (
        torch.randn(batch, m, k, generator=gen),
        torch.randn(batch, k, n, generator=gen),
        torch.randn(1, 1, n, generator=gen),
    )
    return [a, b, bias, torch.zeros(batch, m, n)], torch.relu(a @ b + bias)


def sdpa(b: int = 1, h: int = 2, s: int = 8, d: int = 16, score_mod: Any = None) -> tuple[Any, list[Any]]:
    dims = [b, h, s, d]
    with cudnn.graph(None, io_data_type=DT.HALF) as (g, _):
        q, k, v = (g.tensor(name=n, dim=dims, stride=row_major(dims)) for n in "qkv")
        extra = {"score_mod": score_mod} if score_mod is not None else {}
        o, _stats = g.sdpa(q, k, v, attn_scale=0.25, use_causal_mask=True, generate_stats=False, **extra)
        o.set_output(True).set_data_type(DT.HALF).set_dim(dims).set_stride(row_major(dims))
        return g, [q, k, v, o]


def sdpa_inputs(b: int = 1, h: int = 2, s: int = 8, d: int = 16) -> tuple[list[Any], Any]:
    gen = torch.Generator().manual_seed(2)
    q, k, v = ((torch.randn(b, h, s, d, generator=gen) * 0.5).half() for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.25)
    return [q, k, v, torch.zeros(b, h, s, d, dtype=torch.half)], expected


CASES = {
    "conv_bias_relu": (conv_bias_relu, conv_inputs, 1e-4),
    "matmul_bias_relu": (matmul_bias_relu, matmul_inputs, 1e-4),
    "sdpa": (sdpa, sdpa_inputs, 1e-2),
}


def run(graph: Any, uids: list[int], inputs: Callable[[], tuple[list[Any], Any]], tolerance: float) -> Any:
    """Execute the returned graph the frontend's way, tensors bound by the returned uids;
    check the output; return the cache's plan the graph carries."""
    tensors, expected = inputs()
    graph.execute(dict(zip(uids, tensors)), None)
    torch.testing.assert_close(tensors[-1].float(), expected, atol=tolerance, rtol=tolerance)
    plan = frontend.plan_of(graph)
    assert plan is not None
    return plan


# ---------------------------------------------------------------- jit


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_runs_correctly_and_a_second_cache_loads_it(make_cache: Callable[..., PlanCache], fe: CpuFrontend, name: str) -> None:
    builder, inputs, tolerance = CASES[name]
    decorated = plancache.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.B])(builder)

    first = open_cache(make_cache)
    g, uids = decorated()
    assert len(set(uids)) == 4
    plan = run(g, uids, inputs, tolerance)
    assert plan.source == "built" and first.counters["builds"] == 1
    assert fe.count("build_plans") == 0  # the frontend built nothing: the cache's plan runs

    second = open_cache(make_cache)  # another process's cache, same directory
    g2, uids2 = decorated()
    assert uids2 == uids and g2 is not g
    plan2 = run(g2, uids2, inputs, tolerance)
    assert plan2.source == "loaded"
    assert second.counters["builds"] == 0 and second.counters["hits"] == 1
    assert plan2.key == plan.key


def test_jit_keys_the_heuristic_modes(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    a = plancache.jit(heur_modes=cudnn.heur_mode.A)(matmul_bias_relu)
    ab = plancache.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.B])(matmul_bias_relu)
    g1, _ = a()
    g2, _ = ab()
    assert frontend.plan_of(g1).key != frontend.plan_of(g2).key
    assert cache.counters["builds"] == 2
    fresh, _ = matmul_bias_relu()
    options = dataclasses.replace(cache.options, heuristic_modes=("A",))
    assert make_key(describe(fresh, auto_uids=True), cache.environment_of(0), options).digest == frontend.plan_of(g1).key


def test_jit_returns_the_callers_graph_per_call_and_leaves_its_tensors_alone(make_cache: Callable[..., PlanCache]) -> None:
    """A hit is the caller's own graph object, one per call (never one graph shared by every
    caller), and the tensors the caller left without uids keep them unset."""
    cache = open_cache(make_cache)
    made: list[tuple[Any, list[Any]]] = []

    @plancache.jit(heur_modes=cudnn.heur_mode.A)
    def build() -> tuple[Any, list[Any]]:
        made.append(matmul_bias_relu())
        return made[-1]

    g1, uids1 = build()
    g2, uids2 = build()
    assert g1 is made[0][0] and g2 is made[1][0] and g1 is not g2
    assert g1._lowered_graph is not g2._lowered_graph
    assert cache.counters["builds"] == 1 and cache.counters["memory_hits"] == 1
    assert not any(t.uid_assigned for _, tensors in made for t in tensors)
    run(g1, uids1, matmul_inputs, 1e-4)
    run(g2, uids2, matmul_inputs, 1e-4)


def test_jit_returns_a_graph_the_caller_planned_unchanged(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    g0, tensors0 = matmul_bias_relu()
    g0._planning_done = True  # as the frontend marks a graph it planned

    @plancache.jit()
    def already_planned() -> tuple[Any, list[Any]]:
        return g0, tensors0

    g, uids = already_planned()
    assert g is g0 and uids == [t.get_uid() for t in tensors0]
    assert lookups(cache) == 0


def test_jit_default_cache_is_created_lazily(cache_dir: Any) -> None:
    frontend.use(None)
    with pytest.MonkeyPatch.context() as mp:
        made: list[PlanCache] = []

        def fake_cache() -> PlanCache:
            cache = PlanCache(backend=CpuTestBackend())
            made.append(cache)
            return cache

        mp.setattr("plancache.cache.cache.PlanCache", fake_cache)
        g, uids = plancache.jit()(matmul_bias_relu)()
        assert len(made) == 1 and frontend.current() is made[0]
        run(g, uids, matmul_inputs, 1e-4)
        made[0].close()


# ---------------------------------------------------------------- graph_cache


def test_graph_cache_shortcuts_by_the_callers_key_and_returns_what_the_function_did(
    make_cache: Callable[..., PlanCache], fe: CpuFrontend
) -> None:
    cache = open_cache(make_cache)
    calls: list[int] = []

    @plancache.graph_cache(key_fn=lambda batch: ("ignored", batch), maxsize=2)
    def build(batch: int) -> tuple[Any, list[Any]]:
        calls.append(batch)
        return matmul_bias_relu(batch=batch)

    g, _ = build(2)
    assert build(2)[0] is g and calls == [2]  # the caller's key: a shortcut only
    assert not g._planning_done and lookups(cache) == 0  # as the frontend's: nothing planned here
    build(3)
    build(4)  # evicts batch 2 from the in-process shortcut (maxsize=2)
    assert build(2)[0] is not g and calls == [2, 3, 4, 2]

    # What is dropped when, as the frontend's own decorator does it: the oldest inserted
    # first, a hit changing nothing (least recently used order ran the function less often).
    for batch in (3, 2, 5, 3, 2):
        build(batch)
    frontends: list[int] = []
    oracle = frontends_graph_cache(key_fn=lambda batch: batch, maxsize=2)(lambda batch: frontends.append(batch))
    for batch in (2, 2, 3, 4, 2, 3, 2, 5, 3, 2):
        oracle(batch)
    assert calls == frontends == [2, 3, 4, 2, 3, 5, 2]

    @plancache.graph_cache(key_fn=lambda: "other")
    def other() -> dict[str, int]:
        return {"not": 1}

    assert other() == {"not": 1}


def test_graph_cache_graphs_get_persistent_plans_when_built(make_cache: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    """The frontend's idiom: a graph_cache'd builder, then ``g.build(...)`` on what it
    returns; installed, the build is served by the cache, whatever ``key_fn`` says."""
    for attempt in range(2):
        open_cache(make_cache)
        plancache.install()

        @cudnn.graph_cache(key_fn=lambda batch: ("mine", attempt, batch))
        def build(batch: int) -> tuple[Any, list[Any]]:
            return matmul_bias_relu(batch=batch)

        g, tensors = build(2)
        g.build([cudnn.heur_mode.A])
        plan = run(g, [t.get_uid() for t in tensors], matmul_inputs, 1e-4)
        assert plan.source == ("loaded" if attempt else "built")
        plancache.uninstall()
    assert fe.count("build_plans") == 0


def test_jit_stacked_on_graph_cache_plans_once(make_cache: Callable[..., PlanCache]) -> None:
    """The frontend's samples stack the two; the graph graph_cache returns again is planned
    already, so jit returns it as it is."""
    for attempt in range(2):
        cache = open_cache(make_cache)

        @plancache.jit(heur_modes=cudnn.heur_mode.A)
        @plancache.graph_cache(key_fn=lambda batch: batch)
        def build(batch: int) -> tuple[Any, list[Any]]:
            return matmul_bias_relu(batch=batch)

        g, uids = build(2)
        assert build(2)[0] is g
        plan = run(g, uids, matmul_inputs, 1e-4)
        assert plan.source == ("loaded" if attempt else "built")
        assert lookups(cache) == 1
    assert cache.counters["builds"] == 0


# ---------------------------------------------------------------- fallback


def softcap(graph: Any, score: Any) -> Any:
    return graph.tanh(score)


def plancache_notices(caught: list[Any]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PlanCacheNotice)]


def test_an_unkeyable_graph_falls_back_with_one_notice(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    built: list[Any] = []

    @plancache.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    def with_score_mod() -> tuple[Any, list[Any]]:
        g, tensors = sdpa(score_mod=softcap)
        g.build = lambda modes: built.append(modes)  # the frontend's own build needs a GPU
        return g, tensors

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g1, uids = with_score_mod()
        g2, _ = with_score_mod()
    assert len(plancache_notices(caught)) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__  # the notice points at the caller
    assert built == [[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]] * 2  # the frontend's behaviour
    assert len(uids) == 4 and g1 is not g2
    assert lookups(cache) == 0 and frontend.plan_of(g1) is None

    frontend._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plancache.jit()(lambda: sdpa(score_mod=softcap))()
    assert len(plancache_notices(caught)) == 1 and caught[0].filename == __file__


def test_a_notice_never_becomes_an_error(make_cache: Callable[..., PlanCache], caplog: pytest.LogCaptureFixture) -> None:
    """Under ``-W error`` (or pytest's ``filterwarnings = error``, which this suite uses) the
    notice is logged instead of raised: plancache never fails a program that runs without it."""
    open_cache(make_cache)

    @plancache.jit()
    def with_score_mod() -> tuple[Any, list[Any]]:
        g, tensors = sdpa(score_mod=softcap)
        g.build = lambda modes: None
        return g, tensors

    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="plancache"):
        warnings.simplefilter("error")
        with_score_mod()
    assert any("not persisting" in r.getMessage() for r in caplog.records)


def test_notices_can_be_filtered_by_category(make_cache: Callable[..., PlanCache]) -> None:
    open_cache(make_cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=PlanCacheNotice)
        g, _ = sdpa(score_mod=softcap)
        g.build = lambda modes: None
        frontend.plan_graph(g)
    assert caught == []


# ---------------------------------------------------------------- install


def test_install_and_uninstall_swap_the_decorators_and_the_pipeline() -> None:
    graph_module = sys.modules["cudnn.graph"]
    originals = (cudnn.jit, cudnn.graph_cache, graph_module.jit, graph_module.graph_cache)
    methods = {name: cudnn.pygraph.__dict__[name] for name in ("build_plans", "build", "execute", "create_execution_plan")}
    assert not frontend.installed()
    plancache.install()
    plancache.install()  # idempotent
    assert cudnn.jit is frontend.jit and cudnn.graph_cache is frontend.graph_cache
    assert graph_module.jit is frontend.jit and graph_module.graph_cache is frontend.graph_cache
    for name, original in methods.items():
        assert cudnn.pygraph.__dict__[name].__plancache_original__ is original
    plancache.uninstall()
    plancache.uninstall()
    assert (cudnn.jit, cudnn.graph_cache, graph_module.jit, graph_module.graph_cache) == originals
    assert {name: cudnn.pygraph.__dict__[name] for name in methods} == methods
    assert not frontend.installed()


def test_installed_decorators_serve_unchanged_frontend_code(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    plancache.install()

    @cudnn.jit(heur_modes=cudnn.heur_mode.A)
    def unchanged() -> tuple[Any, list[Any]]:
        return conv_bias_relu()

    g, uids = unchanged()
    run(g, uids, conv_inputs, 1e-4)
    assert cache.counters["builds"] == 1


def test_the_frontends_own_jit_is_served_through_build(make_cache: Callable[..., PlanCache], fe: CpuFrontend) -> None:
    """A decorator taken before install (``from cudnn import jit``) is the frontend's; the
    ``g.build(heur_modes)`` it calls is plancache's once installed."""
    from cudnn.graph import jit as frontends_jit

    cache = open_cache(make_cache)
    plancache.install()
    g, uids = frontends_jit(heur_modes=[cudnn.heur_mode.A])(matmul_bias_relu)()
    run(g, uids, matmul_inputs, 1e-4)
    assert cache.counters["builds"] == 1 and fe.count("build_plans") == 0


def test_another_frontend_version_keeps_the_frontends_behaviour(make_cache: Callable[..., PlanCache], fe: CpuFrontend,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    cache = open_cache(make_cache)
    monkeypatch.setattr(cudnn, "__version__", "1.31.0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plancache.install()
        g, _ = plancache.jit(heur_modes=cudnn.heur_mode.A)(matmul_bias_relu)()
    notices = plancache_notices(caught)
    assert len(notices) == 1 and "1.31.0" in notices[0], notices
    assert not hasattr(cudnn.pygraph.__dict__["build_plans"], "__plancache_original__")  # the pipeline is not patched
    assert fe.frontend_built(g) and lookups(cache) == 0


def _run_python(code: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), **(env or {})}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_environment_variable_installs_at_import() -> None:
    code = (
        "import sys, plancache\n"
        "assert ('cudnn' in sys.modules) == (sys.argv[1] == '1')\n"
        "if sys.argv[1] == '1':\n"
        "    import cudnn, plancache.integrations.frontend as f\n"
        "    assert cudnn.jit is f.jit and sys.modules['cudnn.graph'].graph_cache is f.graph_cache\n"
        "    assert cudnn.pygraph.build_plans.__plancache_original__ is not None\n"
    )
    for value in ("1", "0"):
        result = _run_python(code, value, env={"PLANCACHE_PATCH_CUDNN": value})
        assert result.returncode == 0, result.stderr


def test_the_start_up_hooks_import_leaves_the_store_and_its_dependencies_unimported() -> None:
    # The hook imports the integration in every Python process that sets the variable,
    # cuDNN or not: what it imports is paid by each of them. Its lock's per-process holder
    # comes with it, and of the store's folder nothing else (the folder loads its names lazily).
    code = (
        "import sys; sys.modules['cudnn'] = None\n"
        "import plancache.integrations.frontend\n"
        "print(sorted(m for m in sys.modules if m.startswith(('plancache.store', 'plancache.cache', 'orjson', 'sqlite3'))))\n"
    )
    result = _run_python(code, env={"PLANCACHE_PATCH_CUDNN": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['plancache.store', 'plancache.store.per_process']", result.stdout


def test_the_environment_variable_without_cudnn_warns_instead_of_failing() -> None:
    code = (
        "import sys, warnings\n"
        "sys.modules['cudnn'] = None  # cuDNN Frontend cannot be imported here\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import plancache\n"
        "assert not plancache.integrations.frontend.installed()\n"
        "print([str(w.message) for w in caught if w.category is plancache.PlanCacheNotice])\n"
    )
    result = _run_python(code, env={"PLANCACHE_PATCH_CUDNN": "1"})
    assert result.returncode == 0, result.stderr
    assert "cannot be imported" in result.stdout, result.stdout
    strict = _run_python("import sys; sys.modules['cudnn'] = None; import plancache", env={"PLANCACHE_PATCH_CUDNN": "1",
                                                                                         "PYTHONWARNINGS": "error"})  # fmt: skip
    assert strict.returncode == 0, strict.stderr
