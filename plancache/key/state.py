"""A graph's state as one comparable value: what lets a repeat lookup skip ``describe``.

``GraphState.of(graph)`` keeps every value ``describe`` reads from a ``cudnn.pygraph``:
each tensor's fields, each node's attributes, ports and parameters, the graph's context,
keyword arguments, public attributes and planning filters. ``state.holds(graph)`` says
whether the graph still holds them all, exactly (``GraphState`` says how). A graph that
holds its state describes as it did, so the key computed then is its key now.

What cannot be compared that way is not guessed at: a torch tensor or numpy array held
as a parameter (its bytes are keyed, and may change in place), a device property object,
a value of a type this module does not know. Then there is no state, and the caller
describes the graph every time. Checking a state is a few C-speed comparisons of flat
tuples, without canonical names, JSON or hashing: half of what describing alone costs.

Pure: imports neither cuDNN nor torch.
"""

from __future__ import annotations

import enum
import types
import weakref
from collections.abc import Callable, Mapping
from itertools import chain
from operator import itemgetter
from typing import Any

__all__ = ["GraphState"]


class _Unfit(Exception):
    """A value that cannot be compared exactly: the graph is described every time."""


# ---------------------------------------------------------------------- exact tokens

# The exact token of a value that ``==`` alone cannot vouch for (a list of floats, a
# nested mapping): made at each check, for the few such values a graph has.


def _float(walk: _Walk, v: float) -> Any:
    return (float, v.hex())  # to the bit: -0.0 is not 0.0


def _sequence(walk: _Walk, v: Any) -> Any:
    items = tuple(v)
    if set(map(type, items)) <= _INT:
        return (v.__class__, items)
    return (v.__class__, tuple(map(walk.value, items)))


def _mapping(walk: _Walk, v: Any) -> Any:
    value = walk.value
    return ("mapping", tuple((value(k), value(x)) for k, x in v.items()))


def _set(walk: _Walk, v: Any) -> Any:
    return (v.__class__, frozenset(map(walk.value, v)))


Rule = Callable[["_Walk", Any], Any]
#: Per type: None keeps a value as it is (immutable, or compared by identity: a callable,
#: whose behaviour the caller's tag stands for, or a weak reference, a tensor's owner),
#: else the function that makes its token.
_RULES: dict[type, Rule | None] = {
    t: None for t in (int, bool, str, bytes, type(None), types.FunctionType, types.BuiltinFunctionType,
                      types.MethodType, weakref.ReferenceType)
}  # fmt: skip
_RULES.update({float: _float, list: _sequence, tuple: _sequence, dict: _mapping, types.MappingProxyType: _mapping,
               set: _set, frozenset: _set})  # fmt: skip
_INT = frozenset({int})
_STR = frozenset({str})


def _rule(cls: type) -> Rule | None:
    """The rule of a type met for the first time (then remembered)."""
    if isinstance(cls, enum.EnumMeta) or (hasattr(cls, "__members__") and hasattr(cls, "__int__")):
        rule = None  # enum members (a pybind11 enum of the frontend's too: cudnn.data_type) are immutable
    elif cls.__module__ == "torch" and cls.__name__ == "dtype":
        rule = None  # torch's dtypes are immortal singletons
    else:
        raise _Unfit(cls.__name__)  # a torch tensor, a numpy array, an object of unknown kind
    if len(_RULES) < 256:
        _RULES[cls] = rule
    return rule


class _Walk:
    """Tokens of values, and the tensors they reach (in order of first appearance)."""

    def __init__(self, tensor_type: type) -> None:
        if _RULES.get(tensor_type) is not _Walk.tensor:
            _RULES[tensor_type] = _Walk.tensor
        self.tensor_type = tensor_type
        self.ports = frozenset({tensor_type, type(None)})
        self.seen: set[int] = {id(None)}  # ids of the tensors reached (None is no tensor)
        self.order: list[Any] = []

    def tensor(self, t: Any) -> Any:
        if id(t) not in self.seen:
            self.seen.add(id(t))
            self.order.append(t)
        return t  # compared by identity (tensors are equal only to themselves)

    def value(self, v: Any) -> Any:
        """The exact token of one value; raises ``_Unfit``."""
        cls = v.__class__
        rule = _RULES[cls] if cls in _RULES else _rule(cls)
        return (cls, v) if rule is None else rule(self, v)


