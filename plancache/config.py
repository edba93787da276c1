"""Every setting plancache reads, declared once: its environment variable, what it means,
its default, the constructor arguments and command options that set it too, and the one
reader of every value it is given. ``SETTINGS`` lists them in README.md's order (a test
holds the table to it).

A value from the variable (``from_env``), from code or from a command line (``of``) is read
alike: blank text is the default; anything else is the setting's value or a one-line
``ConfigError`` naming where the value came from and what would be accepted. So
``PlanCache(max_size="64M")`` reads as ``PLANCACHE_MAX_SIZE=64M`` does, and
``PlanCache(max_size=2)`` is refused as ``PLANCACHE_MAX_SIZE=2`` is. A typo never turns a
setting, or a safety check, the other way round, and never deletes a stored plan.

An argument or option takes the Python value it stands for (True or False, or 0 or 1, for
a switch; an int for a count; a number for bytes or seconds) or its variable's text. Words
are read in any case (``ON``, ``TopK``); ``off`` or ``none`` lifts a limit that can be lifted.

What a value means for the cache is documented where it is used, and a file a setting names
is read there too (``store.files``: ``PLANCACHE_REDIS_SECRET_FILE`` is a path here).
"""

from __future__ import annotations

import enum
import importlib
import logging
import math
import os
import re
import stat
import sys
import urllib.parse
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from .errors import PlanCacheError

__all__ = ["ALLOW_SHARED_DIR", "APP", "AUTOTUNE_BUDGET", "AUTOTUNE_MEMORY", "AUTO_PRIME", "BACKEND", "CACHE_DIR", "MAX_SIZE",
           "MEMORY_PLANS", "MIN_SECRET_BYTES", "PATCH_CUDNN", "RECORD", "REDIS_LOCK_TTL", "REDIS_MAX_STALL", "REDIS_MAX_VALUE",
           "REDIS_NAMESPACE", "REDIS_SECRET", "REDIS_SECRET_FILE", "REDIS_SETTINGS", "REDIS_TIMEOUT", "REDIS_TTL", "REDIS_URL",
           "SECRET_HINT", "SETTINGS", "ConfigError", "MemoryBudget", "Refused", "Setting", "argument", "file_kind",
           "format_size", "instance_of", "lazy_getattr", "number", "size", "switch", "tag", "wait_seconds", "whole_number"]  # fmt: skip

log = logging.getLogger("plancache")

T = TypeVar("T")

if sys.version_info >= (3, 11):
    from enum import StrEnum as StrEnum  # (the alias: for the modules that import it from here)
else:  # Python 3.10: enum.StrEnum by hand (a member is its value as text, in str() and formats too)

    class StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str.__str__(self)


