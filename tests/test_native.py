"""The native load and launch path (``plancache.guest.native``) without a GPU.

The blob parser and the variant-pack layout are checked against real plans recorded on an
H200 (``tests/data/plans``, written by ``scripts/gpu_native.py --record``), and against
blobs written here the way the frontend writes them. ``NativePlan`` runs against a fake C
library that records every call: what a load may call (no capture, no synchronization,
no allocation), what a launch does before the backend executes, and when descriptors are
destroyed.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from ubjson_writer import ubjson

import plancache
from plancache.formats.ubjson import UbjsonError, decode
from plancache.guest.native import record as records
from plancache.guest.native.plan import NativePlan
from plancache.guest.native.record import Fallback, Layout, RecordError, parse, refusal

PLANS = Path(__file__).parent / "data" / "plans"
RECORDED = sorted(PLANS.glob("*.ubj"))


# ------------------------------------------------------------------ UBJSON as nlohmann::json writes it


def hexfloat(value: float) -> str:
    """A float as the frontend writes one: its bits, 8 upper-case hex digits."""
    return f"{struct.unpack('<I', struct.pack('<f', value))[0]:08X}"


def frontend_blob(**changes: Any) -> bytes:
    plan = {
        "json_version": "2.0",
        "cudnn_backend_data": '{"engineId": 7}',
        "variant_pack_uids": [5, 1, 3, 9],
        "behavior_notes": [[]],
        "pass_by_values": {
            "9": {"index": 3, "value": hexfloat(0.125)},
            "10": {"index": 5, "value": hexfloat(1.5)},
            "11": {"index": 0, "value": 7},
        },
        "workspace_modifications": {"12": [1, 0, [hexfloat(256.0)]], "13": [0, 256, [hexfloat(1.0), hexfloat(-2.0)]]},
        "aligned_operands": {"1": [16, 2], "3": [16, 2]},
        "variant_pack_replacements": [[3, [14, 64]]],
        "fe_workspace_size": 1024,
        "tensors_to_dump": [],
        "nodes": [{"type": "MATMUL", "params": {"padding": 0.0}}],
        "tensors": [{"uid": 1}, {"uid": 3}, {"uid": 5}],
        "gid": 3,
        "context": {"name": ""},
    }
    plan.update(changes)
    return ubjson(plan)


def test_the_decoder_reads_every_marker_and_optimized_containers() -> None:
    value = {"a": [1, -200, 40000, 2**40, 1.5, "x", None, True, False], "b": {"c": []}}
    assert decode(ubjson(value)) == value
    # typed, counted containers (the specification's optimized form)
    assert decode(b"[$i#U\x03\x01\x02\x03") == [1, 2, 3]
    assert decode(b"[#U\x02Si\x01xU\x05") == ["x", 5]
    assert decode(b"{#U\x01U\x01kSU\x01v") == {"k": "v"}
    assert decode(b"HU\x1418446744073709551615") == 18446744073709551615
    assert decode(b"C" + b"z") == "z"
    assert decode(b"NNU\x07") == 7  # no-ops before a value


def test_the_decoder_reads_optimized_and_plain_containers_inside_each_other() -> None:
    # counted containers have no end marker
    assert decode(b"{i\x01a[#U\x02[i\x01T]{#U\x01i\x01b{i\x01cZ}i\x01dSi\x01e}") == {
        "a": [[1, True], {"b": {"c": None}}],
        "d": "e",
    }
    assert decode(b"[" * 40 + b"[#U\x01" * 24 + b"Z" + b"]" * 40) is not None  # 64 levels: the limit
    with pytest.raises(UbjsonError, match="nested deeper"):
        decode(b"[" * 40 + b"[#U\x01" * 25 + b"Z" + b"]" * 40)
    with pytest.raises(UbjsonError, match="ends early"):  # a short string's length running past the end
        decode(b"{i\x01aSi\x05ab}")


@pytest.mark.parametrize(
    ("data", "why"),
    [(b"[U\x01", "ends early"), (b"SU\x05ab", "ends early"), (b"Q", "unknown UBJSON marker"), (ubjson(1) + b"x", "after"),
     (b"S" + b"Sab", "length must be an integer"), (b"[$i", "ends early"), (b"[$iU", "needs a count")],
)  # fmt: skip
def test_the_decoder_refuses_what_is_not_ubjson(data: bytes, why: str) -> None:
    with pytest.raises(UbjsonError, match=why):
        decode(data)


# ------------------------------------------------------------------ the record of a plan


def test_a_frontend_blob_is_read_field_by_field() -> None:
    record = parse(frontend_blob())
    assert refusal(record) is None
    assert record.version == "2.0" and record.representation == b'{"engineId": 7}'
    assert record.variant_pack_uids == (1, 3, 5, 9)
    assert record.by_value[9].kind == "float" and struct.unpack("<f", record.by_value[9].data) == (0.125,)
    assert record.by_value[10].kind == "bfloat16" and record.by_value[10].data == struct.pack("<f", 1.5)[2:]
    assert record.by_value[11].data == struct.pack("<q", 7)
    assert record.workspace[12].operation == 1 and record.workspace[12].zero_bytes == 256
    assert record.workspace[13].words == (0x3F800000, 0xC0000000) and record.workspace[13].offset == 256  # 1.0, -2.0
    assert record.replacements == {3: (14, 64)} and record.fe_workspace_size == 1024 and record.aligned == {1: 16, 3: 16}


@pytest.mark.parametrize(
    ("changes", "why"),
    [({"json_version": "3.0"}, Fallback.FORMAT), ({"json_version": ""}, Fallback.FORMAT),
     ({"launch_hooks": [1]}, Fallback.FIELDS)],
)  # fmt: skip
def test_the_gate_leaves_untested_blobs_to_the_frontend(changes: dict[str, Any], why: Fallback) -> None:
    assert refusal(parse(frontend_blob(**changes))) is why


@pytest.mark.parametrize(
    "blob",
    [b"", b"PLANCACHE-TEST-PLAN/1\n{}", ubjson([1, 2]), ubjson({"json_version": "2.0"}),
     frontend_blob(pass_by_values={"9": {"index": 9, "value": 1}}), frontend_blob(workspace_modifications={"1": [0]})],
)  # fmt: skip
def test_blobs_that_are_not_frontend_plans_are_refused_with_a_reason(blob: bytes) -> None:
    with pytest.raises(RecordError):
        parse(blob)


@pytest.mark.parametrize(
    "changes",
    [{"json_version": 2.0}, {"json_version": None},  # the frontend refuses a version that is not text
     {"workspace_modifications": {"12": [1, -16, [hexfloat(256.0)]]}},  # before the workspace
     {"workspace_modifications": {"13": [0, 1 << 30, [hexfloat(1.0)]]}},  # far past it
     {"workspace_modifications": {"13": [0, 1020, [hexfloat(1.0), hexfloat(2.0)]]}},  # a copy running past it
     {"workspace_modifications": {"12": [1, 512, [hexfloat(1024.0)]]}},  # a zeroing running past it
     {"workspace_modifications": {"12": [1, 0, [hexfloat(-16.0)]]}},  # a negative size (2**64 - 16 as size_t)
     {"workspace_modifications": {"12": [1, 0, ["7FC00000"]]}},  # NaN bytes
     {"workspace_modifications": {"12": [1, 0, ["tag"]]}},
     {"fe_workspace_size": -4096}, {"fe_workspace_size": 1024.0}, {"fe_workspace_size": "1024"},
     {"pass_by_values": {str(2**64 + 9): {"index": 3, "value": hexfloat(0.125)}}},  # truncated to uid 9 by int64
     {"variant_pack_uids": [5, 1, "3", 9]}, {"variant_pack_replacements": [[3, [14, -64]]]},
     {"aligned_operands": {"1": [24, 2]}}],
)  # fmt: skip
def test_values_a_launch_would_turn_into_addresses_outside_its_buffers_are_refused(changes: dict[str, Any]) -> None:
    """Each was accepted: on a GPU, writes before or past the workspace, into another tensor."""
    with pytest.raises(RecordError):
        parse(frontend_blob(**changes))


def test_workspace_words_are_copied_as_the_bits_the_frontend_wrote_even_under_flush_to_zero() -> None:
    """The frontend writes int32 sequence lengths as floats' bits; 100 is a denormal float,
    which a round trip through a float turned into 0 with denormals flushed."""
    import torch

    changes = {"workspace_modifications": {"13": [0, 256, ["00000064", "00000064"]]}}
    flushing = torch.set_flush_denormal(True)
    try:
        library = FakeLibrary()
        plan = native_plan(library, **changes)
        plan.launch([0x1000, 0x2000, 0x3000], 0x100000, handle=7, stream=55)
    finally:
        torch.set_flush_denormal(False)
    (copy,) = [c for c in library.calls if c[0] == "copy"]
    assert copy[2] == [100, 100], f"flush-to-zero {'on' if flushing else 'unsupported'}: {copy[2]}"
    assert parse(frontend_blob(**changes)).workspace[13].words == (100, 100)


@pytest.mark.parametrize(
    ("data", "why"),
    [(b"[$Z#L" + struct.pack(">q", 2**62), "typed container of 'Z'"),  # hung for ever
     (b"[#U\x05U\x01U\x02", "container of 5 elements in 4 bytes"),
     (b"HU\x03tag", "integer's digits"), (b"H" + ubjson(5000) + b"9" * 5000, "integer's digits"),
     (b"[" * 100 + b"]" * 100, "nested deeper")],
)  # fmt: skip
def test_the_decoder_refuses_counts_and_depths_no_plan_has(data: bytes, why: str) -> None:
    with pytest.raises(UbjsonError, match=why):
        decode(data)


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_a_damaged_recorded_plan_is_read_or_refused_never_anything_else(path: Path) -> None:
    """Bytes flipped, cut or repeated anywhere: a record or RecordError (the frontend's path
    then), never another exception, a hang or a record with an offset outside its buffers."""
    import random

    blob = path.read_bytes()
    rng = random.Random(path.stem)
    for _ in range(150):
        damaged = bytearray(blob)
        at = rng.randrange(len(blob))
        kind = rng.randrange(3)
        if kind == 0:
            damaged[at] = rng.randrange(256)
        elif kind == 1:
            del damaged[at:]
        else:
            damaged[at:at] = damaged[at : at + rng.randrange(1, 16)]
        try:
            record = parse(bytes(damaged))
        except RecordError:
            continue
        for change in record.workspace.values():
            assert (
                change.offset >= 0 and change.offset + 4 * len(change.words) * (change.operation == 0) <= record.fe_workspace_size
            )
            assert change.offset + change.zero_bytes <= record.fe_workspace_size


def test_the_layout_is_the_frontends_variant_pack_template() -> None:
    # prepare_variant_pack_template: variant-pack uids and replacement sources sorted, then
    # by-value uids, then workspace uids; the caller fills what is neither.
    layout = Layout.of(parse(frontend_blob(variant_pack_uids=[5, 1, 9, 14])))
    assert layout.uids == (1, 3, 5, 9, 14, 10, 11, 12, 13)
    assert layout.user_uids == (1, 3, 5)  # 9 is by value, 14 the replacement's destination
    pointers = layout.pointers([0x1000, 0x2000, 0x3000], 0x10000, [0xA0, 0xB0, 0xC0])
    assert dict(zip(layout.uids, pointers)) == {1: 0x1000, 3: 0x2000, 5: 0x3000, 9: 0xA0, 10: 0xB0, 11: 0xC0, 12: 0x10000,
                                                13: 0x10000 + 256, 14: 0x2000 + 64}  # fmt: skip
    # 3 is a replacement source the plan does not read itself: not handed to cuDNN
    assert 3 not in [layout.uids[slot] for slot in layout.backend]
    with pytest.raises(ValueError, match=r"uid 1: .* 16-byte aligned"):
        layout.pointers([0x1008, 0x2000, 0x3000], 0x10000, [0xA0, 0xB0, 0xC0])


def test_a_plan_with_nothing_of_the_frontends_own_lays_out_every_slot_as_the_callers() -> None:
    # No by-value scalar, workspace change or replacement (most plans): the uids once each,
    # sorted; every slot the caller's and handed to cuDNN; the alignments kept.
    record = parse(frontend_blob(variant_pack_uids=[5, 1, 9, 5], pass_by_values={}, workspace_modifications={},
                                 variant_pack_replacements=[], aligned_operands={"9": [32, 2], "1": [1, 2]}))  # fmt: skip
    layout = Layout.of(record)
    assert layout.uids == layout.user_uids == (1, 5, 9)
    assert layout.backend == (0, 1, 2) and not layout.fixed and not layout.workspace and not layout.replacements
    assert layout.aligned == ((2, 32),)  # an alignment of 1 asks nothing
    assert layout.pointers([0x1000, 0x2000, 0x3000], 0, []) == [0x1000, 0x2000, 0x3000]
    with pytest.raises(ValueError, match=r"uid 9: .* 32-byte aligned"):
        layout.pointers([0x1000, 0x2000, 0x3010], 0, [])


# ------------------------------------------------------------------ real plans recorded on a GPU


def test_plans_recorded_on_a_gpu_are_here() -> None:
    kinds = {path.stem for path in RECORDED}
    assert {"conv_bias_relu", "matmul_bias_relu", "sdpa_forward_stats", "sdpa_backward", "sdpa_ragged", "sdpa_paged",
            "layernorm"} <= kinds, f"record them again: python3 scripts/gpu_native.py --record tests/data/plans ({sorted(kinds)})"  # fmt: skip


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_a_recorded_plan_parses_passes_the_gate_and_lays_out_as_on_the_gpu(path: Path) -> None:
    facts = json.loads(path.with_suffix(".json").read_text())
    record = parse(path.read_bytes())
    assert refusal(record) is None
    layout = Layout.of(record)
    assert list(layout.user_uids) == facts["user_uids"]
    tables = {t["uid"] for t in facts["tensors"]}
    assert set(layout.user_uids) <= tables, "every uid a launch fills is one of the caller's tensors"
    assert record.fe_workspace_size <= facts["workspace_size"] <= facts["native_workspace_size"] + record.fe_workspace_size


# ------------------------------------------------------------------ NativePlan against a fake library


class FakeLibrary:
    """The calls ``cudnn.library.Library`` offers, recorded; nothing else exists,
    so a load that captured, synchronized or allocated would fail with AttributeError."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.live: set[int] = set()
        self.destroyed: list[int] = []
        self.next = 100

    def _new(self) -> int:
        self.next += 1
        self.live.add(self.next)
        return self.next

    def load_plan(self, handle: int, representation: bytes) -> int:
        plan = self._new()
        self.calls.append(("load_plan", handle, representation))
        return plan

    def plan_workspace(self, plan: int) -> int:
        return 4096

    def variant_pack(self, uids: Any, pointers: Any, count: int, workspace: int) -> int:
        pack = self._new()
        self.calls.append(("variant_pack", list(uids), [p or 0 for p in pointers], workspace))
        return pack

    def destroy(self, descriptor: int) -> None:
        assert descriptor in self.live, f"descriptor {descriptor} destroyed twice, or never made"
        self.live.remove(descriptor)
        self.destroyed.append(descriptor)

    def execute(self, handle: int, plan: int, pack: int) -> None:
        assert plan in self.live and pack in self.live, "launched a destroyed descriptor"
        self.calls.append(("execute", handle, plan, pack))

    def copy_to_device(self, destination: int, source: Any, size: int, stream: int) -> None:
        self.calls.append(("copy", destination, list(source), size, stream))

    def zero(self, destination: int, size: int, stream: int) -> None:
        self.calls.append(("zero", destination, size, stream))


