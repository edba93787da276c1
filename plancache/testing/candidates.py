"""The candidate plans of one graph on the CPU test backend, launched for real by
``autotuning.candidates`` as cuDNN's are, through the reference kernels, with the test
device's faults and simulated, deterministic timings (``CpuPlans.simulated_ms``)."""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..errors import BuildError
from ..guest.backend import BuiltPlan, EngineChoice
from ..key import TensorSpec, canonical_json
from .device import SimulatedCuda
from .kernels import Behaviour, scratch_bytes

__all__ = ["CpuPlans", "candidate_workspace"]


def candidate_workspace(backend: _Backend, index: int | None, tensors: Sequence[TensorSpec]) -> int:
    """Workspace bytes of candidate ``index``: its output scratch plus its ``extra_workspace``."""
    return scratch_bytes(tensors) + (backend.extra_workspace.get(index, 0) if index is not None else 0)


class _Backend(Protocol):
    """What candidates use of ``backend.CpuTestBackend``, which imports this module."""

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

    def behaviour(self, engine: int | None) -> Behaviour: ...
    def run(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], *,
            behaviour: Behaviour = ..., workspace: Any = None, stream: int | None = None, took: float = 0.0) -> None: ...  # fmt: skip
    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice,
                  behaviour: Behaviour = ..., index: int | None = None) -> BuiltPlan: ...  # fmt: skip


class CpuPlans:
    """The candidate plans of one graph on the test device (``guest.backend.GraphPlans``)."""

    def __init__(self, backend: _Backend, description: dict[str, Any], tensors: list[TensorSpec]) -> None:
        self.backend = backend
        self.description = description
        self.tensors = tensors
        self.digest = hashlib.sha256(canonical_json(description).encode()).digest()
        self.built: set[int] = set()
        self.launches: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        return self.backend.candidate_count

    def engine(self, index: int) -> EngineChoice:
        engine_id = self.backend.engine_ids[index] if index < len(self.backend.engine_ids) else index
        return EngineChoice(engine_id=engine_id, knobs={"tile": 64 << (index % 3)}, name=f"test_engine_{index}")

    def compiles(self, index: int) -> bool:
        return index in self.backend.runtime_compiled

    def build(self, index: int) -> int:
        self.backend.cuda.check()
        if index in self.backend.unbuildable:
            raise BuildError("not supported by the test device", reason="not built")
        delay = self.backend.build_delay * (self.backend.compile_factor if self.compiles(index) else 1)
        if delay:
            time.sleep(delay)
        self.built.add(index)
        return candidate_workspace(self.backend, index, self.tensors)

    def launch(self, index: int, pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
        if index not in self.built:
            raise RuntimeError(f"candidate {index} was not built")
        if index in self.backend.unlaunchable:
            raise RuntimeError(f"candidate {index} failed to launch (simulated)")
        took = self.simulated_ms(index) * (1 + 0.001 * (self.launches[index] % 3))
        self.launches[index] += 1
        self.backend.run(self.description, self.tensors, pack, behaviour=self.backend.behaviour(index), workspace=workspace,
                         stream=handle.stream, took=took)  # fmt: skip

    def simulated_ms(self, index: int) -> float:
        """How long a launch of candidate ``index`` takes on the test device's clock:
        deterministic per (graph, index); candidate 0 is rarely the best, as on GPUs. A
        wrong candidate is the fastest of all."""
        if index in self.backend.wrong:
            return 0.001 * (1 + index)
        return 0.05 + (self.digest[index % len(self.digest)] / 255.0) * (1 + index % 4)

    def finish(self, index: int) -> BuiltPlan:
        return self.backend.make_plan(
            self.description, self.tensors, self.engine(index), self.backend.behaviour(index), index=index
        )