# ---------------------------------------------------------------------- the state


class GraphState:
    """Everything ``describe`` reads from one graph at one moment; ``holds()`` says whether
    the graph still reads alike (then its description, and so its key, is the same).

    What is read is a list of mappings: the graph's own attributes, the attributes of each
    node, of the context and of each tensor, and each node's parameters. They are kept as
    one flat run of names, of values (a list and a node's ports copied, so a change in
    place shows) and of the values' types, with each mapping's length; ``holds`` compares
    the four at C speed. What ``==`` cannot tell apart is checked beside it: a float by its
    bits, the elements of a list of ints by their types (``True == 1``), anything else by
    its exact token. The graph itself is not held (a memo keyed weakly by the graph keeps
    its state); the objects read are."""

    __slots__ = ("_checks", "_ints", "_keys", "_kinds", "_lens", "_objects", "_params", "_tensor_type", "_top", "_values")

    def __init__(self, graph: Any, top: tuple[Any, ...], tensor_type: type) -> None:
        self._top = top
        self._tensor_type = tensor_type
        walk = _Walk(tensor_type)
        attrs = graph.__dict__
        for t in attrs["_tensor_by_uid"].values():
            walk.tensor(t)
        objects: list[Any] = [*attrs["_nodes"], graph.context]
        params: list[tuple[Any, str]] = []
        # In reading order, (value kept, check) of: the graph's attributes, the nodes', the
        # context's, every tensor's reached (walk.order grows as it is read: a tensor's
        # fields reach its ragged offset), each node's parameters.
        kept = [self._keep(k, v, None, params, walk) for k, v in _graph_attributes(attrs).items()]
        kept += [self._keep(k, v, obj, params, walk) for obj in objects for k, v in vars(obj).items()]
        kept += [self._keep(k, v, obj, params, walk) for obj in walk.order for k, v in vars(obj).items()]
        objects += walk.order
        kept += [self._keep(k, v, None, params, walk) for obj, name in params for k, v in vars(obj)[name].items()]
        self._objects = tuple(objects)
        self._params = tuple(params)
        maps = self._mappings(graph)
        self._lens = tuple(map(len, maps))
        self._keys = tuple(chain.from_iterable(maps))
        checks = [check for _, check in kept]
        self._values = tuple(value for value, _ in kept)
        self._kinds = tuple(map(type, chain.from_iterable([m.values() for m in maps])))
        ints = [i for i, check in enumerate(checks) if check is _INTS]
        self._ints = itemgetter(*ints) if len(ints) > 1 else None if not ints else (lambda v, i=ints[0]: (v[i],))
        self._checks = tuple((i, check) for i, check in enumerate(checks) if check is not None and check is not _INTS)

    @staticmethod
    def _keep(name: str, v: Any, owner: Any, params: list[tuple[Any, str]], walk: _Walk) -> tuple[Any, Any]:
        """What is kept of one value to compare with, and how it is checked beside ``==``."""
        cls = v.__class__
        if cls is walk.tensor_type:
            return walk.tensor(v), None
        if cls is float:
            return v, v.hex()  # to the bit: -0.0 is not 0.0
        if (cls is list or cls is tuple) and set(map(type, v)) <= _INT:  # dims, strides, paddings
            return cls(v), _INTS
        if (cls is set or cls is frozenset) and set(map(type, v)) <= _STR:  # engine names deselected
            return cls(v), None
        if isinstance(v, (dict, types.MappingProxyType)) and set(map(type, v)) <= _STR:
            if set(map(type, v.values())) <= walk.ports:  # a node's ports: tensors (or None) by identity
                for t in v.values():
                    walk.tensor(t)
                return dict(v), None
            if owner is not None:  # a node's parameters: read as a mapping of their own
                params.append((owner, name))
                return v, None
        if (_RULES[cls] if cls in _RULES else _rule(cls)) is not None:
            return v, walk.value(v)  # anything else: its exact token
        return v, None

    @classmethod
    def of(cls, graph: Any) -> GraphState | None:
        """The state of ``graph``; None when some value of it cannot be compared exactly
        (a torch tensor held as a parameter, a device property, an unknown kind of value,
        a pygraph laid out otherwise): then it must be described every time."""
        top = _top(graph)
        by_uid = top[3] if top is not None else ()  # the graph's (uid, tensor) pairs
        if top is None or not by_uid:  # (no tensor: nothing to describe)
            return None
        tensor_type = by_uid[0][1].__class__
        try:
            return cls(graph, top, tensor_type)
        except _Unfit:
            return None

    def _mappings(self, graph: Any) -> list[Mapping[str, Any]]:
        """The mappings read, in order: the graph's attributes, each object's, each node's parameters."""
        return [_graph_attributes(graph.__dict__), *map(vars, self._objects), *[vars(o)[n] for o, n in self._params]]

    def holds(self, graph: Any) -> bool:
        """Whether ``graph``, the graph this state was taken of, still reads alike."""
        if _top(graph) != self._top:
            return False
        try:
            maps = self._mappings(graph)
            values = tuple(chain.from_iterable([m.values() for m in maps]))
        except (AttributeError, KeyError, TypeError):  # a node's parameters are no mapping now
            return False
        if (values != self._values or tuple(map(len, maps)) != self._lens or tuple(chain.from_iterable(maps)) != self._keys
                or tuple(map(type, values)) != self._kinds):  # fmt: skip
            return False
        if self._ints is not None and not set(map(type, chain.from_iterable(self._ints(values)))) <= _INT:
            return False
        for i, check in self._checks:
            try:  # a float's bits, or anything else's exact token
                if (values[i].hex() if check.__class__ is str else _Walk(self._tensor_type).value(values[i])) != check:
                    return False
            except _Unfit:
                return False
        return True


