"""Prewarm manifests: the graphs to build and autotune ahead of time (format version 1).

A manifest is a JSON (or TOML) document::

    {"version": 1,
     "pythonpath": ["."],                       # optional, relative to the manifest
     "entries": [
       {"template": "conv_bias_act", "params": {"n": [1, 8, 32], "c": 64, "h": 56, "w": 56, "k": 64}},
       {"template": "sdpa", "params": {"h": 16, "d": 64}, "shapes": [{"b": 4, "s": 1024}, {"b": 1, "s": 4096}]},
       {"builder": "mymodel.graphs:attention", "args": [8], "kwargs": {"heads": 16}, "expand": {"seq": [512, 1024]}},
       {"graph": {...canonical description, as written by the recorder...}}]}

Entry kinds: ``template`` (a built-in template of ``plancache.workflows.templates``; a list-valued
param expands into one graph per value, several lists into their cartesian product, and
``shapes`` lists parameter sets merged over ``params``); ``builder`` (``module:function``
called with ``args``/``kwargs``, returning a ``cudnn.pygraph``; ``expand`` maps keyword
names to value lists, expanded like template lists); ``graph`` (a canonical description,
rebuilt exactly by ``plancache.replay``). Every entry may carry a ``name`` and ``options``
(the ``BuildOptions`` fields its plan is keyed and built with). ``SCHEMA`` is the JSON
Schema. ``load_manifest`` reports a bad entry as a ``ManifestError`` naming the file, the
entry index and its line, and still returns every good entry.

Code: a ``builder`` entry imports a module and calls a function, and ``pythonpath`` adds
folders to ``sys.path``; ``parse_manifest``'s ``allow_code`` and ``listing`` keep either from
happening. ``code_references`` names what would run.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cache.recording import MANIFEST_VERSION, write_json
from ..config import Refused, StrEnum
from ..errors import ManifestError
from ..key import HEURISTIC_MODES, POLICIES, BuildOptions
from ..store.files import read_regular
from . import templates

__all__ = [
    "MAX_GRAPHS",
    "MAX_MANIFEST_BYTES",
    "SCHEMA",
    "EntryKind",
    "ManifestEntry",
    "code_references",
    "load_manifest",
    "parse_manifest",
    "refuse_unusable",
    "resolve_builder",
    "write_manifest",
]

log = logging.getLogger("plancache")

_ALLOW_CODE = "allowed with --allow-code, or allow_code=True, for a manifest you trust"

#: The most graphs one manifest may expand to, counted before any is made (its lists'
#: cartesian products): far more than any model's shapes, far fewer than fill a machine.
MAX_GRAPHS = 100_000
#: The largest manifest file read (a manifest of 100,000 explicit graphs is a few MB).
MAX_MANIFEST_BYTES = 64 << 20

_SCALAR = {"type": ["integer", "number", "string", "boolean", "null"]}
_PARAMS = {"type": "object", "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "minItems": 1, "items": _SCALAR}]}}
_OPTIONS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "policy": {"enum": list(POLICIES)},
        "top_k": {"type": ["integer", "null"], "minimum": 1},
        "heuristic_modes": {"type": "array", "minItems": 1, "items": {"enum": list(HEURISTIC_MODES)}},
        "workspace_limit": {"type": ["integer", "null"], "minimum": 0},
        "kernel_cache": {"type": "boolean"},
    },
}
_COMMON = {"name": {"type": "string"}, "options": _OPTIONS}


def _entry_schema(kind: str, **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": [kind], "additionalProperties": False, "properties": {**properties, **_COMMON}}


_ENTRY_SCHEMAS: dict[str, dict[str, Any]] = {
    "template": _entry_schema("template", template={"type": "string"}, params=_PARAMS,
                              shapes={"type": "array", "minItems": 1, "items": _PARAMS}),
    "builder": _entry_schema("builder", builder={"type": "string", "pattern": r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"},
                             args={"type": "array"}, kwargs={"type": "object"},
                             expand={"type": "object", "additionalProperties": {"type": "array", "minItems": 1}}),
    "graph": _entry_schema("graph", graph={
        "type": "object",
        "required": ["nodes", "tensors"],
        "properties": {
            "nodes": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type", "inputs", "outputs", "params"],
                "properties": {"type": {"type": "string", "pattern": "^[A-Z][A-Z0-9_]*$"},
                               "inputs": {"type": "object"}, "outputs": {"type": "object"},
                               "params": {"type": "object"}}}},
            "tensors": {"type": "object", "propertyNames": {"pattern": "^[uv][0-9]+$"}},
        },
    }),
}  # fmt: skip
#: JSON Schema (draft 2020-12) of a version-1 manifest.
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "plancache prewarm manifest",
    "type": "object",
    "required": ["version", "entries"],
    "additionalProperties": False,
    "properties": {
        "version": {"const": MANIFEST_VERSION},
        "pythonpath": {"type": "array", "items": {"type": "string"}},
        "entries": {"type": "array", "items": {"oneOf": list(_ENTRY_SCHEMAS.values())}},
    },
}


class EntryKind(StrEnum):
    """What a manifest entry names its graph by (the entry's one key of these)."""

    TEMPLATE = "template"
    BUILDER = "builder"
    GRAPH = "graph"


@dataclass(frozen=True)
class ManifestEntry:
    """One graph to prewarm: an entry of a manifest with its lists expanded."""

    index: int  # position in the manifest's "entries"
    kind: EntryKind
    spec: dict[str, Any]  # {"template", "params"} | {"builder", "args", "kwargs"} | {"graph"}
    line: int | None = None
    path: str | None = None
    name: str | None = None
    options: dict[str, Any] | None = None
    builder: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    #: Read without running code (``listing=True``): a builder entry to list, never to build.
    listed_only: bool = field(default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", EntryKind(self.kind))

    @property
    def where(self) -> str:
        """``file:line: entry N`` for messages."""
        return f"{_place(self.path or '<manifest>', self.line)}: entry {self.index}"

    @property
    def label(self) -> str:
        if self.kind is EntryKind.TEMPLATE:
            text = self.spec["template"] + " " + " ".join(f"{k}={v}" for k, v in self.spec["params"].items())
        elif self.kind is EntryKind.BUILDER:
            # default=str: a TOML manifest's dates and times are arguments too
            args = [json.dumps(a, default=str) for a in self.spec["args"]]
            args += [f"{k}={json.dumps(v, default=str)}" for k, v in self.spec["kwargs"].items()]
            text = f"{self.spec['builder']}({', '.join(args)})"
        else:
            from ..store import summarize

            text = summarize(self.spec["graph"])
        text = text.strip()
        return f"{self.name}: {text}" if self.name else text

    def build(self) -> Any:
        """A fresh ``cudnn.pygraph`` for this entry (no GPU needed)."""
        if self.kind is EntryKind.TEMPLATE:
            return templates.build(self.spec["template"], **self.spec["params"])
        if self.kind is EntryKind.GRAPH:
            from ..cudnn.replay import rebuild_graph

            return rebuild_graph(self.spec["graph"])
        if self.listed_only:
            raise self._error("was listed without importing it; load the manifest with allow_code to build it")
        function = self.builder or resolve_builder(self.spec["builder"])
        graph = function(*self.spec["args"], **self.spec["kwargs"])
        if not hasattr(graph, "nodes") or not hasattr(graph, "tensors"):
            raise self._error(f"returned {type(graph).__name__}, not a cudnn.pygraph")
        return graph

    def _error(self, what: str) -> ManifestError:
        return ManifestError(f"{self.where}: builder {self.spec['builder']} {what}", path=self.path, entry=self.index,
                             line=self.line)  # fmt: skip

    def build_options(self, default: BuildOptions) -> BuildOptions:
        """``default`` with this entry's own options applied."""
        if not self.options:
            return default
        changes = {k: v for k, v in self.options.items() if not (k == "top_k" and v is None)}
        return dataclasses.replace(default, **changes)

    def record(self, **fields: Any) -> dict[str, Any]:
        """The start of this entry's record in a prewarm report, with ``fields``."""
        return {"index": self.index, "line": self.line, "label": self.label, "key": None, **fields}

    def to_dict(self) -> dict[str, Any]:
        """This (expanded) entry as a manifest entry."""
        data: dict[str, Any] = dict(self.spec)
        if self.name:
            data["name"] = self.name
        if self.options:
            data["options"] = dict(self.options)
        return data


def resolve_builder(ref: str, what: str = "builder") -> Callable[..., Any]:
    """The callable named by ``module:function`` (``function`` may be dotted, ``Class.method``).
    Raises ``LookupError`` saying what is missing."""
    module_name, _, attr = ref.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # user code: a missing module, or one that fails as it imports
        raise LookupError(f"{what} {ref!r}: module {module_name!r} cannot be imported ({type(exc).__name__}: {exc})") from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise LookupError(f"{what} {ref!r}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise LookupError(f"{what} {ref!r} is a {type(target).__name__}, not callable")
    found: Callable[..., Any] = target
    return found


# ---------------------------------------------------------------------- loading


def _place(where: str, line: int | None) -> str:
    return f"{where}:{line}" if line else where


def _entry_offsets(text: str) -> list[int]:
    """Character offsets of the elements of the top-level "entries" array of JSON ``text``
    (already known to parse), found by decoding value by value."""
    decoder = json.JSONDecoder()

    def skip(pos: int, sep: str = "") -> int:  # past whitespace, and one separator if present
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        if sep and text.startswith(sep, pos):
            return skip(pos + 1)
        return pos

    def past_value(pos: int) -> int:
        return skip(decoder.raw_decode(text, pos)[1], ",")

    pos = skip(0)
    if not text.startswith("{", pos):
        return []
    pos = skip(pos + 1)
    while pos < len(text) and text[pos] != "}":
        name, pos = decoder.raw_decode(text, pos)
        pos = skip(pos, ":")
        if name == "entries" and text.startswith("[", pos):
            offsets: list[int] = []
            pos = skip(pos + 1)
            while not text.startswith("]", pos):
                offsets.append(pos)
                pos = past_value(pos)
            return offsets
        pos = past_value(pos)
    return []


def _schema_problem(schema: Mapping[str, Any], value: Any) -> str | None:
    import jsonschema  # only when loading a manifest

    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if error is None:
        return None
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    return f"{where}: {error.message}" if where else error.message


def _graphs(kind: EntryKind, raw: Mapping[str, Any]) -> int:
    """How many graphs an entry (already checked against its schema) expands to, counted
    before any is made: the product of its lists' lengths, per shape of a template."""
    if kind is EntryKind.TEMPLATE:
        return sum(math.prod(map(len, lists.values())) for _, lists in _template_shapes(raw))
    if kind is EntryKind.BUILDER:
        return math.prod(map(len, raw.get("expand", {}).values()))
    return 1


def _template_shapes(raw: Mapping[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, list[Any]]]]:
    """A template entry's parameters per shape (``params`` under each of ``shapes``), split
    into the single values and the lists to expand."""
    for shape in raw.get("shapes") or [{}]:
        params = {**raw.get("params", {}), **shape}
        yield ({k: v for k, v in params.items() if not isinstance(v, list)},
               {k: v for k, v in params.items() if isinstance(v, list)})  # fmt: skip


def _product(base: Mapping[str, Any], lists: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    return [{**base, **dict(zip(lists, values))} for values in itertools.product(*lists.values())]


_COUNTS = {"r": 1, "s": 1, "stride": 1, "dilation": 1, "h_kv": 1, "s_kv": 1, "padding": 0}  # optional ints: least value
_FLAGS = ("bias", "causal", "dynamic")


def _check_template_params(name: str, params: Mapping[str, Any]) -> None:
    """Refuse now what would only fail (or divide by zero) when the graph is built."""
    required = templates.TEMPLATES[name].required
    for key, least in _COUNTS.items():
        value = params.get(key)
        if key in required or value is None:
            continue  # required ones are checked by the template itself
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"template {name!r}: {key} must be an integer >= {least}, not {value!r}")
    for key in _FLAGS:
        if key in params and not isinstance(params[key], bool):
            raise ValueError(f"template {name!r}: {key} must be true or false, not {params[key]!r}")
    act = params.get("act", "relu")
    if act not in templates.ACTIVATIONS:
        raise ValueError(f"template {name!r}: act must be one of {[a for a in templates.ACTIVATIONS if a]} or null, not {act!r}")
    out = templates.layout(name, **params)[-1]  # unknown or missing params, required ones > 0
    if any(d < 1 for d in out.shape):
        raise ValueError(
            f"template {name!r}: the output would be empty ({list(out.shape)}): the kernel is larger than the padded input"
        )


def _expand(kind: EntryKind, raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    if kind is EntryKind.TEMPLATE:
        name = raw["template"]
        if name not in templates.TEMPLATES:
            raise ValueError(f"unknown template {name!r}; known: {', '.join(templates.TEMPLATES)}")
        combos = [params for scalars, lists in _template_shapes(raw) for params in _product(scalars, lists)]
        for params in combos:
            _check_template_params(name, params)
        return [{"template": name, "params": params} for params in combos]
    if kind is EntryKind.BUILDER:
        base = {"builder": raw["builder"], "args": list(raw.get("args", [])), "kwargs": dict(raw.get("kwargs", {}))}
        return [{**base, "kwargs": kwargs} for kwargs in _product(base["kwargs"], raw.get("expand", {}))]
    return [{"graph": raw["graph"]}]


def _read_document(text: str, where: str, fmt: str) -> tuple[dict[str, Any], list[int | None]] | ManifestError:
    """The manifest document and the line of each entry, or the one error saying why the
    document cannot be used at all. Runs no code and leaves ``sys.path`` alone."""

    def fatal(message: str, line: int | None = None) -> ManifestError:
        return ManifestError(f"{_place(where, line)}: {message}", path=where, entry=None, line=line)

    try:
        if fmt == "toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            document: Any = tomllib.loads(text)
            lines: list[int | None] = [i + 1 for i, line in enumerate(text.splitlines())
                                       if re.match(r"\s*\[\[\s*entries\s*\]\]", line)]  # its [[entries]] tables  # fmt: skip
        else:
            document = json.loads(text)
            lines = [text.count("\n", 0, offset) + 1 for offset in _entry_offsets(text)]
    except json.JSONDecodeError as exc:
        return fatal(f"not valid JSON: {exc.msg} (column {exc.colno})", exc.lineno)
    except RecursionError:  # arrays or tables nested thousands deep: no manifest is
        return fatal(f"nested too deeply to read as {fmt.upper()} (a manifest nests a few levels)")
    except ValueError as exc:  # tomllib.TOMLDecodeError
        return fatal(f"not valid TOML: {exc}")
    except ModuleNotFoundError:
        return fatal("reading a TOML manifest needs Python 3.11 or the tomli package")
    if not isinstance(document, dict):
        return fatal("a manifest is an object with 'version' and 'entries'")
    version = document.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > MANIFEST_VERSION:
        return fatal(f"manifest format {version} is newer than this plancache supports ({MANIFEST_VERSION}); upgrade plancache")
    top = {k: v for k, v in SCHEMA.items() if k != "properties"}
    problem = _schema_problem({**top, "properties": {**SCHEMA["properties"], "entries": {"type": "array"}}}, document)
    if problem:
        return fatal(problem)
    return document, lines


def parse_manifest(
    text: str,
    path: str | os.PathLike[str] | None = None,
    *,
    fmt: str = "json",
    allow_code: bool = True,
    listing: bool = False,
) -> tuple[list[ManifestEntry], list[ManifestError]]:
    """Parse manifest ``text`` (``fmt`` json or toml): the good entries, expanded, and one
    error per bad entry. A document that cannot be read at all gives no entries and one error.

    ``allow_code=False``: builder entries and ``pythonpath`` are refused (reported as
    errors; nothing is imported and ``sys.path`` is left alone). ``listing=True``: nothing
    is imported and ``sys.path`` is left alone either, but builder entries are returned
    unresolved (``builder`` None) so that they can be listed; they must not be built."""
    where = os.fspath(path) if path is not None else "<manifest>"
    read = _read_document(text, where, fmt)
    if isinstance(read, ManifestError):
        return [], [read]
    document, lines = read
    runs_code = allow_code and not listing
    errors: list[ManifestError] = []
    if document.get("pythonpath") and not runs_code:
        if not listing:
            errors.append(ManifestError(f"{where}: pythonpath {document['pythonpath']} refused: it changes sys.path for "
                                        f"builder modules, which run code ({_ALLOW_CODE})", path=where, entry=None, line=None))  # fmt: skip
    elif runs_code:
        base = Path(where).resolve().parent if path is not None else Path.cwd()
        for folder in document.get("pythonpath", []):
            folder = str((base / folder).resolve())
            if folder not in sys.path:
                sys.path.insert(0, folder)  # so builder modules next to the manifest import
    entries: list[ManifestEntry] = []
    for index, raw in enumerate(document["entries"]):
        line = lines[index] if index < len(lines) else None
        try:
            if isinstance(raw, dict) and "builder" in raw and not allow_code and not listing:
                raise ValueError(f"builder {raw['builder']!r} refused: builder entries import and run code ({_ALLOW_CODE})")
            entries += _load_entry(index, raw, where, line, resolve=runs_code, room=MAX_GRAPHS - len(entries))
        except Exception as exc:  # one bad entry is reported; the others still load
            known = isinstance(exc, (ValueError, LookupError))
            message = exc.message if isinstance(exc, ManifestError) else str(exc) if known else f"{type(exc).__name__}: {exc}"
            errors.append(ManifestError(f"{_place(where, line)}: entry {index}: {message}", path=where, entry=index, line=line))
    return entries, errors


def _load_entry(index: int, raw: Any, where: str, line: int | None, *, resolve: bool,
                room: int) -> list[ManifestEntry]:  # fmt: skip
    """The graphs of one entry; ``room``: how many more the manifest may hold."""
    kinds = [k for k in _ENTRY_SCHEMAS if isinstance(raw, dict) and k in raw]
    if len(kinds) != 1:
        raise ValueError("an entry is an object with exactly one of 'template', 'builder' or 'graph'")
    kind = EntryKind(kinds[0])
    problem = _schema_problem(_ENTRY_SCHEMAS[kind], raw)
    if problem:
        raise ValueError(problem)
    graphs = _graphs(kind, raw)
    if graphs > room:
        raise ValueError(f"expands to {graphs:,} graphs, more than the {room:,} left of the {MAX_GRAPHS:,} a manifest "
                         f"may hold: split it, or list fewer values")  # fmt: skip
    function = resolve_builder(raw["builder"]) if kind is EntryKind.BUILDER and resolve else None
    options = dict(raw["options"]) if raw.get("options") else None
    if options:
        ManifestEntry(index, kind, {}, options=options).build_options(BuildOptions())  # refuses bad combinations now
    listed_only = kind is EntryKind.BUILDER and not resolve
    return [ManifestEntry(index, kind, spec, line, where, raw.get("name"), options, function, listed_only)
            for spec in _expand(kind, raw)]  # fmt: skip


def _read_text(path: str | os.PathLike[str]) -> str | ManifestError:
    """The manifest's text, read from a regular file (a link to one is followed: manifests
    live in projects), never a FIFO or a device, of at most ``MAX_MANIFEST_BYTES``."""
    try:
        return read_regular(path, MAX_MANIFEST_BYTES, follow=True)[0].decode("utf-8")
    except (OSError, UnicodeDecodeError, Refused) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return ManifestError(f"{os.fspath(path)}: cannot read the manifest: {why}", path=os.fspath(path), entry=None, line=None)


def _format(path: str | os.PathLike[str]) -> str:
    return "toml" if str(path).endswith(".toml") else "json"


def load_manifest(
    path: str | os.PathLike[str], *, allow_code: bool = True, listing: bool = False
) -> tuple[list[ManifestEntry], list[ManifestError]]:
    """Read a manifest file (``.toml`` is TOML, anything else JSON): ``parse_manifest``'s
    answer (the ``plancache`` command passes ``allow_code=False`` unless ``--allow-code``,
    and ``listing=True`` for ``--dry-run``). ``ManifestError`` fields: ``path``, ``entry``,
    ``line``."""
    text = _read_text(path)
    if isinstance(text, ManifestError):
        return [], [text]
    return parse_manifest(text, path, fmt=_format(path), allow_code=allow_code, listing=listing)


def _whole_document(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[int | None]]:
    """The document at ``path`` and its entries' lines, or the ``ManifestError`` that makes it unusable."""
    text = _read_text(path)
    read = text if isinstance(text, ManifestError) else _read_document(text, os.fspath(path), _format(path))
    if isinstance(read, ManifestError):
        raise read
    return read


def refuse_unusable(path: str | os.PathLike[str], *, allow_code: bool) -> None:
    """Raise the ``ManifestError`` that makes the manifest at ``path`` unusable as a whole,
    so that nothing is built: it cannot be read, it is no manifest (not valid JSON or TOML,
    not an object with ``version`` and ``entries``, a newer format), or it runs code
    (``code_references``) while ``allow_code`` is False. Imports nothing."""
    document, lines = _whole_document(path)
    code = [] if allow_code else _code_in(document, lines)
    if code:
        shown = "; ".join(code[:3]) + (f"; and {len(code) - 3} more" if len(code) > 3 else "")
        raise ManifestError(f"{os.fspath(path)} runs code ({shown}): nothing was built. Pass --allow-code (allow_code=True) if "
                            "you trust this manifest, or --dry-run to list its entries", path=os.fspath(path), entry=None,
                            line=None)  # fmt: skip


def code_references(path: str | os.PathLike[str]) -> list[str]:
    """What in the manifest at ``path`` would run code or change ``sys.path``: its
    ``pythonpath`` and each builder entry, as short descriptions (``entry 3 (line 7):
    builder mymodel.graphs:attn``). Imports nothing; an unreadable manifest gives []."""
    try:
        return _code_in(*_whole_document(path))
    except ManifestError:
        return []


def _code_in(document: Mapping[str, Any], lines: list[int | None]) -> list[str]:
    found = [f"pythonpath {document['pythonpath']}"] if document.get("pythonpath") else []
    for index, raw in enumerate(document["entries"]):
        if isinstance(raw, dict) and "builder" in raw:
            line = lines[index] if index < len(lines) else None
            found.append(f"entry {index}{f' (line {line})' if line else ''}: builder {raw['builder']}")
    return found


# ---------------------------------------------------------------------- writing and recording


def write_manifest(
    path: str | os.PathLike[str], entries: Iterable[ManifestEntry | Mapping[str, Any]], *, pythonpath: list[str] | None = None
) -> None:
    """Write a version-1 JSON manifest of ``entries`` (``ManifestEntry`` or raw entry dicts)."""
    document: dict[str, Any] = {"version": MANIFEST_VERSION}
    if pythonpath:
        document["pythonpath"] = list(pythonpath)
    document["entries"] = [e.to_dict() if isinstance(e, ManifestEntry) else dict(e) for e in entries]
    write_json(Path(path), document)
