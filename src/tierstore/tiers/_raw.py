"""The raw engine's old import path; it lives in :mod:`tierstore.tiers.raw` now. Kept until the
benchmark scripts import it from there."""

from __future__ import annotations

from tierstore.tiers.raw import RawEngine, probe_direct_io
from tierstore.tiers.raw._syscalls import pread_all as _pread_all
from tierstore.tiers.raw._syscalls import pwrite_all as _pwrite_all

__all__ = ["RawEngine", "_pread_all", "_pwrite_all", "probe_direct_io"]
