"""One server per database file: ``rota serve`` holds an exclusive ``flock`` on the file
itself, so the lock belongs to the file and not to a name of it.

Why the file itself: a lock file beside ``rota.store.sqlite`` was keyed by a path, and a hard link
(or a bind mount) is another path to the same file: a second server on it took its own
lock and both wrote the file. The kernel keys ``flock`` by the file, so every name of it
(a hard link, a symlink, a path through ``..``, the same file seen from another container)
meets the same lock.

Why SQLite's own locking is not disturbed: SQLite locks the database with POSIX record
locks, which on Linux are a separate kind from ``flock`` and never conflict with it. But
POSIX locks belong to the whole process, and closing *any* descriptor of the file drops
them all, so the descriptor taken here is never closed while the process lives: leaving
the block only unlocks it, and the kernel closes it (and drops the lock) when the process
ends, however it ends (kill -9 too), so a crash never blocks the restart.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from rota.base.errors import DatabaseInUse, DatabaseLinked

# A name that is replaced between our open and our lock (another program's rename) is
# opened again; more than a few such races in a row is not a race but a fight.
OPEN_ATTEMPTS = 5


@contextlib.contextmanager
def hold_database(path: Path) -> Iterator[None]:
    """Hold the one-server lock of the database at ``path`` while the block runs; raise
    ``DatabaseInUse`` (naming the holder's pid when it can be found) if another process,
    or another block, holds it. A file that does not exist yet is created, empty (which
    SQLite takes for an empty database), so that the lock has a file to belong to."""
    fd = _open_locked(path)
    try:
        refuse_linked(path, os.fstat(fd))
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # and the descriptor stays open: see the module


def refuse_linked(path: Path, file: os.stat_result | None = None) -> None:
    """Raise ``DatabaseLinked`` if the SQLite file at ``path`` has more than one name.
    The lock above stops a second server under any name, but ``rota tokens --db`` writes
    beside a running server through SQLite's own locking, which a second name defeats
    (its write-ahead log is another file): so neither opens a file with hard links."""
    if file is None:
        try:
            file = os.stat(path)
        except FileNotFoundError:
            return
    if file.st_nlink > 1:
        raise DatabaseLinked(str(path), file.st_nlink)


def _open_locked(path: Path) -> int:
    """A descriptor of the file at ``path`` with our flock on it, taken after the name
    was checked to still lead to the file we locked."""
    for _ in range(OPEN_ATTEMPTS):
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        # Closing here is safe: SQLite has not opened this file in this process yet.
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = holder(os.fstat(fd))
            os.close(fd)
            raise DatabaseInUse(str(path), pid) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        if now is not None and _same_file(now, os.fstat(fd)):
            return fd
        os.close(fd)  # the name now leads elsewhere: lock what it leads to
    raise OSError(errno.EAGAIN, "it kept being replaced while it was being locked", str(path))


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holder(file: os.stat_result) -> int | None:
    """The pid of the process that holds a flock on ``file``, from /proc/locks (Linux), or
    None where it cannot be told (no /proc, a process in another pid namespace).

    /proc/locks names a file by its file system's device and its inode number. The device
    there is the file system's own, which can differ from ``st_dev`` (btrfs subvolumes,
    overlayfs): a line with the right inode on another device is taken only when that
    process has the file open, as far as /proc lets us see."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    device = f"{os.major(file.st_dev):02x}:{os.minor(file.st_dev):02x}"
    maybe: list[int] = []
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146309 0 EOF" (a waiter's line has "->")
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK" or fields[3] != "WRITE":
            continue
        pid, where = fields[4], fields[5].rsplit(":", 1)
        if not pid.isdigit() or len(where) != 2 or where[1] != str(file.st_ino):
            continue
        if where[0] == device:
            return int(pid)
        maybe.append(int(pid))
    return next((pid for pid in maybe if _has_open(pid, file)), None)


def _has_open(pid: int, file: os.stat_result) -> bool:
    """Whether process ``pid`` has ``file`` open (False where /proc does not let us look)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if _same_file(os.stat(f"/proc/{pid}/fd/{fd}"), file):
                return True
        except OSError:
            continue
    return False
