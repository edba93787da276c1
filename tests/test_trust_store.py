"""Only its owner's store is trusted (issue #34): a cache directory, ``plans.db``, its
``-wal``/``-shm`` or a lock that another user owns or can write is refused (one warning,
plans built in memory, nothing read), root included; no path beside the store is opened
through a link; a schema the migrations did not make is refused and never migrated; and
``plancache sql`` calls no function with side effects.

The cases of several users run as real users: the test (run as root, as CI is) creates
``plancache-test-*`` users and a group, and runs the victim's side in a forked child that
drops to that user (the interpreter lives under root's home, which the user cannot read,
so a fresh interpreter cannot be started as that user; the fork keeps what is imported).
"""

from __future__ import annotations

import grp
import logging
import os
import pickle
import pwd
import select
import shutil
import signal
import sqlite3
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from click.testing import CliRunner
from graphs import ConvBiasRelu

from plancache import CacheDirError, PlanCache, Store, StoreError
from plancache.cache.flight import SingleFlight, lock_name
from plancache.cli import cli
from plancache.store import DB_NAME, migrations, recovery
from plancache.testing import CpuTestBackend

T = TypeVar("T")

MALLORY = "plancache-test-mallory"  # the other user, who fills a directory
VICTIM = "plancache-test-victim"  # a user who is not root, and a member of TEAM
TEAM = "plancache-test-team"
SPEC = ConvBiasRelu(n=1)


def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates users and gives files to them (CI runs as root)")


@pytest.fixture(scope="session")
def users() -> dict[str, pwd.struct_passwd]:
    """MALLORY and VICTIM, both members of TEAM, created when missing."""
    _root_only()
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        pytest.skip("needs useradd and groupadd to create the test's users")
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True, capture_output=True)
    for name in (MALLORY, VICTIM):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "--groups", TEAM, name],
                           check=True, capture_output=True)  # fmt: skip
    return {name: pwd.getpwnam(name) for name in (MALLORY, VICTIM)}


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A directory every user can reach (pytest's own are root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="plancache-trust-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _as_user(user: str, run: Callable[[], T]) -> T:
    """``run()`` in a forked child that is ``user`` (its uid, gid and groups), its result
    (or its exception, as text) sent back pickled; a child that has not answered in two
    minutes is killed (it hung)."""
    entry = pwd.getpwnam(user)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            try:
                import torch  # imported already, by the backend

                torch.set_num_threads(1)  # the parent's thread pool did not survive the fork: a first op would wait on it
                os.setgroups(os.getgrouplist(user, entry.pw_gid))
                os.setgid(entry.pw_gid)
                os.setuid(entry.pw_uid)
                payload = pickle.dumps(("ok", run()))
            except BaseException as exc:  # every failure goes back to the test
                payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}"))
            os.write(write, payload)
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(read, 1 << 16) if ready else b""
        if not chunk:
            break
        data += chunk
    os.close(read)
    if not data:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert data, f"as {user}: the child hung or died"
    kind, value = pickle.loads(data)
    assert kind == "ok", f"as {user}: {value}"
    return value  # type: ignore[no-any-return]


