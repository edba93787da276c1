"""The ``@cache.builder`` decorator: a plan per argument signature, so a repeat call with
tensors of the same layout costs a few microseconds and builds no graph.

The signature keys every argument as exactly as ``describe`` keys what the builder makes
of it, since a signature that two different graphs share returns the first one's plan
for the second: tensors by layout (shape, strides, dtype, device); ``int``, ``str``,
``bytes`` and None as themselves; ``bool`` and ``float`` tagged by type, floats to the bit
(``0``, ``0.0`` and ``-0.0`` are three signatures, as they are three keys); tuples, lists,
dicts and sets by content; enum members, dtypes and devices by value; numpy values by dtype,
shape and bytes; a frozen dataclass or a named tuple by its fields. Any other object (a
mutable config, an object hashed by identity) has no value that stays what it was when
the plan was built, and is refused (``UnkeyableArgumentError``): pass ``key=``. A callable
is keyed by identity only under a ``tag=``, which stands for what it does (docs/key.md).

On the hot path of every decorated call, hence the plain loops in ``_signature``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Protocol, TypeVar

from ..errors import UnkeyableArgumentError
from ..guest.backend import Backend
from ..guest.tensors import TensorLike
from ..key import BuildOptions
from ..runtime.plan import Plan
from ..tiers.local import LocalTier
from ..tiers.memory import LRU
from .counters import Count, Counters


class _Cache(Protocol):
    """What the decorator needs of a ``PlanCache`` (named here so that builder.py does not
    import cache.py, which imports it)."""

    backend: Backend
    counters: Counters
    local: LocalTier

    @property
    def memory(self) -> LRU[tuple[str, int], Plan]: ...

    def check_open(self) -> None: ...

    def get(self, graph: object, *, options: BuildOptions | None = None, tag: str | None = None) -> Plan: ...


__all__ = ["plan_builder"]

F = TypeVar("F", bound=Callable[..., object])


def plan_builder(
    cache: _Cache, func: F, options: BuildOptions | None, key: Callable[..., Hashable] | None, tag: str | None = None
) -> Callable[..., Plan]:
    """``func`` (which builds a pygraph) wrapped to return its plan, remembered per signature
    in an LRU as large as the cache's memory tier. ``tag``: passed to ``get`` for every
    graph (it stands for the callables a graph holds), and what lets a callable argument be
    keyed (by identity)."""
    plans: LRU[Hashable, Plan] = LRU(cache.memory.capacity)  # a forked child's start empty, as the memory tier
    current_device = cache.backend.current_device
    count = cache.counters.count
    note_hit = cache.local.note_hit
    tagged = tag is not None
    name = getattr(func, "__qualname__", None) or repr(func)

    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> Plan:
        if key is not None:
            signature: Hashable = key(*args, **kwargs)
        else:
            described, has_tensor = _signature(args, kwargs, tagged, name)
            # No tensor argument tells the device: the plan belongs to the current one.
            signature = described if has_tensor else (*described, current_device())
        plan = plans.get(signature)
        if plan is None:
            plan = cache.get(func(*args, **kwargs), options=options, tag=tag)  # refused once the cache is closed
            plans.put(signature, plan)
        else:
            cache.check_open()  # as get(): a closed cache serves nothing, remembered plans neither
            count(Count.MEMORY_HITS)
            note_hit(plan.key)  # as get()'s memory hits: the plan a program runs every step stays young for eviction
        return plan

    wrapper.plans = plans  # type: ignore[attr-defined]
    return wrapper


_tensor_type: type[TensorLike] | None = None
_KWARGS = object()
#: Arguments that are their own exact description: no two values of these types are
#: equal unless they are the same value (``1 == 1.0 == True`` is why float and bool are
#: not here). A tuple of these alone is taken as it is (one pass in C over the item types:
#: strides and paddings are tuples of ints, on the hot path).
_EXACT = frozenset({int, str, bytes, type(None)})


def _signature(
    args: tuple[object, ...], kwargs: Mapping[str, object], tagged: bool = False, builder: str = "builder"
) -> tuple[tuple[object, ...], bool]:
    """What a builder's result depends on, as a hashable value two calls share only when
    every argument is keyed alike (the module's docstring says how), and whether any
    argument was a tensor. Raises ``UnkeyableArgumentError`` for an argument with no stable
    value."""
    global _tensor_type
    tensor_type: type[TensorLike] | tuple[()] | None = _tensor_type
    if tensor_type is None:
        torch = sys.modules.get("torch")
        if torch is None:
            tensor_type = ()
        else:
            tensor_type = _tensor_type = torch.Tensor  # resolved once torch is loaded
    has_tensor = False
    signature: list[object] = []
    for a in args:
        if isinstance(a, tensor_type):
            signature.append((a.shape, a.stride(), a.dtype, a.device))
            has_tensor = True
        elif type(a) in _EXACT or (type(a) is tuple and set(map(type, a)) <= _EXACT):
            signature.append(a)
        else:
            position = next(i for i, b in enumerate(args) if b is a)  # off the hot path: for a refusal's words
            described, nested = _part(a, tensor_type, tagged, (builder, position))
            signature.append(described)
            has_tensor = has_tensor or nested
    if kwargs:
        signature.append(_KWARGS)  # f(("n", 1)) and f(n=1) must not look alike
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, tensor_type):
                signature.append((name, (value.shape, value.stride(), value.dtype, value.device)))
                has_tensor = True
            elif type(value) in _EXACT:
                signature.append((name, value))
            else:
                described, nested = _part(value, tensor_type, tagged, (builder, name))
                signature.append((name, described))
                has_tensor = has_tensor or nested
    return tuple(signature), has_tensor


#: Tags of described values: objects no argument can be, so a described value never
#: equals another type's (a list never equals a tuple, a float never equals an int).
_FLOAT, _BOOL, _TUPLE, _LIST, _DICT, _SET, _ENUM, _VALUE, _ARRAY, _FIELDS, _CALLABLE = (object() for _ in range(11))
#: The largest numpy value keyed by its bytes, as ``describe`` keys arrays.
_MAX_ARRAY_BYTES = 64 << 10


def _part(
    value: Any, tensor_type: type[TensorLike] | tuple[()], tagged: bool, where: tuple[str, int | str]
) -> tuple[object, bool]:
    """One argument (or an item of one) as part of a signature, and whether it held a
    tensor; ``UnkeyableArgumentError`` for a value with no stable description. ``value``:
    Any, read by its exact type (``type(value) is float``), which mypy does not narrow by."""
    kind = type(value)
    if kind in _EXACT:
        return value, False
    if kind is float:
        return (_FLOAT, value.hex()), False  # to the bit: -0.0 is not 0.0, and nan matches nan
    if kind is bool:
        return (_BOOL, value), False
    if isinstance(value, tensor_type):
        return (value.shape, value.stride(), value.dtype, value.device), True
    if kind is tuple or kind is list or isinstance(value, tuple):
        if kind is tuple and set(map(type, value)) <= _EXACT:
            return value, False
        parts = [_part(item, tensor_type, tagged, where) for item in value]
        head = _TUPLE if kind is tuple else _LIST if kind is list else kind  # a named tuple, torch.Size: its type too
        return (head, *(part for part, _ in parts)), any(nested for _, nested in parts)
    if kind is dict:
        # In its own order: a builder may build in it, and two orders are two graphs.
        items = [(_part(k, tensor_type, tagged, where), _part(v, tensor_type, tagged, where)) for k, v in value.items()]
        return (_DICT, *((k, v) for (k, _), (v, _) in items)), any(kn or vn for (_, kn), (_, vn) in items)
    if kind is set or kind is frozenset:
        parts = [_part(item, tensor_type, tagged, where) for item in value]
        return (_SET, frozenset(part for part, _ in parts)), any(nested for _, nested in parts)
    if isinstance(value, enum.Enum) or (hasattr(kind, "__members__") and hasattr(value, "name")):  # pybind11 enums too
        return (_ENUM, kind, value.name), False
    module = kind.__module__.split(".")[0]
    if module == "torch" and kind.__name__ in ("dtype", "device", "memory_format", "layout"):
        return (_VALUE, value), False
    if module == "numpy":
        numpy = sys.modules["numpy"]
        if isinstance(value, numpy.dtype):  # numpy.dtypes.Float32DType and the like
            return (_VALUE, value), False
        if hasattr(value, "dtype") and hasattr(value, "tobytes"):
            array = numpy.asarray(value)
            if array.dtype.hasobject or array.nbytes > _MAX_ARRAY_BYTES:
                raise _unkeyable(value, where, "a numpy value larger than 64 KiB or of Python objects")
            return (_ARRAY, kind, array.dtype.str, array.shape, array.tobytes()), False
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not kind.__dataclass_params__.frozen:
            raise _unkeyable(value, where, "a dataclass that is not frozen: its fields can change after the plan is built")
        parts = [_part(getattr(value, f.name), tensor_type, tagged, where) for f in dataclasses.fields(value)]
        return (_FIELDS, kind, *(part for part, _ in parts)), any(nested for _, nested in parts)
    if kind is slice or kind is range:
        ends = (_part(getattr(value, end), tensor_type, tagged, where)[0] for end in ("start", "stop", "step"))
        return (_VALUE, kind, *ends), False
    if isinstance(value, type):
        return (_VALUE, value), False  # a class: by identity
    if callable(value):
        if tagged:
            return (_CALLABLE, value), False  # by identity; the tag stands for what it does
        raise _unkeyable(value, where, "a callable, whose behaviour cannot be keyed: pass tag= naming what it does")
    raise _unkeyable(value, where, "an object with no stable value: make it a frozen dataclass")


def _unkeyable(value: object, where: tuple[str, int | str], why: str) -> UnkeyableArgumentError:
    builder, argument = where
    named = f"argument {argument + 1}" if isinstance(argument, int) else f"argument {argument!r}"
    return UnkeyableArgumentError(
        f"@cache.builder {builder}: {named} is {why}; or pass key= to @cache.builder (a function of the arguments "
        f"returning what the graph depends on) (got a {type(value).__name__})",
        argument=argument,
    )
