"""The narrow seam between the cache and whatever builds and runs plans.

The cache (``cache/``, ``autotuning/``, ``runtime/``) only talks to these Protocols. Both
implementations are ``guest.guest_backend.GuestBackend`` over a driver (``guest.driver``):
``cudnn.backend.CudnnBackend`` on a GPU, ``testing.CpuTestBackend`` on a machine without
one, so the CPU suite runs the same loads, launches and candidate plumbing as a GPU. What
differs is the library's list of candidate plans for a graph (``GraphPlans``). No cuDNN,
torch or CUDA import here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from ..formats.plan_blob import PlanBlob
from ..key import BuildOptions, TensorSpec
from .driver import Driver
from .handles import Handles

__all__ = ["Backend", "BuiltPlan", "EngineChoice", "GraphPlans", "Launch", "Load"]

#: A plan's launch: ``(tensors by uid, their data pointers in the backend's order)``.
Launch = Callable[[Mapping[int, Any], Sequence[int]], None]

#: How a stored plan is loaded: ``(blob, tensors, device) -> native``, as ``Backend.load``
#: does (or the frontend drop-in, straight into the caller's graph: ``PlanCache.get(load=...)``).
#: The blob is the ``PlanBlob`` the store's judge read: its decoding is the load's.
Load = Callable[[PlanBlob, Sequence[TensorSpec], int], Any]


@dataclass(frozen=True)
class EngineChoice:
    """Which engine a plan runs and with which knobs: enough to rebuild it without
    autotuning when its serialized blob cannot be loaded."""

    engine_id: int | None
    knobs: dict[str, int] = field(default_factory=dict)
    name: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "knobs": dict(self.knobs), "name": self.name}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineChoice:
        return cls(engine_id=data.get("engine_id"), knobs=dict(data.get("knobs") or {}), name=str(data.get("name", "")))


@dataclass
class BuiltPlan:
    """What a build hands the cache: the backend's executable object, and what the store
    keeps of it."""

    native: Any  # backend object that executes (a built cuDNN graph, say)
    blob: bytes  # serialized plan
    tensors: list[TensorSpec]
    workspace_size: int
    engine: EngineChoice | None


class GraphPlans(Protocol):
    """The candidate plans a library lists for one graph, in its heuristics' order (best
    guess first): what differs between libraries. ``autotuning.candidates`` launches,
    checks and times them, the same code on every backend."""

    @property
    def description(self) -> Mapping[str, Any]:
        """The graph's canonical description (what its key was made of)."""
        ...

    @property
    def tensors(self) -> Sequence[TensorSpec]:
        """The graph's tensors."""
        ...

    def __len__(self) -> int: ...

    def engine(self, index: int) -> EngineChoice:
        """The engine and knobs of candidate ``index``."""
        ...

    def compiles(self, index: int) -> bool:
        """Whether building candidate ``index`` compiles kernels at run time (hundreds of
        milliseconds, where others take a few): the library's own word, asked without
        building it."""
        ...

    def build(self, index: int) -> int:
        """Build candidate ``index``; its workspace bytes. Raises ``BuildError`` (its
        ``reason`` the library's words) when the library cannot build it."""
        ...

    def launch(self, index: int, pack: Mapping[int, Any], workspace: Any, handle: Any) -> None:
        """Queue one launch of built candidate ``index`` on the tensors by uid, on the
        stream ``handle`` is set to."""
        ...

    def finish(self, index: int) -> BuiltPlan:
        """Make candidate ``index`` the graph's plan and serialize it."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Builds, loads and executes plans. ``name`` is stored with each entry.

    Devices are explicit: a plan belongs to the device it was loaded or built on, and every
    call that touches one names it (or uses the caller's current device for a build).
    """

    name: str
    #: torch device type the plan's tensors must live on ("cuda" or "cpu").
    device_type: str

    @property
    def driver(self) -> Driver:
        """The machine beneath (``guest.driver``)."""
        ...

    @property
    def handles(self) -> Handles:
        """The cuDNN handles leased on it (``guest.handles``)."""
        ...

    def environment(self, device: int | None = None) -> dict[str, Any]:
        """Everything outside the graph that changes a plan on ``device`` (default: the
        current one): GPU, driver, library versions. Per device: two devices of one
        machine may differ."""
        ...

    def current_device(self) -> int:
        """Index of the calling thread's current device."""
        ...

    def use_device(self, index: int) -> None:
        """Make ``index`` the calling thread's current device."""
        ...

    def device_count(self) -> int:
        """How many devices this process can use (what ``prewarm --devices all`` shards over)."""
        ...

    def device_in_use(self, device: int) -> bool:
        """Whether this process has already set ``device`` up (a CUDA context exists), so
        that loading a plan there creates nothing the program did not create itself."""
        ...

    def plans(self, graph: Any, options: BuildOptions, description: Mapping[str, Any]) -> GraphPlans:
        """Validate ``graph`` on the current device and list its candidate plans. Raises
        ``InvalidGraphError`` naming the node when the library rejects the graph.
        ``description``: the graph's canonical description (what its key was made of),
        from which the roles of its tensors are read."""
        ...

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        """Build ``graph`` (a fresh, unplanned one) with a known engine and knobs, skipping
        autotuning."""
        ...

    def load(self, blob: PlanBlob | bytes, tensors: Sequence[TensorSpec], device: int | None = None) -> Any:
        """Deserialize a stored plan onto ``device`` (default: the current one) and load its
        kernels (``blob``: as the judge read it, its decoding kept, or bytes); raises
        ``TransientLoadError`` for a failure that is not the blob's, and anything else when
        the library refuses the blob."""
        ...

    def read_ahead(self, blob: PlanBlob) -> None:
        """Read now, on the host and with no CUDA call, what a later ``load`` of ``blob``
        reads of its bytes (kept by the ``PlanBlob``); never raises."""
        ...

    def kept_record(self, blob: PlanBlob) -> Mapping[str, Any] | None:
        """What a store keeps of the record a ``load`` of ``blob`` read (``store.kept``),
        None where the load read none (the frontend's own path loaded it)."""
        ...

    def keep_record(self, blob: PlanBlob, kept: Mapping[str, Any]) -> bool:
        """Take a kept record (``kept_record``) as what a ``load`` of ``blob`` reads of its
        bytes; False, taking nothing, for one this code cannot read."""
        ...

    def capturing(self) -> bool:
        """Whether the calling thread's current stream is capturing a CUDA graph (asked
        without setting CUDA up)."""
        ...

    def guest(self, device: int) -> AbstractContextManager[None]:
        """The block in which plancache does CUDA work of its own on ``device`` (loads,
        builds, timing, handles; ``guest.block``): raises ``CaptureInProgressError`` when
        this thread captures; runs in relaxed capture mode, its queued work on a
        non-blocking stream of plancache's own; leaves the caller's device and streams as
        they were."""
        ...

    def own_stream(self, device: int) -> Any:
        """plancache's own non-blocking stream on ``device`` (inside a guest block)."""
        ...

    def prepare(self, device: int) -> None:
        """Create now whatever a launch on ``device`` from this thread needs, so that a
        launch inside a CUDA-graph capture creates nothing."""
        ...

    def open_libraries(self) -> int:
        """Open now, with no CUDA call, the libraries a first load opens; how many (the
        primer's first step, before the program has set a device up)."""
        ...

    def pointer_order(self, native: Any) -> Sequence[int] | None:
        """The uids whose data pointers a launch of ``native`` reads, in the order it reads
        them (None: it reads the tensors alone)."""
        ...

    def launcher(self, native: Any, workspace_size: int, device: int) -> Launch:
        """The launch of one plan: a function of the tensors by uid and their data pointers
        (in ``pointer_order``, then the rest), already checked by ``Plan.check``, that runs
        the plan on the current stream of ``device`` with a workspace of ``workspace_size``
        bytes of that stream's. Made once per plan, so it resolves once what does not
        change between launches."""
        ...

    def kernel_cache_blob(self) -> bytes | None:
        """The shared kernel cache of dynamic-shape builds, serialized (None: unused)."""
        ...

    def restore_kernel_cache(self, blob: bytes) -> None:
        """Load a stored kernel cache before the first dynamic-shape build."""
        ...
