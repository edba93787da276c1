"""The frontend's own planning calls, served from the cache: ``build_plans()``, ``build()``
and the build inside ``execute()``.

``Planner.persist(graph, modes)`` plans one caller graph through a ``PlanCache``: the graph
is validated by the frontend as before, keyed (tensors without uids by the uids the
frontend numbered them with; nothing of the graph is changed), rebuilt into a graph
plancache owns (with the caller's engine and note filters and kernel cache: a dynamic-shape
graph's autotuning compiles into the cache the program shares across its builds), and
looked up with the caller's graph's own load (``frontend_adopt.GraphLoad``): a hit
deserializes the checked entry once, straight for the caller's graph; a miss autotunes
among the candidates of the caller's modes, workspace limit and filters
(``autotuning.filters``), and stores the winner only once it was loaded back that way. The
caller's object runs on its own handle and never holds a losing candidate's plan.

Whatever plancache cannot do keeps the frontend's behaviour, with one notice per reason and
process: ``persist`` returns False and the caller runs the frontend's call.

``Interceptor`` wraps those calls on ``cudnn.pygraph``, serving only a thread's outermost
call: the frontend calls its own pipeline (``build`` calls ``build_plans``, ``execute``
calls ``build``), and plancache's miss path drives the same methods on the graph it
autotunes. Code that chooses plans itself is left to the frontend: ``build_plans(ALL)``,
``build_plan_at_index``, ``execute_plan_at_index``, ``create_execution_plan``,
``select_plan``, graphs whose plan list the program read before building (a served graph's
list has one plan, so the indices read would not hold) and graphs already built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..cache.unstored import Why
from ..errors import InvalidGraphError, TransientLoadError
from ..formats.plan_blob import PlanBlob
from ..runtime.plan import PlanSource
from .frontend_adopt import FRONTEND_VERSIONS, AdoptionError, GraphLoad, adopt, missing_state

if TYPE_CHECKING:
    from ..cache.cache import PlanCache
    from ..key import BuildOptions
    from ..runtime.plan import Plan

__all__ = ["Interceptor", "Planner", "Refusal", "inside", "plan_of"]

log = logging.getLogger("plancache.frontend")

_local = threading.local()
#: Caller graphs that carry a plan of the cache, and that plan.
_adopted: weakref.WeakKeyDictionary[Any, Plan] = weakref.WeakKeyDictionary()
#: Graphs whose plans the caller chose itself (``create_execution_plan``).
_self_chosen: weakref.WeakSet[Any] = weakref.WeakSet()


@contextlib.contextmanager
def inside() -> Iterator[None]:
    """While plancache serves a call: the frontend calls made meanwhile on this thread run
    as the frontend's own."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def outermost() -> bool:
    return not getattr(_local, "depth", 0)


def plan_of(graph: Any) -> Plan | None:
    """The cache's plan ``graph`` carries (None when the frontend planned it)."""
    try:
        return _adopted.get(graph)
    except TypeError:  # not weakly referenceable: never adopted
        return None


class Refusal(Exception):
    """Why plancache leaves a graph to the frontend: ``topic`` (one notice per topic and
    process) and the notice's text."""

    def __init__(self, topic: str, message: str) -> None:
        super().__init__(message)
        self.topic = topic


def _mode_names(heur_modes: Any) -> tuple[str, ...]:
    """``("A", "B")`` from a heuristic mode, a list of them, or their names."""
    modes = heur_modes if isinstance(heur_modes, (list, tuple)) else [heur_modes]
    names = (mode if isinstance(mode, str) else getattr(mode, "name", str(mode)) for mode in modes)
    return tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))


def _default_modes() -> list[Any]:
    """The modes the frontend plans with when the caller names none."""
    try:
        from cudnn.engines.heuristics import default_modes

        return list(default_modes())
    except ImportError:
        cudnn = sys.modules["cudnn"]
        return [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]