def native_plan(library: FakeLibrary, **changes: Any) -> NativePlan:
    return NativePlan(library, parse(frontend_blob(**changes)), handle=7, device=0)  # type: ignore[arg-type]


def test_a_load_finalizes_the_plan_and_nothing_else() -> None:
    library = FakeLibrary()
    plan = native_plan(library)
    assert library.calls == [("load_plan", 7, b'{"engineId": 7}')]
    assert plan.workspace_size == 1024 + 4096  # the frontend's part in front of cuDNN's
    assert plan.user_uids == (1, 3, 5)


def test_a_launch_does_the_frontends_work_then_executes_with_the_engines_workspace() -> None:
    library = FakeLibrary()
    plan = native_plan(library)
    library.calls.clear()
    plan.launch([0x1000, 0x2000, 0x3000], 0x100000, handle=7, stream=55)
    kinds = [c[0] for c in library.calls]
    assert kinds == ["copy", "zero", "variant_pack", "execute"]
    copy, zero, pack, _ = library.calls
    assert copy[1] == 0x100000 + 256 and copy[2] == [0x3F800000, 0xC0000000] and copy[3] == 8 and copy[4] == 55  # 1.0, -2.0
    assert zero[1:] == (0x100000, 256, 55)
    assert pack[3] == 0x100000 + 1024, "cuDNN's workspace starts after the frontend's part"
    by_uid = dict(zip(pack[1], pack[2]))
    assert by_uid[1] == 0x1000 and by_uid[5] == 0x3000 and by_uid[12] == 0x100000 and by_uid[13] == 0x100000 + 256
    assert struct.unpack("<f", ctypes.string_at(by_uid[9], 4)) == (0.125,), "by-value scalars are host pointers"


