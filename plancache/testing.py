"""A CPU backend for tests: the whole cache (hits, misses, store, locking, CLI) without a GPU.

``CpuTestBackend`` takes real ``cudnn.pygraph`` objects, which build without a GPU, and
implements the backend seam with PyTorch on the CPU:

* candidates: a fixed number per graph with simulated, deterministic timings (a function
  of the key and the index), so autotuning picks the same winner every time;
* a plan blob: the graph's canonical description and the chosen engine, as JSON behind a
  magic header, so a damaged blob is refused by ``load`` just as cuDNN refuses one;
* execution: a reference implementation of convolution, matmul, pointwise ops and SDPA,
  so users can test code that runs plans on CPU-only CI.

Options make it slow (``build_delay``) or log every build to a file (``build_log``), which
the concurrency tests use to count builds across processes.

Use it with ``PlanCache(backend=CpuTestBackend())``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .engines.backend import BuiltPlan, EngineChoice
from .errors import BuildError, InvalidGraphError
from .key import BuildOptions, TensorSpec, canonical_json, describe, tensor_table

__all__ = ["CpuTestBackend", "TwoDeviceCpuTestBackend"]

MAGIC = b"PLANCACHE-TEST-PLAN/1\n"

_TORCH_DTYPE_NAMES = {
    "data_type.HALF": "float16",
    "data_type.BFLOAT16": "bfloat16",
    "data_type.FLOAT": "float32",
    "data_type.DOUBLE": "float64",
    "data_type.INT32": "int32",
    "data_type.INT64": "int64",
    "data_type.INT8": "int8",
    "data_type.UINT8": "uint8",
    "data_type.BOOLEAN": "bool",
}


def _torch() -> Any:
    import torch

    return torch


class _Native:
    """A 'loaded plan' of the test backend: the description it evaluates, on one device."""

    def __init__(self, description: dict[str, Any], tensors: Sequence[TensorSpec], engine: dict[str, Any], device: int) -> None:
        self.description = description
        self.tensors = list(tensors)
        self.engine = engine
        self.device = device
        self.executions = 0


def _pointwise(torch: Any, mode: str, a: Any, b: Any, params: Mapping[str, Any]) -> Any:
    functional = torch.nn.functional
    binary = {"add": torch.add, "bias": torch.add, "sub": torch.sub, "mul": torch.mul, "scale": torch.mul,
              "div": torch.div, "max": torch.maximum, "min": torch.minimum, "pow": torch.pow}  # fmt: skip
    unary = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "exp": torch.exp,
             "log": torch.log, "neg": torch.neg, "abs": torch.abs, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
             "identity": lambda x: x, "gelu": functional.gelu, "swish": functional.silu,
             "gelu_approx_tanh": lambda x: functional.gelu(x, approximate="tanh"), "erf": torch.erf}  # fmt: skip
    if mode in binary:
        return binary[mode](a, b)
    if mode in unary:
        return unary[mode](a)
    raise NotImplementedError(f"pointwise mode {mode!r}")


def _evaluate(description: Mapping[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Evaluate a canonical description on CPU in float32; ``values`` maps tensor ids to tensors."""
    torch = _torch()
    functional = torch.nn.functional
    for tid, spec in description["tensors"].items():  # scalars the graph holds itself
        if tid.startswith("c"):
            scalar = spec["scalar"]
            values[tid] = float(scalar["float"]) if isinstance(scalar, dict) else scalar

    def get(ref: str | None) -> Any:
        if ref is None:
            return None
        value = values[ref]
        if isinstance(value, (int, float)):
            return torch.tensor(float(value))
        return value.float()

    for node in description["nodes"]:
        kind, params, ins = node["type"], node["params"], node["inputs"]
        if kind == "CONV_FPROP":
            x, w = get(ins["image"]), get(ins["weight"])
            conv = {3: functional.conv1d, 4: functional.conv2d, 5: functional.conv3d}[x.dim()]
            out = conv(x, w, padding=params["padding"], stride=params["stride"], dilation=params["dilation"])
        elif kind == "POINTWISE":
            out = _pointwise(torch, str(params.get("mode")), get(ins.get("IN_0")), get(ins.get("IN_1")), params)
        elif kind == "MATMUL":
            out = torch.matmul(get(ins["A"]), get(ins["B"]))
        elif kind == "SDPA":
            q, k, v = get(ins["q"]), get(ins["k"]), get(ins["v"])
            scale = get(ins.get("attn_scale")) if ins.get("attn_scale") else params.get("attn_scale")
            if k.shape[1] != q.shape[1]:  # grouped-query attention
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            causal = bool(params.get("use_causal_mask") or params.get("causal_mask"))
            scale_value = float(scale) if scale is not None else None
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale_value)
        else:
            raise NotImplementedError(f"node type {kind}")
        first_port = next(iter(node["outputs"]))
        values[node["outputs"][first_port]] = out
    return values


