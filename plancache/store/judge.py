"""The judge: whether a stored blob is a plan of its key's own graph.

A row's checksums say its bytes are the ones written, not that the blob belongs to the key
(another graph's blob, its checksum recomputed, passes them). The blob names the graph the
frontend built it from, normalized as the frontend normalizes (``formats.plan_graph`` reads
it); ``judge`` holds it, field by field, against the form the key's description says the
frontend writes (``key.frontend_form``):

* the ops in order: tags, and every attribute a rule derives from the description (pointwise
  mode and clips, convolution padding, stride and dilation, attention's scale, masks and
  bounds, norm phases, reduction and MoE modes...), with its default where it is left out;
* the wiring: the tensor at every port (caller tensors by uid, the graph's own intermediate
  tensors by one consistent pairing);
* every caller tensor: data type, by-value or not, dims and strides as the frontend lays them
  out, its ragged offset and that offset's multiplier, its reordering;
* the graph's data types and flags, and no tensor a caller binds that the key's graph lacks.

What no rule covers is named in ``Judgement.unproven``, not guessed either way;
docs/reliability.md lists both.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..formats.plan_blob import PlanBlob
from ..formats.plan_graph import BlobNode, BlobTensor, PlanGraph, float_bits, read_graph, written
from ..key.frontend_form import F32, FormNode, FormTensor, FrontendForm, Layouts, TensorKind, frontend_form
from .per_process import PerProcess

__all__ = ["ANOTHER_GRAPH", "Judgement", "form_of", "judge"]

#: How every refusal of a readable blob begins.
ANOTHER_GRAPH = "the blob is a plan of another graph"


class _Side(enum.Enum):
    """A node's side a port is on (the value: as refusals name it)."""

    INPUT = "input"
    OUTPUT = "output"


@dataclass(frozen=True)
class Judgement:
    """The judge's verdict on one blob: ``refusal``, why it is not a plan of the key's graph
    (None: it is); ``unproven``, what the description says that nothing in the blob could be held to."""

    refusal: str | None
    unproven: tuple[str, ...] = ()


_FORMS: OrderedDict[str, FrontendForm] = OrderedDict()
_FORMS_LOCK = PerProcess(threading.Lock)  # the forms are shared with a forked child; the lock is not
_FORMS_KEPT = 256


def form_of(key: str, description: Mapping[str, object]) -> FrontendForm:
    """The frontend form of ``description``, kept per key: call it only once the key is known
    to be this description's hash (``store.entry`` checks that first)."""
    with _FORMS_LOCK.get():
        form = _FORMS.get(key)
        if form is not None:
            _FORMS.move_to_end(key)
            return form
    form = frontend_form(description)
    with _FORMS_LOCK.get():
        _FORMS[key] = form
        while len(_FORMS) > _FORMS_KEPT:
            _FORMS.popitem(last=False)
    return form


def judge(blob: PlanBlob | bytes, description: Mapping[str, object], form: FrontendForm | None = None) -> Judgement:
    """Whether ``blob`` is a plan of ``description``'s graph (``form``: its frontend form, if
    known); a description of the wrong shape is a refusal. A ``PlanBlob`` keeps its decoding."""
    try:
        graph = read_graph(PlanBlob.of(blob))
    except ValueError as exc:
        return Judgement(f"the blob's graph cannot be read ({str(exc)[:200]})")
    try:
        return _Judge(form if form is not None else frontend_form(description), graph).run()
    except (AttributeError, TypeError, KeyError, ValueError) as exc:
        return Judgement(f"{ANOTHER_GRAPH} (it cannot be compared: {type(exc).__name__}: {str(exc)[:200]})")


class _Refused(Exception):
    """One difference found: the first one ends the judgement."""


def _spelling(name: str) -> str:
    return name.replace("_", "").lower()


