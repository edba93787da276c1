"""Whole-step capture: a model step made of cached plans, replayed as one CUDA graph.

A step of six plans launched one by one costs tens of microseconds of host time each; a
replay of the captured step costs one launch. ``capture(step)`` is the recipe made safe
for plans:

1. warm-up calls of ``step`` on a side stream, outside the capture, so that every lookup
   in the step is a memory hit, every plan has its launch function, the cuDNN handle
   pool of each device holds a handle, and torch's allocator has seen the step (a miss or
   a handle created inside a capture would invalidate it);
2. one call captured into a ``torch.cuda.CUDAGraph``: each launch's workspace is then
   allocated from the capture's private memory pool, so replays never share scratch
   memory with anything outside the graph;
3. ``replay()`` runs the captured kernels again on the current stream and returns what
   the captured call returned.

A replay reads the tensors the captured call read and writes the ones it wrote: copy new
inputs into those tensors (``x.copy_(batch)``) before replaying, and read results from the
returned outputs (copy them out before the next replay if they must outlive it). The step
must launch the same plans on the same tensors each time, as any CUDA-graph capture
requires.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import NoGpuError
from ..guest.block import known_captures

if TYPE_CHECKING:
    import torch

__all__ = ["CapturedStep", "capture"]

T = TypeVar("T")


class CapturedStep(Generic[T]):
    """A captured step: ``replay()`` reruns it; ``output`` is what the captured call
    returned (static tensors, rewritten by every replay)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: T) -> None:
        self.graph = graph
        self.output = output

    def replay(self) -> T:
        """Replay the step on the current stream and return ``output``."""
        self.graph.replay()
        return self.output


# pool: Any, as torch's own type for it (torch.cuda._POOL_HANDLE, a NewType) is private.
def capture(step: Callable[[], T], *, warmup: int = 3, pool: Any = None) -> CapturedStep[T]:
    """Capture one call of ``step`` (a function launching cached plans, and any other CUDA
    work) in a CUDA graph, after ``warmup`` (at least 1) uncaptured calls on a side stream.
    ``pool``: a memory pool to share with other captures (``torch.cuda.graph_pool_handle()``).
    Raises ``NoGpuError`` without a GPU."""
    import torch

    if not torch.cuda.is_available():
        raise NoGpuError("capturing a step needs an NVIDIA GPU: no CUDA device is visible")
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1, not {warmup}: the warm-up calls look plans up and create handles")
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's Stream.__new__ has no annotations
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with known_captures.running(), torch.cuda.graph(graph, pool=pool):  # no handle is created meanwhile
        output = step()
    return CapturedStep(graph, output)
