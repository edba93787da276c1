"""A ready plan, and the checks that guard its launch.

A ``Plan`` is immutable and shared: the memory tier hands one ``Plan`` to every thread
that asks for its key. Everything that must not be shared lives elsewhere:

* **names** belong to the caller's graph, not to the plan. ``cache.get(graph)`` returns
  the plan under the names of *that* graph (``Plan.named``), so a plan stored by a caller
  who named uid 1 "rhs" never binds another caller's "rhs" to uid 1.
* **scratch memory** belongs to the launching thread and stream, from the backend (torch's
  caching allocator for cuDNN): reused by that thread's launches on that stream, which
  run in the order they were queued, so two launches that may run at once never share it.
* **the device** is the plan's own: a launch while another device is current runs on the
  plan's device (tensors must be there too), never on the current one.

No torch import: tensors are checked through ``shape``, ``stride()``, ``dtype``,
``device`` and ``data_ptr()``, so importing plancache stays cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..config import StrEnum
from ..errors import ExecutionError, TensorMismatchError
from ..guest.backend import Backend, EngineChoice, Launch
from ..guest.tensors import Expect, TensorLike, tensor_problems
from ..key import TensorSpec

__all__ = ["Plan", "PlanSource", "names_of"]


class PlanSource(StrEnum):
    """How this process got a plan (``Plan.source``)."""

    BUILT = "built"
    LOADED = "loaded"
    REBUILT = "rebuilt"
    UNPERSISTED = "unpersisted"  # built, and not stored


def names_of(graph: object) -> dict[str, int]:
    """``{name: uid}`` of a graph's non-virtual tensors whose name is unique in it."""
    tensors = getattr(graph, "tensors", None)
    if not isinstance(tensors, Mapping):
        return {}
    return {str(name): int(t.uid) for name, t in tensors.items() if not t.is_virtual}


