"""The ``@cache.builder`` decorator: a plan per argument signature, so a repeat call with
tensors of the same layout costs a few microseconds and builds no graph.

On the hot path of every decorated call, hence the plain loops in ``_signature``.
"""

from __future__ import annotations

import functools
import sys
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

    def get(self, graph: Any, *, options: BuildOptions | None = None) -> Plan: ...


__all__ = ["plan_builder"]

F = TypeVar("F", bound=Callable[..., Any])


def plan_builder(cache: _Cache, func: F, options: BuildOptions | None, key: Callable[..., Any] | None) -> Callable[..., Plan]:
    """``func`` (which builds a pygraph) wrapped to return its plan, remembered per signature
    in an LRU as large as the cache's memory tier."""
    plans: LRU[Any, Plan] = LRU(cache.memory.capacity)
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
            plan = cache.get(func(*args, **kwargs), options=options)
            plans.put(signature, plan)
        else:
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
        else:
            signature.append(a)
    if kwargs:
        signature.append(_KWARGS)  # f(("n", 1)) and f(n=1) must not look alike
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, tensor_type):
                signature.append((name, (value.shape, value.stride(), value.dtype, value.device)))
                has_tensor = True
            else:
                signature.append((name, value))
    return tuple(signature), has_tensor
