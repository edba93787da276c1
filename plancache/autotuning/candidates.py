"""The candidate plans of one graph, launched, compared and timed: one code path over the
driver, run by the GPU and by the CPU suite alike.

What differs between libraries is their list of plans (``guest.backend.GraphPlans``: the
engines, building one, launching one, serializing the winner). Everything around it is
here, written once: the inputs every candidate is launched on (the caller's, else
synthetic ones valid for each tensor's role, ``autotuning.inputs``, within the memory
budget), the program's workspace limit and filters, plancache's own non-blocking stream
(ordered after the caller's work, never the caller's stream, never while the calling
thread captures), a leased handle pointed at that stream, each candidate's workspace
within what the budget left, outputs cleared before and copied after a launch, and the
timing on the device's own clock (CUDA events on a GPU). The CPU test driver simulates
the device beneath, so a change here is a change the CPU suite runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..config import MemoryBudget, format_size
from ..errors import BuildError
from ..guest.backend import Backend, BuiltPlan, EngineChoice, GraphPlans
from ..guest.tensors import checked_inputs
from ..key import BuildOptions
from .bounds import Bound, bounds
from .filters import outside_filters
from .inputs import Refusal, materialize, timing_inputs

__all__ = ["CandidateSet", "Candidates"]


class CandidateSet(Protocol):
    """The candidate plans of one graph, in the heuristics' order (best guess first), as
    ``autotune`` uses them.

    Autotuning builds candidates, launches each once on the same inputs to compare their
    outputs (``outputs``), then times those that agree (``time``). Nothing is launched
    before ``prepare`` said the inputs are ready."""

    def __len__(self) -> int: ...

    def engine(self, index: int) -> EngineChoice:
        """The engine and knobs of candidate ``index``."""

    def build(self, index: int) -> None:
        """Build candidate ``index``; a ``BuildError`` says why it failed."""

    def compiles(self, index: int) -> bool:
        """Whether building candidate ``index`` compiles kernels at run time."""

    def prepare(self, budget: MemoryBudget) -> Refusal | None:
        """Make the inputs every launch uses within ``budget``. None when candidates may be
        launched; else the ``Refusal`` that says why not (a tensor of unknown role, the
        budget, a CUDA-graph capture on this thread), and then nothing is allocated or launched."""

    def streamed(self) -> AbstractContextManager[Any]:
        """After ``prepare``: a block whose device work (the comparison of two candidates'
        outputs) is queued where the launches are, on the candidates' own stream. On the
        caller's current stream it would wait behind the program's work there and
        allocate from the program's pool."""

    def bounds(self) -> Mapping[int, Bound]:
        """How far each element of each output of two right candidates may differ, by
        output uid (``autotuning.bounds``), for the inputs ``prepare`` made."""

    def outputs(self, index: int) -> Mapping[int, Any]:
        """Launch built candidate ``index`` once on the prepared inputs (outputs cleared
        first) and return copies of its outputs, by uid."""

    def time(self, index: int, runs: int) -> list[float]:
        """Run built candidate ``index`` ``runs`` times after warm-up; milliseconds each."""

    def finish(self, index: int) -> BuiltPlan:
        """Make candidate ``index`` the graph's plan and serialize it."""

    def close(self) -> None:
        """Free what timing allocated (inputs, workspaces)."""