def _lookup(directory: Path, spec: Any = SPEC, **env: str) -> dict[str, Any]:
    """One lookup of ``spec`` in ``directory``: where the plan came from, whether a store was
    used, and the warnings said."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("plancache")
    logger.addHandler(handler)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        cache = PlanCache(directory, backend=CpuTestBackend(), auto_prime=False)
        try:
            plan = cache.get(spec.graph())
            return {"source": plan.source, "stored": cache.store is not None, "warnings": said}
        finally:
            cache.close()
    finally:
        logger.removeHandler(handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _filled(directory: Path) -> dict[str, bytes]:
    """``directory`` with SPEC's plan stored (no connection left open); its files' bytes."""
    cache = PlanCache(directory, backend=CpuTestBackend(), auto_prime=False)
    cache.get(SPEC.graph())
    cache.close()
    return _bytes(directory)


def _bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file() and not p.is_symlink()}


def _give(path: Path, user: pwd.struct_passwd, group: int | None = None) -> None:
    for item in [path, *path.rglob("*")]:
        os.chown(item, user.pw_uid, user.pw_gid if group is None else group, follow_symlinks=False)


def _refused(result: dict[str, Any], says: str) -> None:
    assert result["source"] == "built" and not result["stored"], result  # nothing of it was read
    notes = [w for w in result["warnings"] if "not storing plans" in w]
    assert len(notes) == 1 and says in notes[0], result["warnings"]


# ---------------------------------------------------------------------------- ownership


def test_a_directory_another_user_filled_is_refused_even_for_root_and_nothing_is_read(
    users: dict[str, pwd.struct_passwd], public_tmp: Path
) -> None:
    """A 0755 directory of another user, holding a plan, was used read-only (its plan
    served, with one "read-only" warning), to root too."""
    theirs = public_tmp / "theirs"
    before = _filled(theirs)
    _give(theirs, users[MALLORY])
    theirs.chmod(0o755)
    (theirs / DB_NAME).chmod(0o644)
    _refused(_lookup(theirs), f"owned by {MALLORY}, not by root")
    _refused(_as_user(VICTIM, lambda: _lookup(theirs)), f"owned by {MALLORY}, not by {VICTIM}")
    with pytest.raises(CacheDirError, match=f"owned by {MALLORY}"):
        Store(theirs)
    assert _bytes(theirs) == before


def test_a_cache_baked_as_root_is_served_read_only_to_an_unprivileged_user(
    users: dict[str, pwd.struct_passwd], public_tmp: Path
) -> None:
    """A cache that root made while building an image (then `chmod -R a+rX`), used by the image's
    unprivileged user, was refused: "it is owned by root, not by ...". Root can change
    anything a user runs; pip and OpenSSH trust root's files too."""
    baked = public_tmp / "baked"
    before = _filled(baked)
    assert sorted(before) == [DB_NAME]  # no -wal or -shm left behind by the build
    subprocess.run(["chmod", "-R", "a+rX", str(baked)], check=True)  # as docs/prewarm.md's Dockerfile does
    served = _as_user(VICTIM, lambda: _lookup(baked))
    assert (served["source"], served["stored"]) == ("loaded", True)
    assert len(served["warnings"]) == 1 and "is read-only: stored plans are served" in served["warnings"][0]
    assert _bytes(baked) == before


@pytest.mark.parametrize("mode", [0o666, 0o660])
def test_a_plans_db_others_can_write_is_refused_in_the_users_own_directory(cache_dir: Path, mode: int) -> None:
    _root_only()
    before = _filled(cache_dir)
    (cache_dir / DB_NAME).chmod(mode)
    _refused(_lookup(cache_dir), "writable by other users")
    with pytest.raises(
        CacheDirError, match=rf"{DB_NAME}: it is writable by other users \(mode {stat.filemode(mode | stat.S_IFREG)}\)"
    ):
        Store(cache_dir)
    assert _bytes(cache_dir) == before


@pytest.mark.parametrize("side", ["-wal", "-shm"])
def test_a_wal_or_shm_of_another_user_is_refused(users: dict[str, pwd.struct_passwd], cache_dir: Path, side: str) -> None:
    _filled(cache_dir)
    planted = cache_dir / f"{DB_NAME}{side}"
    planted.write_bytes(b"")
    os.chown(planted, users[MALLORY].pw_uid, users[MALLORY].pw_gid)
    planted.chmod(0o600)
    _refused(_lookup(cache_dir), f"{DB_NAME}{side}: it is owned by {MALLORY}")
    assert planted.read_bytes() == b""


def test_a_shared_directory_serves_the_members_of_the_group_it_names_and_no_one_else(
    users: dict[str, pwd.struct_passwd], public_tmp: Path
) -> None:
    """The opt-in names a group: its members may own the files and the group may write
    them; without it, or with a file anyone can write, the directory is refused."""
    shared = public_tmp / "shared"
    _filled(shared)
    team = grp.getgrnam(TEAM).gr_gid
    _give(shared, users[MALLORY], team)
    shared.chmod(0o2770)
    (shared / DB_NAME).chmod(0o660)
    served = _as_user(VICTIM, lambda: _lookup(shared, PLANCACHE_ALLOW_SHARED_DIR=TEAM))
    assert served["source"] == "loaded" and served["stored"], served
    _refused(_as_user(VICTIM, lambda: _lookup(shared)), f"owned by {MALLORY}, not by {VICTIM};")
    _refused(_as_user(VICTIM, lambda: _lookup(shared, PLANCACHE_ALLOW_SHARED_DIR=VICTIM)), f"or a member of group {VICTIM}")
    (shared / DB_NAME).chmod(0o666)
    _refused(_as_user(VICTIM, lambda: _lookup(shared, PLANCACHE_ALLOW_SHARED_DIR=TEAM)), "writable by other users")


