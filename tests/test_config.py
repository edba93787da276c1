"""Settings from the environment. Sizes and PLANCACHE_MAX_SIZE: the spellings people write,
0 as no limit, and a typo that is an error instead of an emptied cache. On/off variables:
one parser, every spelling, and a value meaning "no" that never turns a safety check off."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from plancache import PlanCache
from plancache.config import ConfigError, flag_from_env, max_size_from_env, parse_size
from plancache.workflows import templates

MakeCache = Callable[..., PlanCache]
GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2GB", 2 * GIB), ("2GiB", 2 * GIB), ("2G", 2 * GIB), ("2g", 2 * GIB), ("2 GB", 2 * GIB), ("500M", 500 * MIB),
     ("500MB", 500 * MIB), ("500mib", 500 * MIB), ("1.5G", 3 * GIB // 2), ("1024", 1024), ("1024B", 1024),
     ("64k", 64 * KIB), ("64KB", 64 * KIB), ("64KiB", 64 * KIB), (" 8K ", 8 * KIB), (".5k", 512), ("1T", 1 << 40),
     ("0", None), ("0G", None), ("0.0", None)],
)  # fmt: skip
def test_parse_size_reads_the_spellings_people_write(text: str, expected: int | None) -> None:
    assert parse_size(text, name="SIZE") == expected


@pytest.mark.parametrize("text", ["-5", "-1G", "banana", "", "2GG", "1e9", "1,5G", "2iB", "nan", "G", "5 apples"])
def test_parse_size_refuses_anything_else_naming_the_setting_and_value(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text, name="SIZE")
    message = str(info.value)
    assert message.startswith(f"SIZE={text!r} ") and "\n" not in message
    assert isinstance(info.value, ValueError) and info.value.name == "SIZE" and info.value.value == text


def test_max_size_unset_empty_or_zero_means_no_limit() -> None:
    assert max_size_from_env({}) is None
    assert max_size_from_env({"PLANCACHE_MAX_SIZE": "  "}) is None
    assert max_size_from_env({"PLANCACHE_MAX_SIZE": "0"}) is None
    assert max_size_from_env({"PLANCACHE_MAX_SIZE": "2GB"}) == 2 * GIB


@pytest.mark.parametrize("text", ["-5", "1", "512", "banana", "2 bananas"])
def test_max_size_typos_are_errors_not_an_emptied_cache(
    text: str, monkeypatch: pytest.MonkeyPatch, make_cache: MakeCache, cache_dir: Path
) -> None:
    cache = make_cache()
    keys = [cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=n)).key for n in (2, 3)]
    cache.close()
    monkeypatch.setenv("PLANCACHE_MAX_SIZE", text)
    with pytest.raises(ConfigError, match=r"^PLANCACHE_MAX_SIZE=") as info:
        make_cache()
    assert repr(text) in str(info.value)
    monkeypatch.delenv("PLANCACHE_MAX_SIZE")
    assert make_cache().store.keys() == sorted(keys)  # nothing was deleted


def test_max_size_zero_keeps_every_plan(monkeypatch: pytest.MonkeyPatch, make_cache: MakeCache) -> None:
    monkeypatch.setenv("PLANCACHE_MAX_SIZE", "0")
    cache = make_cache()
    assert cache.max_size is None
    keys = {cache.get(templates.build("matmul_bias_act", b=1, m=4, k=8, n=n)).key for n in (2, 3, 4)}
    assert set(cache.store.keys()) == keys


def test_a_limit_below_one_mib_is_used_with_a_warning(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="plancache"):
        assert max_size_from_env({"PLANCACHE_MAX_SIZE": "64k"}) == 64 * KIB
    assert "PLANCACHE_MAX_SIZE=64k keeps at most 64.0 KiB of plans" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plancache"):
        assert max_size_from_env({"PLANCACHE_MAX_SIZE": "2G"}) == 2 * GIB
    assert caplog.text == ""


# ---------------------------------------------------------------------------- on/off variables

#: Every on/off variable plancache reads, each read through ``flag_from_env``.
FLAGS = ("PLANCACHE_ALLOW_SHARED_DIR", "PLANCACHE_PATCH_CUDNN", "PLANCACHE_AUTO_PRIME")
ON = ["1", "true", "yes", "on", "TRUE", "Yes", "ON", " on ", "true\n"]
OFF = ["0", "false", "no", "off", "FALSE", "No", "OFF", " 0 ", "off\t"]
BAD = ["maybe", "2", "-1", "y", "n", "enable", "1 1", "truee", "nein"]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value", ON)
def test_flag_on_values(value: str) -> None:
    assert flag_from_env("X", False, {"X": value}) is True
    assert flag_from_env("X", True, {"X": value}) is True


@pytest.mark.parametrize("value", OFF)
def test_flag_off_values(value: str) -> None:
    assert flag_from_env("X", True, {"X": value}) is False
    assert flag_from_env("X", False, {"X": value}) is False


@pytest.mark.parametrize("default", [True, False])
def test_flag_unset_or_empty_is_the_default(default: bool) -> None:
    assert flag_from_env("X", default, {}) is default
    assert flag_from_env("X", default, {"X": ""}) is default
    assert flag_from_env("X", default, {"X": "  "}) is default


@pytest.mark.parametrize("value", BAD)
def test_flag_anything_else_is_one_line_naming_the_variable_and_value(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        flag_from_env("PLANCACHE_X", False, {"PLANCACHE_X": value})
    message = str(info.value)
    assert message.startswith(f"PLANCACHE_X={value!r} is not a switch") and "\n" not in message
    assert info.value.name == "PLANCACHE_X" and info.value.value == value


def test_every_on_off_variable_is_read_through_the_one_parser() -> None:
    """No module reads an on/off variable by hand (``os.environ.get(...) == "1"``, ``not in
    ("", "0")``): each flag's name appears in code only as flag_from_env's argument."""
    by_hand = re.compile(r"environ(?:\.get)?\([^)]*\)[^\n]*?(?:==|!=|\bin\b)\s*[\(\[{]?\s*['\"](?:|0|1|true|yes|on)['\"]")
    for path in (ROOT / "plancache").rglob("*.py"):
        text = path.read_text()
        assert not by_hand.search(text), f"{path.relative_to(ROOT)} compares an environment variable by hand"
        for name in FLAGS:
            for match in re.finditer(rf"[\"']{name}[\"']", text):
                before = text[max(0, match.start() - 14) : match.start()]
                assert before.endswith("flag_from_env(") or path.name == "config.py", (path, name)
    from plancache.config import ENVIRONMENT

    assert set(FLAGS) <= set(ENVIRONMENT)


@pytest.mark.parametrize("value", [*OFF, "", None])
def test_a_value_meaning_no_keeps_the_shared_directory_check_on(
    value: str | None, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plancache import Store
    from plancache.errors import CacheDirError

    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    if value is not None:
        monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", value)
    with pytest.raises(CacheDirError, match="writable by other users"):
        Store()
    assert list(cache_dir.iterdir()) == []


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_a_value_meaning_yes_accepts_a_shared_directory(value: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plancache import Store

    cache_dir.mkdir()
    cache_dir.chmod(0o777)
    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", value)
    Store().close()


@pytest.mark.parametrize("value", ["maybe", "2", "flase"])
def test_a_bad_shared_dir_value_is_an_error_and_creates_nothing(
    value: str, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from plancache import Store

    monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", value)
    with pytest.raises(ConfigError, match=rf"^PLANCACHE_ALLOW_SHARED_DIR={value!r} is not a switch"):
        Store()
    assert not cache_dir.exists()


@pytest.mark.parametrize(
    ("value", "on"), [("yes", True), ("ON", True), ("true", True), ("off", False), ("no", False), ("", False)]
)
def test_auto_prime_reads_every_spelling(value: str, on: bool, make_cache: MakeCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLANCACHE_AUTO_PRIME", value)
    assert (make_cache().primer is not None) is on


def test_auto_prime_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from plancache.config import auto_prime_from_env

    monkeypatch.delenv("PLANCACHE_AUTO_PRIME")
    assert auto_prime_from_env() is False


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


@pytest.mark.parametrize(("value", "patched"), [("yes", True), ("TRUE", True), ("on", True), ("no", False), ("off", False),
                                                ("false", False)])  # fmt: skip
def test_patch_cudnn_reads_every_spelling(value: str, patched: bool) -> None:
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