class Candidates:
    """``CandidateSet`` over a library's ``GraphPlans`` and the backend's driver (see the module)."""

    def __init__(
        self, backend: Backend, plans: GraphPlans, options: BuildOptions, inputs: Mapping[int, Any] | None = None
    ) -> None:
        self.backend, self.driver, self.plans, self.options = backend, backend.driver, plans, options
        self.given = dict(inputs or {})
        self.device = backend.current_device()
        self.workspaces: dict[int, int] = {}  # built candidate -> its workspace bytes
        self.pack: dict[int, Any] | None = None
        self.outputs_of: list[int] = []
        self.stream: Any = None
        self.spare = 0  # bytes of the budget left for a candidate's workspace
        self.held = 0  # bytes the inputs took

    @classmethod
    def of(cls, backend: Backend, graph: Any, options: BuildOptions, description: Mapping[str, Any],
           inputs: Mapping[int, Any] | None = None) -> Candidates:  # fmt: skip
        """The candidates of ``graph`` on the current device: ``backend.plans`` (which
        validates it) over the backend's driver. ``inputs`` (by uid): the caller's tensors,
        launched on instead of synthetic ones (checked as ``Plan.execute`` checks tensors,
        and never written)."""
        return cls(backend, backend.plans(graph, options, description), options, inputs)

    def __len__(self) -> int:
        return len(self.plans)

    def engine(self, index: int) -> EngineChoice:
        return self.plans.engine(index)

    def compiles(self, index: int) -> bool:
        return self.plans.compiles(index)

    def build(self, index: int) -> None:
        workspace = self.plans.build(index)
        outside = outside_filters(self.plans.engine(index).name, workspace, self.plans.description, self.options)
        if outside is not None:
            raise BuildError(outside, reason="outside filters")
        self.workspaces[index] = workspace

    def prepare(self, budget: MemoryBudget) -> Refusal | None:
        import torch

        driver, device = self.driver, self.device
        if driver.capturing():
            return Refusal("a CUDA-graph capture is in progress on this thread")
        given = checked_inputs(self.given, self.plans.tensors, driver.device_type, device)
        found = timing_inputs(self.plans.description, self.plans.tensors, given, budget, driver.free_memory(device))
        if isinstance(found, Refusal):
            return found
        plan, need, spare = found.plan, found.need, found.spare
        stream = self.backend.own_stream(device)  # non-blocking: never ordered with the legacy stream
        driver.follow(stream, device)  # the caller's tensors are ready
        # A generator of our own: autotuning must not move the caller's random number
        # stream (a miss would otherwise change every random tensor the program draws next).
        tensor_device = driver.tensor_device(device)
        generator = torch.Generator(device=tensor_device)
        generator.manual_seed(0)
        try:
            driver.hold(need)
            self.held = need
            with driver.on_stream(stream):
                pack = materialize(plan, torch, tensor_device, generator)
            driver.synchronize(stream)
        except (RuntimeError, MemoryError) as exc:  # torch's OutOfMemoryError is a RuntimeError
            self._release()
            return Refusal(f"allocating the inputs to launch candidates on failed: {type(exc).__name__}: {str(exc)[:200]}")
        self.pack, self.stream, self.spare = pack, stream, spare
        self.outputs_of = [spec.uid for spec in plan.outputs]
        return None

    def streamed(self) -> AbstractContextManager[Any]:
        if self.stream is None:
            raise RuntimeError("candidates compared before their inputs were prepared")
        return self.driver.on_stream(self.stream)

    def _ready(self) -> dict[int, Any]:
        if self.pack is None:
            raise RuntimeError("candidates launched before their inputs were prepared")
        if self.driver.capturing():
            raise RuntimeError("a CUDA-graph capture began on this thread")
        return self.pack

    def bounds(self) -> Mapping[int, Bound]:
        pack = self._ready()
        with self.driver.on_stream(self.stream):
            found = bounds(self.plans.description, self.plans.tensors, pack)
        self.driver.synchronize(self.stream)
        return found

    @contextlib.contextmanager
    def _launching(self, index: int) -> Iterator[tuple[Callable[[], None], dict[int, Any]]]:
        """The launch of built candidate ``index`` on the prepared inputs, for the block:
        on the candidates' stream, through a leased handle pointed at it, with a workspace
        of its own from what the budget left; and those inputs (checked ready once)."""
        pack = self._ready()
        size = self.workspaces.get(index)
        if size is None:
            raise RuntimeError(f"candidate {index} was not built")
        if size > self.spare:
            raise MemoryError(f"its workspace of {format_size(size)} is over what is left of the timing budget "
                              f"({format_size(self.spare)})")  # fmt: skip
        driver, plans = self.driver, self.plans
        with driver.on_stream(self.stream), self.backend.handles.lease(self.device) as handle:
            driver.set_stream(handle, driver.raw_stream(self.stream))
            workspace = driver.workspace_getter()(size, self.device) if size > 0 else None
            yield (lambda: plans.launch(index, pack, workspace, handle)), pack

    def outputs(self, index: int) -> dict[int, Any]:
        import torch

        with self._launching(index) as (launch, pack):
            for uid in self.outputs_of:
                pack[uid].zero_()  # a region no candidate writes compares equal
            launch()
            copies = {uid: pack[uid].clone(memory_format=torch.contiguous_format) for uid in self.outputs_of}
        self.driver.synchronize(self.stream)
        return copies

    def time(self, index: int, runs: int) -> list[float]:
        with self._launching(index) as (launch, _):
            return self.driver.time(launch, runs)

    def finish(self, index: int) -> BuiltPlan:
        return self.plans.finish(index)

    def close(self) -> None:
        if self.stream is not None:
            self.driver.synchronize(self.stream)  # nothing of ours is in flight when the caller goes on
        self.pack = None
        self.stream = None
        self._release()

    def _release(self) -> None:
        if self.held:
            self.driver.hold(-self.held)  # back to the caching allocator's pool
            self.held = 0
