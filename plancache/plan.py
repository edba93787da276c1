"""A ready plan, and the checks that guard its launch.

A ``Plan`` is immutable and shared: the memory tier hands one ``Plan`` to every thread
that asks for its key. Everything that must not be shared lives elsewhere:

* **names** belong to the caller's graph, not to the plan. ``cache.get(graph)`` returns
  the plan under the names of *that* graph (``Plan.named``), so a plan stored by a caller
  who named uid 1 "rhs" never binds another caller's "rhs" to uid 1.
* **scratch memory** is allocated per launch, on the launching stream, by the backend
  (torch's caching allocator for cuDNN), so two threads launching one plan on two streams
  never share a workspace.
* **the device** is the plan's own: a launch while another device is current runs on the
  plan's device (tensors must be there too), never on the current one.

No torch import: tensors are checked through ``shape``, ``stride()``, ``dtype``,
``device`` and ``data_ptr()``, so importing plancache stays cheap.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .engines.backend import Backend, EngineChoice
from .errors import ExecutionError, TensorMismatchError
from .key import TensorSpec

__all__ = ["TORCH_DTYPES", "Plan", "names_of"]

#: cuDNN data type -> the torch dtypes a tensor of that type may have. Every data type the
#: frontend defines is listed: one with no entry could be launched unchecked. FP8_E5M3 has
#: no torch dtype and travels as bytes; 4-bit types are packed two per byte (see _PACKED).
#: FAST_FLOAT_FOR_FP8 is a compute type: no tensor may hold it, so nothing is accepted.
TORCH_DTYPES: dict[str, tuple[str, ...]] = {
    "data_type.HALF": ("float16",),
    "data_type.BFLOAT16": ("bfloat16",),
    "data_type.FLOAT": ("float32",),
    "data_type.DOUBLE": ("float64",),
    "data_type.INT8": ("int8",),
    "data_type.UINT8": ("uint8",),
    "data_type.INT32": ("int32",),
    "data_type.INT64": ("int64",),
    "data_type.BOOLEAN": ("bool",),
    "data_type.FP8_E4M3": ("float8_e4m3fn",),
    "data_type.FP8_E5M2": ("float8_e5m2",),
    "data_type.FP8_E8M0": ("float8_e8m0fnu",),
    "data_type.FP8_E5M3": ("uint8", "int8"),
    "data_type.FP4_E2M1": ("float4_e2m1fn_x2", "uint8"),
    "data_type.INT4": ("uint8", "int8"),
    "data_type.FAST_FLOAT_FOR_FP8": (),
}
#: Types stored two elements per byte along their unit-stride axis.
_PACKED = frozenset({"data_type.FP4_E2M1", "data_type.INT4"})
#: Bytes every data pointer must be aligned to when a spec does not say: the frontend's
#: graph API declares its tensors 16-byte aligned to cuDNN, and a plan built under that
#: promise fails or misbehaves on a pointer 2 bytes off (seen on an H200).
DEFAULT_ALIGNMENT = 16


def names_of(graph: Any) -> dict[str, int]:
    """``{name: uid}`` of a graph's non-virtual tensors whose name is unique in it."""
    tensors = getattr(graph, "tensors", None)
    if not isinstance(tensors, Mapping):
        return {}
    return {str(name): int(t.uid) for name, t in tensors.items() if not t.is_virtual}


