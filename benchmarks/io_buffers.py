"""How much the memory an O_DIRECT transfer uses decides its speed, on your disk.

Run: PYTHONPATH=src python benchmarks/io_buffers.py --dir /var/tmp

One file of ``--size`` bytes is written and read in chunks of ``--chunk`` on ``--threads``
threads (the raw engine's defaults), with the raw engine's ``os.pwrite``/``os.preadv`` loops,
from and into these kinds of memory, the kinds alternating from repeat to repeat:

- ``huge``: an anonymous mapping with ``MADV_HUGEPAGE``, touched once before timing, as the
  store's read pool (``ReadPool``) maps its buffers;
- ``4k-one-thread``: 4 KiB pages, touched once by one thread before timing;
- ``4k-io-threads``: 4 KiB pages, first touched by the I/O threads' reads in an untimed
  pass, as memory arrives that a transfer faults in;
- ``bounce``: a source 64 bytes off a page, as torch puts a CPU tensor, copied chunk by chunk
  into page-aligned buffers with a CRC32C, as the raw engine wrote such a tensor until it
  learnt its lead (and still writes one at an odd address) (writes only);
- ``lead``: the same source written straight from its pages, the 64 bytes before it
  included, with a CRC32C of its own bytes, as the raw engine writes it now (Note: [A
  tensor's lead] in ``tiers/raw/_layout.py``) (writes only).

A block device takes a bounded number of memory segments per request (virtio-blk here: 254,
``/sys/block/*/queue/max_segments``); pages that sit together in physical memory merge into one
segment, scattered ones do not. docs/benchmarks.md has this machine's figures.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import queue
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore.config import parse_size
from tierstore.tiers._checksum import crc32c
from tierstore.tiers._memcopy import memmove
from tierstore.tiers.raw import probe_direct_io
from tierstore.tiers.raw._syscalls import pread_all, pwrite_all

_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_TORCH_OFFSET = 64


def _map(nbytes: int, *, huge: bool, touch: bool) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    if touch:
        m.madvise(_POPULATE_WRITE)
    return m


def _fill(m: mmap.mmap, start: int, nbytes: int) -> None:
    """Random bytes, each page stamped with its index, so a misplaced page shows."""
    seed = os.urandom(1 << 20)
    for at in range(0, nbytes, len(seed)):
        n = min(len(seed), nbytes - at)
        m[start + at : start + at + n] = seed[:n]
    for page in range(0, nbytes, mmap.PAGESIZE):
        m[start + page : start + page + 8] = page.to_bytes(8, "little")


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


class _Bench:
    def __init__(self, path: Path, size: int, chunk: int, threads: int, direct: bool) -> None:
        self.path, self.size, self.chunk = path, size, chunk
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self.fd, 0, size)
        self.pool = ThreadPoolExecutor(threads)
        self.offsets = range(0, size, chunk)
        self.maps = {
            "huge": _map(size, huge=True, touch=True),
            "4k-one-thread": _map(size, huge=False, touch=True),
            "4k-io-threads": _map(size, huge=False, touch=False),
        }
        self.source = _map(size + mmap.PAGESIZE, huge=False, touch=True)
        _fill(self.source, _TORCH_OFFSET, size)
        # Every kind holds random bytes before it is timed: a disk may take zeros faster.
        _fill(self.maps["huge"], 0, size)
        _fill(self.maps["4k-one-thread"], 0, size)
        self.bounce: queue.SimpleQueue[tuple[memoryview, int]] = queue.SimpleQueue()
        for _ in range(threads):
            b = _map(chunk, huge=False, touch=True)
            self.bounce.put((memoryview(b), _address(b)))
        self._each(self._writer(self.maps["huge"]))  # the file: random bytes, not zeros
        self._each(self._reader(self.maps["4k-io-threads"]))  # its first touch, untimed

    def _each(self, fn: Callable[[int], None]) -> float:
        t0 = time.perf_counter()
        list(self.pool.map(fn, self.offsets))
        return self.size / (time.perf_counter() - t0) / 1e9

    def _writer(self, m: mmap.mmap) -> Callable[[int], None]:
        view = memoryview(m)

        def write(offset: int) -> None:
            pwrite_all(self.fd, view[offset : offset + self.chunk], offset)

        return write

    def _reader(self, m: mmap.mmap) -> Callable[[int], None]:
        view = memoryview(m)

        def read(offset: int) -> None:
            pread_all(self.fd, view[offset : offset + self.chunk], offset, self.path)

        return read

    def _bounced_writer(self) -> Callable[[int], None]:
        source = _address(self.source) + _TORCH_OFFSET

        def write(offset: int) -> None:
            buf, address = self.bounce.get()
            try:
                memmove(address, source + offset, self.chunk)
                crc32c(address, self.chunk)
                pwrite_all(self.fd, buf, offset)
            finally:
                self.bounce.put((buf, address))

        return write

    def _lead_writer(self) -> Callable[[int], None]:
        base = _address(self.source)
        view = memoryview(self.source)

        def write(offset: int) -> None:
            # Chunks start on the source's pages, so the file holds the page span: 64 bytes
            # before the data, and the data's last 64 bytes fall past ``size`` (not written).
            # Each CRC covers the chunk's own data, as in the engine.
            start = max(offset, _TORCH_OFFSET)
            crc32c(base + start, offset + self.chunk - start)
            pwrite_all(self.fd, view[offset : offset + self.chunk], offset)

        return write

    def run(self, kind: str, op: str) -> float:
        if kind == "lead":
            return self._each(self._lead_writer())
        if kind == "bounce":
            return self._each(self._bounced_writer())
        m = self.maps[kind]
        return self._each(self._writer(m) if op == "write" else self._reader(m))

    def verify(self) -> None:
        """Write from every kind of memory and read it back into a buffer of its own, then
        read the last write into every kind; compare every byte each time."""
        sent = memoryview(self.source)
        writes = [
            ("bounce", self._bounced_writer(), sent[_TORCH_OFFSET : _TORCH_OFFSET + self.size]),
            ("lead", self._lead_writer(), sent[: self.size]),
        ]
        for kind, m in self.maps.items():
            _fill(m, 0, self.size)  # fresh bytes, so a write that did nothing shows
            writes.append((kind, self._writer(m), memoryview(bytes(m))))
        back = _map(self.size, huge=False, touch=True)
        for kind, write, expected in writes:
            self._each(write)
            self._each(self._reader(back))
            if memoryview(back) != expected:
                raise SystemExit(f"the file read back differs from what was written ({kind})")
        for kind, m in self.maps.items():
            self._each(self._reader(m))
            if memoryview(m) != expected:
                raise SystemExit(f"the file read back into {kind} differs from what was written")
        back.close()

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--size", default="1GiB", help="file size (default 1GiB)")
    p.add_argument("--chunk", default="8MiB", help="bytes per request (default 8MiB)")
    p.add_argument("--threads", type=int, default=8, help="I/O threads (default 8)")
    p.add_argument("--repeats", type=int, default=4, help="repeats (default 4)")
    args = p.parse_args(argv)
    size = parse_size(args.size, name="--size")
    chunk = parse_size(args.chunk, name="--chunk")
    if chunk % mmap.PAGESIZE or size % chunk:
        p.error(f"--chunk {chunk} must be a multiple of {mmap.PAGESIZE} that divides --size {size}")
    direct = probe_direct_io(args.dir).supported
    print(f"{args.dir}: {'O_DIRECT' if direct else 'buffered (O_DIRECT refused)'}, ", end="")
    print(f"{size >> 20} MiB in {chunk >> 20} MiB requests on {args.threads} threads")
    runs = [(k, "write") for k in ("huge", "4k-one-thread", "4k-io-threads", "bounce", "lead")]
    runs += [(k, "read") for k in ("huge", "4k-one-thread", "4k-io-threads")]
    gbps: dict[tuple[str, str], list[float]] = {r: [] for r in runs}
    fd, name = tempfile.mkstemp(prefix="io-buffers-", dir=args.dir)
    os.close(fd)
    bench = _Bench(Path(name), size, chunk, args.threads, direct)
    try:
        for i in range(args.repeats):
            for kind, op in runs if i % 2 == 0 else runs[::-1]:
                gbps[(kind, op)].append(bench.run(kind, op))
        bench.verify()
    finally:
        bench.close()
        os.unlink(name)
    print("op     memory           GB/s min / median / max")
    for (kind, op), v in gbps.items():
        print(f"{op:6s} {kind:16s} {min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}")
    print("verified: the file read back equals the bytes written, from and into every kind")


if __name__ == "__main__":
    main()
