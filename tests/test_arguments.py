"""Arguments of the public entry points are read as the matching settings are, by
config.py's readers, and a bad one is refused where it is given, in one line that names
it: never accepted and turned the other way (``read_only="no"`` was read-only), and never
an ``AttributeError`` or a comparison error at the first lookup."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from graphs import ConvBiasRelu

from plancache import BuildOptions, ConfigError, PlanCache, TimingPolicy
from plancache.testing import CpuTestBackend


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"read_only": "maybe"}, r"PlanCache\(read_only\)='maybe' is not a switch"),
        ({"persist_kernel_cache": "nope"}, r"PlanCache\(persist_kernel_cache\)='nope' is not a switch"),
        ({"backend": CpuTestBackend}, r"PlanCache\(backend=<class .*CpuTestBackend'>\) is a class, not a backend instance"),
        ({"backend": "cpu"}, r"PlanCache\(backend='cpu'\) is text, not a backend instance"),
        ({"options": {"policy": "heuristic"}}, r"PlanCache\(options\)=\{'policy': 'heuristic'\} is a dict, not an instance"),
        ({"timing": 7}, r"PlanCache\(timing\)=7 is an int, not an instance"),
        ({"max_size": "lots"}, r"max_size='lots' is not a size"),
    ],
)
def test_a_bad_constructor_argument_is_refused_at_construction_naming_it(
    cache_dir: Path, arguments: dict[str, Any], named: str
) -> None:
    arguments = {"backend": CpuTestBackend(), **arguments}
    with pytest.raises(ConfigError, match=named) as caught:
        PlanCache(**arguments)
    assert "\n" not in str(caught.value)
    assert not cache_dir.exists()  # refused before anything was opened


@pytest.mark.parametrize(("given", "read"), [("no", False), ("off", False), (False, False), ("yes", True), (True, True)])
def test_switch_arguments_read_as_switch_settings_do(make_cache: Any, given: Any, read: bool) -> None:
    """``PlanCache(read_only="no")`` was read-only, and ``persist_kernel_cache="no"`` on."""
    make_cache().close()  # a store to open read-only
    cache = make_cache(read_only=given, persist_kernel_cache=given)
    assert cache.local.read_only is read and cache.persist_kernel_cache is read


def test_build_options_read_text_as_settings_do_and_key_alike(make_cache: Any) -> None:
    """``top_k="4"`` and ``workspace_limit="1G"`` failed with comparison errors at the first
    miss, while ``max_size="1G"`` was accepted."""
    assert BuildOptions(top_k="4") == BuildOptions(top_k=4)  # type: ignore[arg-type]
    assert BuildOptions(workspace_limit="1G").workspace_limit == 1 << 30  # type: ignore[arg-type]
    assert BuildOptions(kernel_cache="off").kernel_cache is False  # type: ignore[arg-type]
    assert BuildOptions(heuristic_modes=["A"]).heuristic_modes == ("A",)  # type: ignore[arg-type]
    cache = make_cache()
    graph = ConvBiasRelu().graph
    assert cache.get(graph(), options=BuildOptions(top_k="4")).key == cache.get(graph(), options=BuildOptions()).key  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"top_k": 2.5}, r"BuildOptions\(top_k\)=2.5 is not a whole number of candidates"),
        ({"top_k": True}, r"BuildOptions\(top_k\)=True is not a whole number"),
        ({"top_k": "0"}, r"BuildOptions\(top_k\)='0' is not a whole number of candidates, 1 or more"),
        ({"workspace_limit": "1 lot"}, r"BuildOptions\(workspace_limit\)='1 lot' is not a size"),
        ({"workspace_limit": -1}, r"BuildOptions\(workspace_limit\)=-1 is not a size"),
        ({"policy": "fastest"}, r"BuildOptions\(policy\)='fastest' is not a policy: use one of heuristic, topk, exhaustive"),
        ({"heuristic_modes": ("C",)}, r"BuildOptions\(heuristic_modes\)=\('C',\) is not"),
        ({"kernel_cache": "sometimes"}, r"BuildOptions\(kernel_cache\)='sometimes' is not a switch"),
    ],
)
def test_bad_build_options_are_refused_when_made(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named) as caught:
        BuildOptions(**arguments)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)


def test_get_and_builder_refuse_options_that_are_no_build_options(cache: PlanCache) -> None:
    with pytest.raises(ConfigError, match=r"get\(options\)=\{'top_k': 2\} is a dict"):
        cache.get(ConvBiasRelu().graph(), options={"top_k": 2})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"builder\(options\)="):
        cache.builder(lambda: ConvBiasRelu().graph(), options="heuristic")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"builder\(key=3\)"):
        cache.builder(lambda: ConvBiasRelu().graph(), key=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"runs": 2.5}, r"TimingPolicy\(runs\)=2.5 is not a whole number of timed runs, 1 or more"),
        ({"runs": 0}, r"TimingPolicy\(runs\)=0 is not a whole number"),
        ({"prune_factor": "fast"}, r"TimingPolicy\(prune_factor\)='fast' is not a factor over the best first run"),
        ({"prune_factor": 0.5}, r"TimingPolicy\(prune_factor\)=0.5 is not a factor"),
    ],
)
def test_bad_timing_policies_are_refused_when_made(arguments: dict[str, Any], named: str) -> None:
    """``TimingPolicy(runs=2.5)`` was accepted and failed inside the first miss's timing."""
    with pytest.raises(ConfigError, match=named):
        TimingPolicy(**arguments)
    assert TimingPolicy(runs="3", prune_factor="2").to_dict()["runs"] == 3  # type: ignore[arg-type]


def test_key_tune_and_preload_read_their_arguments_as_get_does(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path, backend=CpuTestBackend(), auto_prime=False)
    graph = ConvBiasRelu().graph
    assert cache.key(graph(), tag="v1").digest != cache.key(graph()).digest, "the tag is part of the key"
    assert cache.key(graph(), tag="v1").digest == cache.key(graph(), tag="v1").digest
    with pytest.raises(ConfigError, match=r"key\(options\)"):
        cache.key(graph(), options={"policy": "topk"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"key\(device\)"):
        cache.key(graph(), device=-1)
    with pytest.raises(ConfigError, match=r"tune\(options\)"):
        cache.tune(graph(), options="exhaustive")  # type: ignore[arg-type]
    plan = cache.get(graph())
    with pytest.raises(ConfigError, match=r"preload\(keys='.*'\) is not a list of keys"):
        cache.preload(plan.key)  # one key alone: its characters are no keys
    assert cache.preload([plan.key])["loaded"] == [plan.key]
    cache.close()
