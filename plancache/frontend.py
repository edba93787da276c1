"""cuDNN Frontend's own idioms, persisted: ``jit``, ``graph_cache``, ``install``.

Code written for the frontend builds a graph inside a function decorated with
``@cudnn.jit(heur_modes=...)`` or ``@cudnn.graph_cache(key_fn)``. The decorators here take
the same arguments and return the same things, but the plan comes from a ``PlanCache``:
the first process autotunes and stores it, later processes deserialize it.

    import plancache
    plancache.install()            # or PLANCACHE_PATCH_CUDNN=1 in the environment

    @cudnn.jit(heur_modes=[cudnn.heur_mode.A])      # unchanged frontend code
    def conv(x, w):
        with cudnn.graph(handle) as (g, _):
            ...
            return g, [X, W, Y]

    g, uids = conv(x, w)           # a ready graph: g.execute({uid: tensor}, workspace, handle=h)

The graph returned is the plan's own executable graph: the caller's graph, planned, on a
miss; a freshly deserialized one on a hit. Graphs plancache cannot key exactly (a
``score_mod`` callable, say) keep the frontend's behaviour, with one warning per reason.
Graphs the caller already planned are returned unchanged, as the frontend does.

The decorators use one process-wide ``PlanCache``: ``PlanCache()`` created at first use,
or the one given to ``use(cache)``. The cache's default options apply, except the
heuristic modes, which come from ``heur_modes``.

Importing this module does not import cuDNN; the decorators import it when first called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from .errors import InvalidGraphError

__all__ = ["current", "graph_cache", "install", "installed", "jit", "plan_graph", "uninstall", "use"]

log = logging.getLogger("plancache")

_lock = threading.Lock()
_cache: Any = None
_warned: set[str] = set()
#: Graphs plancache handed out: planned, or deserialized (which the frontend may report as
#: having no plans), and never to be planned again by a decorator stacked above.
_handed_out: weakref.WeakSet[Any] = weakref.WeakSet()
#: The frontend's originals while installed: (cudnn module, cudnn.graph module or None,
#: {attribute: original}) - None when not installed.
_originals: tuple[Any, Any, dict[str, Any]] | None = None


def use(cache: Any) -> Any:
    """Make ``cache`` the ``PlanCache`` the decorators use (None: a ``PlanCache()`` at
    next use). Returns the cache used before."""
    global _cache
    with _lock:
        previous, _cache = _cache, cache
    return previous


def current() -> Any:
    """The ``PlanCache`` the decorators use, created (``PlanCache()``) on first call."""
    global _cache
    with _lock:
        if _cache is None:
            from .cache import PlanCache

            _cache = PlanCache()
        return _cache


def _mode_names(heur_modes: Any) -> tuple[str, ...]:
    """``("A", "B")`` from a heuristic mode, a list of them, or their names."""
    modes = heur_modes if isinstance(heur_modes, (list, tuple)) else [heur_modes]
    names = []
    for mode in modes:
        name = mode if isinstance(mode, str) else getattr(mode, "name", str(mode))
        name = name.rsplit(".", 1)[-1]
        if name not in names:
            names.append(name)
    return tuple(names)


def _native_modes(heur_modes: Any) -> list[Any]:
    """The frontend's ``heur_mode`` values for ``g.build``."""
    import cudnn

    return [getattr(cudnn.heur_mode, name) for name in _mode_names(heur_modes)]


def _is_pygraph(obj: Any) -> bool:
    cudnn = sys.modules.get("cudnn")
    cls = getattr(cudnn, "pygraph", None) if cudnn is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _is_planned(graph: Any) -> bool:
    """Whether the caller (or anyone) already planned ``graph``."""
    if getattr(graph, "_planning_done", False):
        return True
    try:
        if graph in _handed_out:
            return True
    except TypeError:
        pass
    try:
        return int(graph.get_execution_plan_count()) > 0
    except Exception:  # an unplanned graph may refuse the question
        return False


def _adopt_uids(graph: Any, tensors: Any = ()) -> None:
    """Make the uids the frontend gave ``graph``'s tensors the caller's own.

    The frontend numbers every tensor as it is created, and code written for it binds
    tensors by ``t.get_uid()``. Those uids are part of plancache's key (a plan is stored
    under the very uids it executes with), so a graph built in another order keys
    differently and a hit always binds the caller's uids. ``set_uid`` with the same value
    changes no number; it only records the uid as chosen."""
    candidates = list(getattr(graph, "tensors", {}).values()) if isinstance(getattr(graph, "tensors", None), dict) else []
    candidates.extend(t for t in tensors if t is not None)
    for t in candidates:
        if getattr(t, "uid_assigned", True) or getattr(t, "is_virtual", False):
            continue
        if getattr(t, "pass_by_value", None) is not None and getattr(t, "scalar_type", None) is not None:
            continue  # a scalar the graph holds itself: lowered by value, its uid binds nothing
        try:
            t.set_uid(t.get_uid())
        except Exception:  # describing the graph reports what is still missing
            continue


def _warn_once(reason: str, message: str, stacklevel: int) -> None:
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    log.warning("%s", message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)


