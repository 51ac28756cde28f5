"""The testing kit: what tests of tierstore, and of a disk engine of your own, build on.

:class:`EngineTests` is the conformance suite every disk engine passes: subclass it once per
engine, name the engine class and implement its backdoors (see its module). The byte helpers
it uses come with it.

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

__all__ = [
    "CHUNK",
    "SIZES",
    "EngineTests",
    "KiB",
    "MiB",
    "make_dirs",
    "random_bytes",
    "random_bytes_at",
]
