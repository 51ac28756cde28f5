"""Whether O_DIRECT works in a directory: the probe the engine runs once per directory."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierstore.tiers.raw._syscalls import O_DIRECT, PAGE

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["DirectIOProbe", "probe_direct_io"]


def probe_direct_io(directory: Path) -> DirectIOProbe:
    """Do in ``directory``, on a scratch file, what the engine will do with O_DIRECT.

    The file is opened with O_DIRECT, grown with ``posix_fallocate`` as a spill file is, and
    a page is written and read back. Some filesystems (ramfs) refuse the open; others accept
    it and fail on the first transfer. Where the filesystem has no ``fallocate`` (ext2), glibc
    emulates it by writing a byte into each block, which O_DIRECT refuses (EINVAL): there the
    open and a page of I/O succeed, but the engine could never grow a spill file. A full disk
    (ENOSPC, EDQUOT) cannot tell, and does not count against O_DIRECT.

    Never raises: a directory where the scratch file cannot be made (read-only, a path too
    long) is reported as not supporting O_DIRECT, with the reason. The scratch file is removed.
    """
    if not O_DIRECT:
        return DirectIOProbe(str(directory), False, "this platform has no O_DIRECT")
    path = os.path.join(directory, f".tierstore-probe-{os.getpid()}-{secrets.token_hex(4)}")
    buf = mmap.mmap(-1, PAGE)
    fd = -1
    step = "opening a file with O_DIRECT"
    made = True
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | O_DIRECT, 0o600)
        except FileExistsError:
            made = False  # someone else's file: never remove it
            raise
        step = "growing it with posix_fallocate"
        os.posix_fallocate(fd, 0, 2 * PAGE)
        step = "writing and reading a page"
        view = memoryview(buf)
        try:
            os.pwrite(fd, view, 0)
            os.preadv(fd, [view], 0)
        finally:
            view.release()
    except OSError as e:
        if fd >= 0 and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return DirectIOProbe(str(directory), True, f"ok (no space to test {step})")
        return DirectIOProbe(str(directory), False, f"{step}: {e.strerror} (errno {e.errno})")
    finally:
        if fd >= 0:
            os.close(fd)
        if made:
            # ramfs makes the file before it refuses the flag; a read-only filesystem or a
            # path too long for the kernel never made it, and says so with its own errno.
            with contextlib.suppress(OSError):
                os.unlink(path)
        buf.close()
    return DirectIOProbe(str(directory), True, "ok")


@dataclass(frozen=True, slots=True)
class DirectIOProbe:
    """Whether O_DIRECT works in one directory, as :func:`probe_direct_io` found."""

    directory: str
    """The directory probed."""
    supported: bool
    """An O_DIRECT open, ``posix_fallocate``, page write and page read all succeeded."""
    reason: str
    """Why not (the OS error), or ``"ok"``."""
