"""Every setting, declared once (``plancache.config``), read alike by its environment
variable, its constructor arguments and its command option: valid, invalid, empty, ``nan``
and ``inf`` values through each entry point; every refusal one line naming where the value
came from; no module reading a ``PLANCACHE_*`` variable by hand; README's table the
declarations' own."""

from __future__ import annotations

import ast
import grp
import logging
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from plancache import PlanCache, Store
from plancache.autotuning.autotune import TimingPolicy
from plancache.cli import cli
from plancache.config import (
    AUTO_PRIME,
    CACHE_DIR,
    MAX_SIZE,
    PATCH_CUDNN,
    RECORD,
    REDIS_URL,
    SETTINGS,
    ConfigError,
    MemoryBudget,
    Setting,
)
from plancache.errors import CacheDirError
from plancache.testing import CpuTestBackend
from plancache.tiers.remote import configured_secret
from plancache.workflows import templates

ROOT = Path(__file__).resolve().parent.parent
GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
SECRET = "s" * 32
URL = "redis://127.0.0.1:1/0"
GROUP = grp.getgrgid(os.getegid()).gr_name  # a group that exists, and that the test's directories belong to

REFUSED = "refused"  # the entry point refuses the value: one ConfigError line
DEFAULT = "default"  # the entry point takes its default, as when nothing is given


@dataclass(frozen=True)
class Cases:
    """What one entry point makes of each kind of value: a valid one (value, result), an
    invalid one (None: every value is valid there, as any text is a path or a name),
    empty text, ``nan`` and ``inf`` (text for a variable or an option, floats for a
    numeric argument)."""

    valid: tuple[Any, Any]
    invalid: Any
    empty: Any
    nan: Any
    inf: Any


def _secret_file(tmp: Path, size: int) -> str:
    path = tmp / f"secret-{size}"
    path.write_bytes(b"k" * size + b"\n")
    return str(path)


#: Each variable, read as every module reads it (``Setting.from_env``). Values that depend
#: on the test's directory are functions of it.
VARIABLES: dict[str, Cases] = {
    "PLANCACHE_DIR": Cases(("cache", Path("cache")), None, None, Path("nan"), Path("inf")),
    "PLANCACHE_MAX_SIZE": Cases(("64M", 64 * MIB), "banana", None, REFUSED, REFUSED),
    "PLANCACHE_RECORD": Cases(("m.json", Path("m.json")), "m.toml", None, Path("nan"), Path("inf")),
    "PLANCACHE_BACKEND": Cases(
        ("plancache.testing:CpuTestBackend", "plancache.testing:CpuTestBackend"), "os", None, REFUSED, REFUSED
    ),
    "PLANCACHE_ALLOW_SHARED_DIR": Cases((GROUP, GROUP), "maybe", None, REFUSED, REFUSED),
    "PLANCACHE_REDIS_URL": Cases((URL, URL), "http://127.0.0.1:1", None, REFUSED, REFUSED),
    # the path: the secret in it is read by tiers.remote.configured_secret (see the test below)
    "PLANCACHE_REDIS_SECRET_FILE": Cases(("secret", Path("secret")), None, None, Path("nan"), Path("inf")),
    "PLANCACHE_REDIS_SECRET": Cases((SECRET, SECRET.encode()), "short", None, REFUSED, REFUSED),
    "PLANCACHE_REDIS_NAMESPACE": Cases(("fleet1", "fleet1"), "a:b", "plancache", "nan", "inf"),
    "PLANCACHE_REDIS_TIMEOUT": Cases(("0.5", 0.5), "-1", 0.25, REFUSED, REFUSED),
    "PLANCACHE_REDIS_TTL": Cases(("30", 30), "0", None, REFUSED, REFUSED),
    "PLANCACHE_REDIS_MAX_STALL": Cases(("3", 3.0), "soon", 2.0, REFUSED, REFUSED),
    "PLANCACHE_REDIS_LOCK_TTL": Cases(("120", 120.0), "-5", 60.0, REFUSED, REFUSED),
    "PLANCACHE_REDIS_MAX_VALUE": Cases(("8M", 8 << 20), "2", 16 << 20, REFUSED, REFUSED),
    "PLANCACHE_MEMORY_PLANS": Cases(("16", 16), "many", 1024, REFUSED, REFUSED),
    "PLANCACHE_PATCH_CUDNN": Cases(("on", True), "maybe", False, REFUSED, REFUSED),
    "PLANCACHE_AUTOTUNE_MEMORY": Cases(("10%", MemoryBudget(share=0.1)), "abc", MemoryBudget(), REFUSED, REFUSED),
    "PLANCACHE_AUTOTUNE_BUDGET": Cases(("2", 2.0), "0.5", 1.5, REFUSED, math.inf),
    "PLANCACHE_AUTO_PRIME": Cases(("off", False), "2", True, REFUSED, REFUSED),
    "PLANCACHE_APP": Cases(("svc", "svc"), None, None, "nan", "inf"),
}


