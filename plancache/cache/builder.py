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


class _Cache(Protocol):
    """What the decorator needs of a ``PlanCache`` (named here so that builder.py does not
    import cache.py, which imports it)."""

    memory: LRU[Any, Plan]
    backend: Any
    counters: dict[str, int]
    local: Any  # the local tier: note_hit
    #: Every builder's plans: a forked child clears them with the memory tier.
    builder_plans: weakref.WeakSet[LRU[Any, Plan]]

    @property
    def closed(self) -> bool: ...

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
            if cache.closed:  # as get(): a closed cache serves nothing, remembered plans neither
                cache.check_open()
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


def _nested(value: Any, tensor_type: Any) -> tuple[Any, bool]:
    """A tuple, list or dict argument as part of a signature (tensors by layout, a type tag
    so that ``[1]`` and ``(1,)`` stay apart), and whether it held a tensor."""
    if isinstance(value, tensor_type):
        return (value.shape, value.stride(), value.dtype, value.device), True
    if type(value) not in _CONTAINERS:
        return value, False
    items = sorted(value.items(), key=lambda item: repr(item[0])) if type(value) is dict else enumerate(value)
    described, has_tensor = [], False
    for name, item in items:
        part, nested = _nested(item, tensor_type)
        described.append((name, part) if type(value) is dict else part)
        has_tensor = has_tensor or nested
    return (type(value).__name__, *described), has_tensor