class _Candidates:
    def __init__(self, backend: CpuTestBackend, graph_description: dict[str, Any], tensors: list[TensorSpec]) -> None:
        self.backend = backend
        self.description = graph_description
        self.tensors = tensors
        self.digest = hashlib.sha256(canonical_json(graph_description).encode()).digest()
        self.built: set[int] = set()

    def __len__(self) -> int:
        return self.backend.candidate_count

    def engine(self, index: int) -> EngineChoice:
        return EngineChoice(engine_id=index, knobs={"tile": 64 << (index % 3)}, name=f"test_engine_{index}")

    def build(self, index: int) -> str | None:
        if index in self.backend.unbuildable:
            return "not supported by the test device"
        if self.backend.build_delay:
            time.sleep(self.backend.build_delay)
        self.built.add(index)
        return None

    def simulated_ms(self, index: int) -> float:
        """Deterministic per (graph, index); candidate 0 is rarely the best, as on GPUs."""
        return 0.05 + (self.digest[index % len(self.digest)] / 255.0) * (1 + index % 4)

    def time(self, index: int, runs: int) -> list[float]:
        if index not in self.built:
            raise RuntimeError(f"candidate {index} was not built")
        if index in self.backend.unlaunchable:
            raise RuntimeError(f"candidate {index} failed to launch (simulated)")
        return [self.simulated_ms(index) * (1 + 0.001 * (r % 3)) for r in range(runs)]

    def finish(self, index: int) -> BuiltPlan:
        engine = self.engine(index)
        return self.backend.make_plan(self.description, self.tensors, engine)

    def close(self) -> None:
        self.built.clear()


def summary_of_ops(description: Mapping[str, Any]) -> str:
    """What a kernel is compiled for, regardless of shapes: the op types in order."""
    return "+".join(node["type"] for node in description["nodes"])


