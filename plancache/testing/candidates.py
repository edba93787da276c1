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
from ..engines.consensus import tolerance
from ..engines.inputs import materialize, timing_inputs
from ..engines.tensors import checked_inputs
from ..key import TensorSpec, canonical_json
from .device import SimulatedCuda

__all__ = ["CpuCandidates"]


class _Backend(Protocol):
    """What candidates use of the backend that makes them: ``backend.CpuTestBackend``, which
    imports this module, so it is described here rather than imported."""

    candidate_count: int
    engine_ids: list[int]
    unbuildable: frozenset[int]
    unlaunchable: frozenset[int]
    wrong: frozenset[int]
    build_delay: float
    cuda: SimulatedCuda

    def current_device(self) -> int: ...
    def guest(self, device: int) -> contextlib.AbstractContextManager[int]: ...
    def run(self, description: Mapping[str, Any], tensors: Sequence[TensorSpec], pack: Mapping[int, Any], *,
            wrong: bool = False, workspace_size: int | None = None) -> None: ...  # fmt: skip
    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice,
                  wrong: bool = False) -> BuiltPlan: ...  # fmt: skip


class CpuCandidates:
    def __init__(self, backend: _Backend, description: dict[str, Any], tensors: list[TensorSpec],
                 given: Mapping[int, Any] | None) -> None:  # fmt: skip
        self.backend = backend
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

    def build(self, index: int) -> str | None:
        self.backend.cuda.check()
        if index in self.backend.unbuildable:
            return "not supported by the test device"
        if self.backend.build_delay:
            import time

            time.sleep(self.backend.build_delay)
        self.built.add(index)
        return None

    def tolerance(self) -> float:
        return tolerance(self.description, [s for s in self.tensors if s.is_output])

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

    def outputs(self, index: int) -> dict[int, Any]:
        if index not in self.built:
            raise RuntimeError(f"candidate {index} was not built")
        if index in self.backend.unlaunchable:
            raise RuntimeError(f"candidate {index} failed to launch (simulated)")
        pack = self._ready()
        for uid in self.outputs_of:
            pack[uid].zero_()  # a region no candidate writes compares equal
        with self.backend.guest(self.device) as stream, self.backend.cuda.stream(stream):
            self.backend.run(self.description, self.tensors, pack, wrong=index in self.backend.wrong)
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
        return self.backend.make_plan(self.description, self.tensors, self.engine(index), wrong=index in self.backend.wrong)

    def close(self) -> None:
        self.built.clear()
        self.pack = None
        if self.allocated:
            self.backend.cuda.release(self.allocated, sync=False)  # back to the caching allocator's pool
            self.allocated = 0
