"""Shared fixtures: stores on a private temporary disk directory, and the gpu marker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import tierstore


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A parent directory for spill directories, private to one test."""
    d = tmp_path / "spill"
    d.mkdir()
    return d


@pytest.fixture
def make_store(disk_dir: Path) -> Iterator[object]:
    """Build TieredStores on ``disk_dir``; every one is closed and checked empty afterwards."""
    stores: list[tierstore.TieredStore] = []

    def make(**overrides: object) -> tierstore.TieredStore:
        overrides.setdefault("disk_dir", disk_dir)
        overrides.setdefault("min_bytes", 0)
        store = tierstore.TieredStore(**overrides)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
    leftovers = [p for p in disk_dir.iterdir()] if disk_dir.exists() else []
    assert leftovers == [], f"spill directories left behind: {leftovers}"