def lazy_getattr(package: str, names: Mapping[str, str], submodules: Collection[str]) -> Callable[[str], Any]:
    """The ``__getattr__`` (PEP 562) of a package whose ``names`` (name -> its module under
    ``package``) and ``submodules`` load on first use; a name loaded is kept in the package."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(f".{names[name]}", package), name)
            setattr(sys.modules[package], name, value)
            return value
        if name in submodules:
            return importlib.import_module(f".{name}", package)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class ConfigError(PlanCacheError, ValueError):
    """A setting was given a value plancache cannot use, by its environment variable, a
    constructor argument or a command option. Fields: ``name`` (the setting's variable),
    ``value`` (None for a secret)."""


class Refused(ValueError):
    """Why a value is not one of a setting's, raised by a reader (``Setting.of`` and
    ``argument`` name the setting or argument)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One setting. ``name``: its environment variable. ``meaning`` and ``shown_default``:
    what README.md's table says. ``default``: its value when nothing sets it.
    ``parse``: a value that is not blank -> the setting's value, or ``Refused`` saying
    why not. ``arguments`` and ``option``: what else sets it (the constructor arguments, the
    command's option). ``secret``: a value never shown in a message."""

    name: str
    meaning: str
    shown_default: str
    default: T
    parse: Callable[[Any], T]
    arguments: tuple[str, ...] = ()
    option: str | None = None
    secret: bool = False

    def from_env(self, environ: Mapping[str, str] | None = None) -> T:
        """The value of the environment variable (``os.environ`` unless ``environ``)."""
        return self.of(self._text(environ), self.name)

    def is_set(self, environ: Mapping[str, str] | None = None) -> bool:
        """Whether the variable holds anything but empty text or spaces (read or not)."""
        return not _blank(self._text(environ))

    def _text(self, environ: Mapping[str, str] | None) -> str | None:
        return (os.environ if environ is None else environ).get(self.name)

    def of(self, value: object, where: str) -> T:
        """``value``, given by ``where`` (the variable, an argument, an option), as the
        setting's value: None or blank text is the default."""
        if _blank(value):
            return self.default
        try:
            return self.parse(value)
        except Refused as exc:
            written = repr(value)
            shown = (
                "" if self.secret else f"={written if len(written) <= 300 else written[:60] + f'... ({len(written)} characters)'}"
            )
            raise ConfigError(f"{where}{shown} {exc}", name=self.name, value=None if self.secret else value) from None

    def given_or_env(self, value: object, argument: str) -> T:
        """A constructor's ``argument`` when it was given, else (None, or blank text, as for
        the variable) the variable."""
        return self.from_env() if _blank(value) else self.of(value, argument)


def argument(where: str, value: T | object, parse: Callable[[Any], T]) -> T:
    """``value``, given to ``where`` (``PlanCache(read_only=)``), read by one of the readers
    below (``switch``, ``size``...) that the settings use too: a refused value is a one-line
    ``ConfigError`` naming ``where``, raised where it is given, never at a later use. A
    blank value is no default here: callers read None themselves."""
    try:
        return parse(value)
    except Refused as exc:
        raise ConfigError(f"{where}={_shown(value)} {exc}", name=where, value=value) from None


def _shown(value: object) -> str:
    if isinstance(value, type):
        return f"<class {value.__module__}.{value.__qualname__}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _blank(value: object) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


# ---------------------------------------------------------------------------- the readers

_SWITCH_ON = ("1", "true", "yes", "on")
_SWITCH_OFF = ("0", "false", "no", "off")
#: The words that lift a limit that has a "no limit" (where a number may be given, ``inf``
#: and ``infinity`` are read as the number).
_NO_LIMIT = ("off", "none")


def _switch(value: object) -> bool:
    """A switch variable's text (any case, surrounding spaces), or True or False."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _SWITCH_ON:
        return True
    if text in _SWITCH_OFF:
        return False
    raise Refused("is not a switch: use 1, true, yes or on, or 0, false, no or off")


def switch(value: object) -> bool:
    """The reader of on/off arguments: True or False, 0 or 1, or the text a switch variable
    takes (``"no"`` is off, as ``PLANCACHE_AUTO_PRIME=no`` is); anything else is refused."""
    if isinstance(value, str) or (isinstance(value, int) and value in (0, 1)):  # True and False too
        return _switch(value)
    raise Refused("is not a switch: pass True or False, 1 or 0 (or text: 1, true, yes or on, or 0, false, no or off)")


def whole_number(least: int, what: str) -> Callable[[Any], int]:
    """The reader of a whole number of ``what``, ``least`` or more: an int, or text of one
    (``"4"``); a float, even 4.0, is refused (2.5 candidates is no number of them)."""

    def read(value: object) -> int:
        text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
        if not re.fullmatch(r"[+-]?\d{1,18}", text) or int(text) < least:  # 18 digits: int() of thousands raises
            raise Refused(f"is not a whole number of {what}, {least} or more")
        return int(text)

    return read


def _as_float(value: object) -> float:
    """A number, or text of one (``inf`` too), as a float; NaN for anything else, bools too."""
    try:
        return float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        return math.nan


def number(least: float, what: str) -> Callable[[Any], float]:
    """The reader of a finite number (``what``) of ``least`` or more: a number, or text of one."""

    def read(value: object) -> float:
        got = _as_float(value)
        if not (math.isfinite(got) and got >= least):
            raise Refused(f"is not {what}: give a number of {least:g} or more")
        return got

    return read


def size(value: object) -> int:
    """The reader of a size in bytes, 0 or more: as ``PLANCACHE_MAX_SIZE`` reads one (a
    number, or text such as ``1G``, ``500M``, ``64k``)."""
    return _bytes(value, _SIZE_HINT)


def instance_of(cls: type | tuple[type, ...], hint: str) -> Callable[[Any], Any]:
    """The reader of an argument that must be an instance of ``cls`` (a class itself, a
    dict of its fields or a name are refused, with ``hint``)."""

    def read(value: object) -> Any:
        if isinstance(value, cls):
            return value
        noun = type(value).__name__
        got = "a class" if isinstance(value, type) else f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
        raise Refused(f"is {got}, not an instance: {hint}")

    return read


def tag(value: object) -> str:
    """The reader of a ``tag=``: text that is not blank (it stands for the callables of a
    graph, docs/key.md)."""
    if not isinstance(value, str) or not value.strip():
        raise Refused("is not a tag: pass text that names what the graph's callables do and changes whenever they do")
    return value


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?$", re.IGNORECASE)
_SIZE_HINT = "write bytes with an optional unit (500M, 2G, 1.5GiB, 64k)"


def _bytes(value: object, hint: str) -> int:
    """Bytes of a size: a number of bytes, or text written ``1024``, ``64k``, ``500M``,
    ``500MB``, ``1.5G``, ``2GiB``... (every unit a power of 1024)."""
    if isinstance(value, str):
        match = _SIZE.match(value.strip())
        value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()] if match else math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise Refused(f"is not a size: {hint}")
    if 0 < value < 1:  # not to be cut to 0, which means "no limit" (or "launch nothing")
        raise Refused(f"is {value:g} bytes, less than one: {hint}")
    return int(value)


#: The smallest size limit accepted: a number without a unit counts bytes, and
#: ``PLANCACHE_MAX_SIZE=2`` (meant as 2G) would evict every plan as soon as it is stored.
MAX_SIZE_FLOOR = 1 << 10
#: Limits below this are used with a warning: a plan larger than the limit is evicted, with
#: every older one, right after it is stored, and most plans are larger than a few KiB.
MAX_SIZE_WARN = 1 << 20
_warned_sizes: set[int] = set()


def _size_limit(value: object) -> int | None:
    """Bytes of plans kept, None for 0, ``off`` or ``none`` (no limit)."""
    if isinstance(value, str) and value.strip().lower() in _NO_LIMIT:
        return None
    size = _bytes(value, f"{_SIZE_HINT}, or 0 or off for no limit")
    if size == 0:
        return None
    if size < MAX_SIZE_FLOOR:
        raise Refused(f"is {size} byte{'s' if size != 1 else ''}, below the smallest limit of 1 KiB (a number without "
                      "a unit counts bytes: write 2G for 2 GiB, or 0 for no limit)")  # fmt: skip
    if size < MAX_SIZE_WARN and size not in _warned_sizes:
        _warned_sizes.add(size)
        log.warning("plancache: a plan size limit of %s (PLANCACHE_MAX_SIZE, max_size=) keeps few plans: a plan larger "
                    "than that is evicted as soon as it is stored, with every older one", format_size(size))  # fmt: skip
    return size


def _value_cap(value: object) -> int:
    """Bytes of the largest Redis value, 1 KiB or more: a cap, never "no limit"."""
    size = _bytes(value, _SIZE_HINT)
    if size < MAX_SIZE_FLOOR:
        raise Refused(f"is {size} bytes, below the smallest cap of 1 KiB (a number without a unit counts bytes: write 16M "
                      "for 16 MiB)")  # fmt: skip
    return size


def _plans(value: object) -> int:
    """A whole number of plans, 1 or more."""
    text = str(value).strip() if not isinstance(value, bool) else ""
    if not re.fullmatch(r"\+?\d{1,18}", text) or int(text) < 1:  # 18 digits: int() of thousands raises
        raise Refused("is not a whole number of plans, 1 or more (such as 1024)")
    return int(text)


#: The longest time a setting may give, about 31 years: socket timeouts, waits and Redis
#: expiry times overflow somewhere above it (1e10 s is past a socket timeout's 64-bit
#: nanoseconds, 1e17 s past Redis's milliseconds), and no wait of plancache needs more.
MAX_SECONDS = 1e9


def _seconds(value: object) -> float:
    """A number of seconds above 0 and at most ``MAX_SECONDS``."""
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = math.nan
    if not 0 < seconds <= MAX_SECONDS:  # NaN too
        raise Refused(f"is not a number of seconds above 0 and at most {MAX_SECONDS:g}, about 31 years (such as 0.25, "
                      "2 or 60)")  # fmt: skip
    return seconds


def wait_seconds(value: object) -> float:
    """The reader of a wait: a number of seconds above 0, or text of one; ``math.inf`` (or
    ``inf``, ``off``, ``none``) waits without a limit."""
    if isinstance(value, str) and value.strip().lower() in _NO_LIMIT:
        return math.inf
    seconds = _as_float(value)
    if not seconds > 0:  # `not >`: NaN too
        raise Refused("is not a number of seconds above 0: give one such as 60, or math.inf for no limit")
    return seconds


def _whole_seconds(value: object) -> int:
    """A finite number of seconds above 0, rounded to whole seconds (at least 1): Redis
    expires keys by the second."""
    return max(1, round(_seconds(value)))


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise Refused(f"is not text but {type(value).__name__}")
    return value.strip()


def _path(value: object) -> Path:
    if not isinstance(value, (str, os.PathLike)):
        raise Refused(f"is not a path but {type(value).__name__}")
    try:
        return Path(os.fspath(value)).expanduser()
    except RuntimeError as exc:  # ~name of no such user, or ~ with no home directory to stand for
        raise Refused(f"cannot be expanded: {exc}") from None


def file_kind(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a FIFO", "a directory"..."""
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "a special file"


def _record_path(value: object) -> Path | None:
    """A manifest file to record into: JSON, in a directory that exists; off (``0``,
    ``false``, ``no``, ``off``, as every switch) is not recording."""
    word = str(value).strip().lower()
    if word in _SWITCH_OFF:
        return None
    if word in _SWITCH_ON:
        raise Refused("is a switch, but a recording needs a file to write: name a .json file")
    path = _path(value)
    if path.suffix.lower() == ".toml":
        raise Refused("names a TOML file, but a recording is written as JSON (a recorded graph holds nulls, which TOML "
                      "cannot): name it .json")  # fmt: skip
    if not path.parent.is_dir():
        raise Refused(f"is in {path.parent}, which is not a directory: create it first (a recording creates none)")
    try:
        mode = path.lstat().st_mode
    except OSError:  # none there yet: the recording creates it
        return path
    if not stat.S_ISREG(mode):
        raise Refused(f"is {file_kind(mode)}: a recording is written only to a regular file, never through a link; name "
                      "the file itself")  # fmt: skip
    return path


_BACKEND_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def _backend_spec(value: object) -> str:
    spec = _text(value)
    if not _BACKEND_SPEC.match(spec):
        raise Refused("is not a backend class spec: set it to module:Class, e.g. plancache.testing:CpuTestBackend, "
                      "or unset it for cuDNN")  # fmt: skip
    return spec


_REDIS_URL_HINT = "write redis://host:port/db, rediss://host:port/db or unix:///path/to/socket"


def _redis_url(value: object) -> str:
    url = _text(value)
    if url.partition("://")[0].lower() not in ("redis", "rediss", "unix") or "://" not in url:
        raise Refused(f"is not a Redis URL: {_REDIS_URL_HINT}")
    try:
        _ = urllib.parse.urlsplit(url).port  # a port that is no number up to 65535, or a broken [IPv6] host, raise here
    except ValueError:
        # Not the parser's words: with a '/', '#' or '?' in the password, it quotes the
        # password as the port.
        raise Refused(f"is not a Redis URL (its host or port cannot be read): {_REDIS_URL_HINT}") from None
    return url


#: A shorter secret can be guessed offline from one signed value.
MIN_SECRET_BYTES = 16
SECRET_HINT = f"use at least {MIN_SECRET_BYTES} bytes (for example the output of `openssl rand -hex 32`), the same on every node"


def _secret(value: object) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, (bytes, bytearray)):
        raise Refused(f"is not bytes but {type(value).__name__}")
    if len(value) < MIN_SECRET_BYTES:
        raise Refused(f"is {len(value)} byte{'s' if len(value) != 1 else ''}: {SECRET_HINT}")
    return bytes(value)