def test_variant_packs_are_made_once_per_set_of_pointers_and_the_oldest_destroyed() -> None:
    from plancache.guest.native.plan import PACKS_PER_PLAN

    library = FakeLibrary()
    plan = native_plan(library)
    for _ in range(3):
        plan.launch([0x1000, 0x2000, 0x3000], 0x100000, handle=7, stream=1)
    assert sum(c[0] == "variant_pack" for c in library.calls) == 1
    for i in range(PACKS_PER_PLAN + 2):
        plan.launch([0x1000 + 0x100 * i, 0x2000, 0x3000], 0x200000, handle=7, stream=1)
    assert len(library.destroyed) >= 2 and len(set(library.destroyed)) == len(library.destroyed)


def test_a_plan_is_destroyed_exactly_once_when_its_last_reference_goes() -> None:
    library = FakeLibrary()
    plan = native_plan(library)
    plan.launch([0x1000, 0x2000, 0x3000], 0x100000, handle=7, stream=1)
    del plan
    gc.collect()
    assert library.live == set() and len(library.destroyed) == 2  # the plan and its one pack


def test_a_forked_child_never_destroys_its_parents_plan() -> None:
    # A child's per-process plans are made anew, so the parent's copies go at its first
    # lookup; their descriptors belong to the parent's CUDA context, where cuDNN frees them.
    library = FakeLibrary()
    plan = native_plan(library)
    plan.launch([0x1000, 0x2000, 0x3000], 0x100000, handle=7, stream=1)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's outcome is read through the pipe
        try:
            del plan
            gc.collect()
            os.write(write, str(len(library.destroyed)).encode())
        finally:
            os._exit(0)
    os.close(write)
    assert os.waitpid(child, 0)[1] == 0
    assert os.read(read, 16) == b"0", "the child destroyed its parent's descriptors"
    os.close(read)
    del plan
    gc.collect()
    assert library.live == set() and len(library.destroyed) == 2  # the parent still frees them


