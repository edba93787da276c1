"""The key and names of a graph object, computed once while the graph is unchanged.

Describing and hashing a graph is most of a repeat lookup's cost. ``GraphKeys`` keeps,
per graph object (weakly: a graph the program drops is forgotten with it), the graph's
state (``key.state.GraphState``) and what was computed from it: the key under each set of
build options, tag and environment, and the names of its tensors. A later lookup of the
same object compares the graph with that state (C-speed comparisons, no description, no
JSON, no hashing) and reuses the key while it holds. A graph changed in any way describe
would see (a tensor's fields, a node's parameters, a node added, a keyword argument) no
longer holds its state, and is described and keyed again.

Taking a state costs about what describing does, so it is taken at a graph object's
second lookup, not its first: a program that builds a new graph for every lookup pays
only for noting that it saw it. The state is taken before the graph is described: a
graph another thread changes in between is described as changed and fails its state at
the next lookup, never the reverse. A graph whose state cannot be compared exactly (a
torch tensor held as a parameter, say) is described at every lookup.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

from ..key import BuildOptions, CacheKey, describe, make_key
from ..key.state import GraphState
from ..runtime.plan import names_of

__all__ = ["GraphKeys"]

Memo = tuple[str | None, BuildOptions, str]  # (tag, options, environment id)


class _Known:
    """One graph's state (None: seen once, not taken yet) and the keys computed while it held."""

    __slots__ = ("keys", "state")

    def __init__(self, state: GraphState | None) -> None:
        self.state = state
        self.keys: dict[Memo, tuple[CacheKey, dict[str, int]]] = {}


_SEEN = _Known(None)  # a graph seen once: nothing of it is kept
_UNFIT = _Known(None)  # a graph whose state cannot be compared exactly: described every time


class GraphKeys:
    """Keys and names of graph objects, each computed once per state of the graph."""

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[object, _Known] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()  # WeakKeyDictionary's writes are not safe from two threads

    def key(self, graph: object, options: BuildOptions, environment: Mapping[str, object], env_id: str, environment_json: str,
            tag: str | None) -> tuple[CacheKey, dict[str, int]]:  # fmt: skip
        """The key of ``graph`` and its names (``{name: uid}``)."""
        memo = (tag, options, env_id)
        try:
            known = self._known.get(graph)
        except TypeError:  # a graph that cannot be held weakly, or hashed
            return self._compute(graph, options, environment, environment_json, tag)
        if known is None or known is _UNFIT:
            if known is None:  # its first lookup
                with self._lock:
                    self._known[graph] = _SEEN
            return self._compute(graph, options, environment, environment_json, tag)
        if known.state is not None and known.state.holds(graph):
            found = known.keys.get(memo)
            if found is not None:
                return found
        else:
            state = GraphState.of(graph)  # before describing it: see the module's docstring
            known = _Known(state) if state is not None else _UNFIT
            with self._lock:
                self._known[graph] = known
        found = self._compute(graph, options, environment, environment_json, tag)
        if known is not _UNFIT:
            known.keys[memo] = found
        return found

    @staticmethod
    def _compute(graph: object, options: BuildOptions, environment: Mapping[str, object], environment_json: str,
                 tag: str | None) -> tuple[CacheKey, dict[str, int]]:  # fmt: skip
        key = make_key(describe(graph, tag), environment, options, environment_json=environment_json)
        return key, names_of(graph)