def _namespace(value: object) -> str:
    name = _text(value)
    if ":" in name:
        raise Refused("contains ':', which separates the parts of a Redis key: choose a name without it")
    return name


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


#: A quarter of free device memory: room for the graph's tensors, their copies and the
#: workspaces of the candidates, leaving the program most of what it has not allocated yet.
DEFAULT_SHARE = 0.25


@dataclass(frozen=True)
class MemoryBudget:
    """What autotuning may allocate on the device to launch candidates (inputs, outputs,
    the copies that comparing them keeps, workspaces): ``share`` of the device's free
    memory, or ``limit`` bytes (neither given: a quarter of free memory); 0 launches no
    candidate. A graph that needs more is not timed (the heuristics' order is taken, and
    the entry says why): the frontend's own build allocates nothing, so a miss must not
    run the program out of memory."""

    share: float | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.share is None and self.limit is None:  # neither given: a quarter, the default
            object.__setattr__(self, "share", DEFAULT_SHARE)
        share, limit = self.share, self.limit
        if (share is None) == (limit is None):
            problem = "gives neither or both of a share and a limit: give one"
        elif share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                    or not (math.isfinite(share) and 0 <= share <= 1)):  # fmt: skip
            problem = "is not a share of free device memory between 0 and 1 (0.25 is a quarter)"
        elif limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            problem = "is not a number of bytes, 0 or more"
        else:
            return
        raise ConfigError(f"MemoryBudget(share={share!r}, limit={limit!r}) {problem}", name=AUTOTUNE_MEMORY.name,
                          value=(share, limit))  # fmt: skip

    def bytes_of(self, free: int) -> int:
        return int(free * self.share) if self.share is not None else int(self.limit or 0)

    def describe(self) -> str:
        return f"{self.share * 100:g}% of free device memory" if self.share is not None else format_size(self.limit or 0)


