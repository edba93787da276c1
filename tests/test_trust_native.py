"""The native gate bounds every pointer a launch hands cuDNN (issue 34).

Four mutations of a plan blob once reached ``cudnnBackendExecute`` with pointers outside
every tensor and the workspace: a variant-pack replacement far past its source tensor, a
by-value or workspace slot on a uid of the caller's tensors, backend JSON whose tensors
disagree with the tensor table, and a workspace of 2^62 bytes. Each is applied to a CPU
test plan's blob and to every real blob recorded on an H200 (``tests/data/plans``) it
applies to; the gate must refuse it, and the simulated C library must never finalize or
execute it. The unmutated blob passes the same gate, so a refusal is the mutation's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

import plancache
from plancache.guest.native.record import OUT_OF_BOUNDS, Fallback, RecordError, parse, refusal
from plancache.guest.tensors import span
from plancache.key import TensorSpec
from plancache.testing import CpuTestBackend

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from gpu_gate import MUTATIONS, lowered, mutated, replacement  # the mutations scripts/gpu_gate.py makes on a GPU

PLANS = Path(__file__).parent / "data" / "plans"
RECORDED = sorted(PLANS.glob("*.ubj"))


# ------------------------------------------------------------------ blobs and their tables


def recorded(path: Path) -> tuple[bytes, dict[int, TensorSpec], int]:
    """A real blob, its tensor table by uid, and its GPU's memory."""
    meta = json.loads(path.with_suffix(".json").read_text())
    return path.read_bytes(), {t["uid"]: TensorSpec.from_dict(t) for t in meta["tensors"]}, meta["environment"]["total_memory"]


def cpu_plan() -> tuple[bytes, list[TensorSpec]]:
    from graphs import EXAMPLES

    built = CpuTestBackend().plans(EXAMPLES["conv_bias_relu"].graph(), plancache.BuildOptions(), {})
    return built.finish(0).blob, built.tensors