class Plan:
    """An executable plan for one graph on one device.

    ``plan.execute({uid_or_name: tensor, ...})`` checks every tensor (shape, strides,
    dtype, device, alignment) and launches on the current stream of the plan's device.
    Names are those of the graph the plan was asked for. Thread-safe: a plan holds no
    mutable state; scratch memory is the launching thread's on its stream, from the backend.
    """

    __slots__ = ("_backend", "_by_uid", "_launch", "_name_to_uid", "_native", "_slots", "device", "engine", "key",
                 "source", "tensors", "workspace_size")  # fmt: skip

    def __init__(
        self,
        *,
        key: str,
        backend: Backend,
        native: object,
        tensors: Sequence[TensorSpec],
        workspace_size: int,
        engine: EngineChoice | None,
        source: PlanSource,
        device: int,
        names: Mapping[str, int] | None = None,
    ) -> None:
        self.key = key
        self.tensors = tuple(tensors)
        self.workspace_size = int(workspace_size)
        self.engine = engine
        self.source = PlanSource(source)  # how this process got it
        self.device = int(device)
        self._backend = backend
        self._native = native
        self._launch: Launch | None = None  # the backend's, made at the first launch
        self._by_uid = {spec.uid: Expect(spec) for spec in self.tensors}
        known = {spec.uid for spec in self.tensors}
        # Where each tensor's data pointer goes in the list a launch takes: the backend's
        # order first (the uids its plan reads), then the rest. Fixed for the plan's life.
        order = [u for u in backend.pointer_order(native) or () if u in known]
        order += sorted(known.difference(order))
        self._slots = {uid: (self._by_uid[uid], position) for position, uid in enumerate(order)}
        self._name_to_uid = {n: u for n, u in (names or {}).items() if u in known}

    def named(self, names: Mapping[str, int]) -> Plan:
        """This plan under another graph's names (``{name: uid}``); shares everything else."""
        wanted = {n: u for n, u in names.items() if u in self._by_uid}
        if wanted == self._name_to_uid:
            return self
        twin = object.__new__(Plan)
        for slot in Plan.__slots__:
            object.__setattr__(twin, slot, getattr(self, slot))
        twin._name_to_uid = wanted
        return twin

    def __repr__(self) -> str:
        return f"<Plan {self.key[:12]} {self.source} {self._backend.device_type}:{self.device} tensors={sorted(self._by_uid)} workspace={self.workspace_size}>"

    @property
    def native(self) -> object:
        """The backend's own plan object (a cuDNN graph for the cuDNN backend): its type is the
        backend's, so a caller narrows it to the one its backend builds."""
        return self._native

    @property
    def names(self) -> dict[str, int]:
        """The names this plan accepts, from the graph it was asked for: ``{name: uid}``."""
        return dict(self._name_to_uid)

    def prepare(self) -> Plan:
        """Make this thread ready to launch without creating anything: call it before
        capturing a CUDA graph from a thread that has not launched plans yet."""
        self._backend.prepare(self.device)
        return self

    def check(self, tensors: Mapping[int | str, TensorLike]) -> dict[int, TensorLike]:
        """The variant pack by uid, after checking every tensor. Raises
        ``TensorMismatchError`` naming each problem; launches nothing."""
        return self._verified(tensors)[0]

    def _verified(self, tensors: Mapping[int | str, TensorLike]) -> tuple[dict[int, TensorLike], list[int]]:
        """The pack and the pointers (``_checked``) of a mapping that fits, else
        ``TensorMismatchError`` naming each problem."""
        if not isinstance(tensors, Mapping):
            raise TensorMismatchError(
                f"plan {self.key[:12]}: tensors must be a mapping of uid or name to tensor, not {type(tensors).__name__}",
                key=self.key,
                problems=["not a mapping"],
            )
        checked = self._checked(tensors)
        if checked is None:
            self._explain_mismatch(tensors)
        return checked  # type: ignore[return-value]

    def _checked(self, tensors: Mapping[int | str, TensorLike]) -> tuple[dict[int, TensorLike], list[int]] | None:
        """The pack and the data pointers (in the launch's order) when every tensor is what
        the plan expects, else None (the slow path then names each problem)."""
        if len(tensors) != len(self._by_uid):
            return None
        try:
            return self._matched(tensors)
        except (AttributeError, TypeError, IndexError, KeyError, RuntimeError):
            return None  # not a tensor, or not one of ours

    def _matched(self, tensors: Mapping[int | str, TensorLike]) -> tuple[dict[int, TensorLike], list[int]] | None:
        """The fast path of ``check``, run on every launch: one pass over the tensors, each
        compared with what its uid expects and its data pointer put in its place; None on
        the first mismatch. Must accept exactly what ``_problems_of`` accepts."""
        slots, name_to_uid = self._slots, self._name_to_uid
        cuda = self._backend.device_type == "cuda"
        device = self.device
        pack: dict[int, TensorLike] = {}
        pointers = [0] * len(slots)
        for ref, tensor in tensors.items():
            # A name not in the plan's names stays a str, which no uid equals: KeyError below.
            uid: int = name_to_uid.get(ref, ref) if isinstance(ref, str) else ref  # type: ignore[arg-type]
            if uid.__class__ is not int:  # True and 1.0 hash as uid 1 does: only an int is a uid
                return None
            expect, position = slots[uid]
            pack[uid] = tensor
            dtypes = expect.dtypes
            if dtypes is None:
                expect.resolve()
                dtypes = expect.dtypes
            if expect.by_value:  # a host scalar: one element of the plan's type, in host memory
                typed = expect.dtype_names is None or tensor.dtype in dtypes  # type: ignore[operator]
                if not (tensor.is_cpu and typed and tensor.numel() == 1):
                    return None
                pointers[position] = tensor.data_ptr()
                continue
            # Empty dims: a shape the backend left unknown, not checked (as in the slow path).
            if tensor.dtype not in dtypes or (expect.dims and tensor.shape != expect.dims):  # type: ignore[operator]
                return None
            stride = tensor.stride()
            if stride != expect.strides and any(stride[i] != s for i, s in expect.stride_items):
                return None
            pointer = pointers[position] = tensor.data_ptr()
            if pointer % expect.alignment:
                return None
            # is_cpu, not "not is_cuda": a meta (or mps, xpu) tensor is no CPU tensor.
            if not (tensor.is_cuda and tensor.get_device() == device) if cuda else not tensor.is_cpu:
                return None
        return (pack, pointers) if len(pack) == len(slots) else None  # a uid given twice (by name and by uid)

    def _explain_mismatch(self, tensors: Mapping[int | str, TensorLike]) -> None:
        """The slow path: name every problem, then raise."""
        pack: dict[int, TensorLike] = {}
        problems: list[str] = []
        for ref, tensor in tensors.items():
            uid = self._name_to_uid.get(ref) if isinstance(ref, str) else ref
            if not isinstance(ref, (int, str)) or isinstance(ref, bool):
                problems.append(f"{ref!r} is neither a uid (an int) nor a name (text)")
                continue
            if uid is None or uid not in self._by_uid:
                known = ", ".join(sorted(self._name_to_uid)) or "none; pass uids"
                problems.append(
                    f"{ref!r} is not a tensor of this plan (names: {known})"
                    if isinstance(ref, str)
                    else f"{ref!r} is not a tensor of this plan"
                )
                continue
            if uid in pack:
                problems.append(f"uid {uid} is given twice (by name and by uid)")
            pack[uid] = tensor
        missing = set(self._by_uid).difference(pack)
        if missing:
            problems.append("missing " + ", ".join(self._where(u) for u in sorted(missing)))
        for uid, tensor in pack.items():
            problems.extend(self._problems_of(uid, tensor))
        if not problems:  # the fast path refused something the slow path cannot name
            problems.append("the tensors do not match the plan")
        raise TensorMismatchError(f"plan {self.key[:12]}: " + "; ".join(problems), key=self.key, problems=problems)

    def _where(self, uid: int) -> str:
        """A tensor as the caller knows it: ``'X' (uid 1)``, or ``uid 1`` without a name."""
        names = [n for n, u in self._name_to_uid.items() if u == uid]
        return f"{names[0]!r} (uid {uid})" if names else f"uid {uid}"

    def _problems_of(self, uid: int, tensor: TensorLike) -> list[str]:
        return tensor_problems(self._by_uid[uid], tensor, self._where(uid), self._backend.device_type, self.device)

    def execute(self, tensors: Mapping[int | str, TensorLike]) -> None:
        """Check ``tensors`` (by uid or name) and launch the plan on the current stream of
        the plan's device, with scratch memory of its own."""
        # A dict, the common case, skips the Mapping test; anything else, or a mismatch,
        # goes through _verified, which names every problem.
        checked = self._checked(tensors) if tensors.__class__ is dict else None
        if checked is None:
            checked = self._verified(tensors)
        launch = self._launch
        try:
            if launch is None:
                launch = self._launch = self._backend.launcher(self._native, self.workspace_size, self.device)
            launch(*checked)
        except Exception as exc:
            raise ExecutionError(
                f"plan {self.key[:12]} failed to launch on {self._backend.device_type}:{self.device}: {type(exc).__name__}: {exc}",
                key=self.key,
                device=self.device,
            ) from exc

    __call__ = execute
