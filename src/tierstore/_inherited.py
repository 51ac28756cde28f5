"""Closing, in a forked child, the descriptors it inherited of one file.

Note: [Descriptors across fork]
    A forked child closes its copies of its parent's spill files and lock files, whose space
    and locks stay the parent's. By number, that failed both ways when the fork came while
    another thread of the parent was opening or closing one (``os.open`` and ``os.close`` let
    other threads run): a number not yet recorded, or recorded as closed before it was, stayed
    open in the child, holding the parent's file (its space allocated, its lock alive) until
    the child exited; and a number the parent had closed and reused since (the pipe a data
    loader makes just before it forks a worker) was closed under the child, whose start then
    failed with EBADF. So the child closes descriptors by what they point to: every one whose
    device and inode are still the file's, and every one of a file inside a private spill
    directory of the parent's (by its real path, as ``/proc/self/fd`` shows it: a spill
    parent reached through a symlink matched nothing), which also catches a spill file being
    created at the fork, before any object recorded it. One pass over the child's
    descriptors serves every directory (18 ms a fork with 8 stores and 1000 descriptors; a
    pass per directory and per file took 107). An identity is dropped with its file: the
    filesystem gives the inode to the next file made. No lock is involved: one that fork
    waited for lost a Ctrl-C pressed meanwhile and could hang the child.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

__all__ = ["Identity", "close_copies", "close_inside", "identity_of"]

Identity = tuple[int, int]
"""A file's device and inode."""


def identity_of(fd: int) -> Identity:
    """The device and inode of the file ``fd`` refers to.

    Raises:
        OSError: ``fd`` is not open.
    """
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_numbers() -> list[int] | None:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return None


def close_inside(directories: Iterable[Path]) -> None:
    """Close every descriptor of this process of a file inside one of ``directories``, given
    as real paths (symlinks resolved), in one pass over ``/proc/self/fd`` (errors ignored;
    nothing where it cannot be listed)."""
    prefixes = tuple(f"{d}{os.sep}" for d in directories)
    if not prefixes:
        return
    for fd in _open_numbers() or ():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefixes):
            with contextlib.suppress(OSError):
                os.close(fd)


def close_copies(identity: Identity, known: Iterable[int]) -> None:
    """Close those of the descriptors ``known`` that still refer to the file ``identity``
    (errors ignored): a number closed and reused meanwhile names another file."""
    for fd in known:
        try:
            if identity_of(fd) != identity:
                continue
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        with contextlib.suppress(OSError):
            os.close(fd)
