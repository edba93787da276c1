"""The ``@cache.builder`` decorator: a plan per argument signature, so a repeat call with
tensors of the same layout costs a few microseconds and builds no graph.

On the hot path of every decorated call, hence the plain loops in ``_signature``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from ..key import BuildOptions
from ..runtime.plan import Plan
from ..tiers.memory import LRU
from .counters import Counters


class _Cache(Protocol):
    """What the decorator needs of a ``PlanCache`` (named here so that builder.py does not
    import cache.py, which imports it)."""

    backend: Any
    counters: Counters
    local: Any  # the local tier: note_hit
    #: Every builder's plans: a forked child clears them with the memory tier.
    builder_plans: weakref.WeakSet[LRU[Any, Plan]]

    @property
    def memory(self) -> LRU[Any, Plan]: ...

    def check_open(self) -> None: ...

    def get(self, graph: Any, *, options: BuildOptions | None = None) -> Plan: ...


__all__ = ["plan_builder"]

F = TypeVar("F", bound=Callable[..., Any])


def plan_builder(cache: _Cache, func: F, options: BuildOptions | None, key: Callable[..., Any] | None) -> Callable[..., Plan]:
    """``func`` (which builds a pygraph) wrapped to return its plan, remembered per signature
    in an LRU as large as the cache's memory tier."""
    plans: LRU[Any, Plan] = LRU(cache.memory.capacity)
    cache.builder_plans.add(plans)
    current_device = cache.backend.current_device
    counters = cache.counters
    note_hit = cache.local.note_hit

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Plan:
        if key is not None:
            signature: Any = key(*args, **kwargs)
        else:
            signature, has_tensor = _signature(args, kwargs)
            if not has_tensor:
                # No tensor argument tells the device: the plan belongs to the current one.
                signature = (*signature, current_device())
        plan = plans.get(signature)
        if plan is None:
            plan = cache.get(func(*args, **kwargs), options=options)  # refused once the cache is closed
            plans.put(signature, plan)
        else:
            cache.check_open()  # as get(): a closed cache serves nothing, remembered plans neither
            counters["memory_hits"] += 1
            note_hit(plan.key)  # as get()'s memory hits: the plan a program runs every step stays young for eviction
        return plan

    wrapper.plans = plans  # type: ignore[attr-defined]
    return wrapper


_tensor_type: Any = None
_KWARGS = object()


def _signature(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], bool]:
    """What a builder's result depends on: tensors by layout (shape, strides, dtype,
    device), everything else by value; and whether any argument was a tensor.

    On the hot path of every decorated call, hence the plain loops and no helper calls.
    """
    global _tensor_type
    tensor_type = _tensor_type
    if tensor_type is None:
        torch = sys.modules.get("torch")
        tensor_type = () if torch is None else torch.Tensor
        if torch is not None:
            _tensor_type = tensor_type  # resolved once torch is loaded
    has_tensor = False
    signature: list[Any] = []
    for a in args:
        if isinstance(a, tensor_type):
            signature.append((a.shape, a.stride(), a.dtype, a.device))
            has_tensor = True
        elif type(a) is tuple and set(map(type, a)) <= _PLAIN:  # strides, paddings: as they are
            signature.append(a)
        elif type(a) in _CONTAINERS:
            described, nested = _nested(a, tensor_type)
            signature.append(described)
            has_tensor = has_tensor or nested
        else:
            signature.append(a)
    if kwargs:
        signature.append(_KWARGS)  # f(("n", 1)) and f(n=1) must not look alike
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, tensor_type):
                signature.append((name, (value.shape, value.stride(), value.dtype, value.device)))
                has_tensor = True
            elif type(value) in _CONTAINERS:
                described, nested = _nested(value, tensor_type)
                signature.append((name, described))
                has_tensor = has_tensor or nested
            else:
                signature.append((name, value))
    return tuple(signature), has_tensor


#: Arguments that hold other arguments: described item by item, so a tensor inside one is
#: described by its layout (by identity it would never match again, and the memo would keep
#: it alive), and a list or dict, which cannot be a key, can be part of one.
_CONTAINERS = (tuple, list, dict)
#: Items that are their own description: a tuple of these alone is taken as it is (one
#: pass in C over the item types: strides and paddings are tuples, on the hot path).
_PLAIN = frozenset({int, float, bool, str, bytes, type(None)})
#: Tags of described containers: objects no argument can be, so a described list never
#: equals a tuple a caller passed.
_TUPLE, _LIST, _DICT = object(), object(), object()


def _nested(value: Any, tensor_type: Any) -> tuple[Any, bool]:
    """A tuple, list or dict argument as part of a signature (tensors by layout; a dict in
    its own order, which a builder may build in), and whether it held a tensor."""
    if isinstance(value, tensor_type):
        return (value.shape, value.stride(), value.dtype, value.device), True
    kind = type(value)
    if kind not in _CONTAINERS:
        return value, False
    if kind is dict:
        if set(map(type, value.values())) <= _PLAIN:
            return (_DICT, *value.items()), False
        items = [(name, _nested(item, tensor_type)) for name, item in value.items()]
        return (_DICT, *((name, part) for name, (part, _) in items)), any(nested for _, (_, nested) in items)
    if set(map(type, value)) <= _PLAIN:
        return (value if kind is tuple else (_LIST, *value)), False
    parts = [_nested(item, tensor_type) for item in value]
    return (_TUPLE if kind is tuple else _LIST, *(part for part, _ in parts)), any(nested for _, nested in parts)
