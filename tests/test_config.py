"""Sizes and PLANCACHE_MAX_SIZE: the spellings people write, 0 as no limit, and a typo that
is an error instead of an emptied cache."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from plancache import PlanCache, templates
from plancache.config import ConfigError, max_size_from_env, parse_size

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
