"""The candidates of one graph on the CPU test backend.

Like cuDNN's, they are launched for real: on the same inputs (the caller's, else the
synthetic ones of ``plancache.engines.inputs``), through the reference kernels, with the
test device's faults. A candidate the backend was told is wrong computes a wrong result
and is the fastest, as a wrong cuDNN engine may be; timings are otherwise simulated and
deterministic (a function of the graph and the index), so autotuning picks the same
winner every time.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..config import MemoryBudget
from ..engines.backend import BuiltPlan, EngineChoice
from ..engines.bounds import Bound, bounds
from ..engines.filters import outside_filters
from ..engines.inputs import materialize, timing_inputs
from ..engines.tensors import checked_inputs
from ..key import BuildOptions, TensorSpec, canonical_json
from .device import SimulatedCuda
from .kernels import Behaviour, scratch_bytes

__all__ = ["CpuCandidates", "candidate_workspace"]


def candidate_workspace(backend: _Backend, index: int | None, tensors: Sequence[TensorSpec]) -> int:
    """Workspace bytes of candidate ``index``: the scratch its outputs are staged in, plus the
    extra the backend was told it needs (``extra_workspace``)."""
    return scratch_bytes(tensors) + (backend.extra_workspace.get(index, 0) if index is not None else 0)


class _Backend(Protocol):
    """What candidates use of the backend that makes them: ``backend.CpuTestBackend``, which
    imports this module, so it is described here rather than imported."""

    candidate_count: int
    engine_ids: list[int]
    unbuildable: frozenset[int]
    unlaunchable: frozenset[int]
    wrong: frozenset[int]
    runtime_compiled: frozenset[int]
    extra_workspace: dict[int, int]
    build_delay: float
    compile_factor: float
    cuda: SimulatedCuda

    def current_device(self) -> int: ...
    def guest(self, device: int) -> contextlib.AbstractContextManager[None]: ...
    def own_stream(self, device: int) -> Any: ...
    def behaviour(self, engine: int | None) -> Behaviour: ...
    def run(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], *,
            behaviour: Behaviour = ..., workspace: Any = None, stream: int | None = None) -> None: ...  # fmt: skip
    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice,
                  behaviour: Behaviour = ..., index: int | None = None) -> BuiltPlan: ...  # fmt: skip


class CpuCandidates:
    def __init__(self, backend: _Backend, description: dict[str, Any], tensors: list[TensorSpec],
                 given: Mapping[int, Any] | None, options: BuildOptions) -> None:  # fmt: skip
        self.backend = backend
        self.options = options
        self.description = description
        self.tensors = tensors
        self.given = dict(given or {})
        self.device = backend.current_device()
        self.digest = hashlib.sha256(canonical_json(description).encode()).digest()
        self.built: set[int] = set()
        self.pack: dict[int, Any] | None = None
        self.allocated = 0
        self.outputs_of = [spec.uid for spec in tensors if spec.is_output]

    def __len__(self) -> int:
        return self.backend.candidate_count

    def engine(self, index: int) -> EngineChoice:
        engine_id = self.backend.engine_ids[index] if index < len(self.backend.engine_ids) else index
        return EngineChoice(engine_id=engine_id, knobs={"tile": 64 << (index % 3)}, name=f"test_engine_{index}")

    def compiles(self, index: int) -> bool:
        return index in self.backend.runtime_compiled

    def build(self, index: int) -> str | None:
        self.backend.cuda.check()
        if index in self.backend.unbuildable:
            return "not supported by the test device"
        delay = self.backend.build_delay * (self.backend.compile_factor if self.compiles(index) else 1)
        if delay:
            import time

            time.sleep(delay)
        outside = outside_filters(self.engine(index).name, candidate_workspace(self.backend, index, self.tensors), self.description,
                                  self.options)  # fmt: skip
        if outside is not None:
            return outside
        self.built.add(index)
        return None

    def bounds(self) -> Mapping[int, Bound]:
        return bounds(self.description, self.tensors, self._ready())

    def prepare(self, budget: MemoryBudget) -> str | None:
        import torch

        cuda = self.backend.cuda
        cuda.check()
        if cuda.capturing():
            return "a CUDA-graph capture is in progress on this thread"
        given = checked_inputs(self.given, self.tensors, "cpu", self.device)
        found = timing_inputs(self.description, self.tensors, given, budget, cuda.free_memory - cuda.allocated)
        if isinstance(found, str):
            return found
        plan, need, _spare = found
        cuda.allocate(need)
        self.allocated = need
        generator = torch.Generator().manual_seed(0)
        self.pack = materialize(plan, torch, "cpu", generator)
        return None

    def _ready(self) -> dict[int, Any]:
        if self.pack is None:
            raise RuntimeError("candidates launched before their inputs were prepared")
        if self.backend.cuda.capturing():
            raise RuntimeError("a CUDA-graph capture began on this thread")
        return self.pack

    def streamed(self) -> contextlib.AbstractContextManager[Any]:
        self._ready()
        return self.backend.cuda.stream(self.backend.own_stream(self.device))

    def outputs(self, index: int) -> dict[int, Any]:
        if index not in self.built:
            raise RuntimeError(f"candidate {index} was not built")
        if index in self.backend.unlaunchable:
            raise RuntimeError(f"candidate {index} failed to launch (simulated)")
        pack = self._ready()
        for uid in self.outputs_of:
            pack[uid].zero_()  # a region no candidate writes compares equal
        with self.backend.guest(self.device), self.backend.cuda.stream(self.backend.own_stream(self.device)):
            self.backend.run(self.description, self.tensors, pack, behaviour=self.backend.behaviour(index))
        return {uid: pack[uid].clone() for uid in self.outputs_of}

    def simulated_ms(self, index: int) -> float:
        """Deterministic per (graph, index); candidate 0 is rarely the best, as on GPUs. A
        wrong candidate is the fastest of all."""
        if index in self.backend.wrong:
            return 0.001 * (1 + index)
        return 0.05 + (self.digest[index % len(self.digest)] / 255.0) * (1 + index % 4)

    def time(self, index: int, runs: int) -> list[float]:
        if index not in self.built:
            raise RuntimeError(f"candidate {index} was not built")
        if index in self.backend.unlaunchable:
            raise RuntimeError(f"candidate {index} failed to launch (simulated)")
        self._ready()
        return [self.simulated_ms(index) * (1 + 0.001 * (r % 3)) for r in range(runs)]

    def finish(self, index: int) -> BuiltPlan:
        return self.backend.make_plan(
            self.description, self.tensors, self.engine(index), self.backend.behaviour(index), index=index
        )

    def close(self) -> None:
        self.built.clear()
        self.pack = None
        if self.allocated:
            self.backend.cuda.release(self.allocated, sync=False)  # back to the caching allocator's pool
            self.allocated = 0
