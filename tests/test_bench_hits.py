"""scripts/bench_hits.py runs end to end (at its --quick sizes) and writes every figure it
prints as a number. No timing is asserted: the figures depend on the machine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark itself, at its --quick sizes

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_hits.py"

FIGURES = (
    "lock_memory_hit_worst_ms", "lock_memory_hit_p99_ms", "lock_memory_hit_p50_ms", "lock_memory_hit_count",
    "lock_store_hit_worst_ms", "lock_store_hit_p99_ms", "lock_store_hit_p50_ms", "lock_store_hit_count",
    "lock_worst_ms", "lock_flush_attempts", "lock_flush_refused", "lock_hit_counts_written", "lock_hit_counts_expected",
    "get_repeat_median_us", "get_repeat_p90_us", "memory_tier_median_us", "get_fresh_median_us", "describe_median_us",
    "make_key_median_us",
    "builder_repeat_median_us", "store_entries", "store_hit_p50_ms", "store_hit_p99_ms", "store_hit_count",
    "store_hit_calls", "store_hit_files", "kept_store_hit_p50_ms", "kept_store_hit_p99_ms", "kept_store_hit_calls",
)  # fmt: skip


def test_quick_run_writes_every_figure_as_a_number(tmp_path: Path) -> None:
    out = tmp_path / "hits.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    figures = data["figures"]
    assert set(FIGURES) <= figures.keys()
    for name, value in figures.items():
        assert type(value) in (int, float) and math.isfinite(value), (name, value)
    assert set(data["targets"]) <= figures.keys()
    assert figures["lock_hit_counts_written"] == figures["lock_hit_counts_expected"] > 0
    assert figures["lock_flush_attempts"] > 0  # the hit-count writer did try during the lock
    assert data["header"]["cpus"] and data["header"]["python"]
    assert 100 < figures["store_hit_calls"] < 100_000 and figures["store_hit_files"] > 5  # counted, not left at zero
    # The next process takes each row's kept judgement: no blob decoded or judged, fewer calls.
    assert 100 < figures["kept_store_hit_calls"] < figures["store_hit_calls"]
    for label in ("write lock", "get(graph)", "@cache.builder", "store hits of distinct keys"):
        assert label in done.stdout
