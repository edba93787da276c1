"""The key that names a plan: the build options, the tensor table a plan executes with,
and the SHA-256 over a graph's description, an environment fingerprint and the options.

Pure: no cuDNN, torch or CUDA import. Never uses Python's ``hash()``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import orjson

from ..config import Refused, StrEnum, argument, size, switch, whole_number

__all__ = ["HEURISTIC_MODES", "JSON", "KEY_FORMAT", "POLICIES", "BuildOptions", "CacheKey", "Policy", "TensorSpec",
           "canonical_json", "environment_id", "make_key"]  # fmt: skip

#: Bumped whenever the description or key layout changes, so old entries become misses.
KEY_FORMAT = 3


class Policy(StrEnum):
    """How a miss chooses among the candidates (``BuildOptions.policy``)."""

    HEURISTIC = "heuristic"
    TOPK = "topk"
    EXHAUSTIVE = "exhaustive"


#: A policy by its name, as callers pass it (``BuildOptions(policy="exhaustive")``): the
#: values of ``Policy``, for type checkers (tests/test_import.py keeps the two alike).
PolicyName = Literal["heuristic", "topk", "exhaustive"]
POLICIES = tuple(p.value for p in Policy)
HEURISTIC_MODES = ("A", "B", "FALLBACK")
#: The frontend's own modes: the first candidate a miss launches is the plan the frontend
#: alone would run, and its planning costs what the frontend's does (mode B's query took
#: longer than a whole heuristic build for a matmul on an H200). B adds candidates on request.
DEFAULT_HEURISTIC_MODES = ("A", "FALLBACK")


@dataclass(frozen=True)
class BuildOptions:
    """Everything the caller chooses that can change which plan is built.

    ``policy`` (a ``Policy``, or its name; read as a ``Policy``): ``"heuristic"`` takes the
    heuristics' first buildable plan without timing; ``"topk"`` times the first ``top_k``
    candidates; ``"exhaustive"`` times all of them.
    ``workspace_limit`` (bytes) excludes plans that need more workspace.
    ``kernel_cache``: dynamic-shape graphs build against the one kernel cache the
    backend shares per device (False: each builds its own). Static graphs ignore it.
    """

    policy: Policy = Policy.TOPK
    # 4: on an H200 (cuDNN 9.19), the best of the first 4 candidates was within 1.8% of the
    # exhaustive best for all seven benchmark graphs; 3 missed by up to 6.6%.
    top_k: int = 4
    heuristic_modes: tuple[str, ...] = DEFAULT_HEURISTIC_MODES
    workspace_limit: int | None = None
    kernel_cache: bool = True

    if TYPE_CHECKING:  # the constructor as type checkers see it: a policy by its name as well

        def __init__(self, policy: Policy | PolicyName = Policy.TOPK, top_k: int = 4,
                     heuristic_modes: tuple[str, ...] = DEFAULT_HEURISTIC_MODES, workspace_limit: int | None = None,
                     kernel_cache: bool = True) -> None: ...  # fmt: skip

    def __post_init__(self) -> None:
        # Read as the settings are (config's readers): top_k="4" is 4 and workspace_limit="1G"
        # is 1 GiB, as max_size="1G" is; top_k=2.5 is refused here, not at the first miss.
        # A value read alike keys alike.
        read = {"policy": Policy(argument("BuildOptions(policy)", self.policy, _policy)),
                "top_k": argument("BuildOptions(top_k)", self.top_k, whole_number(1, "candidates")),
                "heuristic_modes": argument("BuildOptions(heuristic_modes)", self.heuristic_modes, _modes),
                "workspace_limit": None if self.workspace_limit is None
                else argument("BuildOptions(workspace_limit)", self.workspace_limit, size),
                "kernel_cache": argument("BuildOptions(kernel_cache)", self.kernel_cache, switch)}  # fmt: skip
        for name, value in read.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The options as they enter the key (top_k only matters for the topk policy)."""
        return dict(_options_dict(self))  # a copy: callers may change theirs


def _policy(value: object) -> str:
    if not isinstance(value, str) or value.strip().lower() not in POLICIES:
        raise Refused(f"is not a policy: use one of {', '.join(POLICIES)}")
    return value.strip().lower()


def _modes(value: object) -> tuple[str, ...]:
    """A non-empty tuple (or list) of heuristic modes, each once, in any case; text names one mode."""
    modes = (value,) if isinstance(value, str) else value
    read: tuple[str, ...] = ()
    if isinstance(modes, (tuple, list)) and all(isinstance(m, str) for m in modes):
        read = tuple(m.strip().upper() for m in modes)
    if not read or any(m not in HEURISTIC_MODES for m in read):
        raise Refused(f"is not a non-empty sequence of heuristic modes from {', '.join(HEURISTIC_MODES)}")
    return read


@functools.lru_cache(maxsize=64)
def _options_dict(options: BuildOptions) -> dict[str, Any]:
    # Every lookup keys its options; asdict() deep-copies, so do it once per options value.
    data = asdict(options)
    data["policy"] = options.policy.value  # the key's text: plain
    data["heuristic_modes"] = list(options.heuristic_modes)
    if options.policy is not Policy.TOPK:
        data["top_k"] = None
    return data