_SHARE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*%$")


def _budget(value: object) -> MemoryBudget:
    if isinstance(value, MemoryBudget):
        return value
    share = _SHARE.match(value.strip()) if isinstance(value, str) else None
    if share is None:
        try:
            return MemoryBudget(share=None, limit=_bytes(value, ""))
        except Refused:
            raise Refused("is neither a share of free device memory (25%) nor a size (4G); 0 launches no candidate") from None
    fraction = float(share.group(1)) / 100
    if fraction > 1:
        raise Refused("is more than all of free device memory: write a share up to 100%, such as 25%")
    return MemoryBudget(share=fraction)


# ---------------------------------------------------------------------------- the settings

CACHE_DIR: Setting[Path | None] = Setting(
    "PLANCACHE_DIR", "the cache directory", "the user cache directory (`~/.cache/plancache` on Linux)", None, _path,
    arguments=("PlanCache(directory=)", "Store(directory=)"), option="--dir")  # fmt: skip
MAX_SIZE: Setting[int | None] = Setting(
    "PLANCACHE_MAX_SIZE", "bytes of plans kept: `2G`, `500M`, `64k`, `1024` (every unit a power of 1024; `0` or `off`: no limit); "
    "beyond it the least recently used entries are evicted after each store", "no limit", None, _size_limit,
    arguments=("PlanCache(max_size=)",))  # fmt: skip