def _tier(**given: Any) -> Any:
    from plancache.tiers.remote import RemoteTier

    pytest.importorskip("redis")
    arguments = {"url": URL, "secret": SECRET, **given}
    tier = RemoteTier(arguments.pop("url"), **arguments)
    tier.close()
    return tier


def _cache(tmp: Path, directory: Any = "cache", **given: Any) -> PlanCache:
    cache = PlanCache(directory, backend=CpuTestBackend(), **{"auto_prime": False, **given})
    cache.close()
    return cache


def _store(directory: Any) -> Store:
    store = Store(directory)
    store.close()
    return store


def _shared_store_opens(tmp: Path, allow: Any) -> bool:
    shared = tmp / "shared"
    shared.mkdir(exist_ok=True)
    shared.chmod(0o2770)  # its group's to write (the user's own group: GROUP), setgid as a shared one must be
    try:
        Store(shared, allow_shared_dir=allow).close()
    except CacheDirError:
        return False
    return True


def _dir_option(value: str | None) -> Path:
    result = CliRunner().invoke(cli, [*(["--dir", value] if value is not None else []), "stats", "--json"])
    if result.exit_code == 2:  # refused, in one line, as a bad variable is
        raise ConfigError(result.stderr.strip().removeprefix("plancache: error: "))
    assert result.exit_code == 0, result.output
    import json

    return Path(json.loads(result.stdout)["path"]).parent