_INTS = "ints"  # the check of a list of ints: its elements are ints, not bools


class _Held:
    """A kernel cache, compared by identity (all describe reads of it is which one it is),
    and held so that its id is not reused."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return other.__class__ is _Held and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_RULES[_Held] = None
_PUBLIC: dict[tuple[str, ...], tuple[str, ...]] = {}


def _public(attrs: Mapping[str, Any]) -> tuple[str, ...]:
    """The public attribute names of a graph, by its attribute layout (remembered)."""
    names = tuple(attrs)
    found = _PUBLIC.get(names)
    if found is None:
        found = tuple(k for k in names if not k.startswith("_"))
        if len(_PUBLIC) < 64:
            _PUBLIC[names] = found
    return found


def _top(graph: Any) -> tuple[Any, ...] | None:
    """The graph's nodes and tensors, by identity and in order (their attributes are read
    as mappings of their own); None when the graph is laid out otherwise."""
    attrs = getattr(graph, "__dict__", None) or {}
    nodes, by_name, by_uid = attrs.get("_nodes"), attrs.get("_tensors"), attrs.get("_tensor_by_uid")
    if not (nodes.__class__ is list and by_name.__class__ is dict and by_uid.__class__ is dict):
        return None
    # The context by id: the state holds it (it reads its attributes), so the id is not reused.
    return (graph.__class__, tuple(nodes), tuple(by_name.items()), tuple(by_uid.items()), id(graph.context))


def _graph_attributes(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """What ``describe`` reads of the graph itself: its keyword arguments (of a kernel cache,
    only which one is attached), public attributes and planning filters."""
    found = dict(attrs.get("_cpp_graph_kwargs") or ())
    if "kernel_cache" in found:
        found["kernel_cache"] = _Held(found["kernel_cache"])
    for k in _public(attrs):
        found["." + k] = attrs[k]  # (a dot: no keyword argument is named so)
    found["._barred_names"] = attrs.get("_barred_names")
    found["._note_filters"] = attrs.get("_note_filters")
    return found