class _Judge:
    """One comparison of a blob's graph with a form."""

    def __init__(self, form: FrontendForm, graph: PlanGraph) -> None:
        self.form = form
        self.graph = graph
        self.uid_of: dict[str, int] = dict(form.uids)
        self.tid_of: dict[int, str] = {uid: tid for tid, uid in self.uid_of.items()}
        self.notes: list[str] = []

    def run(self) -> Judgement:
        try:
            if tuple(node.tag for node in self.form.nodes) != self.graph.tags:
                raise _Refused(f"its ops are {'+'.join(self.graph.tags)[:200]}")
            self.context()
            for node, found in zip(self.form.nodes, self.graph.nodes):
                self.attributes(node, found)
                self.ports(node, found)
            self.tensors()
        except _Refused as exc:
            return Judgement(f"{ANOTHER_GRAPH} ({exc})")
        return Judgement(None, (*self.form.unproven, *self.notes))

    # ------------------------------------------------------------------ the graph and its ops

    def context(self) -> None:
        context = self.graph.context
        for name, expected in self.form.context.items():
            if name not in context or context[name] != expected:
                raise _Refused(f"its {name} is {context.get(name, 'not said')!r}, not {expected!r}")

    def attributes(self, node: FormNode, found: BlobNode) -> None:
        held = found.attributes
        for name, expected in node.attributes.items():
            value = held.get(name, _MISSING)
            if type(value) is type(expected) and value == expected:  # as written: most attributes, no conversion
                continue
            if value is _MISSING:
                raise _Refused(f"node {node.position} ({node.tag}) does not say its {name}")
            if not _same(expected, value):
                shown = expected.hex() if isinstance(expected, F32) else expected
                raise _Refused(f"node {node.position} ({node.tag}) has {name} {value!r}, not {shown!r}")

    def ports(self, node: FormNode, found: BlobNode) -> None:
        for side, ports, names, held in ((_Side.INPUT, node.inputs, node.names[0], found.inputs),
                                         (_Side.OUTPUT, node.outputs, node.names[1], found.outputs)):  # fmt: skip
            if held.keys() == names:  # every port named as written, and no other: nothing is loose or extra
                for port in ports:
                    self.bind(port.tid, held[port.name], (side, port.name, node))
                continue
            matched: set[str] = set()
            loose: list[str] = []
            spelled: dict[str, str] | None = None  # the blob's ports by spelling, made when first needed
            for port in ports:
                name: str | None = port.name
                if not port.exact and name not in held:
                    spelled = spelled if spelled is not None else {_spelling(n): n for n in held}
                    name = spelled.get(_spelling(port.name))
                if name is None or name not in held:
                    if port.exact:
                        raise _Refused(f"node {node.position} ({node.tag}) has no {side.value} {port.name}")
                    loose.append(port.tid)
                    continue
                matched.add(name)
                self.bind(port.tid, held[name], (side, name, node))
            # a port plancache cannot name in the blob: its tensor must be among the node's (a
            # batch norm's peer statistics are a list beside its ports)
            among = (_uids(held.values()) | (_uids([found.attributes.get("peer_stats")]) if side is _Side.INPUT else set())
                     if loose else set())  # fmt: skip
            for tid in loose:
                uid = self.uid_of.get(tid)
                if uid is not None and uid not in among:
                    raise _Refused(f"node {node.position} ({node.tag}) does not {side.value} tensor {uid}")
                self.notes.append(f"node {node.position} ({node.tag}): an {side.value} port matched by its tensor only")
            for name, uid in held.items():
                if uid is None or name in matched:
                    continue
                others = {self.tid_of.get(u) for u in _uids([uid])} - {None}
                # a tensor of the key's graph at a port the key's graph does not have, or one not the frontend's own
                if others - set(loose) or (name not in node.extras and not all(self._own(u) for u in _uids([uid]))):
                    raise _Refused(f"node {node.position} ({node.tag}) has {side.value} {name}, which the key's graph does not")

    def _own(self, uid: int) -> bool:
        """Whether ``uid`` is a tensor the frontend made itself (virtual, or by value)."""
        record = self.graph.records.get(uid)
        return record is not None and (record.get("is_virtual") is True or record.get("is_pass_by_value") is True)

    def bind(self, tid: str, uid: object, where: _Where) -> None:
        """Pair the description's tensor ``tid`` with the blob's ``uid``: a caller tensor with its
        own uid, the graph's own tensors one to one. ``where`` (``_Where``) is named on a refusal."""
        bound = self.uid_of.get(tid)
        if bound == uid and type(uid) is int:
            return
        if type(uid) is not int:
            raise _Refused(f"{_where(where)} holds {uid!r}, not one tensor")
        if bound is not None:
            raise _Refused(f"{_where(where)} holds tensor {uid}, not {bound}")
        if uid in self.tid_of:
            raise _Refused(f"{_where(where)} holds tensor {uid}, which is another of the key's graph")
        self.uid_of[tid], self.tid_of[uid] = uid, tid

    # ------------------------------------------------------------------ tensors

    def tensors(self) -> None:
        laid_out: Layouts | None = None  # worked out for the first tensor not written as the form says
        for tid, tensor in self.form.tensors.items():
            uid = self.uid_of.get(tid)
            if uid is None or (tensor.kind is TensorKind.CALLER and tid not in self.form.used):
                continue  # a tensor no node uses is in no plan; an unpaired intermediate was compared by its ports
            record = self.graph.records.get(uid)
            if record is None:
                raise _Refused(f"tensor {uid} is not in the blob")
            expected = tensor.written
            if expected is not None:  # written as the form says, value for value: what the checks below would find
                found_written = written(record)
                if found_written == expected if expected[0] is not None else found_written[2:] == expected[2:]:
                    continue
            found = self.graph.tensor(uid)
            assert found is not None
            if laid_out is None:
                laid_out = self.form.layouts(tuple(node.attributes.get("implementation") for node in self.graph.nodes))
            if found.is_virtual != (tensor.kind is TensorKind.VIRTUAL):
                raise _Refused(f"{_what(tensor, uid)} is {'virtual' if found.is_virtual else 'not virtual'} in one graph only")
            if found.is_pass_by_value != tensor.by_value:
                raise _Refused(f"{_what(tensor, uid)} is passed by value in one graph only")
            if tensor.data_type is not None and found.data_type != tensor.data_type:
                raise _Refused(f"{_what(tensor, uid)}: data type {found.data_type}, not {tensor.data_type}")
            layouts = laid_out.get(tid)
            if layouts is not None and not _laid_out_as(layouts, found):
                raise _Refused(f"{_what(tensor, uid)}: dims {list(found.dims)} strides {list(found.strides)}")
            if tensor.kind is TensorKind.SCALAR:
                self.scalar(tensor, uid, found)
                continue
            self.ragged(tensor, uid, found)
            if found.reordering != tensor.reordering:
                raise _Refused(f"{_what(tensor, uid)}: reordering_type {found.reordering!r}, not {tensor.reordering!r}")
            if found.multiplier != tensor.multiplier:
                raise _Refused(f"{_what(tensor, uid)}: ragged_offset_multiplier {found.multiplier!r}, not {tensor.multiplier!r}")
        for uid in self.graph.records:  # the frontend's own tensors are its only extras
            if uid not in self.tid_of and not self._own(uid):
                raise _Refused(f"tensor {uid} is not the key's")

    def ragged(self, tensor: FormTensor, uid: int, found: BlobTensor) -> None:
        offset = tensor.ragged_offset
        expected = None if offset is None else self.uid_of.get(offset)
        if offset is not None and expected is None:  # an offset only its tensor names: paired here
            if found.ragged_offset is None:
                raise _Refused(f"{_what(tensor, uid)} has no ragged offset")
            self.bind(offset, found.ragged_offset, (_what(tensor, uid),))
        elif found.ragged_offset != expected:
            raise _Refused(f"{_what(tensor, uid)}: ragged offset {found.ragged_offset}, not {expected}")

    @staticmethod
    def scalar(tensor: FormTensor, uid: int, found: BlobTensor) -> None:
        held, value = found.fields.get("pass_by_value"), tensor.value
        if value is None or not isinstance(held, dict):
            return
        if not _same(value, held.get("value")):
            raise _Refused(f"{_what(tensor, uid)} holds {held.get('value')!r}, not {value.hex()}")