RECORD: Setting[Path | None] = Setting(
    "PLANCACHE_RECORD", "a manifest file that every `PlanCache` appends each new graph to, as JSON, in a directory that "
    "exists ([docs/prewarm.md](docs/prewarm.md)); `0`, `off`, `no`, `false`: not recording",
    "not recording", None, _record_path)  # fmt: skip
BACKEND: Setting[str | None] = Setting(
    "PLANCACHE_BACKEND", "the backend of the `plancache` command (`prewarm`, `verify --deserialize`, `prune "
    "--other-environments`), as `module:Class`; `plancache.testing:CpuTestBackend` runs on a CPU", "cuDNN", None,
    _backend_spec)  # fmt: skip


def _shared_group(value: object) -> str | None:
    """The name of a group that exists, or None for off (``0``, ``off``... or False): on
    (``1``, True) once accepted any directory, and now names no one, so it is refused."""
    if isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in _SWITCH_ON + _SWITCH_OFF):
        if not _switch(value):
            return None
        raise Refused("no longer switches the check off: name the group whose members share the directory (such as "
                      "PLANCACHE_ALLOW_SHARED_DIR=ml-team)")  # fmt: skip
    if not isinstance(value, str):
        raise Refused(f"is not a group name but {type(value).__name__}")
    import grp  # only when a group is named

    try:
        return grp.getgrnam(value.strip()).gr_name
    except KeyError:
        raise Refused("is not a group on this machine: name the group whose members share the directory") from None