class Planner:
    """Plans caller graphs through the cache ``cache_of()`` returns; ``notice(topic,
    message)`` tells the caller once per topic why a graph keeps the frontend's planning."""

    def __init__(self, cache_of: Callable[[], PlanCache], notice: Callable[[str, str], None]) -> None:
        self.cache_of = cache_of
        self.notice = notice

    def persist(self, graph: Any, heuristics: Any) -> bool:
        """Give ``graph`` (not built, not pinned) its plan from the cache; ``heuristics``:
        the caller's modes (None: the frontend's default). True: ``graph`` carries the plan;
        False: nothing changed but, possibly, validation, whose errors propagate as they would."""
        try:
            self._persist(graph, heuristics)
        except Refusal as refusal:
            self.notice(refusal.topic, str(refusal))
            return False
        return True

    def _persist(self, graph: Any, heuristics: Any) -> None:
        self._check_graph(graph)
        try:
            cache = self.cache_of()
        except Exception as exc:  # no usable cache directory, say: the frontend's way
            raise Refusal(f"cache:{type(exc).__name__}", f"plancache: no plan cache to persist graphs in ({exc})") from exc
        options = self._options(cache, graph, heuristics)
        # Keyed before validation (the description is the same after it): a graph left to
        # the frontend is validated by the frontend's own call, once.
        description = self._describe(graph)
        if not graph._is_validated:
            graph.validate()  # the frontend's own validation, its errors the caller's
        replay = self._replay(description, graph)
        with self._on_device(cache, graph):
            try:
                load = GraphLoad(graph, cache.backend)
            except AdoptionError as exc:
                raise Refusal("adopt:backend", f"plancache: not persisting graphs here ({exc})") from exc
            try:
                plan = cache.get(replay, options=options, load=load)  # role-valid timing inputs: autotuning.inputs
            except Exception as exc:  # autotuning or the store failing keeps the frontend's way
                log.debug("plancache: lookup failed", exc_info=True)
                raise Refusal(f"lookup:{type(exc).__name__}", f"plancache: not persisting this graph: {exc}") from exc
            native, blob = self._loaded(cache, plan, load)
            try:
                adopt(load, plan, native, blob)
            except Exception as exc:
                raise _unadoptable(exc) from exc
        _adopted[graph] = plan

    # ------------------------------------------------------------------ the steps

    def _check_graph(self, graph: Any) -> None:
        """Refuse, before anything runs, what plancache cannot serve on this graph."""
        cudnn = sys.modules.get("cudnn")
        version = str(getattr(cudnn, "__version__", "unknown"))
        if version not in FRONTEND_VERSIONS:
            raise Refusal("frontend version", f"plancache: cuDNN Frontend {version} is not a version plancache was made for "
                          f"({', '.join(FRONTEND_VERSIONS)}); graphs are planned the frontend's way")  # fmt: skip
        missing = missing_state(graph)
        if missing:
            raise Refusal("frontend internals", f"plancache: this frontend's graphs have no {', '.join(missing)}; "
                          "graphs are planned the frontend's way")  # fmt: skip
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise Refusal("capture", "plancache: not persisting a graph planned during a CUDA-graph capture "
                          "(loading or autotuning a plan would break the capture); the frontend plans it")  # fmt: skip
        kwargs = graph._cpp_graph_kwargs
        if kwargs.get("device_property") is not None:
            raise Refusal("device property", "plancache: not persisting graphs planned for a device property "
                          "(without a GPU); the frontend plans them")  # fmt: skip
        unlowerable = getattr(graph, "_unlowerable_node", None)
        node = unlowerable() if callable(unlowerable) else None
        if node is not None:
            raise Refusal("python engine", f"plancache: not persisting graphs only the frontend's Python engines run "
                          f"({node.node_type.name}): their plans cannot be loaded into the graph; the frontend plans them")  # fmt: skip

    def _options(self, cache: PlanCache, graph: Any, heuristics: Any) -> BuildOptions:
        """The cache's options, with the caller's heuristic modes and the tighter of the
        caller's and the cache's workspace limits: both change which plan is chosen."""
        from ..key import HEURISTIC_MODES

        modes = _mode_names(heuristics if heuristics is not None else _default_modes())
        unknown = [m for m in modes if m not in HEURISTIC_MODES]
        if unknown or not modes:
            raise Refusal(f"mode {unknown}", f"plancache: not persisting graphs planned with heuristic mode(s) {unknown} "
                          f"(plancache autotunes among {', '.join(HEURISTIC_MODES)}); the frontend plans them")  # fmt: skip
        limits = [limit for limit in (graph._workspace_limit, cache.options.workspace_limit) if limit is not None]
        try:
            return dataclasses.replace(cache.options, heuristic_modes=modes, workspace_limit=min(limits) if limits else None)
        except (ValueError, TypeError) as exc:  # a limit plancache cannot key (negative, say): the frontend's to judge
            raise Refusal(
                f"options:{exc}", f"plancache: not persisting a graph planned with {exc}; the frontend plans it"
            ) from exc

    def _describe(self, graph: Any) -> dict[str, Any]:
        from ..key import describe

        try:
            return describe(graph, auto_uids=True)
        except InvalidGraphError as exc:
            raise Refusal(f"unkeyable:{_reason(exc)}", f"plancache: not persisting this graph ({exc}); the frontend plans it "
                          "as before") from exc  # fmt: skip

    def _replay(self, description: dict[str, Any], graph: Any) -> Any:
        """A graph of plancache's own, keyed alike: the cache autotunes it on a miss. It
        builds against the caller's kernel cache, if any: the frontend shares one kernel
        cache across a program's dynamic-shape builds, and so does plancache."""
        from ..cudnn.replay import rebuild_graph

        try:
            return rebuild_graph(description, kernel_cache=graph._cpp_graph_kwargs.get("kernel_cache"))
        except InvalidGraphError as exc:
            raise Refusal(f"replay:{_reason(exc)}", f"plancache: not persisting this graph: it cannot be rebuilt for "
                          f"autotuning ({exc}); the frontend plans it as before") from exc  # fmt: skip

    @contextlib.contextmanager
    def _on_device(self, cache: PlanCache, graph: Any) -> Iterator[None]:
        """The graph's device current (its handle's; the current one without a handle): the
        plan is looked up, loaded and run there."""
        backend = cache.backend
        try:
            current = backend.current_device()
        except Exception as exc:  # no GPU: the frontend raises its own error
            raise Refusal(f"device:{type(exc).__name__}", f"plancache: not persisting graphs here ({exc})") from exc
        wanted = _handle_device(graph._handle)
        if wanted is None or wanted == current:
            yield
            return
        backend.use_device(wanted)
        try:
            yield
        finally:
            backend.use_device(current)

    def _loaded(self, cache: PlanCache, plan: Plan, load: GraphLoad) -> tuple[Any, PlanBlob]:
        """``plan`` deserialized for the caller's graph, and its stored blob: the lookup's
        own load (a hit from the store, or a miss's load-back before storing); else, for a
        plan in memory already or not stored, ``_stored_blob`` loaded now."""
        if load.last is not None and (load.last[0] is plan.native or plan.source in (PlanSource.BUILT, PlanSource.REBUILT)):
            return load.last
        blob = PlanBlob(self._stored_blob(cache, plan))
        try:
            return load(blob, plan.tensors, plan.device), blob
        except TransientLoadError as exc:  # a Python engine's plan, or a load that failed for now
            raise Refusal(f"load:{str(exc)[:60]}", f"plancache: the plan of this graph cannot be loaded into it ({exc}); "
                          "the frontend plans it") from exc  # fmt: skip
        except Exception as exc:
            raise _unadoptable(exc) from exc

    def _stored_blob(self, cache: PlanCache, plan: Plan) -> bytes:
        """The store's entry of ``plan`` (checked against its checksum), else, for a plan
        this process built and could not store, its graph serialized."""
        from ..store import sha256

        with contextlib.suppress(Exception):  # an unreadable entry: serialize below
            entry = cache.local.get(plan.key)
            engine = plan.engine.to_dict() if plan.engine is not None else None
            # Only the entry of this very plan: a lookup that re-checked a stored entry and
            # found no majority returns the frontend's own choice, not what is stored.
            if (entry is not None and entry.blob and sha256(entry.blob) == entry.blob_sha256
                    and entry.engine == engine and entry.workspace_size == plan.workspace_size):  # fmt: skip
                return bytes(entry.blob)
        refused = cache.lookup.unstored.why(plan.key)
        if refused is not None and refused[0] is Why.UNLOADABLE:  # built here, and not stored: it cannot be loaded back
            why = refused[1]
            raise Refusal(
                f"unloadable:{why[:60]}", f"plancache: the plan of this graph is not stored ({why}); the frontend plans it"
            )
        if plan.source in (PlanSource.BUILT, PlanSource.REBUILT):
            graph: Any = plan.native  # built here: the frontend's own graph, which has no types
            with contextlib.suppress(Exception):
                return bytes(graph.serialize(as_bytes=True))
        raise Refusal("not stored", "plancache: no plan of this graph is stored (its candidates did not agree, or loading "
                      "the stored one failed for now); the frontend plans it")  # fmt: skip


