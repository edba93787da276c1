"""Settings read from the environment, and the parsing they share.

``parse_size`` reads the sizes people write (``2G``, ``2GB``, ``2GiB``, ``500M``, ``1.5G``,
``64k``, ``1024``); ``max_size_from_env`` reads ``PLANCACHE_MAX_SIZE`` with ccache's
rules: unset, empty or ``0`` mean no limit, and anything else that is not a usable size is
a ``ConfigError`` naming the variable and its value. A typo never deletes entries.

``flag_from_env`` reads every on/off variable the same way: ``1``, ``true``, ``yes`` or
``on`` and ``0``, ``false``, ``no`` or ``off``, in any case and with surrounding
whitespace; unset or empty means the default; anything else is a ``ConfigError`` naming
the variable and its value, never a guess (so ``PLANCACHE_ALLOW_SHARED_DIR=no`` keeps the
safety check on).

``ENVIRONMENT`` lists every environment variable plancache reads, with its meaning and
default (the README's table is checked against it).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import PlanCacheError

__all__ = ["ENVIRONMENT", "FLAG_OFF", "FLAG_ON", "MAX_SIZE_FLOOR", "MAX_SIZE_WARN", "ConfigError", "MemoryBudget",
           "auto_prime_from_env", "autotune_budget_from_env", "flag_from_env", "format_size", "max_size_from_env", "memory_budget_from_env", "parse_size"]  # fmt: skip

log = logging.getLogger("plancache")

#: The smallest PLANCACHE_MAX_SIZE accepted: a smaller positive value is refused, because
#: a number without a unit counts bytes and ``PLANCACHE_MAX_SIZE=2`` (meant as 2G) would
#: otherwise evict every plan as soon as it is stored.
MAX_SIZE_FLOOR = 1 << 10
#: Limits below this are accepted with a warning: most plans are larger than a few KiB, and
#: a plan larger than the limit is evicted (with every older one) right after it is stored.
MAX_SIZE_WARN = 1 << 20

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?$", re.IGNORECASE)

#: Every environment variable plancache reads: name -> (meaning, default).
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "PLANCACHE_DIR": ("the cache directory (`--dir` overrides it)", "the user cache directory, e.g. `~/.cache/plancache`"),
    "PLANCACHE_MAX_SIZE": ("bytes of plans kept; least recently used entries are evicted beyond it", "no limit"),
    "PLANCACHE_RECORD": ("a manifest file every `PlanCache` appends each new graph to (docs/prewarm.md)", "not recording"),
    "PLANCACHE_BACKEND": ("the backend of the `plancache` command, `module:Class` (`plancache.testing:CpuTestBackend` runs on the CPU)", "cuDNN"),
    "PLANCACHE_ALLOW_SHARED_DIR": ("on (`1`) accepts a cache directory that other users can write", "refused"),
    "PLANCACHE_REDIS_URL": ("the Redis tier of a fleet (docs/fleet.md)", "no Redis tier"),
    "PLANCACHE_REDIS_SECRET_FILE": ("file holding the secret that signs Redis entries", "none"),
    "PLANCACHE_REDIS_SECRET": ("the secret itself (prefer the file)", "none"),
    "PLANCACHE_REDIS_NAMESPACE": ("key prefix in Redis", "`plancache`"),
    "PLANCACHE_REDIS_TIMEOUT": ("seconds per Redis round trip", "`0.25`"),
    "PLANCACHE_REDIS_TTL": ("seconds a published plan lives in Redis", "no expiry"),
    "PLANCACHE_REDIS_MAX_STALL": ("seconds a process may lose to a failing Redis before switching the tier off", "`2`"),
    "PLANCACHE_REDIS_LOCK_TTL": ("seconds the fleet lock outlives a holder that died (renewed while its holder builds)", "`60`"),
    "PLANCACHE_MEMORY_PLANS": ("loaded plans a process keeps in memory, least recently used dropped", "`1024`"),
    "PLANCACHE_PATCH_CUDNN": ("on (`1`): cuDNN Frontend code persists its plans unchanged (`plancache.install()` runs when the program imports `cudnn`, or `plancache`)", "not patched"),
    "PLANCACHE_AUTO_PRIME": ("a cache that opens loads, on background threads, the plans its application used in its latest run; `0` turns it off (docs/priming.md)", "on"),
    "PLANCACHE_AUTOTUNE_MEMORY": ("device memory autotuning may allocate to launch and compare candidates: a share of free memory or a size; a graph that needs more is not timed (docs/checking.md)", "`25%`"),
    "PLANCACHE_AUTOTUNE_BUDGET": ("a miss's time, as a multiple of the frontend's own build of the graph (its heuristics and first plan); beyond it tuning stops and `plancache tune` finishes it; the candidates the check needs are launched anyway; `off` for no limit (docs/checking.md)", "`1.5`"),
    "PLANCACHE_APP": ("the application name plan use is recorded and primed under", "the entry script's path (plus `#rankN` with `LOCAL_RANK`)"),
}  # fmt: skip


class ConfigError(PlanCacheError, ValueError):
    """A setting (an environment variable, say) has a value plancache cannot use.
    Fields: ``name``, ``value``."""


#: The values of an on/off variable (``flag_from_env``), compared in lower case without
#: surrounding whitespace.
FLAG_ON = ("1", "true", "yes", "on")
FLAG_OFF = ("0", "false", "no", "off")


def flag_from_env(name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    """The on/off variable ``name``: True for 1/true/yes/on, False for 0/false/no/off (any
    case, surrounding whitespace ignored), ``default`` when unset or empty. Anything else
    is a one-line ``ConfigError`` naming the variable and its value: a typo never turns a
    setting, or a safety check, the other way round."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in FLAG_ON:
        return True
    if value in FLAG_OFF:
        return False
    raise ConfigError(f"{name}={raw!r} is not a switch: use 1, true, yes or on, or 0, false, no or off "
                      f"(unset: {'on' if default else 'off'})", name=name, value=raw)  # fmt: skip


