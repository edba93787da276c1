#!/usr/bin/env python3
"""What the blob check costs a store hit.

Every stored entry is judged by ``store.entry.problem`` before its blob is loaded, and part
of that judgement is ``store.judge.judge``: the blob's own graph (its context, ``tensors`` and
``nodes``) read and compared, field by field, with the frontend form of the description the
key is derived from (derived once per key and kept, as a store hit does). The blob is
decoded once per hit (``formats.plan_blob.PlanBlob``, handed from the check to the load),
so the check's cost is not the time of the check alone. Printed:

1. the check alone on a blob never read before (its decoding included), on the backend's
   own blob of a conv+bias+relu graph and on each real blob recorded on an H200
   (``tests/data/plans``) against its own description (graphs that need CUDA to be
   described are skipped on a CPU);
2. a store hit (``PlanCache.get`` of a graph whose plan is stored but not in memory: the
   memory tier holds one plan and four keys are cycled), with the check and with the check
   (the judge and its form) taken out, in alternating turns, and the difference: what the
   check costs a hit; once with each key's form kept, as a key's later hits find it, and
   once with it derived on every hit, as the first hit of each key in a process (a start-up)
   does. The target is under 5% of a store hit.

Figures only, no exit status beyond a failed run. ``--runs N`` sets how many of each are
timed; ``--backend cudnn`` uses the GPU, the default where CUDA is (elsewhere the CPU test
backend); ``--out FILE`` writes the figures as JSON too. Run from anywhere:
``python scripts/bench_blob_check.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from graphs import ConvBiasRelu  # noqa: E402  (the tests' graphs, after the path above)

from plancache import PlanCache  # noqa: E402
from plancache.key.frontend_form import frontend_form  # noqa: E402
from plancache.store.judge import Judgement, judge  # noqa: E402
from plancache.testing import CpuTestBackend  # noqa: E402


def median_us(call: Callable[[], object], runs: int, setup: Callable[[], Any] = lambda: None) -> float:
    """The median time of ``call(setup())``, ``setup`` untimed (None: ``call()``)."""
    times = []
    for _ in range(runs):
        given = setup()
        started = time.perf_counter()
        call() if given is None else call(given)  # type: ignore[call-arg]
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def fresh(blob: bytes) -> bytes:
    """An equal blob no read has seen: what a store hit reads from SQLite."""
    return bytes(bytearray(blob))


def recorded(runs: int) -> list[tuple[str, int, float, float]]:
    """``(name, blob bytes, median us of the check, decoding included, median us of the
    decoding alone)`` on each recorded H200 blob."""
    import gpu_native

    from plancache.formats.ubjson import decode

    rows = []
    for name, (description, blob) in gpu_native.described_here().items():
        form = frontend_form(description)
        assert judge(blob, description, form).refusal is None, name
        check = median_us(lambda b, d=description, f=form: judge(b, d, f), runs, lambda b=blob: fresh(b))
        rows.append((name, len(blob), check, median_us(decode, runs, lambda b=blob: fresh(b))))
    return rows


def store_hits(cache: PlanCache, graphs: list[Any], runs: int, first_hits: bool) -> tuple[float, float]:
    """Median store hit with the check and without it (neither the judge nor its form),
    timed in alternating turns. ``first_hits``: every checked hit derives its key's form,
    as the first hit of each key in a process does (the forms kept are dropped before it)."""
    from plancache.store import entry as entry_module
    from plancache.store import judge as judge_module

    checked, formed = entry_module.judge, entry_module.form_of
    accepted = Judgement(None)
    turn = iter(range(10**9))

    def store_hit() -> None:
        plan = cache.get(graphs[next(turn) % len(graphs)])
        assert plan.source == "loaded", plan.source

    with_check: list[float] = []
    without: list[float] = []
    for _ in range(50):  # warm up
        store_hit()
    try:
        for i in range(2 * runs):
            if i % 2 == 0:
                entry_module.judge, entry_module.form_of = checked, formed
                if first_hits:
                    judge_module._FORMS.clear()
            else:
                entry_module.judge = lambda blob, description, form=None: accepted
                entry_module.form_of = lambda key, description: None
            started = time.perf_counter()
            store_hit()
            (with_check if i % 2 == 0 else without).append(time.perf_counter() - started)
    finally:
        entry_module.judge, entry_module.form_of = checked, formed
    return statistics.median(with_check) * 1e6, statistics.median(without) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument(
        "--backend",
        choices=("cpu", "cudnn"),
        default=None,
        help="cudnn: the GPU (the default where CUDA is); cpu: the CPU test backend (the default elsewhere)",
    )
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args()
    if args.backend is None:
        import torch

        args.backend = "cudnn" if torch.cuda.is_available() else "cpu"
    backend = CpuTestBackend() if args.backend == "cpu" else None  # None: PlanCache's default, cuDNN
    specs = [ConvBiasRelu(n=n) for n in (1, 2, 3, 4)]
    with tempfile.TemporaryDirectory() as directory:
        cache = PlanCache(directory, backend=backend, max_plans=1, auto_prime=False)  # every get below is a store hit
        graphs = [spec.graph() for spec in specs]
        keys = [cache.get(graph).key for graph in graphs]
        entry = cache.store.get(keys[0])
        assert entry is not None and judge(entry.blob, entry.description).refusal is None
        form = frontend_form(entry.description)
        check = median_us(lambda b: judge(b, entry.description, form), args.runs, lambda: fresh(entry.blob))
        hits = {first: store_hits(cache, graphs, args.runs, first) for first in (False, True)}
        cache.close()
    print(f"{args.backend} backend's blob ({len(entry.blob)} bytes): blob check alone, decoding included, median {check:.1f} us")
    for first, (hit, unchecked) in hits.items():
        label = "first hit of a key (its form derived)" if first else "a key's later hit (its form kept)"
        print(f"{label}: store hit median {hit:.1f} us with the check, {unchecked:.1f} us without (alternating turns): "
              f"the check costs {hit - unchecked:.1f} us = {100 * (hit - unchecked) / unchecked:.1f}% of a store hit "
              f"(target < 5%)")  # fmt: skip
    rows = recorded(max(100, args.runs // 10))
    for name, size, us, decoding in rows:
        print(f"H200 blob {name} ({size} bytes): blob check alone, decoding included, median {us:.1f} us; the decoding "
              f"alone {decoding:.1f} us ({decoding / (size / 1024):.2f} us per KB)")  # fmt: skip
    if args.out is not None:
        figures = {"later" if not first else "first": {"with_us": hit, "without_us": unchecked, "share": (hit - unchecked) / unchecked}
                   for first, (hit, unchecked) in hits.items()}  # fmt: skip
        args.out.write_text(json.dumps({"backend": args.backend, "check_alone_us": check, "store_hit": figures,
                                        "recorded": {name: us for name, _, us, _ in rows},
                                        "decoding": {name: us for name, _, _, us in rows}}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
