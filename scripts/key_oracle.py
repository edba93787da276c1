#!/usr/bin/env python3
"""Does plancache's key separate every graph cuDNN's own key separates? Needs an NVIDIA GPU.

    python scripts/key_oracle.py                        # every family of tests/key_families.py
    python scripts/key_oracle.py sdpa conv_dgrad        # some families
    python scripts/key_oracle.py --json out.json        # also write every result as JSON ("-": stdout)
    python scripts/key_oracle.py --isolate              # each family in its own process (a crash skips one family)
    python scripts/key_oracle.py --list                 # the families and their variants (no GPU)

For each variant that keeps its family's names, uids and tensor creation order, it builds
the graph, keys it with plancache (``describe`` + ``make_key``), then asks cuDNN:
``g.validate(); g.build_operation_graph(); g.key()``. Variants cuDNN rejects are skipped and
counted; one variant failing never stops the run. Within a family, every pair of variants
whose cuDNN keys differ must have different plancache keys: a pair that does not is a
collision (plancache would serve one graph's plan for the other).

It also keys each graph again once cuDNN built its operation graph: the cache keys a graph
before the backend validates and plans that very object, which may be keyed again, so the
key must not change (the backend reports its own layouts back into the graph); a change is
reported as unstable.

Exit status: 0 when nothing collided and no key was unstable; 1 on a collision (whatever
else); 3 when keys were unstable but nothing collided (a cache miss, never a wrong plan:
see the known limits in docs/key.md); 2 when no pair could be compared (no GPU, or cuDNN
rejected everything).

``--smoke``: two variants of each family, keyed by plancache before and after, cuDNN's own
key (validate, operation graph, ``key()``) reported as skipped, so no pair is compared;
exit status 0 when every variant was built and keyed by plancache alike both times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a source tree
sys.path.insert(0, str(ROOT / "tests"))  # the variant builders the CPU property tests use
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from key_families import FAMILIES, Variant  # noqa: E402

from plancache.key import BuildOptions, describe, make_key  # noqa: E402

# One fixed environment and options: only the graphs differ between the keys compared.
_ENVIRONMENT = {"oracle": True}
_OPTIONS = BuildOptions()
SMOKE_VARIANTS = 2  # per family, in a smoke run


@dataclass
class Result:
    """One variant: plancache's key before and after cuDNN built it, and cuDNN's key."""

    family: str
    label: str
    ours: str | None = None
    ours_after: str | None = None
    theirs: str | None = None
    stage: str = ""  # where it stopped: "" (all done), "build", "plancache", "cudnn"
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.ours is not None and self.theirs is not None


@dataclass
class FamilyReport:
    family: str
    variants: int = 0
    compared_pairs: int = 0
    cudnn_distinct_pairs: int = 0
    over_separated_pairs: int = 0  # cuDNN keys alike, plancache apart: a miss, never a wrong plan
    collisions: list[tuple[str, str]] = field(default_factory=list)
    unstable: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (label, stage, error)


def _short_error(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def _key(graph: Any, variant: Variant) -> str:
    return make_key(describe(graph, tag=variant.tag), _ENVIRONMENT, _OPTIONS).digest


def run_variant(variant: Variant) -> Result:
    """Build one variant and key it both ways; never raises (but for KeyboardInterrupt)."""
    result = Result(variant.family, variant.label)
    started = time.perf_counter()
    try:
        result.stage = "build"
        graph = variant.build()
        result.stage = "plancache"
        result.ours = _key(graph, variant)
        result.stage = "cudnn"
        theirs = benchlib.gpu_only("cuDNN's own key: validate, build_operation_graph, key()", _cudnn_key, graph)
        result.theirs = None if theirs is None else str(theirs)
        result.stage = "plancache after build"
        result.ours_after = _key(graph, variant)
        result.stage = ""
        if theirs is None:  # a smoke run: keyed by plancache only
            result.error = benchlib.SKIPPED
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a variant cuDNN rejects, or a bug: recorded, the run goes on
        result.error = _short_error(exc)
        if result.stage not in ("cudnn",):
            result.error += " | " + " / ".join(line.strip() for line in traceback.format_exc().splitlines()[-3:])
    result.seconds = time.perf_counter() - started
    return result


def _cudnn_key(graph: Any) -> Any:
    """cuDNN's own key of ``graph`` (needs cuDNN on a GPU)."""
    graph.validate()
    graph.build_operation_graph()
    return graph.key()


def comparable(name: str) -> list[Variant]:
    """The variants of a family compared with cuDNN (the first few in a smoke run)."""
    found = [v for v in FAMILIES[name].variants() if v.comparable]
    return found[:SMOKE_VARIANTS] if benchlib.smoke() else found


def family_results(name: str, verbose: bool) -> list[Result]:
    """Every comparable variant of a family, run in this process."""
    results = []
    for variant in comparable(name):
        result = run_variant(variant)
        results.append(result)
        if verbose:
            state = "ok" if result.ok else f"skipped at {result.stage}: {result.error[:160]}"
            print(f"  {variant.id}: {state} ({result.seconds * 1000:.0f} ms)", flush=True)
    return results


