"""Private per-process spill directories, and removal of the ones crashed processes left.

Note: [Liveness by flock]
    Each spill directory holds a ``.lock`` file that its process keeps locked with ``flock``
    for its whole life. The kernel drops the lock when the process dies, SIGKILL included, so
    a directory whose lock can be taken belongs to nobody and is removed. Unlike a PID check
    this survives PID reuse and PID namespaces (containers sharing one disk).

Note: [Starts and sweeps take turns]
    Between ``mkdir`` of a new spill directory and the ``flock`` of its ``.lock`` there is a
    moment when the directory exists but nobody holds its lock. Another process's start-up
    sweep that looked then would take it for a dead process's directory and remove it under
    the starting store (about one start in 300 when several processes started in one
    directory at once). So both take a ``flock`` on the parent directory itself: a start
    holds it shared from ``mkdir`` until its lock is held, a sweep holds it exclusive. Starts
    run side by side; a sweep that finds a start under way skips this time, rather than
    delaying it (the next start sweeps). Where the parent cannot be opened or locked (no read
    permission, a filesystem without ``flock`` on directories), a sweep could not list it
    either, or both go ahead as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from tierstore import _registry
from tierstore._fork_safe_lock import ForkSafeLock
from tierstore._inherited import Identity, close_copies, identity_of
from tierstore._libc import libc_function
from tierstore.errors import ConfigError

__all__ = [
    "PREFIX",
    "SpillDirectory",
    "check_parent",
    "in_ram_message",
    "mount_of",
    "ram_filesystem",
    "sweep_stale",
    "warn_if_in_ram",
]

log = logging.getLogger("tierstore")

PREFIX = "tierstore-"
_OUR_NAME = re.compile(re.escape(PREFIX) + r"(\d{1,10})-[0-9a-f]{8}")
"""The name of a spill directory: the prefix, the creating process's PID, 8 random hex digits."""
_LOCK = ".lock"
_NAME_ATTEMPTS = 16
# The setting under both its names: either the argument or the variable may have set it.
_VAR = "disk_dir/TIERSTORE_DISK_DIR"
# The longest spill directory name: the prefix, a PID (at most 7 digits: PID_MAX_LIMIT is
# 4194304), a dash and 8 hex digits.
_DIR_NAME_MAX = len(PREFIX) + 7 + 1 + 8
# Room kept for the longest path an engine makes inside a spill directory: the O_DIRECT probe's
# scratch file is 33 characters, a zarr chunk of an 8-dimensional tensor about 60.
_INSIDE_MAX = 128