class CpuTestBackend:
    """The backend seam implemented on the CPU with PyTorch; see the module docstring.

    It behaves like cuDNN exactly where cache bugs hide:

    * a graph is planned once: ``candidates`` and ``rebuild`` freeze the pygraph and refuse
      one that was already planned, as cuDNN Frontend does;
    * kernels use the workspace as scratch: outputs are staged in it, so two launches that
      share one workspace give wrong results;
    * devices differ: ``devices`` environments, one per device, ``use_device(i)`` per thread
      (like ``torch.cuda.set_device``), and a plan launched on another device than the one
      it was loaded on raises;
    * alignment matters: a tensor whose data pointer is not 16-byte aligned is refused at
      launch, as cuBLASLt refuses it on a GPU.

    ``candidates``: how many candidate plans each graph has. ``unbuildable``: indices whose
    build fails. ``unlaunchable``: indices whose timed runs raise. ``build_delay``: seconds
    each candidate build sleeps. ``build_log``: a file that gets one line per finished build
    (the key of the description). ``environment``: replaces fields of device 0's fingerprint
    (to stand for another GPU or library version); ``devices``: how many devices, or one
    dict of replaced fields per device.
    """

    name = "cpu-test"
    device_type = "cpu"

    def __init__(
        self,
        *,
        candidates: int = 4,
        unbuildable: Sequence[int] = (),
        unlaunchable: Sequence[int] = (),
        build_delay: float = 0.0,
        build_log: str | os.PathLike[str] | None = None,
        environment: Mapping[str, Any] | None = None,
        devices: int | Sequence[Mapping[str, Any]] = 1,
        in_use: Sequence[int] | None = None,
    ) -> None:
        if candidates < 1:
            raise ValueError("candidates must be >= 1")
        self.candidate_count = candidates
        self.unbuildable = frozenset(unbuildable)
        self.unlaunchable = frozenset(unlaunchable)
        self.build_delay = build_delay
        self.build_log = os.fspath(build_log) if build_log is not None else None
        base = {
            "gpu_name": "CPU test device",
            "compute_capability": "0.0",
            "sm_count": 0,
            "driver_version": "none",
            "cuda_version": "none",
            "cudnn_backend_version": "cpu-test",
            "cudnn_frontend_version": "cpu-test",
            **(environment or {}),
        }
        overrides = [{}] * devices if isinstance(devices, int) else [dict(d) for d in devices]
        if not overrides:
            raise ValueError("devices must be at least 1")
        self._environments = [{**base, **extra} for extra in overrides]
        # Devices this process has done work on (a CUDA context exists there); None: all of
        # them, as in a process that already set its devices up. Work on a device adds it.
        self._in_use: set[int] | None = None if in_use is None else set(in_use)
        self._local = threading.local()
        self.loads = 0
        self.launches = 0
        # Simulated kernel cache: descriptions of the dynamic-shape graphs "compiled" so far.
        self.kernels: set[str] = set()

    def environment(self, device: int | None = None) -> dict[str, Any]:
        return dict(self._environments[self.current_device() if device is None else device])

    def current_device(self) -> int:
        return int(getattr(self._local, "device", 0))

    def device_count(self) -> int:
        return len(self._environments)

    def use_device(self, index: int) -> None:
        """This thread's current device from now on (like ``torch.cuda.set_device``, which
        sets the device up for this process)."""
        if not 0 <= index < len(self._environments):
            raise ValueError(f"no device {index}: the test backend has {len(self._environments)}")
        self._local.device = index
        self._mark_in_use(index)

    def device_in_use(self, device: int) -> bool:
        return self._in_use is None or device in self._in_use

    def _mark_in_use(self, device: int) -> None:
        if self._in_use is not None:
            self._in_use.add(device)

    def after_fork(self) -> None:
        self._local = threading.local()

    def prepare(self, device: int) -> None:
        self._check_device(device)

    def _check_device(self, device: int) -> None:
        """Refuse a device the backend lacks; work on one sets it up (see ``device_in_use``)."""
        if not 0 <= device < len(self._environments):
            raise ValueError(f"no device {device}: the test backend has {len(self._environments)}")
        self._mark_in_use(device)

    def _describe_with_shapes(self, graph: Any) -> tuple[dict[str, Any], list[TensorSpec]]:
        """Description plus a tensor table whose output shapes come from a reference run."""
        description = describe(graph)
        table = tensor_table(graph)
        torch = _torch()
        values: dict[str, Any] = {}
        for spec in table:
            if spec.is_output:
                continue
            if not spec.dims:
                raise InvalidGraphError(f"input tensor {spec.name!r} has no dims", node=None, reason="no dims")
            values[f"u{spec.uid}"] = torch.zeros(spec.dims) if not spec.is_pass_by_value else 1.0
        try:
            _evaluate(description, values)
        except NotImplementedError as exc:
            raise BuildError(f"the CPU test backend cannot run {exc}", reason="unsupported by test backend") from exc
        except (RuntimeError, ValueError, KeyError) as exc:
            raise InvalidGraphError(f"the graph is invalid: {exc}", node=None, reason=str(exc)) from exc
        inferred = []
        for spec in table:
            if spec.is_output and not spec.dims:
                out = values[f"u{spec.uid}"]
                spec = dataclasses.replace(spec, dims=tuple(out.shape), strides=tuple(out.contiguous().stride()))
            inferred.append(spec)
        return description, inferred

    def _plan_once(self, graph: Any) -> tuple[dict[str, Any], list[TensorSpec]]:
        """Describe and mark ``graph`` planned, refusing one planned before (as cuDNN does)."""
        if getattr(graph, "_planning_done", False):
            raise InvalidGraphError(
                "the graph was already planned (create_execution_plans or build ran); pass a fresh pygraph",
                node=None,
                reason="already planned",
            )
        described = self._describe_with_shapes(graph)
        freeze = getattr(graph, "_freeze", None)
        if callable(freeze):
            freeze()
        with contextlib.suppress(AttributeError):
            graph._planning_done = True
        return described

    def candidates(self, graph: Any, options: BuildOptions, inputs: Mapping[int, Any] | None = None) -> _Candidates:
        description, tensors = self._plan_once(graph)
        if description["flags"].get("dynamic_shape") and options.kernel_cache:
            self.kernels.add(summary_of_ops(description))
        return _Candidates(self, description, tensors)

    def kernel_cache_blob(self) -> bytes | None:
        return json.dumps(sorted(self.kernels)).encode() if self.kernels else None

    def restore_kernel_cache(self, blob: bytes) -> None:
        self.kernels.update(json.loads(blob))

    def make_plan(self, description: dict[str, Any], tensors: list[TensorSpec], engine: EngineChoice) -> BuiltPlan:
        payload = {"description": description, "tensors": [t.to_dict() for t in tensors], "engine": engine.to_dict()}
        blob = MAGIC + json.dumps(payload, sort_keys=True).encode()
        if self.build_log is not None:
            line = hashlib.sha256(canonical_json(description).encode()).hexdigest() + f" {os.getpid()}\n"
            with open(self.build_log, "a") as f:  # one short append: atomic on POSIX
                f.write(line)
        native = _Native(description, tensors, engine.to_dict(), self.current_device())
        return BuiltPlan(native, blob, tensors, _scratch_bytes(tensors), engine)

    def rebuild(self, graph: Any, engine: EngineChoice, options: BuildOptions) -> BuiltPlan:
        description, tensors = self._plan_once(graph)
        return self.make_plan(description, tensors, engine)

    def load(self, blob: bytes, tensors: Sequence[TensorSpec], device: int | None = None) -> _Native:
        if not blob.startswith(MAGIC):
            raise ValueError("not a plancache test plan (bad magic)")
        payload = json.loads(blob[len(MAGIC) :])
        self.loads += 1
        device = self.current_device() if device is None else device
        self._check_device(device)
        return _Native(payload["description"], [TensorSpec.from_dict(t) for t in payload["tensors"]], payload["engine"], device)

    def launcher(self, native: _Native, workspace_size: int, device: int) -> Callable[[Mapping[int, Any]], None]:
        def launch(pack: Mapping[int, Any]) -> None:
            self.execute(native, pack, workspace_size, device)

        return launch

    def execute(self, native: _Native, pack: Mapping[int, Any], workspace_size: int, device: int) -> None:
        """One launch (what ``launcher``'s function does): refuses another device's plan
        and misaligned pointers, and stages outputs in a workspace of its own."""
        if native.device != device:
            raise RuntimeError(f"a plan loaded on device {native.device} was launched on device {device}")
        torch = _torch()
        for uid, tensor in pack.items():
            pointer = getattr(tensor, "data_ptr", None)
            if pointer is not None and pointer() % 16:
                raise RuntimeError(f"misaligned address: tensor uid {uid} is not 16-byte aligned")
        # Scratch of this launch alone, as the cuDNN backend allocates it per launch.
        workspace = torch.empty(max(workspace_size, 0), dtype=torch.uint8)
        values = {f"u{uid}": tensor for uid, tensor in pack.items()}
        with torch.no_grad():
            _evaluate(native.description, values)
            _stage_outputs(torch, native.tensors, values, pack, workspace)
        native.executions += 1
        self.launches += 1