def test_a_plan_a_captured_graph_may_replay_lives_as_long_as_the_process() -> None:
    # Through the launcher every plan runs by (guest.guest_backend), over the CPU test
    # driver: a launch on a capturing stream pins the plan, whose descriptors then outlive
    # every reference to it.
    from graphs import EXAMPLES

    from plancache.guest.guest_backend import pinned_plans
    from plancache.guest.native.plan import NativePlan as Loaded
    from plancache.testing import CpuTestBackend

    spec = EXAMPLES["conv_bias_relu"]
    built = CpuTestBackend().plans(spec.graph(), plancache.BuildOptions(), {})
    blob = built.finish(0).blob
    backend = CpuTestBackend()
    native = backend.load(blob, built.tensors, 0)
    assert isinstance(native, Loaded)
    launch = backend.launcher(native, 0, 0)
    tensors = spec.tensors(seed=0)
    pointers = [tensors[u].data_ptr() for u in native.user_uids]
    cuda = backend.cuda
    stream = cuda.new_stream(blocking=False)
    before = pinned_plans()
    with cuda.stream(stream):
        cuda.begin_capture(stream)
        launch(tensors, pointers)
        launch(tensors, pointers)
        assert cuda.end_capture(stream).recorded == 2
    assert pinned_plans() == before + 1, "pinned once"
    destroyed = backend.driver.simulated.destroyed
    del native, launch
    gc.collect()
    assert backend.driver.simulated.destroyed == destroyed, "a CUDA graph captured from it still points at its code and buffers"


