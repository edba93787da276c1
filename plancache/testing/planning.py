"""A pygraph planned on the CPU test backend, once, as cuDNN Frontend plans it."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from ..errors import BuildError, InvalidGraphError, UntaggedCallableError
from ..key import TensorSpec, describe, tensor_table
from .device import SimulatedCuda
from .kernels import evaluate

__all__ = ["plan_once"]


def plan_once(graph: Any, cuda: SimulatedCuda) -> tuple[dict[str, Any], list[TensorSpec]]:
    """The graph's description and tensor table, its outputs shaped as a reference run of the
    description computes them (a pygraph may leave them to be inferred at planning); the graph
    is marked planned and frozen, and one planned before is refused, as the frontend refuses
    a second planning, on a device that still works (``cuda.check``)."""
    import torch

    cuda.check()
    if getattr(graph, "_planning_done", False):
        raise InvalidGraphError(
            "the graph was already planned (create_execution_plans or build ran); pass a fresh pygraph",
            node=None,
            reason="already planned",
        )
    try:
        description = describe(graph)
    except UntaggedCallableError:
        # A graph the caller tagged (get(graph, tag=...)) and keyed so: planning needs its
        # shapes, not its key. The kernels refuse what they cannot compute as cuDNN does
        # (attention with a score_mod): a BuildError that says so, not a plea for a tag.
        description = describe(graph, tag="plancache.testing: callables not run")
    table = tensor_table(graph)
    values: dict[str, Any] = {}
    for spec in table:
        if spec.is_output:
            continue
        if not spec.dims:
            raise InvalidGraphError(f"input tensor {spec.name!r} has no dims", node=None, reason="no dims")
        values[f"u{spec.uid}"] = torch.zeros(spec.dims) if not spec.is_pass_by_value else 1.0
    try:
        evaluate(description, values)
    except NotImplementedError as exc:
        raise BuildError(f"the CPU test backend cannot run {exc}", reason="unsupported by test backend") from exc
    except (RuntimeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidGraphError(f"the graph is invalid: {exc}", node=None, reason=str(exc)) from exc
    freeze = getattr(graph, "_freeze", None)
    if callable(freeze):
        freeze()
    with contextlib.suppress(AttributeError):
        graph._planning_done = True
    inferred = []
    for spec in table:
        if spec.is_output and not spec.dims:
            out = values[f"u{spec.uid}"]
            spec = dataclasses.replace(spec, dims=tuple(out.shape), strides=tuple(out.contiguous().stride()))
        inferred.append(spec)
    return description, inferred
