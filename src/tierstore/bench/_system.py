"""What the benchmark needs from the machine: the raw disk limit, page-cache control, facts."""

from __future__ import annotations

import errno
import itertools
import json
import mmap
import os
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tierstore._spilldir import mount_of

__all__ = [
    "PageCache",
    "RawLimit",
    "cached_bytes",
    "filesystem_of",
    "machine_facts",
    "measure_raw_limit",
]

MiB = 1 << 20


def cached_bytes() -> int:
    """``Cached`` from /proc/meminfo, in bytes (the page cache, shared memory included)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) * 1024
    return 0


def filesystem_of(path: Path) -> str:
    """The filesystem type and mount point holding ``path``, as ``"ext4 on /"``."""
    found = mount_of(path)
    return "? on ?" if found is None else f"{found[1]} on {found[0]}"


class PageCache:
    """Evicts files the buffered paths wrote, so their reads come from the disk.

    As root, ``/proc/sys/vm/drop_caches`` drops the whole clean page cache after a ``sync``;
    otherwise each file gets ``posix_fadvise(DONTNEED)`` after its write-back (clean pages
    only, which is why the writes are written back first).
    """

    def __init__(self) -> None:
        self.drop_caches = os.geteuid() == 0 and os.access("/proc/sys/vm/drop_caches", os.W_OK)

    @property
    def method(self) -> str:
        if self.drop_caches:
            return (
                "buffered paths: write back each file (sync_file_range), then sync + "
                "/proc/sys/vm/drop_caches"
            )
        return (
            "buffered paths: write back each file (sync_file_range), then "
            "posix_fadvise(DONTNEED) on each"
        )

    def evict(self, paths: list[Path]) -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        if self.drop_caches:
            os.sync()
            try:
                with open("/proc/sys/vm/drop_caches", "w") as f:
                    f.write("1\n")
            except OSError:
                self.drop_caches = False


@dataclass(frozen=True, slots=True)
class RawLimit:
    """One measurement of what the disk does with O_DIRECT, without tierstore."""

    tool: str
    """The command that measured it."""
    write_gbps: float
    """Sequential O_DIRECT writes into a new file, GB/s (10**9 bytes per second)."""
    overwrite_gbps: float
    """The same writes again over the file just written: the limit for steady-state spilling
    (Note: [First spill and steady state])."""
    read_gbps: float
    """Sequential O_DIRECT reads, GB/s."""
    write_cpu_s_per_gb: float = float("nan")
    """CPU seconds the tool spent per GB written (user + system)."""
    read_cpu_s_per_gb: float = float("nan")
    """CPU seconds the tool spent per GB read (user + system)."""


def _fio(path: Path, nbytes: int, rw: str, engine: str) -> tuple[float, float]:
    """(GB/s, CPU seconds per GB) of one fio run."""
    cmd = [
        "fio",
        "--name=rawlimit",
        f"--filename={path}",
        f"--size={nbytes}",
        "--bs=1M",
        "--iodepth=16",
        f"--ioengine={engine}",
        "--direct=1",
        f"--rw={rw}",
        "--output-format=json",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    job = json.loads(done.stdout[done.stdout.index("{") :])["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio {engine}: error {job['error']}")
    # usr_cpu and sys_cpu are percentages of one CPU over the job's run time.
    cpu_s = (float(job["usr_cpu"]) + float(job["sys_cpu"])) / 100 * float(job["job_runtime"]) / 1e3
    return float(job[rw]["bw_bytes"]) / 1e9, cpu_s / (nbytes / 1e9)


_SOURCE_MAX_BYTES = 1 << 30
"""The most random bytes a :func:`direct_io` write draws; a longer write cycles through them."""

_PASSES = itertools.count(1)
"""Seeds the random bytes of each :func:`direct_io` write: no two passes write the same."""


def direct_io(path: Path, nbytes: int, rw: str, block: int = MiB) -> tuple[float, float]:
    """(GB/s, CPU seconds per GB) of ``block``-byte O_DIRECT requests on ``path``, one in
    flight, as ``dd oflag=direct`` or ``iflag=direct`` makes them.

    Note: [The disk's limit is measured with real bytes]
        A write sends random bytes, new for every call (an overwrite is not the bytes
        already there) and drawn before the clock starts, as many as it writes up to
        :data:`_SOURCE_MAX_BYTES`: no page repeats, as none repeats in the tensors the
        paths write (Note: [Every page differs]), so a disk that deduplicates, compresses
        or skips zeros gains nothing the paths do not. dd's ``if=/dev/zero`` wrote zeros,
        which such a disk may take faster than data: a review measured zeros 1.25x (new
        file) and 1.4x (overwriting) as fast on this VM one afternoon; a rerun the same
        evening found no such gap (zeros 1.90 and 2.55 GB/s, random 2.12 and 2.85). dd
        also clears each block from ``/dev/zero`` between its writes, in the time it
        measures; this loop does not (3.56 against dd's 3.12 GB/s overwriting, same run).
        The loop's CPU is this thread's (the system calls' kernel time included).

    Raises:
        OSError: ``path``'s filesystem refuses O_DIRECT, or a request failed or moved
            fewer bytes.
    """
    count = max(1, nbytes // block)
    write = rw == "write"
    slots = max(1, min(count, _SOURCE_MAX_BYTES // block)) if write else 1
    # Page-aligned, as O_DIRECT needs; private, so it is not shared memory (``Cached``).
    buf = mmap.mmap(-1, slots * block, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if write:
            g = torch.Generator().manual_seed(next(_PASSES))
            source = torch.frombuffer(buf, dtype=torch.uint8)
            for at in range(0, len(buf), 64 * MiB):  # drawn in pieces: no second copy of it all
                part = source[at : at + 64 * MiB]
                part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, generator=g))
            del source, part
        view = memoryview(buf)
        pieces = [view[k * block : (k + 1) * block] for k in range(slots)]
        try:
            flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
            fd = os.open(path, flags | os.O_DIRECT, 0o600)
            try:
                cpu0, t0 = time.thread_time(), time.perf_counter()
                for i in range(count):
                    piece = pieces[i % slots]
                    if write:
                        n = os.pwrite(fd, piece, i * block)
                    else:
                        n = os.preadv(fd, [piece], i * block)
                    if n != block:
                        raise OSError(errno.EIO, f"{rw} of {block} bytes at {i * block}: {n}")
                seconds, cpu_s = time.perf_counter() - t0, time.thread_time() - cpu0
            finally:
                os.close(fd)
        finally:
            for piece in pieces:
                piece.release()
            view.release()
    finally:
        buf.close()
    return count * block / seconds / 1e9, cpu_s / (count * block / 1e9)


def measure_raw_limit(directory: Path, nbytes: int) -> RawLimit | None:
    """The disk's own O_DIRECT speed in ``directory``: fio if installed, else a loop of
    requests one at a time, as dd makes them (:func:`direct_io`).

    fio runs 1 MiB blocks with 16 in flight through io_uring (libaio where io_uring fails);
    the fallback has one request in flight and so reads lower than the disk can do. Both
    write random bytes (Note: [The disk's limit is measured with real bytes]). The file is
    written twice, new and then overwritten, and read once.

    Returns:
        None where neither tool could run: a filesystem that refuses O_DIRECT (tmpfs before
        Linux 6.6), where the store itself falls back to buffered I/O. The paths are then
        measured without a limit beside them.
    """
    nbytes = max(MiB, nbytes // MiB * MiB)
    path = directory / f".tierstore-bench-rawlimit-{os.getpid()}"
    try:
        if shutil.which("fio"):
            for engine in ("io_uring", "libaio"):
                try:
                    w = _fio(path, nbytes, "write", engine)
                    o = _fio(path, nbytes, "write", engine)
                    r = _fio(path, nbytes, "read", engine)
                except (subprocess.CalledProcessError, RuntimeError, ValueError, KeyError):
                    path.unlink(missing_ok=True)
                    continue
                tool = f"fio direct=1 bs=1M iodepth=16 ioengine={engine}"
                return RawLimit(tool, w[0], o[0], r[0], o[1], r[1])
        try:
            w = direct_io(path, nbytes, "write")
            o = direct_io(path, nbytes, "write")
            r = direct_io(path, nbytes, "read")
        except OSError:
            return None
        tool = "loop: O_DIRECT bs=1M, one request in flight as dd, random bytes (fio not installed)"
        return RawLimit(tool, w[0], o[0], r[0], o[1], r[1])
    finally:
        path.unlink(missing_ok=True)


def machine_facts(directory: Path) -> dict[str, object]:
    """Where the benchmark ran: CPU, memory, kernel, filesystem, library versions."""
    import numpy
    import torch
    import zarr

    from tierstore.tiers import _accelerator

    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "zarr": zarr.__version__,
        "numpy": numpy.__version__,
        "directory": str(directory),
        "filesystem": filesystem_of(directory),
        "cuda": _accelerator.accelerator_type() == "cuda",
        "accelerator": _accelerator.accelerator_type(),
    }
