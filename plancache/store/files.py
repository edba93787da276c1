"""The files of a cache directory, trusted only when they are its owner's: who may own and
write each one, how each is opened (never through a link), and the hardening of every
SQLite connection to the store.

Plans carry native code, so a file that another user could have written is never read:
the directory, ``plans.db`` and its ``-wal``/``-shm``, the build locks and the notes beside
the store must be owned by the effective user (root included: root's store must be root's)
and writable by no one else. A shared cache names its group (``PLANCACHE_ALLOW_SHARED_DIR``):
its files may then be owned by any member of that group and be group-writable, never
writable by others.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import sqlite3
import stat
import time
from pathlib import Path

from ..config import open_regular
from ..errors import CacheDirError

__all__ = ["check_trusted", "harden", "lock_file"]

_POLL_S = (0.005, 0.25)  # first and longest sleep between tries of a held file lock


def _group_id(group: str) -> int | None:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:  # removed since the setting was read
        return None


def _is_member(uid: int, group: str) -> bool:
    """Whether ``uid`` belongs to ``group``, by its primary group or the group's member list."""
    try:
        entry, user = grp.getgrnam(group), pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_gid == entry.gr_gid or user.pw_name in entry.gr_mem


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _distrust(st: os.stat_result, group: str | None) -> str | None:
    """Why a file of this status is not to be trusted, in words; None when it is. With
    ``group``, a file of that group may be group-writable and owned by any of its members."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    shared = group is not None and st.st_gid == _group_id(group)
    if st.st_uid != os.geteuid() and not (shared and group is not None and _is_member(st.st_uid, group)):
        members = f" or a member of group {group} (in that group)" if group else ""
        return f"it is owned by {_name(st.st_uid)}, not by {_name(os.geteuid())}{members}"
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not shared):
        return f"it is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def check_trusted(path: Path, group: str | None, *, follow: bool = False) -> os.stat_result | None:
    """Refuse (``CacheDirError``) a cache file or directory that its owner alone could not
    have written; its status when trusted, None when there is none. ``follow``: the path
    may be a link (the cache directory itself); a file in it never may."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    why = _distrust(st, group)
    if why is None:
        return st
    fix = ("set PLANCACHE_ALLOW_SHARED_DIR=<group> if that group's members are trusted" if group is None
           else f"make it group {group}'s and writable by no one outside that group")  # fmt: skip
    raise CacheDirError(
        f"plancache does not trust {path}: {why}; plans hold native code, so nothing there is read. Use a directory of your "
        f"own (--dir, PLANCACHE_DIR), or {fix}",
        path=str(path),
    )


def lock_file(path: Path, deadline: float) -> tuple[int, bool]:
    """Open (never through a link) and ``flock`` ``path`` before ``deadline`` (``time.monotonic``):
    ``(fd, waited)``; ``TimeoutError`` past it, ``CacheDirError`` for a file another user
    owns or can write. The lock holds only while ``path`` still names the locked file: a
    holder may remove it when done, and a waiter then retries on the current one."""
    waited = False
    pause = _POLL_S[0]
    while True:
        fd, status = open_regular(path, os.O_RDWR | os.O_CREAT)
        try:
            why = _distrust(status, None)
            if why is not None:
                raise CacheDirError(f"plancache does not trust lock file {path}: {why}", path=str(path))
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, CacheDirError) or exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            waited = True
            if time.monotonic() >= deadline:
                raise TimeoutError(str(path)) from exc
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _POLL_S[1])
            continue
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            return fd, waited
        os.close(fd)  # its holder removed it after building: lock the file there now
        waited = True


def harden(conn: sqlite3.Connection) -> None:
    """What every connection to a store sets before it reads: no function with side effects
    runs from the schema (``trusted_schema``), and, where the sqlite3 module offers it
    (``Connection.setconfig``, Python 3.12+), SQLite's defensive mode, which forbids writing
    the schema by hand. On Python 3.11 defensive mode is not reachable; the schema check at
    open (``schema.Schema``) refuses a foreign schema all the same."""
    conn.execute("PRAGMA trusted_schema = OFF")
    if hasattr(conn, "setconfig") and hasattr(sqlite3, "SQLITE_DBCONFIG_DEFENSIVE"):
        conn.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