ALLOW_SHARED_DIR: Setting[str | None] = Setting(
    "PLANCACHE_ALLOW_SHARED_DIR", "a group (its name) whose members may share the cache directory: its files may be owned "
    "by any member and writable by the group, never by others; a directory of that group the group can write must be setgid, "
    "and what plancache makes there is group-writable", "only the user's own files", None, _shared_group,
    arguments=("Store(allow_shared_dir=)",))  # fmt: skip
REDIS_URL: Setting[str | None] = Setting(
    "PLANCACHE_REDIS_URL", "the Redis tier of a fleet ([docs/fleet.md](docs/fleet.md))", "no Redis tier", None, _redis_url,
    arguments=("RemoteTier(url)",), secret=True)  # fmt: skip
#: The path alone: ``tiers.remote.configured_secret`` reads the secret in it (``store.files``).
REDIS_SECRET_FILE: Setting[Path | None] = Setting(
    "PLANCACHE_REDIS_SECRET_FILE", "file holding the secret that signs Redis entries, 16 bytes or more (this or the next "
    "one is required with a URL)", "none", None, _path)  # fmt: skip
REDIS_SECRET: Setting[bytes | None] = Setting(
    "PLANCACHE_REDIS_SECRET", "the secret itself (prefer the file)", "none", None, _secret,
    arguments=("RemoteTier(secret=)",), secret=True)  # fmt: skip
REDIS_NAMESPACE: Setting[str] = Setting(
    "PLANCACHE_REDIS_NAMESPACE", "key prefix in Redis, one per fleet (no `:`)", "`plancache`", "plancache", _namespace,
    arguments=("RemoteTier(namespace=)",))  # fmt: skip
REDIS_TIMEOUT: Setting[float] = Setting(
    "PLANCACHE_REDIS_TIMEOUT", "seconds per Redis round trip", "`0.25`", 0.25, _seconds, arguments=("RemoteTier(timeout=)",)
)
REDIS_TTL: Setting[int | None] = Setting(
    "PLANCACHE_REDIS_TTL", "seconds a published plan lives in Redis (whole seconds)", "no expiry", None, _whole_seconds,
    arguments=("RemoteTier(ttl=)",))  # fmt: skip
REDIS_MAX_STALL: Setting[float] = Setting(
    "PLANCACHE_REDIS_MAX_STALL", "seconds a process may lose to a failing Redis before it switches the tier off", "`2`", 2.0,
    _seconds, arguments=("RemoteTier(max_stall=)",))  # fmt: skip
REDIS_LOCK_TTL: Setting[float] = Setting(
    "PLANCACHE_REDIS_LOCK_TTL", "seconds the fleet lock outlives a holder that died (it is renewed while its holder builds)",
    "`60`", 60.0, _seconds, arguments=("RemoteTier(lock_ttl=)",))  # fmt: skip
#: 16 MiB: a plan blob is kilobytes to a few megabytes; a larger value costs every lookup its transfer.
REDIS_MAX_VALUE: Setting[int] = Setting(
    "PLANCACHE_REDIS_MAX_VALUE", "bytes of the largest Redis value read or published (every unit a power of 1024); a larger "
    "one is refused before it is read", "`16M`", 16 << 20, _value_cap, arguments=("RemoteTier(max_value=)",))  # fmt: skip
#: 1024 loaded plans: every graph of a large model times a few dozen shapes.
MEMORY_PLANS: Setting[int] = Setting(
    "PLANCACHE_MEMORY_PLANS", "loaded plans a process keeps in memory; the least recently used are dropped (they stay "
    "stored)", "`1024`", 1024, _plans, arguments=("PlanCache(max_plans=)",))  # fmt: skip