def _unadoptable(exc: Exception) -> Refusal:
    return Refusal(f"adopt:{type(exc).__name__}", f"plancache: the stored plan could not be put into the graph ({exc})")


def _reason(exc: InvalidGraphError) -> str:
    return str(getattr(exc, "reason", None) or exc)


def _handle_device(handle: Any) -> int | None:
    """The device a cuDNN handle was made on: the ordinal it recorded at creation, else its
    ``device`` (which asks the driver); None without a handle or an answer."""
    if handle is None:
        return None
    ordinal = getattr(handle, "_ordinal", None)
    if isinstance(ordinal, int):
        return ordinal
    with contextlib.suppress(Exception):
        return int(handle.device.ordinal)
    return None


class Interceptor:
    """Wraps ``build_plans``, ``build`` and ``execute`` of a pygraph class (and notes
    ``create_execution_plan``), serving the outermost call of a thread with ``planner``."""

    _NAMES = ("build_plans", "build", "execute", "create_execution_plan")
    #: What a program asks of the plan list when it means to choose by index: once it asked
    #: before the graph was built, the indices must stay those of the frontend's list, and a
    #: served graph has a list of one.
    _INDEXED = ("get_execution_plan_count", "get_plan_name_at_index", "get_workspace_size_plan_at_index")

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.cls: type | None = None
        self.originals: dict[str, Any] = {}

    def install(self, cls: type) -> None:
        missing = [name for name in (*self._NAMES, *self._INDEXED) if name not in cls.__dict__]
        if missing:  # another layout of the class: nothing is wrapped
            raise AttributeError(f"{cls.__name__} defines no {', '.join(missing)}")
        originals = {name: cls.__dict__[name] for name in (*self._NAMES, *self._INDEXED)}
        wrappers = {
            "build_plans": self._build_plans(originals["build_plans"]),
            "build": self._build(originals["build"]),
            "execute": self._execute(originals["execute"]),
            "create_execution_plan": self._create_execution_plan(originals["create_execution_plan"]),
            **{name: self._indexed(originals[name]) for name in self._INDEXED},
        }
        for name, wrapper in wrappers.items():
            functools.update_wrapper(wrapper, originals[name])
            wrapper.__plancache_original__ = originals[name]  # type: ignore[attr-defined]
            setattr(cls, name, wrapper)
        self.cls, self.originals = cls, originals

    def uninstall(self) -> None:
        if self.cls is not None:
            for name, original in self.originals.items():
                setattr(self.cls, name, original)
        self.cls, self.originals = None, {}

    # ------------------------------------------------------------------ the wrappers

    @staticmethod
    def _chooses_itself(graph: Any) -> bool:
        """Plans the caller chose (or a graph already built): the frontend's business."""
        state = graph.__dict__
        return bool(state.get("_is_built") or state.get("_plan_pinned") or graph in _self_chosen)

    @staticmethod
    def _heuristics(graph: Any, requested: Any) -> Any:
        """The modes the frontend plans ``graph`` with: those of its planning when it was
        planned (``create_execution_plans`` stores them), else ``requested``."""
        return graph.__dict__.get("_backend_heuristics") if graph.__dict__.get("_planning_done") else requested

    def _serve(self, graph: Any, requested: Any, frontends: Callable[[], Any]) -> Any:
        """``build_plans`` or ``build``, served: ``frontends()`` is the frontend's own call."""
        with inside():
            if plan_of(graph) is not None:
                return None  # built already from the cache: the default build keeps its plan
            if self._chooses_itself(graph) or not self.planner.persist(graph, self._heuristics(graph, requested)):
                return frontends()
            return None

    def _build_plans(self, original: Any) -> Callable[..., Any]:
        def build_plans(graph: Any, *args: Any, ctx: Any = None, **kwargs: Any) -> Any:
            if not outermost() or not _default_policy(args, kwargs):
                return original(graph, *args, ctx=ctx, **kwargs)
            return self._serve(graph, None, lambda: original(graph, *args, ctx=ctx, **kwargs))

        return build_plans

    def _build(self, original: Any) -> Callable[..., Any]:
        def build(graph: Any, heuristics: Any = None, ctx: Any = None) -> Any:
            if not outermost():
                return original(graph, heuristics, ctx)
            return self._serve(graph, heuristics, lambda: original(graph, heuristics, ctx))

        return build

    def _execute(self, original: Any) -> Callable[..., Any]:
        def execute(graph: Any, *args: Any, **kwargs: Any) -> Any:
            # Every launch passes here: a built graph goes straight on.
            if graph.__dict__.get("_is_built", True) or not outermost():
                return original(graph, *args, **kwargs)
            with inside():
                if not self._chooses_itself(graph):
                    self.planner.persist(graph, self._heuristics(graph, None))  # else: the frontend's lazy build
                return original(graph, *args, **kwargs)

        return execute

    def _indexed(self, original: Any) -> Callable[..., Any]:
        def indexed(graph: Any, *args: Any, **kwargs: Any) -> Any:
            state = graph.__dict__
            # The program's own question (not the frontend's, which asks for plan names while
            # it filters its list, nor plancache's), on a graph planned and not built yet: its
            # plans stay the frontend's to build.
            if (state.get("_planning_done") and not state.get("_is_built") and outermost()
                    and str(sys._getframe(1).f_globals.get("__name__", "")).split(".")[0] != "cudnn"):  # fmt: skip
                with contextlib.suppress(TypeError):
                    _self_chosen.add(graph)
            return original(graph, *args, **kwargs)

        return indexed

    def _create_execution_plan(self, original: Any) -> Callable[..., Any]:
        def create_execution_plan(graph: Any, *args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(TypeError):
                _self_chosen.add(graph)
            return original(graph, *args, **kwargs)

        return create_execution_plan


def _default_policy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``build_plans(*args, **kwargs)`` asks for the heuristics' choice (the
    default) and nothing else: ``ALL`` builds every plan, for the caller to choose from."""
    choice = sys.modules["cudnn"].build_plan_policy.HEURISTICS_CHOICE
    return not set(kwargs) - {"policy"} and all(value == choice for value in (*args, *kwargs.values()))
