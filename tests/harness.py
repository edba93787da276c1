"""Multi-process fault harness shared by tests/test_concurrency.py (small counts) and
scripts/stress_store.py (large counts).

Workers are real processes with their own SQLite connections and file locks. They are
forked from a forkserver that imported torch, cuDNN Frontend and plancache once, so each
costs milliseconds instead of a 3 s torch import; the forkserver itself is a freshly
spawned interpreter, so no test state leaks into the workers. Workers receive every path
as an argument (they do not see environment changes made after the server started).

Every scenario returns a dict of figures plus ``violations``: a list of what went wrong,
empty when every guarantee held. Tests assert it is empty; the stress script counts.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import multiprocessing
import os
import random
import sqlite3
import time
from collections import Counter
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from plancache import BuildOptions, EntryNotFoundError, PlanCache, Store
from plancache.formats.ubjson import encode as encode_ubjson
from plancache.key import KEY_FORMAT, canonical_json, environment_id
from plancache.key.frontend_form import frontend_form, frontend_graph
from plancache.store import DB_NAME, Entry, bookkeeping, maintenance, sha256
from plancache.testing import CpuTestBackend

CTX = multiprocessing.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "torch.distributed.tensor", "cudnn", "plancache", "plancache.testing", "graphs", "harness"])

#: The environment of the synthetic entries the store-level workers write.
HARNESS_ENV = {"gpu_name": "harness", "cudnn_backend_version": "0", "compute_capability": "0.0"}


# ---------------------------------------------------------------------------- processes


@contextlib.contextmanager
def processes() -> Iterator[list[BaseProcess]]:
    """A list to start workers into; whatever is still alive on the way out is killed and
    reaped, so a failing test leaves no process behind."""
    procs: list[BaseProcess] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(10)


def start(procs: list[BaseProcess], target: Callable[..., None], *args: Any) -> BaseProcess:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    procs.append(p)
    return p


def join_all(procs: list[BaseProcess], timeout: float) -> list[int | None]:
    """Exit codes (None: still running at the deadline; the caller's finally kills it)."""
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    return [p.exitcode for p in procs]


def end_if_stuck(seconds: float = 120.0) -> None:
    """In a forked child: still running after ``seconds`` (its work takes well under a
    second, and a few on a busy machine), it waits for something that never comes: it
    prints where each of its threads waits and exits with 1, and the test fails."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def _write_json(path: str, data: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # a reader never sees half a result


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def _log_to(path: str) -> None:
    logging.basicConfig(filename=path, level=logging.INFO, format="%(process)d %(message)s", force=True)


def _sleep_until(when: float) -> None:
    time.sleep(max(0.0, when - time.time()))


# ---------------------------------------------------------------------------- synthetic entries


def entry_for(tag: str, blob_max: int) -> Entry:
    """A consistent entry (its key hashes its parts, as ``verify`` checks) whose blob and
    blob size follow from the key alone, so a checker can tell a whole row from a partial one."""
    description = {"nodes": [], "harness": tag}
    options = BuildOptions().to_dict()
    parts = {"format": KEY_FORMAT, "graph": description, "environment": HARNESS_ENV, "options": options}
    key = sha256(canonical_json(parts).encode())
    blob = expected_blob(key, blob_max)
    now = time.time()
    return Entry(key=key, env_id=environment_id(HARNESS_ENV), label=f"harness {tag}", description=description,
                 environment=HARNESS_ENV, options=options, tensors=[], blob=blob, blob_sha256=sha256(blob),
                 engine={"engine_id": 1, "knobs": {}, "name": "harness"}, workspace_size=0, policy="heuristic",
                 candidates=[], timing={}, build_seconds=0.0, autotune_seconds=0.0, backend="harness",
                 created_at=now, last_used_at=now, check={"status": "single", "rule": 2, "compared": 1, "agreeing": 1})  # fmt: skip


def graph_blob(description: dict[str, Any], filler: bytes = b"") -> bytes:
    """A blob that carries the graph of ``description`` as a frontend plan does, then
    ``filler``, and nothing a backend could load: what tests of the store and its tiers,
    which never load a plan, store under a key (the store refuses a blob that carries no
    graph, or another graph than its key's)."""
    return encode_ubjson({**frontend_graph(frontend_form(description), {}, {}), "filler": filler.hex()})


def expected_blob(key: str, blob_max: int) -> bytes:
    size = 256 + int(key[:8], 16) % max(1, blob_max - 256)
    seed = bytes.fromhex(key)
    return graph_blob({}, (seed * (size // len(seed) + 1))[: size // 2])  # a blob of no ops, about size bytes (hex)


# ---------------------------------------------------------------------------- single flight


def flight_worker(directory: str, rank: int, ns: list[int], delay: float, build_log: str, out: str, start_at: float) -> None:
    """Get a plan for every ConvBiasRelu(n) in ``ns`` (rotated by rank, so ranks meet on
    different keys), check each runs correctly, write what happened to ``out``."""
    from graphs import ConvBiasRelu, assert_runs_correctly

    _log_to(out + ".log")
    cache = PlanCache(directory, backend=CpuTestBackend(build_delay=delay, build_log=build_log), lock_timeout=120)
    _sleep_until(start_at)
    shift = rank % len(ns)
    results = []
    for n in ns[shift:] + ns[:shift]:
        spec = ConvBiasRelu(n=n)
        plan = cache.get(spec.graph())
        assert_runs_correctly(plan, spec)
        results.append({"n": n, "key": plan.key, "source": plan.source})
    cache.close()
    _write_json(out, {"rank": rank, "results": results, "counters": cache.counters})


def single_flight(root: Path, *, processes_n: int, keys: int, delay: float, timeout: float = 120) -> dict[str, Any]:
    """``processes_n`` processes miss the same ``keys`` keys at once: each key must be
    built exactly once, and every process must get a working plan for every key."""
    root.mkdir(parents=True, exist_ok=True)
    directory, build_log = root / "cache", root / "builds.log"
    ns = list(range(1, keys + 1))
    start_at = time.time() + 0.5
    with processes() as procs:
        for rank in range(processes_n):
            start(procs, flight_worker, str(directory), rank, ns, delay, str(build_log), str(root / f"rank{rank}.json"), start_at)
        codes = join_all(procs, timeout)
    results = [_read_json(root / f"rank{rank}.json") for rank in range(processes_n)]
    builds = Counter(line.split()[0] for line in build_log.read_text().splitlines()) if build_log.exists() else Counter()
    violations = []
    if any(code != 0 for code in codes):
        violations.append(f"exit codes {codes}")
    if len(builds) != keys or set(builds.values()) != {1}:
        violations.append(f"builds per key {sorted(builds.values())}, expected {keys} keys built once each")
    built = Counter(r["key"] for res in results if res for r in res["results"] if r["source"] == "built")
    if set(built.values()) != {1} or len(built) != keys:
        violations.append(f"'built' plans per key {dict(built)}")
    plans = sum(len(res["results"]) for res in results if res)
    if plans != processes_n * keys:
        violations.append(f"{plans} plans returned, expected {processes_n * keys}")
    logs = "".join(
        Path(root / f"rank{r}.json.log").read_text() for r in range(processes_n) if (root / f"rank{r}.json.log").exists()
    )
    return {
        "processes": processes_n,
        "keys": keys,
        "plans": plans,
        "builds": sum(builds.values()),
        "waits": sum(res["counters"]["waits"] for res in results if res),
        "wait_log_lines": logs.count("waiting up to"),
        "violations": violations,
    }


# ---------------------------------------------------------------------------- SIGKILL of store writers


def churn_writer(directory: str, writer: int, writers: int, tag: str, journal: str, seed: int, blob_max: int) -> None:
    """Write forever (until killed): puts, hit counts, quarantines, deletes, each between a
    ``B`` (begin) and an ``E`` (committed) journal line. Touches only keys with
    ``int(key, 16) % writers == writer``, so concurrent writers never race on one key."""
    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def note(text: str) -> None:
        os.write(fd, (text + "\n").encode())  # one write(2) per line: whole or cut, never mixed

    rng = random.Random(seed)
    store = Store(directory)
    note("R")
    mine = [k for k in store.keys() if int(k, 16) % writers == writer]  # noqa: SIM118 - Store.keys() is a query
    made = 0
    while True:
        r = rng.random()
        if r < 0.55 or not mine:
            entry = entry_for(f"{tag}-{made}", blob_max)
            made += 1
            if int(entry.key, 16) % writers != writer:
                continue
            note(f"B put {entry.key}")
            store.put(entry)
            note(f"E put {entry.key}")
            mine.append(entry.key)
        elif r < 0.75:
            key = rng.choice(mine)
            note(f"B hit {key}")
            bookkeeping.record_hits(store, {key: (1, time.time())})
            note(f"E hit {key}")
        else:
            key = mine.pop(rng.randrange(len(mine)))
            op = "quarantine" if r < 0.88 else "delete"
            note(f"B {op} {key}")
            if op == "quarantine":
                store.quarantine(key, "churn")
            else:
                store.delete(key)
            note(f"E {op} {key}")


class StoreModel:
    """What the store must hold after the committed (``E``) operations of the journals; an
    operation cut by SIGKILL (``B`` without ``E``) may have happened or not, never half."""

    def __init__(self, blob_max: int) -> None:
        self.blob_max = blob_max
        self.state: dict[str, str] = {}  # key -> plans | quarantine | gone (keys are never reused)
        self.hits: Counter[str] = Counter()
        self.uncertain: dict[str, tuple[set[str], set[int]]] = {}

    def apply(self, journal: Path) -> tuple[int, int]:
        """Apply one writer's journal; returns (operations committed, operations cut)."""
        lines = journal.read_text().split("\n")[:-1] if journal.exists() else []  # drop a cut last line
        committed, pending = 0, None
        for line in lines:
            if line == "R":
                continue
            mark, op, key = line.split()
            if mark == "B":
                pending = (op, key)
                continue
            self._commit(op, key)
            committed += 1
            pending = None
        if pending is not None:
            self._maybe(*pending)
        return committed, pending is not None

    def _after(self, op: str, key: str) -> str:
        return {"put": "plans", "quarantine": "quarantine", "delete": "gone"}.get(op, self.state.get(key, "gone"))

    def _commit(self, op: str, key: str) -> None:
        if op == "hit":
            self.hits[key] += 1
        self.state[key] = self._after(op, key)

    def _maybe(self, op: str, key: str) -> None:
        before = self.state.get(key, "gone")
        hits = {self.hits[key], self.hits[key] + (op == "hit")}
        self.uncertain[key] = ({before, self._after(op, key)}, hits)

    def check(self, path: Path) -> tuple[list[str], int]:
        """Compare with the database file; resolve cut operations to what happened.
        Returns (violations, entries lost)."""
        violations: list[str] = []
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        try:
            integrity = [r[0] for r in conn.execute("PRAGMA integrity_check")]
            if integrity != ["ok"]:
                violations.append(f"integrity_check: {integrity[:3]}")
            rows = {r["key"]: r for r in conn.execute("SELECT * FROM plans")}
            quarantine = Counter(r[0] for r in conn.execute("SELECT key FROM quarantine"))
        finally:
            conn.close()
        violations += self._check_rows(rows)
        lost = 0
        for key in set(self.state) | set(self.uncertain):
            observed = "plans" if key in rows else "quarantine" if quarantine[key] else "gone"
            hits = int(rows[key]["hit_count"]) if key in rows else None
            allowed, allowed_hits = self.uncertain.pop(key, ({self.state.get(key, "gone")}, {self.hits[key]}))
            if observed not in allowed:
                violations.append(f"{key[:12]}: {observed}, expected {sorted(allowed)}")
                lost += observed == "gone"
            elif hits is not None and hits not in allowed_hits:
                violations.append(f"{key[:12]}: hit_count {hits}, expected {sorted(allowed_hits)}")
            self.state[key] = observed  # a cut operation resolves to what happened
            if hits is not None:
                self.hits[key] = hits
        violations += [f"{key[:12]}: {n} quarantine rows" for key, n in quarantine.items() if n > 1]
        return violations, lost

    def _check_rows(self, rows: dict[str, Any]) -> list[str]:
        """No partial entry: every row decodes, matches its checksum and is the whole blob."""
        violations = []
        for key, row in rows.items():
            if key not in self.state and key not in self.uncertain:
                violations.append(f"{key[:12]}: a row no writer began")
                continue
            try:
                entry = Entry.from_row(row)
            except (ValueError, KeyError, TypeError) as exc:
                violations.append(f"{key[:12]}: row does not decode: {exc}")
                continue
            if not entry.checksum_ok() or entry.blob != expected_blob(key, self.blob_max):
                violations.append(f"{key[:12]}: partial or wrong blob ({len(entry.blob)} bytes)")
        return violations


def sigkill_writers(
    root: Path, *, iterations: int, writers: int = 2, blob_max: int = 32 << 10, seed: int = 1, max_window: float = 0.2
) -> dict[str, Any]:
    """Start ``writers`` churn writers, SIGKILL them at random moments (during start-up and
    open, inside transactions, during checkpoints), ``iterations`` times. After every round
    the store must open normally (nothing moved aside), pass ``integrity_check``, hold every
    committed entry whole, and show each cut operation either done or not done."""
    root.mkdir(parents=True, exist_ok=True)
    directory = root / "cache"
    rng = random.Random(seed)
    model = StoreModel(blob_max)
    figures = {"iterations": iterations, "processes": 0, "sigkills": 0, "operations": 0, "integrity_checks_passed": 0,
               "operations_cut": 0, "entries_lost": 0, "early_kills": 0}  # fmt: skip
    violations: list[str] = []
    for it in range(iterations):
        journals = [root / f"journal-{it}-{w}" for w in range(writers)]
        with processes() as procs:
            for w in range(writers):
                start(
                    procs,
                    churn_writer,
                    str(directory),
                    w,
                    writers,
                    f"{seed}-{it}-{w}",
                    str(journals[w]),
                    rng.randrange(1 << 30),
                    blob_max,
                )
            figures["processes"] += writers
            early = rng.random() < 0.25
            if early:  # during interpreter start-up, Store() and the first migration
                time.sleep(rng.uniform(0, 0.05))
                figures["early_kills"] += 1
            else:
                _wait_for_lines(journals, 10.0)
                time.sleep(rng.uniform(0, max_window))
            for p in procs:
                p.kill()
                figures["sigkills"] += 1
                time.sleep(rng.uniform(0, 0.02))
            join_all(procs, 10)
        for journal in journals:
            committed, cut = model.apply(journal)
            figures["operations"] += committed
            figures["operations_cut"] += cut
        found, lost = model.check(directory / DB_NAME) if (directory / DB_NAME).exists() else ([], 0)
        violations += [f"iteration {it}: {v}" for v in found]
        figures["entries_lost"] += lost
        figures["integrity_checks_passed"] += not any("integrity" in v for v in found)
        aside = list(directory.glob(f"{DB_NAME}.corrupt-*")) if directory.exists() else []
        if aside:
            violations.append(f"iteration {it}: the store was moved aside: {aside}")
            break
    violations += _reopen_and_verify(directory)
    figures["entries_at_end"] = sum(1 for s in model.state.values() if s == "plans")
    return {**figures, "violations": violations}


def _wait_for_lines(journals: list[Path], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(j.exists() and j.stat().st_size > 2 for j in journals):
            return
        time.sleep(0.005)


def _reopen_and_verify(directory: Path) -> list[str]:
    """The next process proceeds: a normal open, then plancache's own verify."""
    if not (directory / DB_NAME).exists():
        return []
    store = Store(directory)
    try:
        report = maintenance.verify(store)
    finally:
        store.close()
    return [f"verify after the kills: {p}" for p in report["problems"]]


# ---------------------------------------------------------------------------- SIGKILL during autotune


def cache_victim(directory: str, ns: list[int], delay: float, build_log: str, journal: str) -> None:
    """A PlanCache process getting ConvBiasRelu(n) plans; killed at random moments,
    usually while it holds a build lock and autotunes."""
    from graphs import ConvBiasRelu

    fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    cache = PlanCache(directory, backend=CpuTestBackend(build_delay=delay, build_log=build_log), lock_timeout=60)
    os.write(fd, b"R\n")
    for n in ns:
        os.write(fd, f"B {n}\n".encode())
        cache.get(ConvBiasRelu(n=n).graph())
        os.write(fd, f"E {n}\n".encode())
    cache.close()


def sigkill_builders(root: Path, *, iterations: int, keys: int, delay: float, seed: int = 2) -> dict[str, Any]:
    """Kill PlanCache processes at random moments of autotuning and storing (two at a time
    on the same new keys, so one may be waiting on the other's lock), then run two clean
    processes over every key: they must not be blocked by a dead process's lock, must get
    working plans, and the store must verify clean."""
    root.mkdir(parents=True, exist_ok=True)
    directory, build_log = root / "cache", root / "builds.log"
    rng = random.Random(seed)
    kills = 0
    for it in range(iterations):
        journals = [root / f"victim-{it}-{v}" for v in range(2)]
        ns = list(range(it * keys + 1, (it + 1) * keys + 1))  # new keys each round: the kills land in autotuning
        with processes() as procs:
            for v in range(2):
                start(procs, cache_victim, str(directory), rng.sample(ns, len(ns)), delay, str(build_log), str(journals[v]))
            _wait_for_lines(journals, 10.0)
            time.sleep(rng.uniform(0, delay * 8))
            for p in procs:
                if p.is_alive():
                    p.kill()
                    kills += 1
            join_all(procs, 10)
    started = time.monotonic()
    final = _final_run(directory, list(range(1, iterations * keys + 1)), 0.01, root)
    violations = final["violations"] + _reopen_and_verify(directory)
    return {"iterations": iterations, "sigkills": kills, "final_seconds": time.monotonic() - started,
            "keys": iterations * keys, "final_plans": final["plans"], "violations": violations}  # fmt: skip


def _final_run(directory: Path, ns: list[int], delay: float, root: Path) -> dict[str, Any]:
    start_at = time.time() + 0.2
    outs = [root / f"final-{r}.json" for r in range(2)]
    with processes() as procs:
        for rank in range(2):
            start(
                procs, flight_worker, str(directory), rank, ns, delay, str(root / "final-builds.log"), str(outs[rank]), start_at
            )
        codes = join_all(procs, 120)
    results = [_read_json(o) for o in outs]
    violations = [f"final run exit codes {codes}"] if any(c != 0 for c in codes) else []
    plans = sum(len(r["results"]) for r in results if r)
    if plans != 2 * len(ns):
        violations.append(f"final run returned {plans} plans, expected {2 * len(ns)}")
    return {"plans": plans, "violations": violations}


# ---------------------------------------------------------------------------- readers and writers


def rw_reader(directory: str, ops: int, seed: int, out: str, start_at: float) -> None:
    """Lookups of every kind; any exception is recorded (it would reach a caller)."""
    rng = random.Random(seed)
    store = Store(directory)
    keys = store.keys()
    errors: list[str] = []
    _sleep_until(start_at)
    for _ in range(ops):
        try:
            r = rng.random()
            if r < 0.6 and keys:
                entry = store.get(rng.choice(keys))
                if entry is not None and not entry.checksum_ok():
                    errors.append(f"served a bad checksum for {entry.key[:12]}")
            elif r < 0.75:
                keys = store.keys() or keys
            elif r < 0.85:
                maintenance.list_entries(store)
            elif r < 0.95:
                store.stats()
            elif keys:
                with contextlib.suppress(EntryNotFoundError):  # deleted meanwhile
                    store.key_named(rng.choice(keys)[:6])
        except Exception as exc:  # recorded, never raised: the parent counts them
            errors.append(f"{type(exc).__name__}: {exc}")
    store.close()
    _write_json(out, {"ops": ops, "errors": errors})


def rw_writer(directory: str, ops: int, seed: int, out: str, start_at: float, max_size: int) -> None:
    """Puts, hit counts, quarantines, deletes, evictions and counters, as a cache does."""
    rng = random.Random(seed)
    store = Store(directory)
    keys = store.keys()
    errors: list[str] = []
    _sleep_until(start_at)
    for i in range(ops):
        try:
            r = rng.random()
            if r < 0.5 or not keys:
                entry = entry_for(f"rw-{seed}-{i}", 16 << 10)
                store.put(entry)
                keys.append(entry.key)
            elif r < 0.7:
                bookkeeping.record_hits(store, {k: (1, time.time()) for k in rng.sample(keys, min(8, len(keys)))})
            elif r < 0.75:
                store.quarantine(keys.pop(rng.randrange(len(keys))), "rw test")
            elif r < 0.8:
                store.delete(keys.pop(rng.randrange(len(keys))))
            elif r < 0.9:
                store.evict_to(max_size)
            else:
                bookkeeping.record_counters(store, {"rw_ops": 1}, wait=True)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    store.close()
    _write_json(out, {"ops": ops, "errors": errors})


def readers_writers(
    root: Path, *, readers: int, writers: int, reader_ops: int, writer_ops: int, seed_entries: int = 40, timeout: float = 180
) -> dict[str, Any]:
    """``readers`` + ``writers`` processes on one store at once; not one error may reach a
    caller (no 'database is locked'), and the store must verify clean afterwards."""
    root.mkdir(parents=True, exist_ok=True)
    directory = root / "cache"
    store = Store(directory)
    for i in range(seed_entries):
        store.put(entry_for(f"seed-{i}", 16 << 10))
    max_size = store.total_size() * 2
    store.close()
    start_at = time.time() + 0.5
    outs = []
    started = time.monotonic()
    with processes() as procs:
        for r in range(readers):
            outs.append(root / f"reader-{r}.json")
            start(procs, rw_reader, str(directory), reader_ops, 100 + r, str(outs[-1]), start_at)
        for w in range(writers):
            outs.append(root / f"writer-{w}.json")
            start(procs, rw_writer, str(directory), writer_ops, 200 + w, str(outs[-1]), start_at, max_size)
        codes = join_all(procs, timeout)
    seconds = time.monotonic() - started
    results = [_read_json(o) for o in outs]
    errors = [e for res in results if res for e in res["errors"]]
    violations = [f"exit codes {codes}"] if any(c != 0 for c in codes) else []
    violations += [f"error reached a caller: {e}" for e in errors[:20]]
    violations += _reopen_and_verify(directory)
    return {
        "processes": readers + writers,
        "operations": sum(res["ops"] for res in results if res),
        "seconds": seconds,
        "errors": len(errors),
        "locked_errors": sum("locked" in e for e in errors),
        "violations": violations,
    }


# ---------------------------------------------------------------------------- damaged files, full disks


def _store_plans(directory: Path, specs: list[Any]) -> list[str]:
    cache = PlanCache(directory, backend=CpuTestBackend())
    keys = [cache.get(spec.graph()).key for spec in specs]
    cache.close()  # the last connection checkpoints: everything is in the main file now
    return keys


def _serve_all(directory: Path, specs: list[Any], fill_disk: int | None = None) -> tuple[list[str], list[str], PlanCache]:
    """Every spec through a fresh cache; returns (sources, violations, cache)."""
    from graphs import assert_runs_correctly

    cache = PlanCache(directory, backend=CpuTestBackend(), lock_timeout=30)
    if fill_disk is not None:
        conn = cache.store.connection()
        conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0] + fill_disk}")
    sources, violations = [], []
    for spec in specs:
        try:
            plan = cache.get(spec.graph())
            assert_runs_correctly(plan, spec)
            sources.append(plan.source)
        except Exception as exc:  # a wrong or refused plan: the guarantee is broken
            violations.append(f"{spec}: {type(exc).__name__}: {str(exc)[:200]}")
            sources.append("refused" if type(exc).__name__ == "TensorMismatchError" else "failed")
    return sources, violations, cache


def _flip_in_blob(path: Path, rng: random.Random, keys: list[str]) -> str:
    """Flip one bit of one stored blob, in the file itself; returns the key damaged."""
    store = Store(path.parent)
    key = rng.choice(keys)
    blob = store.get(key).blob  # type: ignore[union-attr]
    store.close()
    data = bytearray(path.read_bytes())
    starts = list(range(0, len(blob) - 32, 8))
    rng.shuffle(starts)
    for start in starts:
        window = blob[start : start + 32]
        if data.count(window) == 1:
            data[data.index(window) + rng.randrange(32)] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            return key
    raise AssertionError("no unique window of the blob in the file")


def _flip_anywhere(path: Path, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    data[rng.randrange(100, len(data))] ^= 1 << rng.randrange(8)  # past the 100-byte file header
    path.write_bytes(bytes(data))


def fault_rounds(
    root: Path,
    *,
    flips: int,
    flips_anywhere: int,
    truncations: int,
    garbage: int,
    disk_full: int,
    specs_n: int = 8,
    seed: int = 4,
) -> dict[str, Any]:
    """Damage a store of ``specs_n`` plans (a bit flipped in a blob or anywhere in the file,
    a truncated or garbage file) or fill its disk, then ask for every plan again: each must
    come back and run correctly, damaged files must be kept (moved aside, byte for byte),
    and no undamaged entry may go missing."""
    from graphs import ConvBiasRelu

    rng = random.Random(seed)
    specs = [ConvBiasRelu(n=n) for n in range(1, specs_n + 1)]
    kinds = (
        ["flip"] * flips
        + ["flip_anywhere"] * flips_anywhere
        + ["truncate"] * truncations
        + ["garbage"] * garbage
        + ["disk_full"] * disk_full
    )
    figures: Counter[str] = Counter()
    violations: list[str] = []
    for i, kind in enumerate(kinds):
        directory = root / f"{kind}-{i}"
        keys = _store_plans(directory, specs[: specs_n // 2] if kind == "disk_full" else specs)  # the rest: new on a full disk
        found, lost = _one_fault(kind, directory, keys, specs, rng, figures)
        violations += [f"{kind} {i}: {v}" for v in found]
        figures["entries_lost"] += lost
        figures["integrity_checks_passed"] += not any("verify" in v for v in found)
    return {**figures, "rounds": len(kinds), "violations": violations}


def _one_fault(
    kind: str, directory: Path, keys: list[str], specs: list[Any], rng: random.Random, figures: Counter[str]
) -> tuple[list[str], int]:
    path = directory / DB_NAME
    damaged_key = None
    if kind == "flip":
        damaged_key = _flip_in_blob(path, rng, keys)
    elif kind == "flip_anywhere":
        _flip_anywhere(path, rng)
    elif kind == "truncate":
        path.write_bytes(path.read_bytes()[: rng.randrange(100, path.stat().st_size)])
    elif kind == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    damaged = path.read_bytes()
    figures[kind] += 1
    sources, violations, cache = _serve_all(directory, specs, fill_disk=rng.randrange(4) if kind == "disk_full" else None)
    figures["plans_served"] += sources.count("loaded") + sources.count("rebuilt") + sources.count("built")
    figures["rebuilt"] += sources.count("rebuilt")
    figures["autotuned_again"] += sources.count("built")
    cache.close()
    if kind == "disk_full":
        figures["unpersisted"] += cache.counters["unpersisted"]
    aside = [p for p in directory.glob(f"{DB_NAME}.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    figures["moved_aside"] += len(aside)
    if aside and aside[0].read_bytes() != damaged:
        violations.append("the file moved aside is not the damaged file byte for byte")
    if kind == "garbage" and not aside:
        violations.append("a garbage file was not moved aside")
    if kind == "truncate" and not aside:  # cut inside the last page's free space: SQLite pads it, nothing is lost
        figures["truncations_harmless"] += 1
    sources2, violations2, cache = _serve_all(directory, specs)  # the next process: markers acted on
    cache.close()
    violations += violations2
    if kind == "flip_anywhere" and "refused" in sources2:
        # Known limit: a flipped output shape in tensors_json (no checksum covers it) makes
        # execute refuse the right tensors. Counted apart; see docs/reliability.md.
        figures["refused_output_shape"] += 1
        violations = [v for v in violations if "TensorMismatchError" not in v]
    lost = 0
    if kind in ("flip", "disk_full"):  # entries nobody damaged must all still be there
        lost = sum(1 for k, s in zip(keys, sources2) if k != damaged_key and s != "loaded")
    store = Store(directory)
    try:
        if maintenance.verify(store)["problems"]:  # damage no lookup trips over (an index entry): verify --fix's job
            figures["repaired_by_verify_fix"] += 1
            maintenance.verify(store, fix=True)
        violations += [f"verify: {p}" for p in maintenance.verify(store)["problems"]]
    finally:
        store.close()
    return violations, lost