def _storage_geometry(
    dtype: str | None, dims: tuple[int, ...], strides: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape and strides a torch tensor holding this layout has: the layout itself,
    or for packed 4-bit types the unit-stride axis halved (None: no byte layout spells it)."""
    if dtype not in _PACKED:
        return dims, strides
    for axis, (extent, step) in enumerate(zip(dims, strides)):
        if step == 1 and extent > 1 and extent % 2 == 0 and all(s % 2 == 0 or s == 1 for i, s in enumerate(strides) if i != axis):
            packed_dims = tuple(d // 2 if i == axis else d for i, d in enumerate(dims))
            packed_strides = tuple(s if (i == axis or s == 1) else s // 2 for i, s in enumerate(strides))
            return packed_dims, packed_strides
    return None


class _Expect:
    """What one tensor of the plan must look like, resolved once per plan."""

    __slots__ = ("alignment", "by_value", "dims", "dtype_names", "dtypes", "spec", "stride_items", "strides")

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        geometry = _storage_geometry(spec.dtype, tuple(spec.dims), tuple(spec.strides))
        self.dims, self.strides = geometry if geometry is not None else ((-1,), ())  # (-1,): nothing matches
        # Strides of size-1 dimensions never affect addressing, so they are not compared.
        self.stride_items = tuple((i, s) for i, (d, s) in enumerate(zip(self.dims, self.strides)) if d != 1)
        self.dtype_names = TORCH_DTYPES.get(spec.dtype or "")
        self.alignment = max(1, int(getattr(spec, "alignment", DEFAULT_ALIGNMENT) or 1))
        self.by_value = bool(spec.is_pass_by_value)  # a host scalar: nothing to check
        self.dtypes: tuple[Any, ...] | None = None  # torch dtype objects, resolved at first check

    def resolve(self) -> None:
        torch = sys.modules.get("torch")
        names = self.dtype_names if self.dtype_names is not None else ()
        found = tuple(getattr(torch, n) for n in names if torch is not None and hasattr(torch, n))
        self.dtypes = found


class Plan:
    """An executable plan for one graph on one device.

    ``plan.execute({uid_or_name: tensor, ...})`` checks every tensor (shape, strides,
    dtype, device, alignment) and launches on the current stream of the plan's device.
    Names are those of the graph the plan was asked for. Thread-safe: a plan holds no
    mutable state; scratch memory comes per launch from the backend.
    """

    __slots__ = ("_backend", "_by_uid", "_launch", "_name_to_uid", "_native", "device", "engine", "key", "source",
                 "tensors", "workspace_size")  # fmt: skip

    def __init__(
        self,
        *,
        key: str,
        backend: Backend,
        native: Any,
        tensors: Sequence[TensorSpec],
        workspace_size: int,
        engine: EngineChoice | None,
        source: str,
        device: int,
        names: Mapping[str, int] | None = None,
    ) -> None:
        self.key = key
        self.tensors = tuple(tensors)
        self.workspace_size = int(workspace_size)
        self.engine = engine
        self.source = source  # "built", "loaded", "rebuilt": how this process got it
        self.device = int(device)
        self._backend = backend
        self._native = native
        self._launch: Callable[[Mapping[int, Any]], None] | None = None  # the backend's, made at the first launch
        self._by_uid = {spec.uid: _Expect(spec) for spec in self.tensors}
        known = {spec.uid for spec in self.tensors}
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
    def native(self) -> Any:
        """The backend's own plan object (a cuDNN graph for the cuDNN backend)."""
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

    def check(self, tensors: Mapping[int | str, Any]) -> dict[int, Any]:
        """The variant pack by uid, after checking every tensor. Raises
        ``TensorMismatchError`` naming each problem; launches nothing."""
        if not isinstance(tensors, Mapping):
            raise TensorMismatchError(
                f"plan {self.key[:12]}: tensors must be a mapping of uid or name to tensor, not {type(tensors).__name__}",
                key=self.key,
                problems=["not a mapping"],
            )
        pack = self._checked(tensors)
        if pack is None:
            self._explain_mismatch(tensors)
        return pack  # type: ignore[return-value]

    def _checked(self, tensors: Mapping[int | str, Any]) -> dict[int, Any] | None:
        """The pack when every tensor is what the plan expects, else None (the slow path
        then names each problem)."""
        if len(tensors) != len(self._by_uid):
            return None
        try:
            return self._matched(tensors)
        except (AttributeError, TypeError, IndexError, KeyError, RuntimeError):
            return None  # not a tensor, or not one of ours

    def _matched(self, tensors: Mapping[int | str, Any]) -> dict[int, Any] | None:
        """The fast path of ``check``, run on every launch: one pass over the tensors, each
        compared with what its uid expects; None on the first mismatch. Must accept exactly
        what ``_problems_of`` accepts."""
        by_uid, name_to_uid = self._by_uid, self._name_to_uid
        cuda = self._backend.device_type == "cuda"
        device = self.device
        pack: dict[int, Any] = {}
        for ref, tensor in tensors.items():
            # A name not in the plan's names stays a str, which no uid equals: KeyError below.
            uid: int = name_to_uid.get(ref, ref) if ref.__class__ is str else ref  # type: ignore[arg-type, assignment]
            expect = by_uid[uid]
            pack[uid] = tensor
            if expect.by_value:
                continue
            dtypes = expect.dtypes
            if dtypes is None:
                expect.resolve()
                dtypes = expect.dtypes
            # Empty dims: a shape the backend left unknown, not checked (as in the slow path).
            if tensor.dtype not in dtypes or (expect.dims and tensor.shape != expect.dims):  # type: ignore[operator]
                return None
            stride = tensor.stride()
            if stride != expect.strides and any(stride[i] != s for i, s in expect.stride_items):
                return None
            if tensor.data_ptr() % expect.alignment:
                return None
            # is_cpu, not "not is_cuda": a meta (or mps, xpu) tensor is no CPU tensor.
            if not (tensor.is_cuda and tensor.get_device() == device) if cuda else not tensor.is_cpu:
                return None
        return pack if len(pack) == len(by_uid) else None  # a uid given twice (by name and by uid)

    def _explain_mismatch(self, tensors: Mapping[int | str, Any]) -> None:
        """The slow path: name every problem, then raise."""
        pack: dict[int, Any] = {}
        problems: list[str] = []
        for ref, tensor in tensors.items():
            uid = self._name_to_uid.get(ref) if isinstance(ref, str) else ref
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

    def _problems_of(self, uid: int, tensor: Any) -> list[str]:
        expect = self._by_uid[uid]
        spec = expect.spec
        if spec.is_pass_by_value:
            return []
        where = self._where(uid)
        try:
            shape, stride, device, pointer = tuple(tensor.shape), tuple(tensor.stride()), tensor.device, int(tensor.data_ptr())
        except (AttributeError, TypeError, RuntimeError):
            return [f"{where} is a {type(tensor).__name__}, not a tensor"]
        problems = []
        if expect.dims and shape != expect.dims:
            problems.append(f"{where} has shape {list(shape)}, the plan needs {list(expect.dims)}")
        elif any(stride[i] != s for i, s in expect.stride_items):
            problems.append(f"{where} has strides {list(stride)}, the plan needs {list(expect.strides)}")
        if expect.dtypes is None:
            expect.resolve()
        if tensor.dtype not in (expect.dtypes or ()):
            wanted = (
                " or ".join(f"torch.{n}" for n in expect.dtype_names or ())
                or f"none (cuDNN type {spec.dtype} is not a storage type)"
            )
            problems.append(f"{where} has dtype {tensor.dtype}, the plan needs {wanted}")
        if pointer % expect.alignment:
            problems.append(
                f"{where} starts at an address {pointer % expect.alignment} bytes off the {expect.alignment}-byte alignment the plan was built for"
            )
        device_type = self._backend.device_type
        if device.type != device_type or (device_type == "cuda" and device.index != self.device):
            problems.append(f"{where} is on {device}, the plan runs on {device_type}:{self.device}")
        return problems

    def execute(self, tensors: Mapping[int | str, Any]) -> None:
        """Check ``tensors`` (by uid or name) and launch the plan on the current stream of
        the plan's device, with scratch memory of its own."""
        # A dict, the common case, skips check()'s Mapping test; anything else, or a
        # mismatch, goes through check(), which names every problem.
        pack = self._checked(tensors) if tensors.__class__ is dict else None
        if pack is None:
            pack = self.check(tensors)
        launch = self._launch
        try:
            if launch is None:
                launch = self._launch = self._backend.launcher(self._native, self.workspace_size, self.device)
            launch(pack)
        except Exception as exc:
            raise ExecutionError(
                f"plan {self.key[:12]} failed to launch on {self._backend.device_type}:{self.device}: {type(exc).__name__}: {exc}",
                key=self.key,
                device=self.device,
            ) from exc

    __call__ = execute