def test_members_sharing_a_directory_each_store_plans_the_others_are_served(
    users: dict[str, pwd.struct_passwd], public_tmp: Path
) -> None:
    """What one member of the group made there was that member's alone (0600 under a 077
    umask): the next member could not open the store, nor take a build lock."""
    shared = public_tmp / "team"
    shared.mkdir()
    team = grp.getgrnam(TEAM).gr_gid
    os.chown(shared, users[MALLORY].pw_uid, team)
    shared.chmod(0o2770)  # setgid: what each member creates is the group's
    other = ConvBiasRelu(n=2)
    steps = [(MALLORY, SPEC, "built"), (VICTIM, SPEC, "loaded"), (VICTIM, other, "built"), (MALLORY, other, "loaded")]
    for user, spec, source in steps:
        result = _as_user(user, lambda spec=spec: _lookup(shared, spec, PLANCACHE_ALLOW_SHARED_DIR=TEAM))
        assert (result["source"], result["stored"], result["warnings"]) == (source, True, []), (user, result)
    made = sorted(shared.rglob("*"))  # the build locks' files among them; a warning above said if one failed
    assert {shared / DB_NAME, shared / "locks"} <= set(made), made
    for path in made:
        st = path.lstat()
        assert st.st_gid == team and stat.S_IMODE(st.st_mode) & 0o070 in (0o060, 0o070) and not st.st_mode & 0o007, (
            path, stat.filemode(st.st_mode))  # fmt: skip


def test_a_group_writable_shared_directory_that_is_not_setgid_is_refused_saying_so(
    users: dict[str, pwd.struct_passwd], public_tmp: Path
) -> None:
    shared = public_tmp / "team"
    shared.mkdir()
    os.chown(shared, users[VICTIM].pw_uid, grp.getgrnam(TEAM).gr_gid)
    shared.chmod(0o770)
    _refused(_as_user(VICTIM, lambda: _lookup(shared, PLANCACHE_ALLOW_SHARED_DIR=TEAM)), f"run chmod g+s {shared}")
    assert list(shared.iterdir()) == []


def test_naming_a_group_leaves_a_users_own_directory_private(users: dict[str, pwd.struct_passwd], cache_dir: Path) -> None:
    # A fleet may set the opt-in for every user: their own directories stay theirs alone.
    result = _lookup(cache_dir, PLANCACHE_ALLOW_SHARED_DIR=TEAM)
    assert (result["source"], result["stored"], result["warnings"]) == ("built", True, []), result
    assert {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [cache_dir / DB_NAME, cache_dir / "locks"]} == {
        DB_NAME: 0o600, "locks": 0o700}  # fmt: skip