#: Each constructor argument and command option a setting declares: how the test reads the
#: value it ends up with (given the test's directory) and what it makes of each kind of value.
ENTRY_POINTS: dict[str, tuple[Callable[[Path, Any], Any], Cases]] = {
    "PlanCache(directory=)": (lambda tmp, v: _cache(tmp, v).directory,
                              Cases(("cache", Path("cache")), None, DEFAULT, Path("nan"), Path("inf"))),
    "Store(directory=)": (lambda tmp, v: _store(v).directory, Cases(("cache", Path("cache")), None, DEFAULT, Path("nan"),
                                                                   Path("inf"))),
    # an empty --dir is a variable that expanded to nothing: refused, where an empty PLANCACHE_DIR is unset
    "--dir": (lambda tmp, v: _dir_option(v), Cases(("cache", Path("cache")), None, REFUSED, Path("nan"), Path("inf"))),
    "PlanCache(max_size=)": (lambda tmp, v: _cache(tmp, max_size=v).max_size,
                             Cases(("64M", 64 * MIB), 2, DEFAULT, REFUSED, REFUSED)),
    "TimingPolicy(budget=)": (lambda tmp, v: TimingPolicy(budget=v).budget, Cases(("2", 2.0), "0.5", DEFAULT, REFUSED, math.inf)),
    "TimingPolicy(memory=)": (lambda tmp, v: TimingPolicy(memory=v).memory,
                              Cases(("4G", MemoryBudget(limit=4 << 30)), "abc", DEFAULT, REFUSED, REFUSED)),
    "Store(allow_shared_dir=)": (_shared_store_opens, Cases((GROUP, True), "maybe", DEFAULT, REFUSED, REFUSED)),
    "RemoteTier(url)": (lambda tmp, v: _tier(url=v).url, Cases((URL, URL), "http://127.0.0.1:1", REFUSED, REFUSED, REFUSED)),
    "RemoteTier(secret=)": (lambda tmp, v: _tier(secret=v).key_id == _tier().key_id,
                            Cases((SECRET, True), b"short", REFUSED, REFUSED, REFUSED)),
    "RemoteTier(namespace=)": (lambda tmp, v: _tier(namespace=v).namespace,
                               Cases(("fleet1", "fleet1"), "a:b", "plancache", "nan", "inf")),
    "RemoteTier(timeout=)": (lambda tmp, v: _tier(timeout=v).timeout, Cases((0.5, 0.5), -1, 0.25, REFUSED, REFUSED)),
    "RemoteTier(ttl=)": (lambda tmp, v: _tier(ttl=v).ttl, Cases(("30", 30), 0, None, REFUSED, REFUSED)),
    "RemoteTier(max_stall=)": (lambda tmp, v: _tier(max_stall=v).max_stall, Cases((3, 3.0), 0, 2.0, REFUSED, REFUSED)),
    "RemoteTier(lock_ttl=)": (lambda tmp, v: _tier(lock_ttl=v).lock_ttl, Cases((120, 120.0), -5, 60.0, REFUSED, REFUSED)),
    "RemoteTier(max_value=)": (lambda tmp, v: _tier(max_value=v).max_value, Cases(("8M", 8 << 20), 100, 16 << 20, REFUSED, REFUSED)),
    "PlanCache(max_plans=)": (lambda tmp, v: _cache(tmp, max_plans=v).memory.capacity,
                              Cases((16, 16), 0, DEFAULT, REFUSED, REFUSED)),
    "MemoryBudget(share=, limit=)": (lambda tmp, v: MemoryBudget(share=v).share, Cases((0.5, 0.5), 2.0, REFUSED, REFUSED,
                                                                                        REFUSED)),
    "PlanCache(auto_prime=)": (lambda tmp, v: _cache(tmp, auto_prime=v).primer is not None,
                               Cases((True, True), "maybe", DEFAULT, REFUSED, REFUSED)),
    "PlanCache(app=)": (lambda tmp, v: _cache(tmp, app=v).local.app, Cases(("svc", "svc"), 5, DEFAULT, "nan", "inf")),
}  # fmt: skip

KINDS = ("valid", "invalid", "empty", "nan", "inf")


def _value(cases: Cases, kind: str, tmp: Path, numeric: bool) -> Any:
    if kind == "valid":
        value = cases.valid[0]
    elif kind == "invalid":
        value = cases.invalid
    elif kind == "empty":
        value = "  "
    else:
        value = float(kind) if numeric else kind
    return value(tmp) if callable(value) else value


def _expected(cases: Cases, kind: str) -> Any:
    return cases.valid[1] if kind == "valid" else REFUSED if kind == "invalid" else getattr(cases, kind)


def _setting(name: str) -> Setting[Any]:
    return next(s for s in SETTINGS if s.name == name)


def test_every_setting_and_entry_point_has_cases() -> None:
    assert list(VARIABLES) == [s.name for s in SETTINGS]
    declared = {a for s in SETTINGS for a in s.arguments} | {s.option for s in SETTINGS if s.option}
    assert set(ENTRY_POINTS) == declared


def _one_line(exc: ConfigError, where: str, setting: Setting[Any]) -> None:
    message = str(exc)
    assert "\n" not in message and message.startswith(where), message
    assert exc.name == setting.name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(VARIABLES))