@dataclass(frozen=True)
class TensorSpec:
    """One non-virtual tensor of a plan: what ``Plan.execute`` checks before launching.

    ``alignment``: bytes the data pointer must be aligned to. cuDNN Frontend's graph API
    declares every tensor 16-byte aligned to cuDNN, so that is the default (and what a
    table stored before the field existed means).
    """

    uid: int
    name: str
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str | None
    is_output: bool
    is_pass_by_value: bool = False
    alignment: int = 16

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "dims": list(self.dims), "strides": list(self.strides)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorSpec:
        # A store hit reads two tables of these (the row's and its plan record's): the
        # fields are set directly, as the frozen dataclass's __init__ would, at half its
        # cost (its eight object.__setattr__ calls); every value is converted alike.
        spec = object.__new__(cls)
        spec.__dict__.update(
            uid=int(data["uid"]),
            name=str(data["name"]),
            dims=tuple(map(int, data["dims"])),
            strides=tuple(map(int, data["strides"])),
            dtype=data.get("dtype"),
            is_output=bool(data["is_output"]),
            is_pass_by_value=bool(data.get("is_pass_by_value", False)),
            alignment=int(data.get("alignment", 16)),
        )
        return spec


@dataclass(frozen=True)
class CacheKey:
    """The SHA-256 key of a plan and the parts it was computed from."""

    digest: str
    parts: dict[str, Any] = field(compare=False, repr=False)
    #: The canonical text of the graph, environment and options parts, as hashed (a store
    #: hit compares a row's columns with them instead of decoding the columns).
    texts: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    def explain(self) -> dict[str, dict[str, Any]]:
        """Each part with its own hash: two keys that differ show which part differs."""
        return {name: {"sha256": _sha256(value)[:16], "value": value} for name, value in self.parts.items()}


#: A JSON value as decoded (``json.loads``, ``orjson.loads``): what a stored record holds.
JSON: TypeAlias = bool | int | float | str | list["JSON"] | dict[str, "JSON"] | None


def canonical_json(value: Any) -> str:
    """Sorted, compact JSON: the one serialization every hash in plancache uses."""
    # check_circular=False: the same text, ~15% sooner (every lookup hashes a description).
    # What is hashed is decoded JSON or a fresh description, never cyclic; a cyclic value
    # would still raise (RecursionError instead of ValueError).
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False, check_circular=False)


#: orjson's text, each digit as 0 and each exponent's letter as e, every other byte a space.
#: Floats are the one number orjson writes otherwise than ``canonical_json``, and only in
#: two forms: with an exponent (``1e-07`` is its ``1e-7``) and below 1e-4 (``1e-05`` is its
#: ``0.00001``); between, both write the shortest digits that read back as the float, in
#: the same form (900,000 random floats, none differing). A translation and a substring
#: search find a digit before an exponent several times sooner than a regular expression.
_DIGITS_AND_EXPONENTS = bytes(48 if 48 <= i <= 57 else 101 if i in b"eE" else 32 for i in range(256))
#: Sorted keys; a subclass, dataclass or datetime is refused (TypeError): canonical_json writes or refuses it.
_ORJSON_STRICT = (
    orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
)


def _description_json(description: Mapping[str, Any]) -> str:
    """``canonical_json(description)``, the same text, written by orjson (in about a third
    of the time, checks included: every store hit keys its graph) when nothing in it is
    written otherwise: ASCII text with no escape, string keys, integers of 64 bits, floats
    from 1e-4 to 1e16 written without an exponent. Anything else (and whatever orjson
    refuses) is ``canonical_json``'s. A description holds no NaN or infinity (``describe``
    writes those as ``{"float": ...}``), which orjson would write as null where
    ``canonical_json`` refuses them."""
    try:
        fast = orjson.dumps(description, option=_ORJSON_STRICT)
    except TypeError:  # a key that is no string, an integer past 64 bits, a subclass...
        return canonical_json(description)
    # Not written otherwise: ASCII, no escape (orjson writes DEL raw, json escapes it), no
    # float with an exponent or below 1e-4 (a string holding such text is only slower).
    if (fast.isascii() and b"\\u" not in fast and b"\x7f" not in fast and b"0.0000" not in fast
            and b"0e" not in fast.translate(_DIGITS_AND_EXPONENTS)):  # fmt: skip
        return fast.decode()
    return canonical_json(description)


def _sha256(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def environment_id(environment: Mapping[str, Any]) -> str:
    """A short id of an environment fingerprint; entries of one environment share it."""
    return _sha256(dict(environment))[:16]


def make_key(
    description: Mapping[str, Any], environment: Mapping[str, Any], options: BuildOptions, *, environment_json: str | None = None
) -> CacheKey:
    """Hash a canonical description, an environment fingerprint and build options.

    The digest is SHA-256 of ``canonical_json(parts)``. It is assembled from the parts'
    own canonical texts (the top-level names sort as environment, format, graph, options),
    so a caller that keys many graphs of one environment passes its text once encoded as
    ``environment_json`` and every lookup encodes only the description."""
    graph = dict(description)
    parts = {
        "format": KEY_FORMAT,
        "graph": graph,
        "environment": dict(environment),
        "options": options.to_dict(),
    }
    texts = {
        "graph": _description_json(graph),
        "environment": environment_json if environment_json is not None else canonical_json(parts["environment"]),
        "options": options_json(options),
    }
    text = f'{{"environment":{texts["environment"]},"format":{KEY_FORMAT},"graph":{texts["graph"]},"options":{texts["options"]}}}'
    return CacheKey(digest=hashlib.sha256(text.encode()).hexdigest(), parts=parts, texts=texts)


@functools.lru_cache(maxsize=64)
def options_json(options: BuildOptions) -> str:
    """The canonical text of ``options`` as keys hash it, made once per options value."""
    return canonical_json(_options_dict(options))