# ---------------------------------------------------------------------------- links


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-group opt-in"])
def test_a_plans_db_that_is_a_link_is_never_followed(
    users: dict[str, pwd.struct_passwd], public_tmp: Path, shared: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shared-directory opt-in, plancache migrated the SQLite file a link named."""
    target = public_tmp / "other.db"
    conn = sqlite3.connect(target)
    conn.execute("CREATE TABLE notes (text TEXT)")
    conn.close()
    before = target.read_bytes()
    directory = public_tmp / "cache"
    directory.mkdir(mode=0o700)
    (directory / DB_NAME).symlink_to(target)
    if shared:
        os.chown(directory, 0, grp.getgrnam(TEAM).gr_gid)
        directory.chmod(0o770)
        monkeypatch.setenv("PLANCACHE_ALLOW_SHARED_DIR", TEAM)
    with pytest.raises(CacheDirError, match=f"{DB_NAME}: it is a symbolic link"):
        Store(directory)
    _refused(_lookup(directory), "symbolic link")
    assert target.read_bytes() == before and sorted(p.name for p in public_tmp.iterdir()) == ["cache", "other.db"]


def test_a_plans_db_replaced_by_a_link_after_the_open_is_not_opened(cache_dir: Path, tmp_path: Path) -> None:
    """A connection opened later (another thread) refuses the link, even to a sound store
    whose plans it could read (SQLite would follow it)."""
    _filled(cache_dir)
    store = Store(cache_dir)
    target = tmp_path / "other.db"
    shutil.copyfile(cache_dir / DB_NAME, target)
    before = target.read_bytes()
    (cache_dir / DB_NAME).unlink()
    (cache_dir / DB_NAME).symlink_to(target)
    got: list[object] = []

    def read() -> None:
        try:
            got.append(store.keys())
        except (StoreError, sqlite3.Error) as exc:
            got.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    thread.join(timeout=60)
    store.close()
    assert len(got) == 1 and isinstance(got[0], CacheDirError) and "symbolic link" in str(got[0]), got
    assert target.read_bytes() == before


def test_no_lock_file_is_opened_through_a_link_or_used_when_another_user_owns_it(
    users: dict[str, pwd.struct_passwd], cache_dir: Path, tmp_path: Path
) -> None:
    """A build lock that is a link was created (and the file it named) where the link
    pointed; one another user owns was used as ours."""
    locks = cache_dir / "locks"
    locks.mkdir(parents=True, mode=0o700)
    warned: list[str] = []
    flight = SingleFlight(locks, timeout=5, warn=lambda topic, message, *args: warned.append(message % args))
    target = tmp_path / "elsewhere"
    key = "ab" * 32
    (locks / lock_name(key)).symlink_to(target)
    with flight.hold(key, "env"):
        pass
    assert not target.exists() and len(warned) == 1 and "cannot take the build lock" in warned[0]
    (locks / lock_name(key)).unlink()
    theirs = locks / lock_name(key)
    theirs.write_bytes(b"")
    os.chown(theirs, users[MALLORY].pw_uid, users[MALLORY].pw_gid)
    with flight.hold(key, "env"):
        pass
    assert len(warned) == 2 and f"owned by {MALLORY}" in warned[1], warned


def test_the_notes_beside_the_store_are_never_written_or_read_through_a_link_or_a_fifo(cache_dir: Path, tmp_path: Path) -> None:
    """The damage marker was written where a link pointed, and a FIFO in its place hung
    every open; the repair lock was created through a link."""
    store = Store(cache_dir)
    target = tmp_path / "elsewhere"
    marker = cache_dir / f"{DB_NAME}.damaged"
    marker.symlink_to(target)
    store.note_damage(sqlite3.DatabaseError("database disk image is malformed"))
    assert not target.exists()
    marker.unlink()
    os.mkfifo(marker)
    found: list[str | None] = []
    reader = threading.Thread(target=lambda: found.append(recovery.marker_reason(store.path)), daemon=True)
    reader.start()
    reader.join(timeout=20)  # did not hang
    assert found == [None]
    (cache_dir / f"{DB_NAME}.repair.lock").symlink_to(target)
    with pytest.raises(OSError):
        store.repair("a test")
    store.close()
    assert not target.exists()


# ---------------------------------------------------------------------------- the schema


FOREIGN = {
    "trigger": "CREATE TRIGGER swap AFTER INSERT ON plans BEGIN UPDATE plans SET blob = x'00' WHERE key = NEW.key; END",
    "view": "CREATE VIEW mine AS SELECT key FROM plans",
    "table": "CREATE TABLE mine (x)",
    "index": "CREATE INDEX mine ON plans (label)",
}


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_a_foreign_trigger_view_table_or_index_is_refused_and_nothing_is_changed(cache_dir: Path, kind: str) -> None:
    """A trigger someone added to the database swapped the blobs plancache stored."""
    _filled(cache_dir)
    conn = sqlite3.connect(cache_dir / DB_NAME)
    conn.execute(FOREIGN[kind])
    conn.close()
    before = _bytes(cache_dir)
    with pytest.raises(CacheDirError, match=rf"its schema \(version {len(migrations())}\) holds {kind} mine|holds {kind} swap"):
        Store(cache_dir)
    _refused(_lookup(cache_dir), "no migration made")
    assert _bytes(cache_dir) == before


def test_an_older_schema_with_a_foreign_table_is_refused_and_never_migrated(cache_dir: Path) -> None:
    cache_dir.mkdir(mode=0o700)
    conn = sqlite3.connect(cache_dir / DB_NAME, isolation_level=None)
    conn.executescript(migrations()[0][2])
    conn.execute("PRAGMA user_version = 1")
    conn.execute("CREATE TABLE mine (x)")
    conn.close()
    with pytest.raises(CacheDirError, match=r"its schema \(version 1\) holds table mine that no migration made"):
        Store(cache_dir)
    conn = sqlite3.connect(cache_dir / DB_NAME)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 1
    conn.close()


def test_every_connection_trusts_no_function_of_the_schema(cache_dir: Path) -> None:
    store = Store(cache_dir)
    assert store.connection().execute("PRAGMA trusted_schema").fetchone()[0] == 0
    store.close()


# ---------------------------------------------------------------------------- plancache sql


@pytest.mark.parametrize("call", ["load_extension('x')", "load_extension('/tmp/x.so', 'init')", "fts3_tokenizer('simple')",
                                  "sqlite_log(1, 'x')"])  # fmt: skip
def test_sql_calls_no_function_with_side_effects(cache_dir: Path, call: str) -> None:
    _filled(cache_dir)
    result = CliRunner().invoke(cli, ["sql", f"SELECT {call}"])
    name = call.split("(")[0]
    assert result.exit_code == 1, result.output
    assert result.stderr.count("\n") == 1 and f"call {name}()" in result.stderr, result.stderr
    read = CliRunner().invoke(
        cli, ["--json", "sql", "SELECT abs(-2) AS a, datetime(0, 'unixepoch') AS t, count(*) AS n FROM entries"]
    )
    assert read.exit_code == 0, read.output
    assert '"a": 2' in read.stdout and '"n": 1' in read.stdout
