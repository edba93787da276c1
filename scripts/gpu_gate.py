"""The native gate against out-of-bounds plan blobs, on a GPU (issue 34).

    python3 scripts/gpu_gate.py [--out gate.json] [--smoke]

Four mutations of a plan blob once reached ``cudnnBackendExecute`` with pointers outside
every tensor and the workspace: a variant-pack replacement past its source tensor (at
2^62 bytes, and one element past), a by-value or a workspace slot on a uid of the
caller's tensors, backend JSON whose tensor dims disagree with the tensor table, and a
frontend workspace of 2^62 bytes. Each is applied to every blob recorded in
``tests/data/plans`` and to plans this run builds with ``PlanCache.get`` (heuristic
policy), and each mutated blob goes through the backend's own load (``Backend.load``: the
gate, then cuDNN's C API or the frontend's deserialize), with the native library's
``execute`` and the frontend's ``deserialize`` counted. A mutated blob must be refused, or
sent to the frontend's path, and never executed natively. Each blob as it is must pass the
gate; a built one must also load natively and launch once (so the count is seen to count).

Printed: one row per blob and mutation (the gate's kind, what the load did, native
executes). Exit status: 0 when every mutated blob was kept off the native path and every
blob as it is passed, 1 otherwise.

``--smoke``: on the CPU test backend, through the same load (its simulated C library
stands for cuDNN's), with plans it builds at tiny sizes; the recorded blobs, which it
cannot finalize, are judged by the same gate and load, and their unmutated loads skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchlib

import plancache
from plancache.autotuning.inputs import DTYPE_BYTES
from plancache.formats.ubjson import decode, encode
from plancache.guest.native import NativePlan, parse, refusal
from plancache.guest.native.record import Fallback, RecordError
from plancache.key import TensorSpec

PLANS = Path(__file__).resolve().parent.parent / "tests" / "data" / "plans"
#: The graph kinds built here (gpu_native's graphs, at its smoke sizes in a smoke run).
BUILT = ("conv_bias_relu", "matmul_bias_relu", "sdpa_causal", "sdpa_ragged")

#: A mutation of a blob: its top level and its backend JSON, changed in place, given the
#: blob's tensor table by uid.
Mutation = Callable[[dict[str, Any], dict[str, Any], dict[int, TensorSpec]], None]


def mutated(blob: bytes, table: dict[int, TensorSpec], mutation: Mutation) -> bytes:
    """``blob`` with ``mutation`` applied to its top level and to its backend JSON."""
    top = decode(blob)
    backend = json.loads(top["cudnn_backend_data"])
    mutation(top, backend, table)
    top["cudnn_backend_data"] = json.dumps(backend)
    return encode(top)


def lowered(backend: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The backend JSON's non-virtual tensors (top-level ones) by uid."""
    return {int(t["name"]): t for t in backend["operationGraph"]["tensors"] if t["isVirtual"] is False}


def device_tensor(table: dict[int, TensorSpec]) -> int:
    """The uid of a tensor of the table in device memory (not a host scalar): the last of the highest rank."""
    return max((spec for spec in table.values() if not spec.is_pass_by_value), key=lambda s: (len(s.dims), s.uid)).uid