def plan_graph(graph: Any, heur_modes: Any = None, *, fallback_build: bool = True, tensors: Any = (), stacklevel: int = 2) -> Any:
    """The persistent plan's executable graph for ``graph`` (unplanned): from the
    process-wide cache, autotuned and stored on a miss. A graph plancache cannot key is
    built the frontend's way (``fallback_build``) or returned as it is, with one warning
    per reason. ``heur_modes``: the frontend's modes (default: A). ``tensors``: those the
    caller binds by ``get_uid()`` (their frontend-assigned uids are adopted)."""
    from .key import describe

    modes = _mode_names(heur_modes if heur_modes is not None else "A")
    _adopt_uids(graph, tensors)
    try:
        describe(graph)
    except InvalidGraphError as exc:
        reason = str(getattr(exc, "reason", None) or exc)
        _warn_once(reason, f"plancache: not persisting this graph ({exc}); the frontend plans it as before", stacklevel + 1)
        if fallback_build:
            graph.build(_native_modes(modes))
        return graph
    cache = current()
    options = dataclasses.replace(cache.options, heuristic_modes=modes)
    native = cache.get(graph, options=options).native
    with contextlib.suppress(TypeError):  # not weakly referenceable: the frontend's own checks apply
        _handed_out.add(native)
    return native


def jit(heur_modes: Any = None, **kwargs: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``cudnn.jit``, persisted: decorate a function returning ``(graph, tensors)``; the
    decorated function returns ``(ready_graph, [uid, ...])``. ``heur_modes``: a
    ``cudnn.heur_mode``, a list of them, or their names (default: A). Other keyword
    arguments are accepted and ignored, as the frontend does."""
    modes = heur_modes if heur_modes is not None else "A"

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kw: Any) -> tuple[Any, list[int]]:
            graph, tensors = func(*args, **kw)
            if not _is_planned(graph):
                graph = plan_graph(graph, modes, tensors=tensors, stacklevel=3)
            return graph, [t.get_uid() for t in tensors]

        wrapper.__wrapped_by_plancache__ = True  # type: ignore[attr-defined]
        return wrapper

    return decorator


def _replace_graph(result: Any) -> Any:
    """``result`` with an unplanned pygraph in it (itself, or the first element of a
    tuple or list) replaced by the persistent plan's graph."""
    if _is_pygraph(result):
        return result if _is_planned(result) else plan_graph(result, fallback_build=False, stacklevel=4)
    if isinstance(result, (tuple, list)) and result and _is_pygraph(result[0]) and not _is_planned(result[0]):
        graph = plan_graph(result[0], fallback_build=False, stacklevel=4)
        rest = list(result[1:])
        if isinstance(result, list):
            return [graph, *rest]
        if hasattr(result, "_fields"):  # a namedtuple
            return type(result)(graph, *rest)
        return (graph, *rest)
    return result


def graph_cache(key_fn: Callable[..., Hashable], maxsize: int = 256) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``cudnn.graph_cache``, persisted: an in-process cache keyed by ``key_fn(*args,
    **kwargs)`` (``maxsize`` entries, least recently used dropped) in front of the
    function. On a miss the function runs; an unplanned pygraph in its result (the result
    itself, or its first element) is replaced by the persistent plan's graph. What is
    stored on disk is decided by plancache's own key, never by ``key_fn``."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        entries: OrderedDict[Any, Any] = OrderedDict()
        guard = threading.Lock()

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_fn(*args, **kwargs)
            with guard:
                if key in entries:
                    entries.move_to_end(key)
                    return entries[key]
            result = _replace_graph(func(*args, **kwargs))
            with guard:
                entries[key] = result
                entries.move_to_end(key)
                while len(entries) > max(int(maxsize), 0):
                    entries.popitem(last=False)
            return result

        wrapper.cache = entries  # type: ignore[attr-defined]
        wrapper.__wrapped_by_plancache__ = True  # type: ignore[attr-defined]
        return wrapper

    return decorator


_PATCHED = {"jit": jit, "graph_cache": graph_cache}


def install() -> None:
    """Replace ``cudnn.jit`` and ``cudnn.graph_cache`` (and those of the ``cudnn.graph``
    module) with plancache's. Idempotent; ``uninstall()`` restores the originals. Code
    must look the decorators up after this (``cudnn.jit``); a name imported earlier
    (``from cudnn import jit``) keeps the frontend's."""
    global _originals
    import cudnn

    with _lock:
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
        _originals = (cudnn, module, saved)


def uninstall() -> None:
    """Restore the frontend's ``cudnn.jit`` and ``cudnn.graph_cache``. Idempotent."""
    global _originals
    with _lock:
        if _originals is None:
            return
        cudnn, module, saved = _originals
        for name in _PATCHED:
            original = saved.get(f"cudnn.{name}")
            if original is None:
                delattr(cudnn, name)
            else:
                setattr(cudnn, name, original)
            if module is not None and f"cudnn.graph.{name}" in saved:
                setattr(module, name, saved[f"cudnn.graph.{name}"])
        _originals = None


def installed() -> bool:
    """Whether ``install()`` is in force."""
    return _originals is not None
