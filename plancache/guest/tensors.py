"""What a tensor handed to a plan must look like, and the one check of it.

A plan launch (``Plan.execute``) and a candidate timed on the caller's own tensors
(``PlanCache.get(graph, inputs=...)``) check tensors the same way: shape, strides, dtype
(every cuDNN data type has its torch dtypes), device and alignment. No torch import:
tensors are read through ``shape``, ``stride()``, ``dtype``, ``device`` and ``data_ptr()``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from ..errors import TensorMismatchError
from ..key import TensorSpec

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DTYPE_BYTES",
    "TORCH_DTYPES",
    "Expect",
    "TensorLike",
    "checked_inputs",
    "span",
    "storage_geometry",
    "tensor_problems",
]

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
#: Bytes per element of each cuDNN data type (4-bit types: see ``storage_geometry``).
DTYPE_BYTES = {
    "data_type.HALF": 2, "data_type.BFLOAT16": 2, "data_type.FLOAT": 4, "data_type.DOUBLE": 8,
    "data_type.INT8": 1, "data_type.UINT8": 1, "data_type.INT32": 4, "data_type.INT64": 8,
    "data_type.BOOLEAN": 1, "data_type.FP8_E4M3": 1, "data_type.FP8_E5M2": 1, "data_type.FP8_E8M0": 1,
    "data_type.FP8_E5M3": 1, "data_type.FP4_E2M1": 1, "data_type.INT4": 1,
}  # fmt: skip
#: Types stored two elements per byte along their unit-stride axis.
_PACKED = frozenset({"data_type.FP4_E2M1", "data_type.INT4"})
#: Bytes every data pointer must be aligned to when a spec does not say: the frontend's
#: graph API declares its tensors 16-byte aligned to cuDNN, and a plan built under that
#: promise fails or misbehaves on a pointer 2 bytes off (seen on an H200).
DEFAULT_ALIGNMENT = 16


class TensorLike(Protocol):
    """What plancache reads of a tensor (a ``torch.Tensor``) handed to a plan or a builder."""

    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> object: ...
    @property
    def device(self) -> object: ...
    @property
    def is_cpu(self) -> bool: ...
    @property
    def is_cuda(self) -> bool: ...
    def stride(self) -> tuple[int, ...]: ...
    def data_ptr(self) -> int: ...
    def numel(self) -> int: ...
    def get_device(self) -> int: ...


def span(dims: Sequence[int], strides: Sequence[int]) -> int:
    """Elements from a strided layout's first element to its last, both included: what its
    storage must hold (1 for a scalar, 0 when a dimension is 0). Non-negative strides."""
    return 0 if 0 in dims else 1 + sum((d - 1) * s for d, s in zip(dims, strides))


def storage_geometry(
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


class Expect:
    """What one tensor of the plan must look like, resolved once per plan."""

    __slots__ = ("alignment", "by_value", "dims", "dtype_names", "dtypes", "spec", "stride_items", "strides")

    def __init__(self, spec: TensorSpec) -> None:
        self.spec = spec
        geometry = storage_geometry(spec.dtype, tuple(spec.dims), tuple(spec.strides))
        self.dims, self.strides = geometry if geometry is not None else ((-1,), ())  # (-1,): nothing matches
        # Strides of size-1 dimensions never affect addressing, so they are not compared.
        self.stride_items = tuple((i, s) for i, (d, s) in enumerate(zip(self.dims, self.strides)) if d != 1)
        self.dtype_names = TORCH_DTYPES.get(spec.dtype or "")
        self.alignment = max(1, int(getattr(spec, "alignment", DEFAULT_ALIGNMENT) or 1))
        self.by_value = bool(spec.is_pass_by_value)  # a host scalar: one element, in host memory
        self.dtypes: tuple[Any, ...] | None = None  # torch dtype objects, resolved at first check

    def resolve(self) -> None:
        torch = sys.modules.get("torch")
        names = self.dtype_names if self.dtype_names is not None else ()
        found = tuple(getattr(torch, n) for n in names if torch is not None and hasattr(torch, n))
        self.dtypes = found


def tensor_problems(expect: Expect, tensor: Any, where: str, device_type: str, device: int) -> list[str]:
    """Everything wrong with ``tensor`` as the tensor ``expect`` describes (empty: it
    fits), each said as ``where`` (the tensor as the caller knows it) plus what is wrong."""
    spec = expect.spec
    if spec.is_pass_by_value:
        return _by_value_problems(expect, tensor, where)
    try:
        shape, stride, on, pointer = tuple(tensor.shape), tuple(tensor.stride()), tensor.device, int(tensor.data_ptr())
    except (AttributeError, TypeError, RuntimeError):
        return [f"{where} is a {type(tensor).__name__}, not a tensor"]
    problems = []
    if expect.dims and shape != expect.dims:
        problems.append(f"{where} has shape {list(shape)}, the plan needs {list(expect.dims)}")
    elif any(stride[i] != s for i, s in expect.stride_items):
        problems.append(f"{where} has strides {list(stride)}, the plan needs {list(expect.strides)}")
    problems += _dtype_problems(expect, tensor, where)
    if pointer % expect.alignment:
        problems.append(
            f"{where} starts at an address {pointer % expect.alignment} bytes off the {expect.alignment}-byte alignment the plan was built for"
        )
    if on.type != device_type or (device_type == "cuda" and on.index != device):
        problems.append(f"{where} is on {on}, the plan runs on {device_type}:{device}")
    return problems


def _dtype_problems(expect: Expect, tensor: Any, where: str) -> list[str]:
    if expect.dtypes is None:
        expect.resolve()
    if tensor.dtype in (expect.dtypes or ()):
        return []
    spec = expect.spec
    wanted = (
        " or ".join(f"torch.{n}" for n in expect.dtype_names or ()) or f"none (cuDNN type {spec.dtype} is not a storage type)"
    )
    return [f"{where} has dtype {tensor.dtype}, the plan needs {wanted}"]


def _by_value_problems(expect: Expect, tensor: Any, where: str) -> list[str]:
    """A pass-by-value scalar (an attention scale, an epsilon) is handed to cuDNN as a host
    pointer, read as the plan's type: a device tensor's address, another type or more than
    one element would be misread without an error."""
    try:
        on, count = tensor.device, int(tensor.numel())
    except (AttributeError, TypeError, RuntimeError):
        return [f"{where} is a {type(tensor).__name__}: a pass-by-value scalar is a one-element CPU tensor"]
    problems = []
    if on.type != "cpu":
        problems.append(f"{where} is on {on}: a pass-by-value scalar is read from host memory, pass a CPU tensor")
    if count != 1:
        problems.append(f"{where} has {count} elements: a pass-by-value scalar has one")
    if expect.dtype_names is None:  # a type the graph leaves to cuDNN: nothing to compare with
        return problems
    return problems + _dtype_problems(expect, tensor, where)


def checked_inputs(given: Mapping[int, Any], specs: Sequence[TensorSpec], device_type: str, device: int) -> dict[int, Any]:
    """The caller's own tensors for timing (``PlanCache.get(graph, inputs=...)``), by uid,
    checked as a launch checks them; outputs are dropped (autotuning writes outputs of its
    own, never the caller's). Raises ``TensorMismatchError`` naming every problem."""
    by_uid = {spec.uid: spec for spec in specs}
    problems: list[str] = []
    kept: dict[int, Any] = {}
    for uid, tensor in given.items():
        spec = by_uid.get(uid) if isinstance(uid, int) else None
        if spec is None:
            problems.append(f"inputs: {uid!r} is not a uid of this graph")
        elif not spec.is_output:
            problems.extend(tensor_problems(Expect(spec), tensor, f"inputs[{uid}]", device_type, device))
            kept[uid] = tensor
    if problems:
        raise TensorMismatchError("the tensors given to time candidates on do not fit the graph: " + "; ".join(problems),
                                  key="", problems=problems)  # fmt: skip
    return kept