_MISSING = object()


def _what(tensor: FormTensor, uid: int) -> str:
    """How a refusal names a tensor: a caller's by its uid, the graph's own with its id too."""
    return f"tensor {uid}" if tensor.kind is TensorKind.CALLER else f"its tensor {uid} ({tensor.tid})"


#: Where ``bind`` found a uid: a port (side, name, node), or the tensor whose ragged offset it is.
_Where = tuple[_Side, str, FormNode] | tuple[str]


def _where(where: _Where) -> str:
    """A port, from ``bind``'s ``(side, name, node)``, or the ragged offset of a tensor."""
    if len(where) == 1:
        return f"the ragged offset of {where[0]}"
    side, name, node = where
    return f"{side.value} {name} of node {node.position} ({node.tag})"


def _laid_out_as(layouts: list[tuple[tuple[int, ...], tuple[int, ...] | None]], found: BlobTensor) -> bool:
    """Whether ``found`` has one of ``layouts`` (strides None: any strides of those dims)."""
    return (found.dims, found.strides) in layouts or any(s is None and d == found.dims for d, s in layouts)


def _uids(values: Iterable[object]) -> set[int]:
    """The uids among ``values``: ints, and the ints of lists."""
    return {v for value in values for v in (value if isinstance(value, list) else (value,)) if type(v) is int}


def _same(expected: object, found: object) -> bool:
    if isinstance(expected, F32):
        try:
            return found is not None and float_bits(found) == int(expected)
        except ValueError:
            return False
    if isinstance(expected, float) and isinstance(found, (int, float)) and not isinstance(found, bool):
        return float(found) == expected
    if type(expected) is bool or type(found) is bool:
        return type(expected) is type(found) and expected == found
    return bool(expected == found)
