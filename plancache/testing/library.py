"""cuDNN's C API, simulated on the CPU test device: the calls ``cudnn.library.Library``
offers, so that ``guest.native.NativePlan`` (loads, variant packs, the frontend's
workspace changes, launches) runs in the CPU suite exactly as it runs on a GPU.

* **pointers are real.** A launch reads and writes the tensors (and the workspace) at the
  addresses in its variant pack, laid out as the plan's tensor table says: a pointer in the
  wrong slot computes with the wrong tensor, a missing one faults, a misaligned one is refused;
* **handles have a device and a stream.** A plan runs on its handle's stream (recorded, not
  run, while that stream captures) and is refused with a handle of another device;
* **descriptors are destroyed once:** a second destroy, or a use after it, fails as a
  double free would crash;
* **loads are host work:** finalizing allocates, captures and synchronizes nothing
  (``during_load`` and ``load_delay`` stand for the program's work and cuDNN's time).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import NativeError
from ..guest.tensors import TORCH_DTYPES, span, storage_geometry
from ..key import TensorSpec, used_tensors
from . import plans
from .device import SimulatedCuda

__all__ = ["ALIGNMENT", "HANDLE_BYTES", "SimulatedLibrary", "tensor_at"]

_BAD_PARAM = 2000  # CUDNN_STATUS_BAD_PARAM
_NOT_SUPPORTED = 3000  # CUDNN_STATUS_NOT_SUPPORTED
_EXECUTION_FAILED = 5000  # CUDNN_STATUS_EXECUTION_FAILED
HANDLE_BYTES = 4 << 20  # cuDNN's persistent buffer, allocated when a handle is created
ALIGNMENT = 16  # bytes: a tensor address cuDNN accepts (the frontend's path checks the same)


def tensor_at(pointer: int, spec: TensorSpec) -> Any:
    """The tensor ``spec`` describes, at ``pointer`` in this process's memory (a view: writes
    go to whatever lives there)."""
    import torch

    names = TORCH_DTYPES.get(spec.dtype or "") or ("float32",)
    dtype = getattr(torch, names[0])
    geometry = storage_geometry(spec.dtype, tuple(spec.dims), tuple(spec.strides))
    dims, strides = geometry if geometry is not None else (tuple(spec.dims), tuple(spec.strides))
    if spec.is_pass_by_value or not dims:
        dims, strides = (1,), (1,)
    extent = span(dims, strides)
    if extent == 0:
        return torch.empty(dims, dtype=dtype)
    size = extent * torch.empty((), dtype=dtype).element_size()
    buffer = (ctypes.c_byte * size).from_address(pointer)
    return torch.frombuffer(buffer, dtype=dtype, count=extent).as_strided(dims, strides)


@dataclass
class _HandleState:
    device: int
    stream: int | None = None


@dataclass
class _PlanState:
    payload: dict[str, Any]
    tensors: list[TensorSpec]
    device: int
    workspace: int


@dataclass(frozen=True)
class _PackState:
    pointers: Mapping[int, int]  # uid -> address
    workspace: int


#: How the test device computes a plan: ``(description, tensors, pack by uid, payload,
#: workspace tensor or None, stream)`` (``CpuTestBackend.compute``).
Compute = Callable[[Mapping[str, Any], Sequence[TensorSpec], Mapping[int, Any], Any, Any, int | None], None]


class SimulatedLibrary:
    """The C API of cuDNN (and the driver calls a launch makes) on the CPU test device."""

    def __init__(self, cuda: SimulatedCuda, current_device: Callable[[], int], compute: Compute) -> None:
        self.cuda = cuda
        self._current_device = current_device
        self._compute = compute
        self._lock = threading.Lock()
        self._ids = itertools.count(0x10000, 0x10)
        self._handles: dict[int, _HandleState] = {}
        self._plans: dict[int, _PlanState] = {}
        self._packs: dict[int, _PackState] = {}
        self.destroyed = 0
        self.handles_created = 0
        self.loads = 0
        self.launches = 0
        #: Called while a plan finalizes (no capture open): tests put the program's work there.
        self.during_load: Callable[[], None] | None = None
        self.load_delay = 0.0

    def _new_id(self) -> int:
        with self._lock:
            return next(self._ids)

    # ------------------------------------------------------------------ handles

    def version(self) -> int:
        return 91900

    def create_handle(self) -> int:
        """A handle on the calling thread's current device: cuDNN's persistent buffer is a
        ``cudaMalloc`` (refused beside a global-mode capture unless this thread is relaxed)."""
        self.cuda.allocate(HANDLE_BYTES)
        raw = self._new_id()
        self._handles[raw] = _HandleState(device=self._current_device())
        self.handles_created += 1
        return raw

    def set_stream(self, handle: int, stream: int) -> None:
        self._handle(handle, "cudnnSetStream").stream = stream

    def _handle(self, handle: int, call: str) -> _HandleState:
        state = self._handles.get(handle)
        if state is None:
            raise _failed(call, f"CUDNN_STATUS_BAD_PARAM ({_BAD_PARAM}): not a handle")
        return state

    def handle_device(self, handle: int) -> int:
        return self._handle(handle, "cudnnGetHandleDevice").device

    # ------------------------------------------------------------------ descriptors

    def destroy(self, descriptor: int) -> None:
        with self._lock:
            found = self._plans.pop(descriptor, None) or self._packs.pop(descriptor, None)
        if found is None:
            raise _failed("cudnnBackendDestroyDescriptor", f"descriptor {descriptor:#x} is not live (destroyed twice?)")
        self.destroyed += 1

    def load_plan(self, handle: int, representation: bytes) -> int:
        """Finalize a plan from its representation on the handle's device: host work only."""
        call = "cudnnBackendFinalize(EXECUTION_PLAN)"
        state = self._handle(handle, call)
        self.cuda.check()
        try:
            payload = plans.payload_of(representation)
        except ValueError as exc:
            raise _failed(call, f"CUDNN_STATUS_NOT_SUPPORTED ({_NOT_SUPPORTED}): {exc}", _NOT_SUPPORTED) from exc
        if self.during_load is not None:
            self.during_load()
        if self.load_delay:
            import time

            time.sleep(self.load_delay)
        used = used_tensors(payload["description"])  # as cuDNN's plan, it holds the tensors of its nodes only
        tensors = [spec for spec in map(TensorSpec.from_dict, payload["tensors"]) if f"u{spec.uid}" in used]
        plan = self._new_id()
        self._plans[plan] = _PlanState(payload, tensors, state.device, int(payload.get("workspace", 0) or 0))
        self.loads += 1
        return plan

    def plan_workspace(self, plan: int) -> int:
        return self._plan(plan, "cudnnBackendGetAttribute(EXECUTION_PLAN_WORKSPACE_SIZE)").workspace

    def _plan(self, plan: int, call: str) -> _PlanState:
        state = self._plans.get(plan)
        if state is None:
            raise _failed(call, f"plan {plan:#x} is not live")
        return state

    def variant_pack(self, uids: Any, pointers: Any, count: int, workspace: int) -> int:
        pack = self._new_id()
        self._packs[pack] = _PackState({int(uids[i]): int(pointers[i] or 0) for i in range(count)}, int(workspace or 0))
        return pack

    def execute(self, handle: int, plan: int, pack: int) -> None:
        """Run ``plan`` on the handle's stream with the tensors at the pack's addresses."""
        call = "cudnnBackendExecute"
        state, planned = self._handle(handle, call), self._plan(plan, call)
        packed = self._packs.get(pack)
        if packed is None:
            raise _failed(call, f"variant pack {pack:#x} is not live")
        if state.device != planned.device:
            raise _failed(call, f"a plan loaded on device {planned.device} was launched on device {state.device}")
        tensors: dict[int, Any] = {}
        for spec in planned.tensors:
            pointer = packed.pointers.get(spec.uid, 0)
            if not pointer:
                raise _failed(call, f"no pointer for uid {spec.uid}")
            if pointer % ALIGNMENT and not spec.is_pass_by_value:
                why = f"misaligned address: tensor uid {spec.uid} is not {ALIGNMENT}-byte aligned"
                raise _failed(call, why, _EXECUTION_FAILED)
            tensors[spec.uid] = tensor_at(pointer, spec)
        workspace = None
        if planned.workspace:
            if not packed.workspace:
                raise _failed(call, "the plan needs a workspace")
            workspace = tensor_at(packed.workspace, TensorSpec(uid=0, name="workspace", dims=(planned.workspace,), strides=(1,),
                                                               dtype="data_type.UINT8", is_output=False))  # fmt: skip
        self._compute(planned.payload["description"], planned.tensors, tensors, planned.payload, workspace, state.stream)
        self.launches += 1

    # ------------------------------------------------------------------ driver

    def copy_to_device(self, destination: int, source: Any, size: int, stream: int) -> None:
        self.cuda.launch(lambda: ctypes.memmove(destination, source, size), stream)

    def zero(self, destination: int, size: int, stream: int) -> None:
        self.cuda.launch(lambda: ctypes.memset(destination, 0, size), stream)


def _failed(call: str, why: str, status: int = _BAD_PARAM) -> NativeError:
    return NativeError(f"{call} failed: {why}", call=call, status=status)
