"""plancache.frontend on the CPU test backend: builders written the cuDNN Frontend way
(``with cudnn.graph(handle) as (g, _): ... return g, [X, W, Y]``, no uids set) decorated
with ``plancache.jit`` and ``plancache.graph_cache``.

On the CPU backend ``plan.native`` is the test backend's plan object, not a pygraph, so
the graph the decorators return cannot be run with ``g.execute``; the tests run it as the
cache does, through the ``Plan`` that holds it (its tensor checks, then the backend's
launch). tests/test_gpu_frontend.py runs the returned graphs with ``g.execute`` on a GPU.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import cudnn
import pytest
from graphs import row_major

import plancache
import plancache.frontend as frontend
from plancache import PlanCache
from plancache.testing import CpuTestBackend

torch = pytest.importorskip("torch")
DT = cudnn.data_type


@pytest.fixture(autouse=True)
def fresh_frontend() -> Iterator[None]:
    """No default cache, no warnings remembered and the frontend unpatched, before and after."""
    frontend.uninstall()
    previous = frontend.use(None)
    frontend._warned.clear()
    yield
    frontend.uninstall()
    frontend.use(previous)
    frontend._warned.clear()


def open_cache(make_cache: Callable[..., PlanCache]) -> PlanCache:
    cache = make_cache(backend=CpuTestBackend())
    frontend.use(cache)
    return cache


def plan_of(cache: PlanCache, native: Any) -> Any:
    """The Plan of ``cache`` whose executable object is ``native``."""
    held = cache.memory.keys()
    for key in held:
        plan = cache.memory.get(key)
        if plan is not None and plan.native is native:
            return plan
    raise AssertionError("the returned graph is no plan of the cache")


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


def run(cache: PlanCache, graph: Any, uids: list[int], inputs: Callable[[], tuple[list[Any], Any]], tolerance: float) -> Any:
    """Execute the returned graph with tensors bound by the returned uids; check the output."""
    tensors, expected = inputs()
    plan = plan_of(cache, graph)
    plan.execute(dict(zip(uids, tensors)))
    torch.testing.assert_close(tensors[-1].float(), expected, atol=tolerance, rtol=tolerance)
    return plan


# ---------------------------------------------------------------- jit


@pytest.mark.parametrize("name", sorted(CASES))
def test_jit_runs_correctly_and_a_second_cache_loads_it(make_cache: Callable[..., PlanCache], name: str) -> None:
    builder, inputs, tolerance = CASES[name]
    decorated = plancache.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.B])(builder)

    first = open_cache(make_cache)
    g, uids = decorated()
    assert len(set(uids)) == 4
    plan = run(first, g, uids, inputs, tolerance)
    assert plan.source == "built" and first.counters["builds"] == 1

    second = open_cache(make_cache)  # another process's cache, same directory
    g2, uids2 = decorated()
    assert uids2 == uids
    plan2 = run(second, g2, uids2, inputs, tolerance)
    assert plan2.source == "loaded"
    assert second.counters["builds"] == 0 and second.counters["hits"] == 1
    assert plan2.key == plan.key


def test_jit_keys_the_heuristic_modes(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    a = plancache.jit(heur_modes=cudnn.heur_mode.A)(matmul_bias_relu)
    ab = plancache.jit(heur_modes=[cudnn.heur_mode.A, cudnn.heur_mode.B])(matmul_bias_relu)
    g1, _ = a()
    g2, _ = ab()
    assert plan_of(cache, g1).key != plan_of(cache, g2).key
    assert cache.counters["builds"] == 2
    fresh, _ = matmul_bias_relu()
    frontend._adopt_uids(fresh)
    assert cache.key(fresh, dataclasses.replace(cache.options, heuristic_modes=("A",))).digest == plan_of(cache, g1).key


def test_jit_returns_a_graph_the_caller_planned_unchanged(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    g0, tensors0 = matmul_bias_relu()
    g0._planning_done = True  # as the frontend marks a graph it planned

    @plancache.jit()
    def already_planned() -> tuple[Any, list[Any]]:
        return g0, tensors0

    g, uids = already_planned()
    assert g is g0 and uids == [t.get_uid() for t in tensors0]
    assert cache.counters["builds"] == 0 and cache.counters["misses"] == 0


def test_jit_default_cache_is_created_lazily(cache_dir: Any) -> None:
    frontend.use(None)
    with pytest.MonkeyPatch.context() as mp:
        made: list[PlanCache] = []

        def fake_cache() -> PlanCache:
            cache = PlanCache(backend=CpuTestBackend())
            made.append(cache)
            return cache

        mp.setattr("plancache.cache.PlanCache", fake_cache)
        g, uids = plancache.jit()(matmul_bias_relu)()
        assert len(made) == 1 and frontend.current() is made[0]
        run(made[0], g, uids, matmul_inputs, 1e-4)
        made[0].close()


# ---------------------------------------------------------------- graph_cache


def test_graph_cache_shortcuts_by_the_callers_key_and_stores_by_plancache_key(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    calls: list[int] = []

    @plancache.graph_cache(key_fn=lambda batch: ("ignored", batch), maxsize=2)
    def build(batch: int) -> tuple[Any, list[Any]]:
        calls.append(batch)
        return matmul_bias_relu(batch=batch)

    g, tensors = build(2)
    assert build(2)[0] is g and calls == [2]  # the caller's key: a shortcut only
    plan = plan_of(cache, g)
    run(cache, g, [t.get_uid() for t in tensors], matmul_inputs, 1e-4)
    assert plan.source == "built"
    build(3)
    build(4)  # evicts batch 2 from the in-process shortcut (maxsize=2)
    g_again, _ = build(2)
    assert calls == [2, 3, 4, 2]
    assert plan_of(cache, g_again).key == plan.key  # plancache's key found the stored plan
    assert cache.counters["builds"] == 3

    second = open_cache(make_cache)

    @plancache.graph_cache(key_fn=lambda batch: batch)
    def build_elsewhere(batch: int) -> tuple[Any, list[Any]]:
        return matmul_bias_relu(batch=batch)

    g2, tensors2 = build_elsewhere(2)
    plan2 = run(second, g2, [t.get_uid() for t in tensors2], matmul_inputs, 1e-4)
    assert plan2.source == "loaded" and second.counters["builds"] == 0


def test_graph_cache_replaces_a_bare_graph_and_leaves_other_results(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)

    @plancache.graph_cache(key_fn=lambda: "bare")
    def bare() -> Any:
        g, tensors = conv_bias_relu()
        for t in tensors:
            t.set_uid(t.get_uid())
        return g

    g = bare()
    assert plan_of(cache, g).source == "built"

    @plancache.graph_cache(key_fn=lambda: "other")
    def other() -> dict[str, int]:
        return {"not": 1}

    assert other() == {"not": 1}
    assert cache.counters["builds"] == 1


def test_jit_stacked_on_graph_cache_plans_once(make_cache: Callable[..., PlanCache]) -> None:
    """The frontend's samples stack the two; a graph plancache handed out (planned, or
    deserialized) is never planned again by the decorator above."""
    open_cache(make_cache)
    second_dir_cache = None
    for attempt in range(2):
        cache = open_cache(make_cache) if attempt else frontend.current()

        @plancache.jit(heur_modes=cudnn.heur_mode.A)
        @plancache.graph_cache(key_fn=lambda batch: batch)
        def build(batch: int) -> tuple[Any, list[Any]]:
            return matmul_bias_relu(batch=batch)

        g, uids = build(2)
        assert build(2)[0] is g
        plan = run(cache, g, uids, matmul_inputs, 1e-4)
        assert plan.source == ("loaded" if attempt else "built")
        assert cache.counters["misses"] + cache.counters["hits"] == 1
        second_dir_cache = cache
    assert second_dir_cache is not None and second_dir_cache.counters["builds"] == 0


# ---------------------------------------------------------------- fallback


def softcap(graph: Any, score: Any) -> Any:
    return graph.tanh(score)


def test_an_unkeyable_graph_falls_back_with_one_warning(make_cache: Callable[..., PlanCache]) -> None:
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
    assert len([w for w in caught if "plancache" in str(w.message)]) == 1, [str(w.message) for w in caught]
    assert caught[0].filename == __file__  # the warning points at the caller
    assert built == [[cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]] * 2  # the frontend's behaviour
    assert len(uids) == 4 and g1 is not g2
    assert cache.counters["builds"] == 0 and cache.counters["misses"] == 0

    @plancache.graph_cache(key_fn=lambda: 1)
    def cached() -> tuple[Any, list[Any]]:
        return sdpa(score_mod=softcap)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g3, _ = cached()
    assert not caught  # the same reason warns once per process
    frontend._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = plancache.graph_cache(key_fn=lambda: 2)(lambda: sdpa(score_mod=softcap))
        fresh()
    assert len(caught) == 1 and caught[0].filename == __file__
    assert isinstance(g3, cudnn.pygraph) and not getattr(g3, "_planning_done", False)


# ---------------------------------------------------------------- install


def test_install_and_uninstall_swap_the_frontend_decorators() -> None:
    graph_module = sys.modules["cudnn.graph"]
    originals = (cudnn.jit, cudnn.graph_cache, graph_module.jit, graph_module.graph_cache)
    assert not frontend.installed()
    plancache.install()
    plancache.install()  # idempotent
    assert cudnn.jit is frontend.jit and cudnn.graph_cache is frontend.graph_cache
    assert graph_module.jit is frontend.jit and graph_module.graph_cache is frontend.graph_cache
    plancache.uninstall()
    plancache.uninstall()
    assert (cudnn.jit, cudnn.graph_cache, graph_module.jit, graph_module.graph_cache) == originals
    assert not frontend.installed()


def test_installed_decorators_serve_unchanged_frontend_code(make_cache: Callable[..., PlanCache]) -> None:
    cache = open_cache(make_cache)
    plancache.install()

    @cudnn.jit(heur_modes=cudnn.heur_mode.A)
    def unchanged() -> tuple[Any, list[Any]]:
        return conv_bias_relu()

    g, uids = unchanged()
    run(cache, g, uids, conv_inputs, 1e-4)
    assert cache.counters["builds"] == 1


def test_the_environment_variable_installs_at_import(tmp_path: Any) -> None:
    import os
    import subprocess

    code = (
        "import sys, plancache\n"
        "assert ('cudnn' in sys.modules) == (sys.argv[1] == '1')\n"
        "if sys.argv[1] == '1':\n"
        "    import cudnn, plancache.frontend as f\n"
        "    assert cudnn.jit is f.jit and sys.modules['cudnn.graph'].graph_cache is f.graph_cache\n"
    )
    for value in ("1", "0"):
        env = {**os.environ, "PLANCACHE_PATCH_CUDNN": value, "PYTHONPATH": os.getcwd()}
        result = subprocess.run([sys.executable, "-c", code, value], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
