#!/usr/bin/env python3
"""The parts of a store hit that every hit does while it keeps every check, each timed
alone, beside the whole hit: how far cuts of today's hit path can go.

    python3 scripts/probe_hit_parts.py [--cpu] [--graphs conv_bias_relu,matmul_bias_relu,sdpa_causal]

Stores the plan of each graph (the heuristic policy), looks each up once more so that its
row keeps its judgement, then times in this process, best of 5 runs of ``--calls`` calls
each (``timeit``), per graph:

  describe        ``describe(graph)``: the canonical description, walked from the pygraph
  key             ``make_key``: the description's canonical text and SHA-256
  row             the store hit's SELECT of the row (``Store.get`` less the entry)
  entry           ``Entry.from_row``: the row's fields decoded and checked
  kept            ``store.kept.kept``: the kept judgement's digest and decoding
  record          ``guest.native.record.keep``: the load's record from the kept form
  judged          ``store.entry.judged`` with that judgement (checksums, environment,
                  key, tensor table against the graph, the table's specs); of which the
                  blob's checksum (SHA-256 of the blob: every hit checks it) is printed
                  below it and counted once in the sum
  gate            ``guest.native.record.refusal``: every pointer bounded
  layout          ``guest.native.record.Layout.of``: the variant pack's slots
  plan            ``runtime.plan.Plan``: the caller's tensor checks, resolved once

then the same parts called one after another in one function (as a hit calls them, with
nothing around them: no load claim, guest block, wrapper or native load), and the whole
hit below its key (``Lookup.resolve``: the load claim, the guest block, the
read, the judge, the load, the ``Plan``, the memory tier), the best of 5 runs of ``calls``
calls timed one by one, each less its time inside cuDNN's finalize and with the plan it
replaces destroyed outside its timing; and the sum of the parts after the key (each timed
alone) beside them. A part timed alone runs with its code and data hot in the CPU's
caches; the sequence tells how much more the same parts cost one after another, the whole
what the lookup's layers and the native load's own set-up add to that.
``--cpu``: on plancache's CPU test backend (host work is the same code; its finalize is a
simulation, left out like cuDNN's). ``--smoke``: that, with 3 calls a run: checks the
script, measures nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
import timeit
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

import benchlib  # noqa: E402 - after the path it is found on

GRAPHS = {
    "conv_bias_relu": ("conv_bias_act", {"n": 8, "c": 64, "h": 56, "w": 56, "k": 64}),
    "matmul_bias_relu": ("matmul_bias_act", {"b": 1, "m": 512, "n": 512, "k": 1024}),
    "sdpa_causal": ("sdpa", {"b": 4, "h": 16, "s": 1024, "d": 64, "causal": True}),
}
SMALL = {  # the same kinds at sizes the CPU test backend runs in milliseconds
    "conv_bias_relu": ("conv_bias_act", {"n": 1, "c": 8, "h": 6, "w": 6, "k": 8}),
    "matmul_bias_relu": ("matmul_bias_act", {"b": 1, "m": 8, "n": 8, "k": 16}),
    "sdpa_causal": ("sdpa", {"b": 1, "h": 1, "s": 16, "d": 16, "causal": True}),
}


def best_us(fn: Any, calls: int) -> float:
    """Microseconds per call of ``fn``: the best of 5 runs of ``calls`` calls."""
    return min(timeit.repeat(fn, number=calls, repeat=5)) / calls * 1e6


def parts(cache: Any, graph: Any, calls: int) -> dict[str, float]:
    """Microseconds per call of each part of a store hit of ``graph``, and of the whole."""
    from plancache.cache.judging import code_version
    from plancache.formats.plan_blob import PlanBlob
    from plancache.guest.native.record import Layout, keep, parse, refusal
    from plancache.key import describe, make_key
    from plancache.runtime.plan import Plan
    from plancache.store import judged
    from plancache.store.entry import Entry
    from plancache.store.kept import kept
    from plancache.store.store import _READ_HIT

    lookup, backend = cache.lookup, cache.backend
    device = backend.current_device()
    environment, env_id = lookup.environment(device)
    key, names = lookup.key_and_names(graph, cache.options, device)
    known = lookup._known(device, key)
    store = lookup.local.store
    connection = store.connection()
    row = connection.one(_READ_HIT, (key.digest,))
    entry = Entry.from_row(row, known, False)
    judgement = kept(entry.judgement, entry.key, entry.blob_sha256, entry.meta_sha256, code_version())
    if judgement is None:
        raise SystemExit(f"{entry.label}: its row keeps no judgement of this code: the parts would not be a hit's")
    blob = PlanBlob(entry.blob)
    keep(blob, judgement.record)
    record = parse(blob)
    sound = judged(entry, environment, env_id, key, blob=blob, kept=judgement)
    tensors = list(getattr(sound, "tensors", ()))
    table = {spec.uid: spec for spec in tensors}
    native = backend.load(blob, tensors, device)
    description = describe(graph, None)
    env_json = lookup._environment_json[env_id]

    def make_plan() -> Plan:
        return Plan(key=key.digest, backend=backend, native=native, tensors=tensors, workspace_size=entry.workspace_size,
                    engine=None, source="loaded", device=device, names=names)  # fmt: skip

    figures = {
        "describe": best_us(lambda: describe(graph, None), calls),
        "key": best_us(lambda: make_key(description, environment, cache.options, environment_json=env_json), calls),
        "row": best_us(lambda: connection.one(_READ_HIT, (key.digest,)), calls),
        "entry": best_us(lambda: Entry.from_row(row, known, False), calls),
        "kept": best_us(lambda: kept(entry.judgement, entry.key, entry.blob_sha256, entry.meta_sha256, code_version()), calls),
        "record": best_us(lambda: keep(PlanBlob(entry.blob), judgement.record), calls),
        "judged": best_us(lambda: judged(entry, environment, env_id, key, blob=blob, kept=judgement), calls),
        "  of which the blob's checksum": best_us(lambda: hashlib.sha256(entry.blob).hexdigest(), calls),
        "gate": best_us(lambda: refusal(record, table, None), calls),
        "layout": best_us(lambda: Layout.of(record), calls),
        "plan": best_us(make_plan, calls),
    }

    def sequence() -> None:  # the parts after the key one after another, as a hit calls them
        read = Entry.from_row(connection.one(_READ_HIT, (key.digest,)), known, False)
        taken = kept(read.judgement, read.key, read.blob_sha256, read.meta_sha256, code_version())
        assert taken is not None  # the row keeps a judgement (checked above)
        fresh = PlanBlob(read.blob)
        keep(fresh, taken.record)
        found = judged(read, environment, env_id, key, blob=fresh, kept=taken)
        specs = list(getattr(found, "tensors", ()))
        loaded = parse(fresh)
        refusal(loaded, {spec.uid: spec for spec in specs}, None)
        Layout.of(loaded)
        Plan(key=key.digest, backend=backend, native=native, tensors=specs, workspace_size=read.workspace_size,
             engine=None, source="loaded", device=device, names=names)  # fmt: skip

    figures["the same parts in one sequence"] = best_us(sequence, calls)
    inside: list[float] = []
    library = backend.driver.library()
    finalize = benchlib.time_calls(library, "load_plan", inside.append)
    walls: list[float] = []
    try:
        for _ in range(5 * calls):  # the lookup below its key, the plan it replaces destroyed outside the timing
            lookup.memory.clear()
            started = time.perf_counter()
            lookup.resolve(graph, key, names, cache.options, device, None)
            walls.append(time.perf_counter() - started)
    finally:
        library.load_plan = finalize
    own = [wall - inside_one for wall, inside_one in zip(walls, inside, strict=True)]
    figures["whole hit below the key"] = min(sum(own[run * calls : (run + 1) * calls]) / calls for run in range(5)) * 1e6
    figures["blob bytes"] = float(len(entry.blob))
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="on plancache's CPU test backend (host work, small graphs)")
    parser.add_argument("--graphs", default=",".join(GRAPHS), help=f"some of {','.join(GRAPHS)}")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed run (best of 5 runs)")
    benchlib.add_smoke_option(parser)
    opts = parser.parse_args(argv)
    if benchlib.start_smoke(opts.smoke or opts.cpu):
        opts.calls = 3 if opts.smoke else opts.calls
    import plancache
    from plancache.workflows import templates

    torch = benchlib.require_gpu("probe_hit_parts")
    sizes = SMALL if benchlib.smoke() else GRAPHS
    names = [name.strip() for name in opts.graphs.split(",") if name.strip()]
    with tempfile.TemporaryDirectory(prefix="plancache-hit-parts-") as directory:
        cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False,
                                    options=plancache.BuildOptions(policy="heuristic"))  # fmt: skip
        graphs = {name: templates.build(sizes[name][0], **sizes[name][1]) for name in names}
        for graph in graphs.values():
            cache.get(graph)  # stored
        cache.close()  # its judgements are kept as it closes
        cache = plancache.PlanCache(directory, backend=benchlib.backend(), auto_prime=False,
                                    options=plancache.BuildOptions(policy="heuristic"))  # fmt: skip
        rows = {name: parts(cache, graph, opts.calls) for name, graph in graphs.items()}
        cache.close()
    versions = benchlib.versions(torch)
    print(f"plancache store hit by part, us per call (best of 5 runs of {opts.calls}), {versions}"
          f"{' on the CPU test backend' if benchlib.smoke() else ''}")  # fmt: skip
    labels = list(next(iter(rows.values())))
    print(f"{'part':30}" + "".join(f"{name:>18}" for name in rows))
    for label in labels:
        print(f"{label:30}" + "".join(f"{figures[label]:18.1f}" for figures in rows.values()))
    listed = [label for label in labels if label not in ("whole hit below the key", "blob bytes", "describe", "key",
                                                         "the same parts in one sequence") and not label.startswith(" ")]  # fmt: skip
    print(f"{'sum of the parts after the key':30}" + "".join(f"{sum(f[p] for p in listed):18.1f}" for f in rows.values()))
    if opts.smoke:
        benchlib.report_skipped("probe_hit_parts")


if __name__ == "__main__":
    main()