def auto_prime_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """``PLANCACHE_AUTO_PRIME`` (``flag_from_env``): on unless set off.

    On by default: plans load through cuDNN's C API (``engines.native``), which holds no GIL
    and captures, allocates and synchronizes nothing, so priming beside the program's own
    work (weights copied, kernels, CUDA-graph captures, lookups on other threads) breaks
    none of it (docs/priming.md has the runs). Plans that fall back to the frontend's path
    load as guests one at a time."""
    return flag_from_env("PLANCACHE_AUTO_PRIME", True, environ)


def format_size(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover - the loop returns


def parse_size(text: str, *, name: str) -> int | None:
    """Bytes of a size written ``1024``, ``64k``, ``500M``, ``500MB``, ``1.5G``, ``2GiB``...;
    None for zero (no limit).

    Units are powers of 1024 however they are written (``k``, ``K``, ``KB``, ``KiB``; ``M``,
    ``G``, ``T`` alike); a number without a unit (or with ``B``) counts bytes. Raises
    ``ConfigError`` naming ``name`` and the value for anything else: negative numbers,
    unknown units, empty text.
    """
    raw = text
    match = _SIZE.match(text.strip())
    if match is None:
        raise ConfigError(f"{name}={raw!r} is not a size: write bytes with an optional unit (500M, 2G, 1.5GiB, 64k), "
                          "or 0 for no limit", name=name, value=raw)  # fmt: skip
    sign, number, unit = match.group(1), float(match.group(2)), (match.group(3) or "").lower()
    if sign == "-" and number != 0:
        raise ConfigError(f"{name}={raw!r} is negative: write a size such as 2G, or 0 for no limit", name=name, value=raw)
    if number == 0:
        return None
    return int(number * _UNITS[unit])


def max_size_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """``PLANCACHE_MAX_SIZE`` in bytes, or None (unset, empty or 0: no limit).

    A value below ``MAX_SIZE_FLOOR`` (1 KiB) is refused: ``PLANCACHE_MAX_SIZE=1`` asks for
    one byte and would evict every plan. A value below ``MAX_SIZE_WARN`` (1 MiB) is used,
    with a warning that plans larger than it are evicted as soon as they are stored.
    """
    env = os.environ if environ is None else environ
    text = env.get("PLANCACHE_MAX_SIZE", "")
    if not text.strip():
        return None
    size = parse_size(text, name="PLANCACHE_MAX_SIZE")
    if size is None:
        return None
    if size < MAX_SIZE_FLOOR:
        raise ConfigError(
            f"PLANCACHE_MAX_SIZE={text!r} is {size} byte{'s' if size != 1 else ''}, below the smallest limit of 1 KiB "
            "(a number without a unit counts bytes: write 2G for 2 GiB, or 0 for no limit)",
            name="PLANCACHE_MAX_SIZE",
            value=text,
        )
    if size < MAX_SIZE_WARN and text not in _warned:
        _warned.add(text)
        log.warning("plancache: PLANCACHE_MAX_SIZE=%s keeps at most %s of plans: a plan larger than that is evicted "
                    "as soon as it is stored, with every older one", text.strip(), format_size(size))  # fmt: skip
    return size


_warned: set[str] = set()


_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


@dataclass(frozen=True)
class MemoryBudget:
    """What autotuning may allocate on the device to launch candidates (inputs, outputs,
    the copies that comparing them keeps, workspaces): ``share`` of the device's free
    memory, or ``limit`` bytes. A graph that needs more is not timed (the heuristics'
    order is taken, and the entry says why): the frontend's own build allocates nothing,
    so a miss must not run the program out of memory."""

    share: float | None = 0.25
    limit: int | None = None

    def bytes_of(self, free: int) -> int:
        return int(free * self.share) if self.share is not None else int(self.limit or 0)

    def describe(self) -> str:
        return f"{self.share * 100:g}% of free device memory" if self.share is not None else format_size(self.limit or 0)


def memory_budget_from_env(environ: Mapping[str, str] | None = None) -> MemoryBudget:
    """``PLANCACHE_AUTOTUNE_MEMORY``: a share of free device memory (``25%``, the default)
    or a size (``4G``); ``0`` launches nothing. Anything else is a ``ConfigError``."""
    raw = (os.environ if environ is None else environ).get("PLANCACHE_AUTOTUNE_MEMORY", "")
    if not raw.strip():
        return MemoryBudget()
    share = _SHARE.match(raw)
    if share is not None:
        value = float(share.group(1))
        if value > 100:
            raise ConfigError(f"PLANCACHE_AUTOTUNE_MEMORY={raw!r} is more than 100% of free memory", name="PLANCACHE_AUTOTUNE_MEMORY",
                              value=raw)  # fmt: skip
        return MemoryBudget(share=value / 100.0)
    return MemoryBudget(share=None, limit=parse_size(raw, name="PLANCACHE_AUTOTUNE_MEMORY") or 0)


#: PLANCACHE_AUTOTUNE_BUDGET's default: on an H200 a cold first call took 1.0-1.4x the
#: frontend's own build when tuning stopped there (docs/checking.md).
AUTOTUNE_BUDGET = 1.5


def autotune_budget_from_env(environ: Mapping[str, str] | None = None) -> float:
    """``PLANCACHE_AUTOTUNE_BUDGET``: a number of at least 1 (the frontend's own build is 1),
    ``1.5`` when unset or empty; ``off`` (or ``inf``) for no limit. Anything else is a
    ``ConfigError`` naming the variable."""
    raw = (os.environ if environ is None else environ).get("PLANCACHE_AUTOTUNE_BUDGET", "")
    text = raw.strip().lower()
    if not text:
        return AUTOTUNE_BUDGET
    if text in ("off", "inf", "infinity", "none"):
        return float("inf")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0:  # NaN too
        raise ConfigError(
            f"PLANCACHE_AUTOTUNE_BUDGET={raw!r} is not a budget: give a multiple of the frontend's own build of at least 1 "
            "(1.5 is the default), or off for no limit",
            name="PLANCACHE_AUTOTUNE_BUDGET",
            value=raw,
        )
    return value
