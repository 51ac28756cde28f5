"""Fixtures of the adapter tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _adapters_util import make_store as build_store

if TYPE_CHECKING:
    import tierstore


@pytest.fixture
def store_factory(tmp_path: Path) -> Iterator[Callable[..., tierstore.TieredStore]]:
    made: list[tierstore.TieredStore] = []

    def factory(tier: str = "disk", **overrides: object) -> tierstore.TieredStore:
        store = build_store(tier, tmp_path, **overrides)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()