def check_parent(parent: Path) -> None:
    """Check that ``parent`` can hold spill directories.

    Raises:
        ConfigError: it does not exist, is not a directory, is not writable (or on a read-only
            filesystem), or its path is so long that the files inside a spill directory would
            pass the kernel's limit on a path (``PATH_MAX``, 4096 bytes on Linux).
    """
    try:
        st = os.stat(parent)
    except FileNotFoundError:
        raise ConfigError(
            f"{_VAR}={str(parent)!r}: does not exist; create it or point elsewhere"
        ) from None
    except OSError as exc:
        # An ancestor this user may not search (EACCES), a file in the path (ENOTDIR), ...
        raise ConfigError(
            f"{_VAR}={str(parent)!r}: cannot be accessed ({exc.strerror}); choose a directory "
            "this user can reach"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            f"{_VAR}={str(parent)!r}: is not a directory; point it at a directory (several "
            f"separated by {os.pathsep!r} are striped)"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        if _read_only(parent):
            raise ConfigError(
                f"{_VAR}={str(parent)!r}: is on a read-only filesystem; choose a writable directory"
            )
        raise ConfigError(
            f"{_VAR}={str(parent)!r}: is not writable by this user; choose a directory you own"
        )
    limit = _path_max(parent)
    longest = len(os.fsencode(parent)) + 1 + _DIR_NAME_MAX + 1 + _INSIDE_MAX
    if longest >= limit:
        raise ConfigError(
            f"{_VAR}={str(parent)!r}: its path is {len(os.fsencode(parent))} bytes long, and "
            f"the spill files inside would pass the system's limit of {limit - 1} bytes per "
            f"path; choose a directory whose path is at most "
            f"{limit - 1 - (longest - len(os.fsencode(parent)))} bytes long"
        )


# statfs(2) f_type of the filesystems that keep their files in memory.
_RAM_MAGIC = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
_RAM_NAMES = frozenset(_RAM_MAGIC.values())
_statfs = libc_function("statfs", [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int)


def _fs_magic(path: Path) -> int | None:
    """statfs(2)'s ``f_type`` of ``path``'s filesystem, or None where it cannot be read."""
    if _statfs is None:
        return None
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _statfs(os.fsencode(path), buf) != 0:
        return None
    # f_type is the struct's first field, a machine word on every Linux but s390x (32 bits).
    return ctypes.c_ulong.from_buffer(buf).value & 0xFFFFFFFF


def mount_of(path: Path) -> tuple[str, str] | None:
    """The mount point and filesystem type of the mount deepest above ``path``, from
    /proc/self/mountinfo, or None where that cannot be read or nothing matches."""
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                ours, _, theirs = line.partition(" - ")
                fields = ours.split()
                if len(fields) < 5 or not theirs:
                    continue
                # Mount points escape space, tab, newline and backslash as octal.
                mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and (best is None or len(mount) >= len(best[0])):
                    best = (mount, theirs.split()[0])
    except OSError:
        return None
    return best


def _fs_name(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (see :func:`mount_of`)."""
    found = mount_of(path)
    return None if found is None else found[1]


def ram_filesystem(path: Path) -> str | None:
    """``"tmpfs"`` or ``"ramfs"`` when ``path`` is on a filesystem that keeps its files in
    memory, else None (also when it cannot be told)."""
    magic = _fs_magic(path)
    if magic is not None:
        return _RAM_MAGIC.get(magic)
    name = _fs_name(path)
    return name if name in _RAM_NAMES else None


def in_ram_message(parent: Path, filesystem: str) -> str:
    """What to say about a spill directory on a filesystem in memory."""
    return (
        f"{_VAR} {str(parent)!r} is on {filesystem}, which keeps its files in memory: "
        "spilling there puts the disk tier back into RAM. Point TIERSTORE_DISK_DIR at a "
        "directory on a disk (/var/tmp usually is)"
    )


_warned_in_ram: set[str] = set()
_warned_lock = ForkSafeLock()


def warn_if_in_ram(parent: Path) -> str | None:
    """Log a warning, once per directory and process, if ``parent`` is on tmpfs or ramfs;
    return the filesystem's name (each time) or None."""
    filesystem = ram_filesystem(parent)
    if filesystem is None:
        return None
    # Resolved before the lock: a fork while another thread held it across the syscalls
    # left the lock held in the child, whose first store then waited for ever.
    real = os.path.realpath(parent)
    with _warned_lock:
        first = real not in _warned_in_ram
        _warned_in_ram.add(real)
    if first:
        log.warning("tierstore: %s. (warned once)", in_ram_message(parent, filesystem))
    return filesystem


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _path_max(path: Path) -> int:
    try:
        return os.pathconf(path, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 4096


# Note: [Locks across fork]
#     A flock belongs to the open file, which fork shares with the child: a child that inherits
#     a descriptor through which the parent holds a lock keeps the lock alive after the parent
#     lets go, until the child closes its copy. A child forked while another thread held the
#     parent directory's lock (a start or a sweep under way) would then block the parent's
#     later starts, and its own store, starting at its first call, would wait for itself
#     forever. So those short-lived descriptors are opened and closed under _held_lock, which
#     fork waits for, and the child closes its copies at once.
_held_lock = threading.Lock()
_held: set[int] = set()


def _open_held(path: Path, flags: int) -> int:
    with _held_lock:
        fd = os.open(path, flags | os.O_CLOEXEC)
        _held.add(fd)
        return fd


def _close_held(fd: int) -> None:
    with _held_lock:
        _held.discard(fd)
        os.close(fd)


def _close_held_in_child() -> None:
    for fd in _held:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _held_lock.release()


os.register_at_fork(
    before=_held_lock.acquire,
    after_in_parent=_held_lock.release,
    after_in_child=_close_held_in_child,
)


@contextlib.contextmanager
def _parent_locked(parent: Path, *, sweep: bool) -> Iterator[bool]:
    """Hold the parent directory's ``flock``; see Note: [Starts and sweeps take turns].

    A start (``sweep=False``) waits for a shared lock; a sweep asks for an exclusive lock
    without waiting. Yields whether the caller may go ahead: False only for a sweep while a
    start is under way.
    """
    try:
        fd = _open_held(parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if sweep else fcntl.LOCK_SH)
        except OSError as exc:
            yield not (sweep and exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN))
        else:
            yield True
    finally:
        _close_held(fd)  # drops the lock (Note: [Locks across fork])


class SpillDirectory:
    """A private directory (mode 0700) for this process's spill files, locked while alive."""

    def __init__(self, parent: Path) -> None:
        """Create the directory and take its lock.

        Raises:
            ConfigError: ``parent`` is unusable (see :func:`check_parent`), or the directory
                cannot be made there (no space or inodes left, ...); nothing is left behind.
        """
        check_parent(parent)
        self._lock_fd: int | None = None
        self._lock_identity: Identity | None = None
        self._gone = False
        with _parent_locked(parent, sweep=False):
            # mkdir fails if the name exists, so a pre-created directory or symlink is never
            # used; a taken name (planted by someone guessing it, or a PID reused after a
            # crash) just costs another random name.
            for attempt in range(_NAME_ATTEMPTS):
                self.path = parent / f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                try:
                    os.mkdir(self.path, 0o700)
                    # What /proc/self/fd names its files by (Note: [Descriptors across fork]).
                    self.real_path = Path(os.path.realpath(self.path))
                    break
                except FileExistsError as exc:
                    if attempt == _NAME_ATTEMPTS - 1:
                        raise self._cannot_create(parent, exc) from None
                except OSError as exc:
                    raise self._cannot_create(parent, exc) from None
            _registry.track(self)  # from now on, exit and SIGTERM remove it
            try:
                os.chmod(self.path, 0o700)
                # Under the fork lock, so that a child forked now knows the descriptor and
                # forget() closes its copy (Note: [Locks across fork]).
                with _held_lock:
                    self._lock_fd = os.open(
                        self.path / _LOCK,
                        os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                    )
                    self._lock_identity = identity_of(self._lock_fd)
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BaseException as exc:
                self._unlock()
                shutil.rmtree(self.path, ignore_errors=True)
                if isinstance(exc, OSError):
                    raise self._cannot_create(parent, exc) from None
                raise

    def _cannot_create(self, parent: Path, exc: OSError) -> ConfigError:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        # Root passes the permission check before (os.access), and meets a read-only or
        # root-squashed mount only here.
        what = "free space there" if full else "make it writable for this process"
        return ConfigError(
            f"{_VAR}={str(parent)!r}: cannot create the spill directory {self.path.name!r} there "
            f"({exc.strerror}); {what} or choose another directory"
        )

    def remove(self) -> None:
        """Delete the directory and everything in it; safe to call twice."""
        # An I/O thread may still create a file while rmtree runs (a store dropped or killed
        # mid-spill); a few passes outrun it.
        for _ in range(20):
            shutil.rmtree(self.path, ignore_errors=True)
            if not os.path.lexists(self.path):
                break
        self._unlock()

    def _unlock(self) -> None:
        """Close the lock's descriptor (this process's own), then stop tracking the
        directory: a child forked during the close still finds both (Note: [Descriptors
        across fork])."""
        fd = self._lock_fd
        try:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        finally:
            self._lock_fd = None
            self._gone = True  # its identities may name other files from now on
            _registry.untrack(self)

    def forget(self) -> None:
        """In a forked child: drop the parent's lock without deleting anything; once.

        The registry's at-fork hook closes the child's copies of every file inside the
        parent's directories in one pass (Note: [Descriptors across fork] in
        ``_inherited.py``); the lock's recorded number is closed too if it still refers to
        the lock file (the parent may have closed it, and reused the number, at the fork).
        Once the parent removed the directory, nothing: its identity may name another file.
        """
        if self._gone:
            return
        self._gone = True
        _registry.untrack(self)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None and self._lock_identity is not None:
            close_copies(self._lock_identity, [fd])


def sweep_stale(parent: Path) -> list[Path]:
    """Remove spill directories under ``parent`` whose process is gone; return what was removed.

    Only directories owned by this user and named like ours are touched; a live process's
    directory is locked and left alone (see Note: [Liveness by flock]), and so is one a
    process is creating (Note: [Starts and sweeps take turns]).
    """
    with _parent_locked(parent, sweep=True) as may_sweep:
        if not may_sweep:
            log.debug("tierstore: a store is starting in %s; not sweeping it this time", parent)
            return []
        return _sweep(parent)


def _sweep(parent: Path) -> list[Path]:
    removed: list[Path] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        # Exactly the names this module makes, private as it makes them: a directory of the
        # user's own that merely starts with the prefix ("tierstore-results") is never touched.
        if not _OUR_NAME.fullmatch(name):
            continue
        path = parent / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
            continue
        if _is_abandoned(path):
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
                log.info("tierstore: removed spill directory %s left by a dead process", path)
    return removed


def _is_abandoned(path: Path) -> bool:
    try:
        fd = _open_lock_file(path / _LOCK)
    except FileNotFoundError:
        # Killed between mkdir and creating the lock: fall back to the PID in the name.
        return not _pid_alive(path.name)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            log.warning(
                "tierstore: cannot tell whether %s is abandoned (%s); leaving it", path, exc
            )
        return False
    else:
        return True
    finally:
        _close_held(fd)


def _open_lock_file(path: Path) -> int:
    """Open a spill directory's lock file to test it with an exclusive ``flock``.

    Read-write where it can: over NFS, Linux emulates ``flock`` with ``fcntl`` byte-range
    locks, and an exclusive one needs a descriptor open for writing (EBADF otherwise), so a
    sweep there never found a dead process's directory. Read-only where writing is refused (a
    read-only mount, another owner's file), as before.
    """
    try:
        return _open_held(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    return _open_held(path, os.O_RDONLY | os.O_NOFOLLOW)


def _pid_alive(name: str) -> bool:
    match = _OUR_NAME.fullmatch(name)
    if match is None:
        return True
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