def counting_executes(backend: CpuTestBackend, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every plan the simulated library executes, as a list that grows by one per call."""
    library = backend.driver.simulated
    executed: list[int] = []
    real = library.execute

    def execute(handle: int, plan: int, pack: int) -> None:
        executed.append(plan)
        real(handle, plan, pack)

    monkeypatch.setattr(library, "execute", execute)
    return executed


def launch(backend: CpuTestBackend, native: Any) -> None:
    from graphs import EXAMPLES

    tensors = EXAMPLES["conv_bias_relu"].tensors(seed=0)
    backend.launcher(native, 0, 0)(tensors, [tensors[uid].data_ptr() for uid in native.user_uids])


# ------------------------------------------------------------------ the four mutations (scripts/gpu_gate.py)


@pytest.mark.parametrize("name", MUTATIONS)
def test_a_cpu_plan_mutated_out_of_bounds_is_refused_and_never_executed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mutation, why = MUTATIONS[name]
    blob, tensors = cpu_plan()
    table = {spec.uid: spec for spec in tensors}
    backend = CpuTestBackend()
    executed = counting_executes(backend, monkeypatch)
    launch(backend, backend.load(blob, tensors, 0))  # the blob as built loads and runs natively
    assert len(executed) == 1 and not backend.native_fallbacks
    bad = mutated(blob, table, mutation)
    assert refusal(parse(bad), table) is why
    loads = backend.driver.simulated.loads
    with pytest.raises(RecordError, match="refused"):
        backend.load(bad, tensors, 0)
    assert backend.driver.simulated.loads == loads, "never finalized"
    assert backend.driver.loads == 0, "nor left to the frontend's path, which would apply the same pointers"
    assert len(executed) == 1 and backend.native_fallbacks == {why.value: 1}


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.stem)
@pytest.mark.parametrize("name", MUTATIONS)
def test_a_recorded_plan_mutated_out_of_bounds_is_refused_and_never_executed(name: str, path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    mutation, why = MUTATIONS[name]
    blob, table, memory = recorded(path)
    assert refusal(parse(blob), table, memory) is None, "as recorded, the plan passes the gate"
    bad = mutated(blob, table, mutation)
    assert refusal(parse(bad), table, memory) is why
    backend = CpuTestBackend()
    executed = counting_executes(backend, monkeypatch)
    with pytest.raises(RecordError, match="refused"):
        backend.load(bad, list(table.values()), 0)
    assert backend.driver.simulated.loads == 0 and backend.driver.loads == 0 and executed == []
    assert backend.native_fallbacks == {why.value: 1}


def test_a_replacement_inside_its_source_tensor_passes_the_gate() -> None:
    # The bound is the source's extent, not a refusal of every replacement.
    for path in RECORDED:
        blob, table, memory = recorded(path)
        assert refusal(parse(mutated(blob, table, replacement(lambda element: 0))), table, memory) is None, path.stem


def test_a_layouts_span_is_what_its_last_element_reaches() -> None:
    # The one formula behind every bound the gate and the allocations use.
    assert span((2, 3), (3, 1)) == 6
    assert span((2, 3), (1, 2)) == 6  # column-major
    assert span((2, 3), (8, 1)) == 11  # padded rows: the padding after the last row is not reached
    assert span((4, 5), (0, 1)) == 5  # broadcast along the first axis
    assert span((), ()) == 1  # a scalar
    assert span((4, 0, 3), (3, 3, 1)) == 0  # empty: nothing is reached


def test_the_backends_own_workspace_beyond_the_device_is_refused_once_finalized(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only a finalized plan says its workspace (cuDNN's part, behind the frontend's).
    blob, tensors = cpu_plan()

    def huge_engine_workspace(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        backend["workspace"] = 2**62

    bad = mutated(blob, {s.uid: s for s in tensors}, huge_engine_workspace)
    backend = CpuTestBackend()
    executed = counting_executes(backend, monkeypatch)
    with pytest.raises(RecordError, match="device's memory"):
        backend.load(bad, tensors, 0)
    assert executed == [] and backend.native_fallbacks == {Fallback.WORKSPACE.value: 1}


def test_the_workspace_bound_is_the_devices_memory_where_it_says() -> None:
    blob, table, memory = recorded(PLANS / "sdpa_backward.ubj")  # 532,480 bytes of frontend workspace
    record = parse(blob)
    assert refusal(record, table, memory) is None
    assert refusal(record, table, record.fe_workspace_size - 1) is Fallback.WORKSPACE


def test_a_workspace_slot_past_the_frontends_part_is_refused() -> None:
    # sdpa_backward points uid 14 (8,192 bytes) at byte 524,288 of 532,480: exactly inside.
    blob, table, memory = recorded(PLANS / "sdpa_backward.ubj")

    def shift(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        top["workspace_modifications"]["14"][1] += 16

    assert refusal(parse(mutated(blob, table, shift)), table, memory) is Fallback.SLOTS


def test_a_by_value_slot_cuDNN_reads_wider_than_its_buffer_is_refused() -> None:
    blob, table, memory = recorded(PLANS / "sdpa_backward.ubj")  # uid 10: a float scalar, 4 bytes

    def widen(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        lowered(backend)[10]["dataType"] = "CUDNN_DATA_DOUBLE"

    assert refusal(parse(mutated(blob, table, widen)), table, memory) is Fallback.SLOTS


def test_a_backend_tensor_listed_twice_with_two_layouts_is_unreadable() -> None:
    blob, table, _ = recorded(PLANS / "conv_bias_relu.ubj")

    def twice(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        first = lowered(backend)[1]
        backend["operationGraph"]["tensors"].append(dict(first, dim=[d * 2 for d in first["dim"]]))

    with pytest.raises(RecordError, match="twice"):
        parse(mutated(blob, table, twice))


def test_a_cpu_plans_backend_json_lists_the_table_as_cudnns_does() -> None:
    # The CPU suite runs the check a GPU runs: its blobs carry cuDNN's operationGraph tensors.
    blob, tensors = cpu_plan()
    found = parse(blob).backend_tensors
    assert sorted(found) == sorted(spec.uid for spec in tensors)
    for spec in tensors:
        assert (found[spec.uid].dims, found[spec.uid].strides, found[spec.uid].dtype) == (spec.dims, spec.strides, spec.dtype)


def test_every_out_of_bounds_kind_is_one_the_gate_returns() -> None:
    assert {why for _, why in MUTATIONS.values()} == OUT_OF_BOUNDS


def test_a_backend_uid_past_64_bits_is_unreadable() -> None:
    """cuDNN's JSON of the plan is read for the gate's bounds (orjson, which reads an
    integer past 64 bits as a float): such a uid is no uid, and the blob is not read."""
    blob, table, _ = recorded(PLANS / "conv_bias_relu.ubj")

    def huge_name(top: dict[str, Any], backend: dict[str, Any], table: dict[int, TensorSpec]) -> None:
        lowered(backend)[1]["name"] = 2**70

    with pytest.raises(RecordError, match="a uid must be an integer"):
        parse(mutated(blob, table, huge_name))
