"""The files of a cache directory, trusted only when they are its owner's: who may own and
write each, how each is opened (never through a link), and the hardening of every SQLite
connection to the store. Also how a file a user names (a secret, a bundle, a manifest, a
recording) is read: a regular file only, of bounded size.

Plans carry native code, so a file another user could have written is never read: the
directory, ``plans.db`` and its ``-wal``/``-shm``, the build locks and the notes beside the
store must be owned by the effective user or by root, and writable by no one else. Root can
already change anything a user runs, so a cache baked into an image is trusted as pip and
OpenSSH trust root's files; root trusts only root's. A shared cache names its group
(``PLANCACHE_ALLOW_SHARED_DIR``): its files may be owned by any member and group-writable,
never writable by others. What plancache creates is the user's alone (0600, 0700), or in a
directory shared with the group the group's too (0660, 2770): such a directory must be
setgid, so what each member creates is the group's, as the others' checks require.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ..config import MIN_SECRET_BYTES, SECRET_HINT, Refused, file_kind, format_size
from ..errors import CacheDirError

if TYPE_CHECKING:
    from filelock import BaseFileLock

__all__ = ["MAX_SECRET_FILE", "PRIVATE", "SHARED", "Modes", "check_trusted", "create_directory", "create_file", "file_lock", "harden",
           "modes_of", "open_regular", "read_regular", "read_secret_file", "ready_lock_file"]  # fmt: skip


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
    """Why a file of this status is not to be trusted, in words, or None. With ``group``, a
    file of that group may be group-writable and owned by any of its members."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    shared = group is not None and st.st_gid == _group_id(group)
    if st.st_uid not in (os.geteuid(), 0) and not (shared and group is not None and _is_member(st.st_uid, group)):
        members = f" or a member of group {group} (in that group)" if group else ""
        return f"it is owned by {_name(st.st_uid)}, not by {_name(os.geteuid())}{members}"
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and not shared):
        return f"it is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def check_trusted(path: Path, group: str | None, *, follow: bool = False) -> os.stat_result | None:
    """Refuse (``CacheDirError``) a cache file or directory that its owner alone could not have
    written; its status, or None when there is none. ``follow``: the path may be a link (the
    cache directory itself); a file in it never may."""
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


class Modes(NamedTuple):
    """The modes of what plancache creates in a cache directory, and who else may write there."""

    file: int
    directory: int
    group: str | None  # the group whose members' files are trusted (PLANCACHE_ALLOW_SHARED_DIR), or None


PRIVATE = Modes(0o600, 0o700, None)
#: In a directory shared with ``group``; setgid, as its own must be: what is created there is the group's.
SHARED = Modes(0o660, 0o2770, None)


def modes_of(directory: Path, st: os.stat_result | None, group: str | None) -> Modes:
    """How files are made in the trusted ``directory`` of status ``st``: private, unless it is
    ``group``'s and writable by it, when it must be setgid (``CacheDirError`` otherwise: each
    member's files would be that member's own group's, refused by the others)."""
    if group is None:
        return PRIVATE
    if st is None or st.st_gid != _group_id(group) or not st.st_mode & stat.S_IWGRP:  # the user's own directory
        return PRIVATE._replace(group=group)
    if not st.st_mode & stat.S_ISGID:
        raise CacheDirError(
            f"plancache cannot share {directory} with group {group}: it is not setgid, so what each member creates there "
            f"would belong to that member's own group, which the others do not trust; run chmod g+s {directory}",
            path=str(directory),
        )
    return SHARED._replace(group=group)


class _NotRegular(OSError):
    """What ``open_regular`` raises for a file that is there but not a regular one."""


