"""The store's core: the state of every entry and the policies that move it.

:class:`StoreCore` wires the parts under one lock (``_core``): the entries and the bytes each
tier holds (``_entries``), what put accepts (``_checks``), the cascade planned
(``_cascade``) and carried out (``_moves``), the save semaphore (``_save_semaphore``), the
LIFO prefetch walk (``_prefetch``), the disk tier's room (``_disk_room``) and set-up
(``_disk_tier``), what a get returns (``_reads``), the hand-off to the event loop
(``_handoff``), the I/O tasks (``_transfers``) and the counters behind ``stats()``
(``_counters``). docs/architecture.md draws how a tensor goes through them.
"""

from __future__ import annotations

from tierstore.core._core import StoreCore

__all__ = ["StoreCore"]