def replacement(offset: Callable[[int], int]) -> Mutation:
    """A new uid the backend reads, laid out as a table tensor (the source), pointed at
    that tensor plus ``offset(bytes per element of it)``."""

    def mutate(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        source = device_tensor(table)
        destination = max([*lowered(backend), *table]) + 100
        twin = dict(lowered(backend)[source], name=str(destination))
        twin.pop("isRagged", None)
        backend["operationGraph"]["tensors"].append(twin)
        top["variant_pack_uids"] = [*top["variant_pack_uids"], destination]
        moved = [source, [destination, offset(DTYPE_BYTES[table[source].dtype or ""])]]
        top["variant_pack_replacements"] = [*(top.get("variant_pack_replacements") or []), moved]

    return mutate


def by_value_on_a_user_uid(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
    top["pass_by_values"] = {**(top.get("pass_by_values") or {}), str(device_tensor(table)): {"index": 3, "value": "3F800000"}}


def workspace_on_a_user_uid(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
    top["workspace_modifications"] = {**(top.get("workspace_modifications") or {}), str(device_tensor(table)): [2, 0, []]}


def backend_dims_disagree(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
    tensor = lowered(backend)[device_tensor(table)]
    tensor["dim"] = [tensor["dim"][0] * 4, *tensor["dim"][1:]]


def huge_frontend_workspace(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
    top["fe_workspace_size"] = 2**62


#: Each mutation and the gate's kind for it.
MUTATIONS: dict[str, tuple[Mutation, Fallback]] = {
    "replacement at 2^62": (replacement(lambda element: 2**62), Fallback.REPLACEMENT),
    "replacement 1 element past": (replacement(lambda element: element), Fallback.REPLACEMENT),
    "by-value on a user uid": (by_value_on_a_user_uid, Fallback.SLOTS),
    "workspace on a user uid": (workspace_on_a_user_uid, Fallback.SLOTS),
    "backend dims disagree": (backend_dims_disagree, Fallback.BACKEND_TENSORS),
    "frontend workspace 2^62": (huge_frontend_workspace, Fallback.WORKSPACE),
}


class Counted:
    """The native library's executes and the frontend's deserializes of one backend, counted
    by wrapping the calls every launch and frontend load makes."""

    def __init__(self, backend: Any) -> None:
        self.executes = self.deserializes = 0
        library, driver = backend.driver.library(), backend.driver
        execute, deserialize = library.execute, driver.deserialize

        def counted_execute(*args: Any) -> None:
            self.executes += 1
            execute(*args)

        def counted_deserialize(*args: Any) -> Any:
            self.deserializes += 1
            return deserialize(*args)

        library.execute, driver.deserialize = counted_execute, counted_deserialize


def outcome(backend: Any, counted: Counted, blob: bytes, tensors: list[TensorSpec], device: int) -> tuple[str, Any]:
    """What ``Backend.load`` did with ``blob``: "refused", "frontend", "native" or "failed: why"."""
    deserializes = counted.deserializes
    try:
        native = backend.load(blob, tensors, device)
    except RecordError as exc:
        return ("refused" if "refused" in str(exc) else f"failed: {exc}"), None
    except Exception as exc:  # the library's refusal: the blob reached cuDNN
        return f"failed: {type(exc).__name__}: {str(exc)[:120]}", None
    if isinstance(native, NativePlan):
        return "native", native
    return ("frontend" if counted.deserializes > deserializes else "failed: neither path"), native


def launch_once(cache: Any, native: NativePlan, entry: Any, device: int) -> None:
    """One native launch of a built plan on inputs that fit its graph."""
    import torch

    from plancache.autotuning.inputs import Refusal, materialize, plan_inputs

    found = plan_inputs(entry.description, [TensorSpec.from_dict(t) if isinstance(t, dict) else t for t in entry.tensors], {})
    if isinstance(found, Refusal):
        raise RuntimeError(f"no role-valid inputs: {found.why}")
    pack = materialize(found, torch, benchlib.device(), torch.Generator(device=benchlib.device()).manual_seed(0))
    cache.backend.launcher(native, entry.workspace_size, device)(pack, [pack[uid].data_ptr() for uid in native.user_uids])
    benchlib.synchronize(torch)


def blobs(cache: Any) -> list[dict[str, Any]]:
    """The recorded blobs and the plans built here: name, blob, table, built entry or None."""
    found = []
    for path in sorted(PLANS.glob("*.ubj")):
        meta = json.loads(path.with_suffix(".json").read_text())
        table = [TensorSpec.from_dict(t) for t in meta["tensors"]]
        found.append({"name": f"recorded/{path.stem}", "blob": path.read_bytes(), "tensors": table, "entry": None})
    import gpu_native

    cases = gpu_native.SMOKE_CASES if benchlib.smoke() else gpu_native.CASES
    for name in BUILT:
        plan = cache.get(cases[name](), options=plancache.BuildOptions(policy="heuristic"))
        entry = cache.store.get(plan.key)
        tensors = [TensorSpec.from_dict(t) if isinstance(t, dict) else t for t in entry.tensors]
        found.append({"name": f"built/{name}", "blob": entry.blob, "tensors": tensors, "entry": entry})
    return found


def check(cache: Any, counted: Counted, case: dict[str, Any], device: int) -> list[dict[str, Any]]:
    """The rows of one blob: as it is, then each mutation."""
    backend, blob, tensors = cache.backend, case["blob"], case["tensors"]
    table = {spec.uid: spec for spec in tensors}
    memory = backend.environment(device).get("total_memory")
    row: dict[str, Any] = {"blob": case["name"], "mutation": "(as it is)", "gate": refusal(parse(blob), table, memory)}
    executes = counted.executes
    if case["entry"] is None:  # a recorded blob: its load says only whether this cuDNN takes another's plan
        loaded = benchlib.gpu_only("recorded blobs loaded as they are (the CPU test library finalizes only its own)", outcome,
                                   backend, counted, blob, tensors, device)  # fmt: skip
        row["load"] = loaded[0] if loaded is not None else "skipped"
        row["ok"] = row["gate"] is None
    else:
        row["load"], native = outcome(backend, counted, blob, tensors, device)
        if row["load"] == "native":
            launch_once(cache, native, case["entry"], device)
        row["ok"] = row["gate"] is None and row["load"] == "native" and counted.executes - executes == 1
    row["executes"] = counted.executes - executes
    rows = [row]
    for name, (mutation, why) in MUTATIONS.items():
        bad = mutated(blob, table, mutation)
        executes = counted.executes
        row = {"blob": case["name"], "mutation": name, "gate": refusal(parse(bad), table, memory)}
        row["load"], _ = outcome(backend, counted, bad, tensors, device)
        row["executes"] = counted.executes - executes
        row["ok"] = row["gate"] is why and row["load"] in ("refused", "frontend") and row["executes"] == 0
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    smoke = benchlib.start_smoke(args.smoke)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as work:
        cache = plancache.PlanCache(work, backend=benchlib.backend(), auto_prime=False)
        device = cache.backend.current_device()
        counted = Counted(cache.backend)
        for case in blobs(cache):
            try:
                rows += check(cache, counted, case, device)
            except Exception as exc:
                rows.append({"blob": case["name"], "mutation": "-", "gate": None, "load": f"failed: {type(exc).__name__}: {exc}",
                             "executes": None, "ok": False})  # fmt: skip
        cache.close()
    print(f"{'blob':32} {'mutation':28} {'gate':16} {'load':10} {'native executes':>15}  result")
    for r in rows:
        gate = r["gate"].name if r["gate"] is not None else "passes"
        print(f"{r['blob']:32} {r['mutation']:28} {gate:16} {r['load'][:60]:10} {benchlib.fmt(r['executes'], '15.0f')}  "
              f"{'ok' if r['ok'] else 'FAILED'}")  # fmt: skip
    mutations = [r for r in rows if r["mutation"] != "(as it is)"]
    kept = sum(1 for r in mutations if r["ok"])
    failed = sum(1 for r in rows if not r["ok"])
    print(f"gpu_gate{' smoke run' if smoke else ''}: {kept} of {len(mutations)} mutated blobs kept off the native path, "
          f"{failed} failure(s)")  # fmt: skip
    benchlib.report_skipped("gpu_gate")
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
