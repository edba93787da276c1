#!/usr/bin/env python3
"""The reliability scenarios of tests/test_concurrency.py and tests/test_reliability.py at
larger counts, with a short table of what was injected and what held.

    python scripts/stress_store.py                 # the defaults: a few minutes on 2 cores
    python scripts/stress_store.py --kill-iterations 1000 --json out.json

Scenarios (tests/harness.py): single-flight autotuning across processes; SIGKILL of store
writers at random points; SIGKILL of processes while they autotune and store; readers and
writers at once; damaged files (a bit flipped in a blob or anywhere, truncation, garbage)
and full disks. Exit code 1 if any guarantee broke (any violation), else 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # harness.py, graphs.py

import harness  # after the path insert above


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flight-processes", type=int, default=16)
    parser.add_argument("--flight-keys", type=int, default=12)
    parser.add_argument("--kill-iterations", type=int, default=200, help="rounds of SIGKILL of two store writers")
    parser.add_argument("--builder-kills", type=int, default=30, help="rounds of SIGKILL of two autotuning processes")
    parser.add_argument("--readers", type=int, default=16)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--reader-ops", type=int, default=1000)
    parser.add_argument("--writer-ops", type=int, default=2000)
    parser.add_argument("--flips", type=int, default=100, help="bits flipped inside a stored blob")
    parser.add_argument("--flips-anywhere", type=int, default=300, help="bits flipped anywhere in the file")
    parser.add_argument("--truncations", type=int, default=100)
    parser.add_argument("--garbage", type=int, default=30)
    parser.add_argument("--disk-full", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    return parser.parse_args()


def _run(args: argparse.Namespace, root: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}

    def timed(name: str, run: Any) -> None:
        started = time.monotonic()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = {**run(), "wall_seconds": round(time.monotonic() - started, 1)}

    timed("single flight", lambda: harness.single_flight(
        root / "flight", processes_n=args.flight_processes, keys=args.flight_keys, delay=0.6))  # fmt: skip
    timed("SIGKILL writers", lambda: harness.sigkill_writers(root / "kill", iterations=args.kill_iterations, seed=11))
    timed(
        "SIGKILL autotuning",
        lambda: harness.sigkill_builders(root / "builders", iterations=args.builder_kills, keys=6, delay=0.05),
    )
    timed("readers + writers", lambda: harness.readers_writers(
        root / "rw", readers=args.readers, writers=args.writers, reader_ops=args.reader_ops, writer_ops=args.writer_ops))  # fmt: skip
    timed("damaged files, full disks", lambda: harness.fault_rounds(
        root / "faults", flips=args.flips, flips_anywhere=args.flips_anywhere, truncations=args.truncations,
        garbage=args.garbage, disk_full=args.disk_full))  # fmt: skip
    return results


def _rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """scenario, processes, operations, faults injected, integrity checks passed, entries lost, violations."""
    flight, kill, builders, rw, faults = (results[k] for k in results)
    fault_text = ", ".join(
        f"{faults.get(k, 0)} {k.replace('_', ' ')}" for k in ("flip", "flip_anywhere", "truncate", "garbage", "disk_full")
    )
    return [
        ["single flight", str(flight["processes"]), f"{flight['plans']} gets, {flight['builds']} builds of {flight['keys']} keys",
         f"{flight['waits']} waits > 1 s", "-", "0", str(len(flight["violations"]))],
        ["SIGKILL writers", str(kill["processes"]), f"{kill['operations']} committed, {kill['operations_cut']} cut",
         f"{kill['sigkills']} SIGKILLs", f"{kill['integrity_checks_passed']}/{kill['iterations']}", str(kill["entries_lost"]),
         str(len(kill["violations"]))],
        ["SIGKILL autotuning", str(2 * builders["iterations"] + 2), f"{builders['final_plans']} gets of {builders['keys']} keys after",
         f"{builders['sigkills']} SIGKILLs",
         "1/1" if not builders["violations"] else "0/1", "0", str(len(builders["violations"]))],
        ["readers + writers", str(rw["processes"]), f"{rw['operations']} in {rw['seconds']:.1f} s", f"{rw['locked_errors']} 'locked'",
         "1/1" if not rw["violations"] else "0/1", "0", str(len(rw["violations"]))],
        ["damaged files, full disks", "1", f"{faults['plans_served']} plans served", fault_text,
         f"{faults['integrity_checks_passed']}/{faults['rounds']}", str(faults["entries_lost"]), str(len(faults["violations"]))],
    ]  # fmt: skip


def _print_table(rows: list[list[str]]) -> None:
    header = ["scenario", "processes", "operations", "faults injected", "integrity checks passed", "entries lost", "violations"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def main() -> int:
    args = _arguments()
    logging.basicConfig(level=logging.ERROR)  # the scenarios log every fault they inject
    with tempfile.TemporaryDirectory(prefix="plancache-stress-") as tmp:
        root = args.dir or Path(tmp)
        started = time.monotonic()
        results = _run(args, root)
    _print_table(_rows(results))
    faults = results["damaged files, full disks"]
    print(f"\ndamaged files: {faults.get('moved_aside', 0)} moved aside (kept byte for byte), {faults.get('rebuilt', 0)} entries rebuilt "
          f"from their engine, {faults.get('autotuned_again', 0)} autotuned again, {faults.get('repaired_by_verify_fix', 0)} "
          f"repaired by verify --fix, {faults.get('truncations_harmless', 0)} truncations inside free space, "
          f"{faults.get('refused_output_shape', 0)} plans refusing right tensors (flipped output shape: known limit)")  # fmt: skip
    print(f"total {time.monotonic() - started:.0f} s")
    violations = [f"{name}: {v}" for name, r in results.items() for v in r["violations"]]
    for v in violations[:30]:
        print("VIOLATION", v)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