PATCH_CUDNN: Setting[bool] = Setting(
    "PLANCACHE_PATCH_CUDNN", "on (`1`): cuDNN Frontend code persists its plans unchanged: the start-up hook calls "
    "`plancache.install()` when the program imports `cudnn` (and `import plancache` does) (see [Using plancache with "
    "existing cuDNN Frontend code](#using-plancache-with-existing-cudnn-frontend-code))", "not patched", False, _switch)  # fmt: skip
AUTOTUNE_MEMORY: Setting[MemoryBudget] = Setting(
    "PLANCACHE_AUTOTUNE_MEMORY", "device memory autotuning may allocate to launch and compare candidates: a share of free "
    "memory (`25%`) or a size (`4G`); `0` launches no candidate; a graph that needs more is not timed, and its entry says "
    "why ([docs/checking.md](docs/checking.md))", "`25%`", MemoryBudget(), _budget,
    arguments=("TimingPolicy(memory=)", "MemoryBudget(share=, limit=)"))  # fmt: skip
#: On: plans load through cuDNN's C API (``guest.native``), which holds no GIL and
#: captures, allocates and synchronizes nothing, so priming beside the program's own work
#: broke none of it on an H200 (docs/priming.md has the runs).
AUTO_PRIME: Setting[bool] = Setting(
    "PLANCACHE_AUTO_PRIME", "a cache that opens loads, on background threads, the plans its application used in its latest "
    "run; `0` turns it off ([docs/priming.md](docs/priming.md)); use is recorded either way", "on",
    True, _switch, arguments=("PlanCache(auto_prime=)",))  # fmt: skip


def _autotune_budget(value: object) -> float:
    """A multiple of the frontend's own build of at least 1, or ``off`` (no limit)."""
    if isinstance(value, str) and value.strip().lower() in _NO_LIMIT:
        return math.inf
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        number = math.nan
    if not number >= 1.0:  # NaN too
        raise Refused("is not a budget: give a multiple of the frontend's own build of at least 1 (1.5 is the default), "
                      "or off for no limit")  # fmt: skip
    return number


#: 1.5: the frontend's own build, and half of it again for the check and tuning.
AUTOTUNE_BUDGET: Setting[float] = Setting(
    "PLANCACHE_AUTOTUNE_BUDGET", "a miss's time, as a multiple of the frontend's own build of the graph (its heuristics and "
    "its first plan): tuning stops there and `plancache tune` finishes it later; the candidates the check needs are "
    "launched anyway; `off` for no limit ([docs/checking.md](docs/checking.md))", "`1.5`", 1.5, _autotune_budget,
    arguments=("TimingPolicy(budget=)",))  # fmt: skip
APP: Setting[str | None] = Setting(
    "PLANCACHE_APP", "the application name under which plan use is recorded and primed",
    "the entry script's absolute path, plus `#rankN` when `LOCAL_RANK` is set", None, _text,
    arguments=("PlanCache(app=)",))  # fmt: skip

#: Every setting, in README.md's order.
SETTINGS: tuple[Setting[Any], ...] = (
    CACHE_DIR, MAX_SIZE, RECORD, BACKEND, ALLOW_SHARED_DIR, REDIS_URL, REDIS_SECRET_FILE, REDIS_SECRET, REDIS_NAMESPACE,
    REDIS_TIMEOUT, REDIS_TTL, REDIS_MAX_STALL, REDIS_LOCK_TTL, REDIS_MAX_VALUE, MEMORY_PLANS, PATCH_CUDNN, AUTOTUNE_MEMORY, AUTOTUNE_BUDGET,
    AUTO_PRIME, APP,
)  # fmt: skip
#: The settings of the Redis tier: read only when ``PLANCACHE_REDIS_URL`` is set.
REDIS_SETTINGS: tuple[Setting[Any], ...] = (
    REDIS_URL, REDIS_SECRET_FILE, REDIS_SECRET, REDIS_NAMESPACE, REDIS_TIMEOUT, REDIS_TTL, REDIS_MAX_STALL, REDIS_LOCK_TTL,
    REDIS_MAX_VALUE,
)  # fmt: skip
