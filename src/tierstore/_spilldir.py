"""Private per-process spill directories, and removal of the ones crashed processes left.

Note: [Liveness by flock]
    Each spill directory holds a ``.lock`` file that its process keeps locked with ``flock``
    for its whole life. The kernel drops the lock when the process dies, SIGKILL included, so
    a directory whose lock can be taken belongs to nobody and is removed. Unlike a PID check
    this survives PID reuse and PID namespaces (containers sharing one disk).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from tierstore import _registry
from tierstore.errors import ConfigError

__all__ = ["PREFIX", "SpillDirectory", "check_parent", "sweep_stale"]

log = logging.getLogger("tierstore")

PREFIX = "tierstore-"
_LOCK = ".lock"
_NAME_ATTEMPTS = 16


def check_parent(parent: Path) -> None:
    """Check that ``parent`` can hold spill directories.

    Raises:
        ConfigError: it does not exist, is not a directory, or is not writable.
    """
    var = "TIERSTORE_DISK_DIR"
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise ConfigError(
            f"{var}={str(parent)!r}: does not exist; create it or point elsewhere"
        ) from None
    except OSError as exc:
        # An ancestor this user may not search (EACCES), a file in the path (ENOTDIR), ...
        raise ConfigError(
            f"{var}={str(parent)!r}: cannot be accessed ({exc.strerror}); choose a directory "
            "this user can reach"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{var}={str(parent)!r}: is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{var}={str(parent)!r}: is not writable by this user; choose a directory you own"
        )


class SpillDirectory:
    """A private directory (mode 0700) for this process's spill files, locked while alive."""

    def __init__(self, parent: Path) -> None:
        check_parent(parent)
        # mkdir fails if the name exists, so a pre-created directory or symlink is never
        # used; a taken name (planted by someone guessing it, or a PID reused after a crash)
        # just costs another random name.
        for attempt in range(_NAME_ATTEMPTS):
            self.path = parent / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
            try:
                os.mkdir(self.path, 0o700)
                break
            except FileExistsError:
                if attempt == _NAME_ATTEMPTS - 1:
                    raise
        os.chmod(self.path, 0o700)
        self._lock_fd: int | None = os.open(
            self.path / _LOCK, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600
        )
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _registry.track(self)

    def remove(self) -> None:
        """Delete the directory and everything in it; safe to call twice."""
        # An I/O thread may still create a file while rmtree runs (a store dropped or killed
        # mid-spill); a few passes outrun it.
        for _ in range(20):
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.lexists(self.path):
                break
        self.forget()

    def forget(self) -> None:
        """Drop the lock without deleting (a forked child must not keep its parent's lock)."""
        _registry.untrack(self)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None


def sweep_stale(parent: Path) -> list[Path]:
    """Remove spill directories under ``parent`` whose process is gone; return what was removed.

    Only directories owned by this user and named like ours are touched; a live process's
    directory is locked and left alone (see Note: [Liveness by flock]).
    """
    removed: list[Path] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        path = parent / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
            continue
        if _is_abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                log.info("tierstore: removed spill directory %s left by a dead process", path)
    return removed


def _is_abandoned(path: Path) -> bool:
    try:
        fd = os.open(path / _LOCK, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        # Killed between mkdir and creating the lock: fall back to the PID in the name.
        return not _pid_alive(path.name)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    else:
        return True
    finally:
        os.close(fd)


def _pid_alive(name: str) -> bool:
    try:
        pid = int(name[len(PREFIX) :].split("-", 1)[0])
    except ValueError:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