def family_results_isolated(name: str, verbose: bool) -> list[Result]:
    """The same in a child process: a crash inside cuDNN (or a sticky CUDA error) costs
    this family only; its variants are then recorded as skipped at "crashed"."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "results.json"
        command = [sys.executable, str(Path(__file__).resolve()), name, "--json", str(out)] + (["-v"] if verbose else [])
        child = subprocess.run(command, capture_output=not verbose, text=True, check=False)
        if out.exists():
            return [Result(**r) for r in json.loads(out.read_text())["results"][name]]
    error = f"the child process died (exit {child.returncode})"
    return [Result(name, v.label, stage="crashed", error=error) for v in comparable(name)]


def compare(family: str, results: list[Result]) -> FamilyReport:
    report = FamilyReport(family, variants=len(results))
    done = [r for r in results if r.ok]
    report.skipped = [(r.label, r.stage, r.error) for r in results if not r.ok]
    # None after: describing the built graph failed, which is as bad as a changed key
    report.unstable = [r.label for r in done if r.ours_after != r.ours]
    for a, b in itertools.combinations(done, 2):
        report.compared_pairs += 1
        if a.theirs != b.theirs:
            report.cudnn_distinct_pairs += 1
            if a.ours == b.ours:
                report.collisions.append((a.label, b.label))
        elif a.ours != b.ours:
            report.over_separated_pairs += 1
    return report


def _gpu_line() -> str:
    try:
        import cudnn
        import torch

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        return f"{name}, cuDNN {cudnn.backend_version()}, frontend {cudnn.__version__}, torch {torch.__version__}"
    except Exception as exc:  # the report still says what it could
        return f"unknown device ({_short_error(exc)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", help=f"families to run (default: all {len(FAMILIES)})")
    parser.add_argument("--json", metavar="PATH", help='write every result as JSON to PATH ("-": stdout)')
    parser.add_argument("--list", action="store_true", help="list the families and their variants, then exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every variant as it runs")
    parser.add_argument("--isolate", action="store_true", help="run each family in its own process")
    benchlib.add_smoke_option(parser)
    args = parser.parse_args(argv)
    benchlib.start_smoke(args.smoke)  # the variable: an isolated family's process is a smoke run too
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    names = args.families or list(FAMILIES)

    if args.list:
        for name in names:
            variants = FAMILIES[name].variants()
            print(f"{name}: {len(variants)} variants, {sum(v.comparable for v in variants)} compared with cuDNN")
            for v in variants:
                print(f"    {v.kind:6} {'cmp' if v.comparable else '   '} {v.label}")
        return 0

    print(f"key oracle on {_gpu_line()}", flush=True)
    reports: list[FamilyReport] = []
    all_results: dict[str, list[Result]] = {}
    for name in names:
        results = (family_results_isolated if args.isolate else family_results)(name, args.verbose)
        all_results[name] = results
        report = compare(name, results)
        reports.append(report)
        flag = "COLLISION" if report.collisions else "UNSTABLE" if report.unstable else "ok"
        print(
            f"{name:24} variants {report.variants:3}  built {report.variants - len(report.skipped):3}  "
            f"pairs {report.compared_pairs:5}  cudnn-distinct {report.cudnn_distinct_pairs:5}  "
            f"collisions {len(report.collisions)}  {flag}",
            flush=True,
        )
        for a, b in report.collisions:
            print(f"    COLLISION: {name}[{a}] and {name}[{b}]: cuDNN keys differ, plancache keys equal")
        for label in report.unstable:
            print(f"    UNSTABLE: {name}[{label}]: plancache's key changed once cuDNN built the graph")

    variants = sum(r.variants for r in reports)
    skipped = sum(len(r.skipped) for r in reports)
    pairs = sum(r.compared_pairs for r in reports)
    distinct = sum(r.cudnn_distinct_pairs for r in reports)
    collisions = sum(len(r.collisions) for r in reports)
    unstable = sum(len(r.unstable) for r in reports)
    over = sum(r.over_separated_pairs for r in reports)
    reasons = Counter(error.split(" | ")[0][:120] for r in reports for _, _, error in r.skipped)
    print()
    print(f"variants: {variants} ({variants - skipped} built and keyed by cuDNN, {skipped} skipped)")
    print(f"pairs compared: {pairs}; cuDNN-distinct pairs: {distinct}; collisions: {collisions}")
    print(f"unstable keys: {unstable}; pairs plancache keys apart that cuDNN keys alike: {over}")
    if reasons:
        print("most common reasons for skipping:")
        for reason, count in reasons.most_common(8):
            print(f"    {count:4}  {reason}")

    if args.json:
        payload = {
            "device": _gpu_line(),
            "summary": {"variants": variants, "skipped": skipped, "pairs": pairs, "cudnn_distinct_pairs": distinct,
                        "collisions": collisions, "unstable": unstable, "over_separated_pairs": over},
            "families": [asdict(r) for r in reports],
            "results": {name: [asdict(r) for r in results] for name, results in all_results.items()},
        }  # fmt: skip
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            print(f"results written to {args.json}")

    if benchlib.smoke():
        benchlib.report_skipped("key_oracle")
        keyed = [r for results in all_results.values() for r in results if r.ours is not None and r.stage == ""]
        stable = sum(r.ours_after == r.ours for r in keyed)
        print(f"key oracle smoke run: {len(keyed)} of {variants} variants keyed by plancache, {stable} alike after")
        return 0 if variants and stable == len(keyed) == variants else 1
    if pairs == 0:
        print("key oracle: no pair could be compared (is there a GPU? did cuDNN reject every variant?)")
        return 2
    return 1 if collisions else 3 if unstable else 0


if __name__ == "__main__":
    sys.exit(main())