def test_each_variable_reads_every_kind_of_value(name: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cases, setting = VARIABLES[name], _setting(name)
    if kind == "invalid" and cases.invalid is None:
        pytest.skip("every value is valid here")
    value = _value(cases, kind, tmp_path, numeric=False)
    expected = _expected(cases, kind)
    if expected is REFUSED:
        with pytest.raises(ConfigError) as info:
            setting.from_env({name: value})
        _one_line(info.value, name if setting.secret else f"{name}={value!r}", setting)
        if setting.secret:
            assert str(value) not in str(info.value) and info.value.value is None  # a secret is never shown
    else:
        assert setting.from_env({name: value}) == expected


def _numeric(cases: Cases) -> bool:
    return isinstance(cases.valid[0], (int, float)) and not isinstance(cases.valid[0], bool)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_each_argument_and_option_reads_values_as_the_variable_does(
    entry: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    probe, cases = ENTRY_POINTS[entry]
    if kind == "invalid" and cases.invalid is None:
        pytest.skip("every value is valid here")
    value = _value(cases, kind, tmp_path, numeric=_numeric(cases))
    expected = _expected(cases, kind)
    if expected is REFUSED:
        with pytest.raises(ConfigError) as info:
            probe(tmp_path, value)
        keyword = re.search(r"\((\w+)=?", entry) or re.search(r"(--\w+)", entry)
        assert keyword is not None
        first = str(info.value).split(" ")[0]
        assert keyword.group(1) in first and "\n" not in str(info.value), str(info.value)
        return
    found = probe(tmp_path, value)
    if expected == DEFAULT:
        expected = probe(tmp_path, None)
    assert found == expected


@pytest.mark.parametrize("name", [s.name for s in SETTINGS if s is not PATCH_CUDNN])
def test_every_bad_variable_is_one_line_and_exit_2_from_any_command_before_anything_is_created(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command reads every setting before it creates or reads anything; the backend's
    when it needs one (a prewarm, even a dry run). PLANCACHE_PATCH_CUDNN is read by
    ``import plancache``, which never fails for it (tested below)."""
    monkeypatch.chdir(tmp_path)
    cases = VARIABLES[name]
    bad = cases.invalid if cases.invalid is not None else None
    if bad is None:
        pytest.skip("every value is valid here")
    env = {"PLANCACHE_REDIS_URL": URL, "PLANCACHE_REDIS_SECRET": SECRET} if "REDIS" in name else {}
    env = {**env, name: bad(tmp_path) if callable(bad) else bad}
    manifest = tmp_path / "m.json"
    manifest.write_text('{"version": 1, "entries": []}')
    command = ["prewarm", str(manifest), "--dry-run"] if name == "PLANCACHE_BACKEND" else ["ls"]
    result = CliRunner().invoke(cli, ["--dir", str(tmp_path / "cache"), *command], env=env)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"plancache: error: {name}"), result.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("size", [1, 32])
def test_a_secret_file_is_read_before_anything_is_created_and_a_bad_one_is_one_line_and_exit_2(
    size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PLANCACHE_REDIS_SECRET_FILE`` names the file; the secret in it is read with the Redis
    tier's other settings (``tiers.remote.configured_secret``), which every command reads
    before it creates anything."""
    monkeypatch.chdir(tmp_path)
    path = _secret_file(tmp_path, size)
    result = CliRunner().invoke(cli, ["--dir", str(tmp_path / "cache"), "ls"],
                                env={"PLANCACHE_REDIS_URL": URL, "PLANCACHE_REDIS_SECRET_FILE": path})  # fmt: skip
    if size == 32:
        assert configured_secret({"PLANCACHE_REDIS_SECRET_FILE": path}) == b"k" * 32  # without its line end
        assert result.exit_code == 0, result.output
        return
    with pytest.raises(ConfigError) as info:
        configured_secret({"PLANCACHE_REDIS_SECRET_FILE": path})
    assert info.value.name == "PLANCACHE_REDIS_SECRET_FILE"
    assert str(info.value).startswith(f"PLANCACHE_REDIS_SECRET_FILE={path!r} holds 1 byte")
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0] == f"plancache: error: {info.value}", result.stderr
    assert not (tmp_path / "cache").exists()


def test_a_memory_budget_refusal_says_what_is_accepted() -> None:
    from plancache.config import AUTOTUNE_MEMORY

    with pytest.raises(ConfigError) as info:
        AUTOTUNE_MEMORY.from_env({"PLANCACHE_AUTOTUNE_MEMORY": "abc"})
    message = str(info.value)
    assert "25%" in message and "4G" in message and "0 launches no candidate" in message and "no limit" not in message
    assert AUTOTUNE_MEMORY.from_env({"PLANCACHE_AUTOTUNE_MEMORY": "0"}).bytes_of(1 << 30) == 0  # 0 launches nothing


def test_a_memory_budget_of_a_limit_alone_is_that_limit() -> None:
    """``MemoryBudget(limit=N)`` was refused as giving "both" (the share defaulted to 0.25)."""
    assert MemoryBudget(limit=4 << 30).bytes_of(100 << 30) == 4 << 30
    assert MemoryBudget().share == 0.25 and MemoryBudget(share=0.5).limit is None
    with pytest.raises(ConfigError, match="gives neither or both"):
        MemoryBudget(share=0.5, limit=1 << 30)


@pytest.mark.parametrize("name", ["PLANCACHE_REDIS_TIMEOUT", "PLANCACHE_REDIS_TTL", "PLANCACHE_REDIS_MAX_STALL",
                                  "PLANCACHE_REDIS_LOCK_TTL"])  # fmt: skip
def test_seconds_past_what_sockets_waits_and_redis_hold_are_refused(name: str) -> None:
    """1e10 s overflowed a socket timeout (an OverflowError from every lookup), 1e17 s made
    Redis refuse every publish or fleet lock; 1e9 s (about 31 years) is the most any takes."""
    setting = _setting(name)
    assert setting.from_env({name: "1e9"}) == 1e9
    for text in ("1e10", "1e17", "1e400"):
        with pytest.raises(ConfigError, match="at most 1e"):
            setting.from_env({name: text})


@pytest.mark.parametrize("url", ["redis://127.0.0.1:abc/0", "redis://:hunter2@127.0.0.1:abc/0",
                                 "redis://:hunter2@127.0.0.1:70000/0", "redis://[::1/0",
                                 "redis://user:hunter2/pw@host:6379/0", "redis://:hunter2#x@host:6379/0"])  # fmt: skip
def test_a_redis_url_with_a_bad_port_or_host_is_refused_alike_with_or_without_a_password(url: str) -> None:
    """With a password, these raised the URL parser's ValueError (exit 1, no setting named);
    the parser's own message quotes a password that holds '/' or '#' as the port."""
    with pytest.raises(ConfigError) as info:
        REDIS_URL.from_env({"PLANCACHE_REDIS_URL": url})
    assert str(info.value).startswith("PLANCACHE_REDIS_URL is not a Redis URL (") and "hunter2" not in str(info.value)


def test_a_path_of_a_user_that_does_not_exist_is_refused_naming_the_setting(tmp_path: Path) -> None:
    """``~nosuchuser/x`` raised RuntimeError from Path.expanduser: a traceback from every command."""
    for setting in (CACHE_DIR, RECORD):
        with pytest.raises(ConfigError, match=rf"^{setting.name}='~plancache-no-such-user/x' cannot be expanded"):
            setting.from_env({setting.name: "~plancache-no-such-user/x"})
    result = CliRunner().invoke(cli, ["ls"], env={"PLANCACHE_DIR": "~plancache-no-such-user/x"})
    assert result.exit_code == 2 and result.stderr.startswith("plancache: error: PLANCACHE_DIR="), result.output


# ---------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GB", 2 * GIB), ("2GiB", 2 * GIB), ("2G", 2 * GIB), ("2g", 2 * GIB), ("2 GB", 2 * GIB), ("500M", 500 * MIB),
     ("500MB", 500 * MIB), ("500mib", 500 * MIB), ("1.5G", 3 * GIB // 2), ("1024", 1024), ("1024B", 1024),
     ("64M", 64 * MIB), ("64KB", 64 * KIB), ("64KiB", 64 * KIB), (" 8K ", 8 * KIB), ("1T", 1 << 40),
     ("0", None), ("0G", None), ("0.0", None)],
)  # fmt: skip
def test_a_size_reads_the_spellings_people_write(text: str, expected: int | None) -> None:
    assert MAX_SIZE.from_env({"PLANCACHE_MAX_SIZE": text}) == expected
    assert MAX_SIZE.of(text, "max_size") == expected


@pytest.mark.parametrize("text", ["0.5", "0.9", "0.0000001k", ".5"])
def test_a_size_of_less_than_one_byte_is_refused_not_read_as_zero(text: str) -> None:
    """A fraction of a byte was cut to 0: "no limit" for PLANCACHE_MAX_SIZE (while 1023 is
    refused), "launch no candidate" for PLANCACHE_AUTOTUNE_MEMORY (0.25 meant as a quarter)."""
    from plancache.config import AUTOTUNE_MEMORY

    with pytest.raises(ConfigError, match="less than one"):
        MAX_SIZE.from_env({"PLANCACHE_MAX_SIZE": text})
    with pytest.raises(ConfigError):
        AUTOTUNE_MEMORY.from_env({"PLANCACHE_AUTOTUNE_MEMORY": text})
    with pytest.raises(ConfigError, match="less than one"):
        MAX_SIZE.of(float(text.rstrip("k")) if not text.endswith("k") else 1e-9, "max_size")


@pytest.mark.parametrize("value", ["-5", "-1G", "banana", "2GG", "1e9", "1,5G", "2iB", "G", "5 apples", "1", "512", -5, 2,
                                   True, math.inf, math.nan])  # fmt: skip
def test_a_size_limit_refuses_anything_else_and_deletes_nothing(
    value: Any, tmp_path: Path, make_cache: Callable[..., PlanCache], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PlanCache(max_size=2)`` once evicted every other entry, and ``max_size="64M"``
    crashed inside eviction after autotuning: the argument is read as the variable is."""
    cache = make_cache()
    keys = [cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=n)).key for n in (2, 3)]
    cache.close()
    with pytest.raises(ConfigError, match=rf"^max_size={re.escape(repr(value))} "):
        make_cache(max_size=value)
    if isinstance(value, str):
        monkeypatch.setenv("PLANCACHE_MAX_SIZE", value)
        with pytest.raises(ConfigError, match=rf"^PLANCACHE_MAX_SIZE={re.escape(repr(value))} "):
            make_cache()
        monkeypatch.delenv("PLANCACHE_MAX_SIZE")
    assert make_cache().store.keys() == sorted(keys)  # nothing was deleted


def test_a_size_limit_given_as_text_evicts_by_it(make_cache: Callable[..., PlanCache]) -> None:
    cache = make_cache(max_size="8k")
    keys = [cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=n)).key for n in range(2, 8)]
    assert cache.max_size == 8192 and 0 < cache.store.total_size() <= 8192
    stored = cache.store.keys()
    assert keys[-1] in stored and len(stored) < len(keys)


def test_a_limit_below_one_mib_is_used_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="plancache"):
        assert MAX_SIZE.from_env({"PLANCACHE_MAX_SIZE": "63k"}) == 63 * KIB
    assert "a plan size limit of 63.0 KiB" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plancache"):
        assert MAX_SIZE.from_env({"PLANCACHE_MAX_SIZE": "2G"}) == 2 * GIB
    assert caplog.text == ""


# ---------------------------------------------------------------------------- switches

ON = ["1", "true", "yes", "on", "TRUE", "Yes", "ON", " on ", "true\n", True]
OFF = ["0", "false", "no", "off", "FALSE", "No", "OFF", " 0 ", "off\t", False]
BAD = ["maybe", "2", "-1", "y", "n", "enable", "1 1", "truee", "nein"]


@pytest.mark.parametrize("value", ON + OFF)
def test_a_switch_reads_every_spelling(value: Any) -> None:
    assert AUTO_PRIME.of(value, "auto_prime") is (value in ON)


@pytest.mark.parametrize("value", BAD)
def test_a_switch_refuses_anything_else(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        AUTO_PRIME.from_env({"PLANCACHE_AUTO_PRIME": value})
    assert str(info.value).startswith(f"PLANCACHE_AUTO_PRIME={value!r} is not a switch") and "\n" not in str(info.value)


@pytest.mark.parametrize("value", [*OFF[:-1], "", None])
def test_a_value_meaning_no_keeps_the_shared_directory_check_on(
    value: str | None, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    if value is not None:
        monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", value)
    with pytest.raises(CacheDirError, match="writable by other users"):
        Store()
    assert list(cache_dir.iterdir()) == []


@pytest.mark.parametrize(("value", "says"), [("maybe", "is not a group on this machine"), ("flase", "is not a group"),
                                             ("1", "no longer switches the check off: name the group"),
                                             ("yes", "no longer switches the check off")])  # fmt: skip
def test_a_bad_shared_dir_value_is_an_error_and_creates_nothing(
    value: str, says: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The opt-in names its group: ``1`` (once a switch that trusted any writer) is refused."""
    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", value)
    with pytest.raises(ConfigError, match=rf"^PLANCACHE_ALLOW_SHARED_DIR={value!r} {says}"):
        Store()
    assert not cache_dir.exists()


def _import_with_patch(value: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys, plancache\n"
        "patched = 'cudnn' in sys.modules\n"
        "if patched:\n"
        "    import cudnn, plancache.integrations.frontend as f\n"
        "    assert cudnn.jit is f.jit\n"
        "print('patched' if patched else 'unpatched')\n"
    )
    env = {**os.environ, "PLANCACHE_PATCH_CUDNN": value, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("value", "patched"), [("yes", True), ("off", False)])
def test_patch_cudnn_reads_every_spelling_at_import(value: str, patched: bool) -> None:
    result = _import_with_patch(value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("patched" if patched else "unpatched")
    assert result.stderr == ""


def test_a_bad_patch_cudnn_value_never_breaks_the_import() -> None:
    result = _import_with_patch("maybe")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "unpatched"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "PLANCACHE_PATCH_CUDNN='maybe' is not a switch" in lines[0] and "not patched" in lines[0]


# ---------------------------------------------------------------------------- one reader per variable

#: Where plancache's code lives: the package and the interpreter start-up hook.
CODE = [*sorted((ROOT / "plancache").rglob("*.py")), ROOT / "_plancache_startup.py"]


def _reads_by_hand(path: Path) -> list[str]:
    """``os.environ[...]``, ``os.environ.get(...)`` and ``os.getenv(...)`` of a
    ``PLANCACHE_*`` variable, named by a string or by a module constant holding one."""
    tree = ast.parse(path.read_text(), str(path))
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
                 for t in n.targets if isinstance(t, ast.Name)}  # fmt: skip

    def named(node: ast.AST) -> str | None:
        value = node.value if isinstance(node, ast.Constant) else constants.get(node.id) if isinstance(node, ast.Name) else None
        return value if isinstance(value, str) and value.startswith("PLANCACHE_") else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ") and named(node.slice):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Call) and node.args and named(node.args[0]):
            function = ast.unparse(node.func)
            if function.endswith(("environ.get", "getenv", "environ.pop", "environ.setdefault")):
                found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_code_reads_a_variable_but_through_its_setting(path: Path) -> None:
    if path == ROOT / "plancache" / "config.py":
        assert ".get(self.name)" in path.read_text()  # the one reader: Setting._text
        return
    if path.name == "_plancache_startup.py":
        # Whether the variable is set at all, and nothing more: the hook must import nothing of
        # plancache when it is not; plancache's setting reads the value.
        assert len(_reads_by_hand(path)) == 1 and "patch_cudnn_from_env()" in path.read_text()
        return
    assert _reads_by_hand(path) == []


def test_every_variable_the_code_names_is_declared() -> None:
    named = set()
    for path in CODE:
        named |= set(re.findall(r"\bPLANCACHE_[A-Z_]*[A-Z]\b", path.read_text()))
    assert named == {s.name for s in SETTINGS}, named ^ {s.name for s in SETTINGS}


def _readme_row(setting: Setting[Any]) -> str:
    also = ", ".join(f"`{a}`" for a in (*setting.arguments, *([setting.option] if setting.option else []))) or "-"
    return f"| `{setting.name}` | {setting.meaning} | {setting.shown_default} | {also} |"


def test_the_readme_table_is_the_declarations() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| variable | meaning | default | also set by |") :].split("\n\n", 1)[0]
    assert table.splitlines()[2:] == [_readme_row(s) for s in SETTINGS]