def test_a_plan_whose_variant_pack_needs_a_uid_the_tensors_lack_is_left_to_the_frontend() -> None:
    record = parse(frontend_blob())
    assert refusal(record, {1, 3}) is Fallback.UIDS
    assert refusal(record, {1, 3, 5}) is None


def test_tensor_dumps_are_left_to_the_frontend_only_when_its_logging_writes_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # The frontend dumps a plan's tensors_to_dump at each launch only at CUDNN_FRONTEND_LOG_INFO 1..9.
    record = parse(frontend_blob(tensors_to_dump=[[1, "b"]]))
    monkeypatch.delenv("CUDNN_FRONTEND_LOG_INFO", raising=False)
    assert refusal(record) is None
    monkeypatch.setenv("CUDNN_FRONTEND_LOG_INFO", "1")
    assert refusal(record) is Fallback.DUMPS
    monkeypatch.setenv("CUDNN_FRONTEND_LOG_INFO", "12")
    assert refusal(record) is None
    assert {"2.0"} == records.TESTED_VERSIONS


@pytest.mark.parametrize(("status", "library"), [(4003, "CUDNN"), (4004, "CUDNN"), (5000, "CUDNN"), (5003, "CUDNN"), (1, "CUDA")])
def test_a_load_that_failed_for_a_reason_outside_the_blob_keeps_the_entry(status: int, library: str) -> None:
    # Judged by the status, never by the message: memory ran out, or CUDA failed underneath.
    from plancache import TransientLoadError
    from plancache.errors import NativeError, NativeLibrary
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend()
    with pytest.raises(TransientLoadError, match="failed for now"), backend._transient():
        raise NativeError(
            "cudnnBackendFinalize failed", call="cudnnBackendFinalize", status=status, library=NativeLibrary[library]
        )


