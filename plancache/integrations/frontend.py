"""cuDNN Frontend code, unchanged, with persistent plans: ``install`` and the decorators.

Frontend code plans a graph in one of a few ways, and ``install()`` (or
``PLANCACHE_PATCH_CUDNN=1``, with no ``import plancache`` needed: see ``_plancache_startup``)
serves each from a ``PlanCache``:

    g.validate(); g.build_operation_graph()          # the five steps, unchanged
    g.create_execution_plans([cudnn.heur_mode.A]); g.check_support()
    g.build_plans()                                   # <- a stored plan, or autotuned and stored
    g.build([cudnn.heur_mode.A])                      # <- the same in one call
    g.execute(pack, workspace, handle=handle)         # <- an unbuilt graph builds here, the same way
    @cudnn.jit(heur_modes=...) / @cudnn.graph_cache(key_fn)   # the decorators

On a hit the caller's own graph object carries the deserialized plan and runs on its own
handle; on a miss plancache autotunes on a graph of its own, stores the winner and loads it
the same way (``frontend_pipeline``, ``frontend_adopt``). Code that chooses plans itself
and graphs already built are left to the frontend (``frontend_pipeline`` lists them), and
so is whatever plancache cannot serve (a graph it cannot key or rebuild, a Python-engine
plan, a planning during a CUDA-graph capture, a frontend version it was not made for),
with one ``PlanCacheNotice`` per reason and process that never turns into an exception,
even under ``-W error``.

The decorators use one process-wide ``PlanCache`` (``PlanCache()`` at first use, or the one
given to ``use(cache)``), its options with the caller's heuristic modes and workspace limit.
Importing this module does not import cuDNN; ``install`` and the decorators do.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from types import FrameType
from typing import Any

from ..errors import PlanCacheNotice
from ..store.per_process import PerProcess

__all__ = ["current", "graph_cache", "install", "install_from_environment", "installed", "jit", "plan_graph", "plan_of",
           "uninstall", "use"]  # fmt: skip

log = logging.getLogger("plancache.frontend")

# Per process: a thread of the parent may have been inside it at a fork (making the cache,
# which opens its store; patching the frontend). What it guards is kept in a forked child.
_lock = PerProcess(threading.Lock)
_cache: Any = None
_warned: set[str] = set()
#: While installed: (cudnn module, cudnn.graph module or None, {attribute: original},
#: the pipeline's interceptor or None); None when not installed.
_originals: tuple[Any, Any, dict[str, Any], Any] | None = None
_planner: Any = None

# Frames of these packages are skipped when a notice names the caller's line.
_INTERNAL = ("plancache", "cudnn", "_plancache_startup")


def use(cache: Any) -> Any:
    """Make ``cache`` the ``PlanCache`` the decorators use (None: a ``PlanCache()`` at
    next use). Returns the cache used before."""
    global _cache
    with _lock.get():
        previous, _cache = _cache, cache
    return previous


def current() -> Any:
    """The ``PlanCache`` the decorators use, created (``PlanCache()``) on first call."""
    global _cache
    with _lock.get():
        if _cache is None:
            from ..cache.cache import PlanCache

            _cache = PlanCache()
        return _cache


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by ``_warn_once`` name the first frame
    outside plancache and cuDNN Frontend: the caller's own line."""
    level = 2
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and str(frame.f_globals.get("__name__", "")).split(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    return level


def _warn_once(topic: str, message: str) -> None:
    """Say once per process and topic, as a ``PlanCacheNotice`` pointing at the caller's
    line, why a graph keeps the frontend's behaviour. Under a filter that turns warnings
    into errors (``-W error``, pytest's ``filterwarnings = error``) the notice is logged
    instead: it never makes a program fail that would run without plancache."""
    with _lock.get():
        if topic in _warned:
            return
        _warned.add(topic)
    log.info("%s", message)
    try:
        warnings.warn(PlanCacheNotice(message), stacklevel=_caller_stacklevel())
    except PlanCacheNotice:  # an "error" filter: this call's own notice, raised by warn()
        log.warning("%s", message)


def _pipeline() -> Any:
    """The module serving the pipeline (imported on first use: it is only needed then)."""
    from . import frontend_pipeline

    return frontend_pipeline


def _planner_of() -> Any:
    global _planner
    if _planner is None:
        _planner = _pipeline().Planner(current, _warn_once)
    return _planner


def plan_of(graph: Any) -> Any:
    """The ``Plan`` of the cache that ``graph`` carries, or None when the frontend planned
    it (for inspection: ``plan_of(g).key``, ``.source``)."""
    return _pipeline().plan_of(graph)


def _is_planned(graph: Any) -> bool:
    """Whether the caller (or anyone) already planned ``graph`` (what ``cudnn.jit`` asks:
    a graph with plans is returned as it is)."""
    if getattr(graph, "_planning_done", False):
        return True
    try:
        return int(graph.get_execution_plan_count()) > 0
    except Exception:  # an unplanned graph may refuse the question
        return False


def plan_graph(graph: Any, heur_modes: Any = None, *, fallback_build: bool = True, tensors: Any = (), stacklevel: int = 2) -> Any:
    """Plan ``graph`` (unplanned) as ``g.build(heur_modes)`` would, through the process-wide
    cache, and return it: the same object, carrying the stored plan (autotuned and stored on
    a miss). What plancache cannot serve is built the frontend's way (``fallback_build``) or
    returned as it is, with one notice per reason. ``heur_modes``: the frontend's modes or
    their names (default: A). ``tensors`` and ``stacklevel`` are accepted for compatibility:
    nothing of the caller's tensors is changed, and notices name the caller's line."""
    modes = heur_modes if heur_modes is not None else "A"
    pipeline = _pipeline()
    with pipeline.inside():  # the frontend calls made below run as the frontend's own
        if _planner_of().persist(graph, modes):
            return graph
        if fallback_build:
            import cudnn

            graph.build([getattr(cudnn.heur_mode, name) for name in pipeline._mode_names(modes)])
    return graph


def jit(heur_modes: Any = None, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``cudnn.jit``, persisted: decorate a function returning ``(graph, tensors)``; the
    decorated function returns ``(graph, [uid, ...])``, the graph planned from the cache.
    ``heur_modes``: a ``cudnn.heur_mode``, a list of them, or their names (default: A).
    Other keyword arguments are accepted and ignored, as the frontend does."""
    modes = heur_modes if heur_modes is not None else "A"

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kw: Any) -> tuple[Any, list[int]]:
            graph, tensors = func(*args, **kw)
            if not _is_planned(graph):
                plan_graph(graph, modes)
            return graph, [t.get_uid() for t in tensors]

        return wrapper

    return decorator


def graph_cache(key_fn: Callable[..., Hashable], maxsize: int = 256) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``cudnn.graph_cache``: an in-process cache keyed by ``key_fn(*args, **kwargs)``
    (``maxsize`` entries, the oldest inserted dropped first) in front of the function, returning
    what the function returned, as the frontend's does. The graphs in it get persistent
    plans when they are planned (by ``jit`` above it, or by ``build``, ``build_plans`` or
    ``execute`` once ``install()`` is in force); what is stored is decided by plancache's
    own key, never by ``key_fn``."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        entries: OrderedDict[Any, Any] = OrderedDict()
        guard = PerProcess(threading.Lock)  # a child forked while a thread held it would wait forever

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_fn(*args, **kwargs)
            with guard.get():
                if key in entries:  # a hit does not make an entry younger: the frontend's order
                    return entries[key]
            result = func(*args, **kwargs)
            with guard.get():
                entries[key] = result
                while len(entries) > max(int(maxsize), 0):
                    entries.popitem(last=False)
            return result

        wrapper.cache = entries  # type: ignore[attr-defined]
        return wrapper

    return decorator


_PATCHED = {"jit": jit, "graph_cache": graph_cache}


def install() -> None:
    """Serve cuDNN Frontend's planning from the cache: replace ``cudnn.jit`` and
    ``cudnn.graph_cache`` (and those of the ``cudnn.graph`` module) with plancache's, and,
    on a frontend version plancache was made for, wrap ``build_plans``, ``build`` and
    ``execute`` of ``cudnn.pygraph``. Idempotent; ``uninstall()`` restores the originals.
    A decorator imported by name earlier (``from cudnn import jit``) keeps the frontend's,
    but the graphs it builds are still served through ``build``."""
    global _originals
    import cudnn  # outside the lock: importing cudnn may run the start-up hook's install

    from .frontend_adopt import FRONTEND_VERSIONS

    version = str(getattr(cudnn, "__version__", "unknown"))
    with _lock.get():
        if _originals is not None:
            return
        module = sys.modules.get("cudnn.graph")
        saved: dict[str, Any] = {}
        for name, replacement in _PATCHED.items():
            saved[f"cudnn.{name}"] = getattr(cudnn, name, None)
            setattr(cudnn, name, replacement)
            if module is not None and hasattr(module, name):
                saved[f"cudnn.graph.{name}"] = getattr(module, name)
                setattr(module, name, replacement)
        interceptor = None
        if version in FRONTEND_VERSIONS:
            interceptor = _pipeline().Interceptor(_planner_of())
            try:
                interceptor.install(cudnn.pygraph)
            except AttributeError:  # a pygraph laid out otherwise: the decorators only
                interceptor = None
        _originals = (cudnn, module, saved, interceptor)
    if interceptor is None:
        _warn_once("frontend version", f"plancache: cuDNN Frontend {version} is not a version plancache was made for "
                   f"({', '.join(FRONTEND_VERSIONS)}); its graphs are planned the frontend's way")  # fmt: skip


def install_from_environment() -> bool:
    """``install()`` for ``PLANCACHE_PATCH_CUDNN=1``: where cuDNN Frontend cannot be
    imported, a notice instead of an error (the program may not use it). Returns whether
    the patch is in force."""
    try:
        install()
    except Exception as exc:
        _warn_once("no cudnn", f"plancache: PLANCACHE_PATCH_CUDNN is on, but cuDNN Frontend cannot be imported "
                   f"({type(exc).__name__}: {exc}); nothing is patched")  # fmt: skip
        return False
    return True


def uninstall() -> None:
    """Restore the frontend's ``cudnn.jit``, ``cudnn.graph_cache`` and pygraph methods.
    Idempotent."""
    global _originals
    with _lock.get():
        if _originals is None:
            return
        cudnn, module, saved, interceptor = _originals
        for name in _PATCHED:
            original = saved.get(f"cudnn.{name}")
            if original is None:
                delattr(cudnn, name)
            else:
                setattr(cudnn, name, original)
            if module is not None and f"cudnn.graph.{name}" in saved:
                setattr(module, name, saved[f"cudnn.graph.{name}"])
        if interceptor is not None:
            interceptor.uninstall()
        _originals = None


def installed() -> bool:
    """Whether ``install()`` is in force."""
    return _originals is not None