def open_regular(path: str | os.PathLike[str], flags: int, mode: int = 0o600, *,
                 follow: bool = False) -> tuple[int, os.stat_result]:  # fmt: skip
    """``os.open`` of a regular file beside the store: the descriptor and its ``fstat``, so the
    caller judges the file it uses, however the path changes. ``O_NOFOLLOW`` (unless
    ``follow``): a link is ``OSError`` (ELOOP). ``O_NONBLOCK``: a FIFO with no writer does not
    hang the open; it and any other non-regular file is ``OSError`` (EINVAL) naming it."""
    fd = os.open(path, flags | (0 if follow else os.O_NOFOLLOW) | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _NotRegular(errno.EINVAL, f"is {file_kind(status.st_mode)}, not a regular file", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def read_regular(path: str | os.PathLike[str], limit: int, *, follow: bool = False) -> tuple[bytes, int]:
    """The bytes and mode of the regular file a user names at ``path`` (a secret, a bundle, a
    recording). ``Refused`` says why not: a link (unless ``follow``), a FIFO, a device, a
    directory, or over ``limit`` bytes; ``OSError`` when it cannot be opened."""
    try:
        fd, status = open_regular(path, os.O_RDONLY, follow=follow)
    except _NotRegular as exc:
        raise Refused(str(exc.strerror)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("is a symbolic link: plancache reads no file through a link here; name the file itself") from None
        raise
    try:
        with open(fd, "rb", closefd=False) as file:
            data = file.read(limit + 1) if status.st_size <= limit else None  # limit + 1: one that grew since fstat too
    finally:
        os.close(fd)
    if data is None or len(data) > limit:
        raise Refused(f"is larger than {format_size(limit)}, the most plancache reads of such a file")
    return data, stat.S_IMODE(status.st_mode)


#: A secret is a line of text; a file far larger is not a secret file, and is never read whole.
MAX_SECRET_FILE = 64 << 10


def read_secret_file(path: Path) -> bytes:
    """The secret in the file at ``path`` (``PLANCACHE_REDIS_SECRET_FILE``), without its line
    end; ``Refused`` saying why not. Read through a link: secrets are mounted as links (a
    Kubernetes secret volume), and a link cannot make a secret of what is not one."""
    try:
        secret = read_regular(path, MAX_SECRET_FILE, follow=True)[0].rstrip(b"\r\n")
    except OSError as exc:
        raise Refused(f"cannot be read: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise Refused(f"holds {len(secret)} byte{'s' if len(secret) != 1 else ''}: {SECRET_HINT}")
    return secret


def create_file(path: Path, modes: Modes) -> None:
    """Create the empty file ``path`` with ``modes.file`` if there is none, never through a link
    (SQLite gives ``-wal`` and ``-shm`` the database file's mode)."""
    try:
        fd, _ = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, modes.file)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, modes.file)  # exactly: the process's umask would take a shared store's group write away
    finally:
        os.close(fd)


def create_directory(path: Path, modes: Modes) -> None:
    """Create the directory ``path`` with ``modes.directory`` if there is none."""
    try:
        path.mkdir(mode=modes.directory)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, modes.directory)  # mkdir's mode loses the group's write to the umask
    finally:
        os.close(fd)


def file_lock(path: Path, modes: Modes = PRIVATE, then: Callable[[int], None] | None = None) -> BaseFileLock:
    """filelock's ``FileLock`` on ``path``, a lock file beside the store, never removed (a
    process could lock a removed file while another creates a new one). Made here first
    (``create_file``), refused (``CacheDirError``) when a link or not trusted, both before
    filelock opens it and on the descriptor it locked, which must be a regular file.
    ``then(fd)`` runs on that descriptor once locked (filelock's ``on_acquired``)."""
    from filelock import FileLock  # on a miss only: plancache's import stays cheap

    ready_lock_file(path, modes)

    def claim(fd: int) -> None:  # raising lets the lock go again (filelock's on_acquired)
        status = os.fstat(fd)
        why = _distrust(status, modes.group) if stat.S_ISREG(status.st_mode) else "it is not a regular file"
        if why is not None:
            raise CacheDirError(f"plancache does not trust lock file {path}: {why}", path=str(path))
        if then is not None:
            then(fd)

    # preserve_lock_file: filelock promises never to remove it (no soft fallback, which would).
    return FileLock(path, mode=modes.file, preserve_lock_file=True, on_acquired=claim)


def ready_lock_file(path: Path, modes: Modes) -> None:
    """What ``file_lock`` does before filelock opens ``path``: refuse a link or an untrusted
    file, else make it if missing. A lock kept for later acquisitions (filelock opens the
    file again at each) is checked again before each."""
    check_trusted(path, modes.group)
    create_file(path, modes)


def harden(conn: sqlite3.Connection) -> None:
    """What every connection to a store sets before it reads: no function with side effects
    runs from the schema (``trusted_schema``), and SQLite's defensive mode (no writing the
    schema by hand) where ``Connection.setconfig`` offers it (Python 3.12+); on 3.11
    ``schema.migrate`` refuses a foreign schema all the same."""
    conn.execute("PRAGMA trusted_schema = OFF")
    if hasattr(conn, "setconfig") and hasattr(sqlite3, "SQLITE_DBCONFIG_DEFENSIVE"):
        conn.setconfig(sqlite3.SQLITE_DBCONFIG_DEFENSIVE, True)