@pytest.mark.parametrize("status", [1002, 1003, 2000, 3000, 4000])
def test_a_load_the_library_refuses_is_not_called_transient(status: int) -> None:
    from plancache.errors import NativeError
    from plancache.testing import CpuTestBackend

    backend = CpuTestBackend()
    with pytest.raises(NativeError) as raised, backend._transient():
        raise NativeError("cudnnBackendFinalize failed: CUDNN_STATUS_TRANSIENT_SOUNDING (out of memory)",
                          call="cudnnBackendFinalize", status=status)  # fmt: skip
    assert not raised.value.transient


def test_the_frontends_own_load_is_judged_by_its_exception_types() -> None:
    import cudnn

    from plancache import TransientLoadError
    from plancache.cudnn.backend import frontend_failures

    with pytest.raises(TransientLoadError), frontend_failures():
        raise RuntimeError("cuda_graph_end_capture failed: operation not permitted when stream is capturing")
    with pytest.raises(TransientLoadError), frontend_failures():
        raise torch.cuda.OutOfMemoryError("out of memory")
    with pytest.raises(cudnn.cudnnGraphNotSupportedError), frontend_failures():
        raise cudnn.cudnnGraphNotSupportedError("CUDNN_STATUS_NOT_SUPPORTED")
    with pytest.raises(KeyError), frontend_failures():
        raise KeyError("not a failure of the load")


def test_the_libraries_beside_the_loaded_cudnn_are_opened_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``open_beside`` opens each cuDNN library in the folder of the one this process
    mapped (real shared objects here: copies of one of Python's own), nothing else there,
    and only once per process."""
    import _ctypes
    import importlib
    import shutil

    native_library = importlib.import_module("plancache.cudnn.library")  # the package exports library()

    monkeypatch.setattr(native_library, "_opened", [])
    for name in ("libcudnn_graph.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_heuristic.so.9", "libother.so.1"):
        shutil.copy(_ctypes.__file__, tmp_path / name)
    (tmp_path / "libcudnn_notes.txt").write_text("not a library")
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000001000 r-xp 00000000 00:00 1 {tmp_path / 'libcudnn_graph.so.9'}\n")
    assert native_library.open_beside(maps=str(maps)) == 3
    assert native_library.open_beside(maps=str(maps)) == 0, "once per process"
    monkeypatch.setattr(native_library, "_opened", [])
    assert native_library.open_beside(maps=str(tmp_path / "no-maps")) == 0, "no cuDNN loaded: nothing opened"