class TwoDeviceCpuTestBackend(CpuTestBackend):
    """``CpuTestBackend`` with two identical devices unless told otherwise. A class that
    needs no arguments can be named (``PLANCACHE_BACKEND=plancache.testing:TwoDeviceCpuTestBackend``)
    and rebuilt by name in the worker processes of ``prewarm --devices``."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("devices", 2)
        super().__init__(**options)


def _scratch_bytes(tensors: Sequence[TensorSpec]) -> int:
    """Workspace a test plan stages its outputs in: float32 of every output."""
    total = 0
    for spec in tensors:
        if spec.is_output:
            count = 1
            for d in spec.dims:
                count *= int(d)
            total += 4 * count
    return total


def _stage_outputs(
    torch: Any, tensors: Sequence[TensorSpec], values: Mapping[str, Any], pack: Mapping[int, Any], workspace: Any
) -> None:
    """Write each output through the workspace, as kernels stage partial results in theirs:
    a launch that shares its workspace with a concurrent one reads the other's values."""
    offset = 0
    for spec in tensors:
        if not spec.is_output:
            continue
        result = values[f"u{spec.uid}"].float().reshape(-1)
        size = 4 * result.numel()
        if workspace.numel() < offset + size:
            raise RuntimeError(f"workspace of {workspace.numel()} bytes is too small for this plan")
        scratch = workspace[offset : offset + size].view(torch.float32)
        scratch.copy_(result)
        time.sleep(0)  # let a concurrent launch run here, as concurrent kernels would
        pack[spec.uid].copy_(scratch.view(values[f"u{spec.uid}"].shape))
        offset += size
