"""A ready plan: checks the caller's tensors, then launches through the backend.

No torch import: tensors are checked through their ``shape``, ``stride()``, ``dtype`` and
``device`` attributes, so importing plancache stays cheap.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .backend import Backend, EngineChoice
from .errors import TensorMismatchError
from .key import TensorSpec

__all__ = ["TORCH_DTYPES", "Plan"]

#: cuDNN data type -> the torch dtype a tensor of that type has.
TORCH_DTYPES = {
    "data_type.HALF": "torch.float16",
    "data_type.BFLOAT16": "torch.bfloat16",
    "data_type.FLOAT": "torch.float32",
    "data_type.DOUBLE": "torch.float64",
    "data_type.INT8": "torch.int8",
    "data_type.UINT8": "torch.uint8",
    "data_type.INT32": "torch.int32",
    "data_type.INT64": "torch.int64",
    "data_type.BOOLEAN": "torch.bool",
    "data_type.FP8_E4M3": "torch.float8_e4m3fn",
    "data_type.FP8_E5M2": "torch.float8_e5m2",
}


class Plan:
    """An executable plan for one graph on one device.

    ``plan.execute({uid_or_name: tensor, ...})`` runs it on the caller's current CUDA
    stream. The workspace is allocated once, on first use, and reused, so a plan can be
    captured in a CUDA graph after one eager call (or after ``plan.prepare()``).
    """

    __slots__ = (
        "_backend",
        "_expected",
        "_fast",
        "_name_to_uid",
        "_native",
        "_required",
        "_workspace",
        "device",
        "engine",
        "key",
        "source",
        "tensors",
        "workspace_size",
    )  # fmt: skip

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
    ) -> None:
        self.key = key
        self.tensors = list(tensors)
        self.workspace_size = int(workspace_size)
        self.engine = engine
        self.source = source  # "built", "loaded", "rebuilt": how this process got it
        self.device = device
        self._backend = backend
        self._native = native
        self._workspace: Any = None
        self._fast: dict[int, tuple[Any, ...]] | None = None
        self._name_to_uid = {spec.name: spec.uid for spec in self.tensors}
        self._required = frozenset(spec.uid for spec in self.tensors)
        # Strides of size-1 dimensions never affect addressing, so they are not checked.
        self._expected = {
            spec.uid: (
                spec,
                tuple(spec.dims),
                tuple((i, s) for i, (d, s) in enumerate(zip(spec.dims, spec.strides)) if d != 1),
                TORCH_DTYPES.get(spec.dtype or ""),
            )
            for spec in self.tensors
        }

    def __repr__(self) -> str:
        return f"<Plan {self.key[:12]} {self.source} tensors={sorted(self._required)} workspace={self.workspace_size}>"

    @property
    def native(self) -> Any:
        """The backend's own plan object (a cuDNN graph for the cuDNN backend)."""
        return self._native

    def prepare(self) -> Plan:
        """Allocate the workspace now (before CUDA-graph capture, say)."""
        if self._workspace is None and self.workspace_size > 0:
            self._workspace = self._backend.allocate_workspace(self.workspace_size)
        return self

    def _fast_table(self) -> dict[int, tuple[Any, ...]]:
        """Per uid: (dims, strides, torch dtype, size-1-tolerant strides), resolved once.

        torch is looked up in ``sys.modules``: a caller passing tensors has imported it.
        """
        torch = sys.modules.get("torch")
        table = {}
        for uid, (spec, dims, stride_items, dtype_name) in self._expected.items():
            dtype = getattr(torch, dtype_name.split(".")[1], None) if torch is not None and dtype_name else None
            table[uid] = (spec.is_pass_by_value, dims, tuple(spec.strides), stride_items, dtype)
        return table

    def check(self, tensors: Mapping[int | str, Any]) -> dict[int, Any]:
        """The variant pack by uid, after checking every tensor. Raises
        ``TensorMismatchError`` naming each problem; launches nothing."""
        name_to_uid = self._name_to_uid
        # Keys are uids once the check below passes (names were mapped, unknowns refused).
        pack: dict[Any, Any] = {(name_to_uid.get(ref, ref) if ref.__class__ is str else ref): t for ref, t in tensors.items()}
        fast = self._fast
        if fast is None:
            fast = self._fast = self._fast_table()
        ok = pack.keys() == self._required and len(pack) == len(tensors)
        if ok:
            cuda = self._backend.device_type == "cuda"
            try:
                for uid, tensor in pack.items():
                    pass_by_value, dims, strides, stride_items, dtype = fast[uid]
                    if pass_by_value:
                        continue
                    # Empty dims: a shape the backend left unknown, not checked (as in the slow path).
                    if (dims and tensor.shape != dims) or (dtype is not None and tensor.dtype is not dtype):
                        ok = False
                        break
                    stride = tensor.stride()
                    if stride != strides and any(stride[i] != s for i, s in stride_items):
                        ok = False
                        break
                    # is_cpu, not "not is_cuda": a meta (or mps, xpu) tensor is no CPU tensor.
                    if not (tensor.is_cuda if cuda else tensor.is_cpu) or (cuda and tensor.get_device() != self.device):
                        ok = False
                        break
            except (AttributeError, TypeError, IndexError):
                ok = False
        if not ok:
            self._explain_mismatch(tensors)
        return pack

    def _explain_mismatch(self, tensors: Mapping[int | str, Any]) -> None:
        """The slow path: name every problem, then raise."""
        pack: dict[int, Any] = {}
        problems: list[str] = []
        for ref, tensor in tensors.items():
            uid = self._name_to_uid.get(ref) if isinstance(ref, str) else ref
            if uid is None or uid not in self._required:
                problems.append(f"{ref!r} is not a tensor of this plan")
                continue
            if uid in pack:
                problems.append(f"uid {uid} is given twice (by name and by uid)")
            pack[uid] = tensor
        missing = self._required.difference(pack)
        if missing:
            names = ", ".join(f"{self._expected[u][0].name!r} (uid {u})" for u in sorted(missing))
            problems.append(f"missing {names}")
        device_type = self._backend.device_type
        for uid, tensor in pack.items():
            spec, dims, strides, dtype = self._expected[uid]
            if spec.is_pass_by_value:
                continue
            where = f"{spec.name!r} (uid {uid})"
            try:
                shape = tuple(tensor.shape)
                stride = tuple(tensor.stride())
                device = tensor.device
            except (AttributeError, TypeError):
                problems.append(f"{where} is a {type(tensor).__name__}, not a tensor")
                continue
            if dims and shape != dims:
                problems.append(f"{where} has shape {list(shape)}, the plan needs {list(dims)}")
            elif any(stride[i] != s for i, s in strides):
                problems.append(f"{where} has strides {list(stride)}, the plan needs {list(spec.strides)}")
            if dtype is not None and str(tensor.dtype) != dtype:
                problems.append(f"{where} has dtype {tensor.dtype}, the plan needs {dtype}")
            if device.type != device_type or (device_type == "cuda" and device.index != self.device):
                problems.append(f"{where} is on {device}, the plan runs on {device_type}:{self.device}")
        if not problems:  # the fast path refused something the slow path cannot name
            problems.append("the tensors do not match the plan")
        raise TensorMismatchError(f"plan {self.key[:12]}: " + "; ".join(problems), key=self.key, problems=problems)

    def execute(self, tensors: Mapping[int | str, Any]) -> None:
        """Check ``tensors`` (by uid or name) and launch the plan on the current stream."""
        pack = self.check(tensors)
        if self._workspace is None and self.workspace_size > 0:
            self._workspace = self._backend.allocate_workspace(self.workspace_size)
        self._backend.execute(self._native, pack, self._workspace)

    __call__ = execute
