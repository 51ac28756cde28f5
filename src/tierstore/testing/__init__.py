"""The testing kit: what tests of tierstore, and of a disk engine of your own, build on.

* :class:`EngineTests`: the conformance suite every disk engine passes. Subclass it once per
  engine, name the engine class and implement its backdoors (see its module); the byte
  helpers it uses come with it.
* :class:`FaultyEngine` and :func:`install_faults`: a wrapper around a store's engine that
  fails, delays or gates writes and reads; :func:`short_io` makes every ``pwrite``/``preadv``
  move at most a page; :func:`backdoor_files` lists a store's spill files.
* :func:`audit`: a store's counters recomputed from its entries and compared;
  :func:`internals`: the few views of a store's insides that tests look at;
  :func:`plain_tensor_type`: accept a tensor subclass that stands in for device tensors;
  :func:`settled` and :func:`wait_for`.

Importing this module imports pytest.
"""

from __future__ import annotations

from tierstore.testing._engine_tests import (
    CHUNK,
    SIZES,
    EngineTests,
    KiB,
    MiB,
    make_dirs,
    random_bytes,
    random_bytes_at,
)
from tierstore.testing._faults import FaultyEngine, backdoor_files, install_faults, short_io
from tierstore.testing._internals import (
    StoreInternals,
    audit,
    internals,
    plain_tensor_type,
    settled,
    wait_for,
)

__all__ = [
    "CHUNK",
    "SIZES",
    "EngineTests",
    "FaultyEngine",
    "KiB",
    "MiB",
    "StoreInternals",
    "audit",
    "backdoor_files",
    "install_faults",
    "internals",
    "make_dirs",
    "plain_tensor_type",
    "random_bytes",
    "random_bytes_at",
    "settled",
    "short_io",
    "wait_for",
]
