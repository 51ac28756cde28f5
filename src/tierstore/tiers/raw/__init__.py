"""The raw disk engine (``TIERSTORE_DISK_FORMAT=raw``, the default).

Its parts, from the bottom up: ``_syscalls`` (whole-transfer ``pwrite``/``pread``, page-cache
dropping, bounce buffers), ``_probe`` (does O_DIRECT work here), ``_extents`` (the allocator),
``_spill_file`` (one file per directory, grown on demand), ``_layout`` (chunks, leads and the
records of where bytes lie), ``_striping`` (which directory each chunk goes to),
``_chunk_io`` (the blocking transfers on the I/O threads), ``_packs`` (small blobs written and
read together) and ``_engine`` (:class:`RawEngine`, the contract).
"""

from __future__ import annotations

from tierstore.tiers.raw._engine import RawEngine
from tierstore.tiers.raw._probe import DirectIOProbe, probe_direct_io
from tierstore.tiers.raw._spill_file import SPILL_FILE

__all__ = ["SPILL_FILE", "DirectIOProbe", "RawEngine", "probe_direct_io"]
