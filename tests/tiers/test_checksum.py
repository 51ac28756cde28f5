"""CRC32C over raw memory: every implementation gives google-crc32c's value (Note: [Where the
CRC32C comes from])."""

from __future__ import annotations

import ctypes
import sys

import google_crc32c
import pytest
import torch

from tierstore.tiers import _checksum

SIZES = [0, 1, 4095, 4096, 65536, _checksum.SHORT_CALL_BYTES + 1, 3 * (1 << 20) + 5]


def _random(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("loader", [ctypes.CDLL, ctypes.PyDLL], ids=["gil-released", "gil-held"])
@pytest.mark.parametrize("library", ["isal", "libcrc32c"])
@pytest.mark.parametrize("n", SIZES)
def test_every_implementation_gives_the_standard_crc32c(
    library: str, loader: type[ctypes.CDLL], n: int
) -> None:
    load = _checksum._load_isal if library == "isal" else _checksum._load_libcrc32c
    extend = load(loader)
    assert extend is not None, f"{library} did not load"
    t = _random(n + 3, seed=n)
    address = t.data_ptr() + 3  # not aligned
    expected = google_crc32c.value(bytes(t[3:].numpy()))
    assert extend(0, address, n) == expected
    half = n // 2  # continued from a first part, as packs and chunks do
    assert extend(extend(0, address, half), address + half, n - half) == expected


def test_isal_goes_in_pieces_past_its_int_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_checksum, "_ISAL_MAX_CALL", 4096)
    extend = _checksum._load_isal()
    assert extend is not None
    t = _random(3 * 4096 + 17, seed=1)
    assert extend(0, t.data_ptr(), t.numel()) == google_crc32c.value(bytes(t.numpy()))


def test_isal_is_used_where_installed_and_libcrc32c_where_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert _checksum.IMPLEMENTATION.startswith("ISA-L")
    monkeypatch.setitem(sys.modules, "isal", None)  # as if not installed
    extend, name = _checksum._load(ctypes.CDLL)
    assert name.startswith("libcrc32c") and extend is not None
    t = _random(10_000, seed=2)
    assert extend(0, t.data_ptr(), 10_000) == google_crc32c.value(bytes(t.numpy()))


@pytest.mark.parametrize("n", [5, _checksum.SHORT_CALL_BYTES + 1])
def test_without_either_library_a_copy_is_checksummed(
    monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    monkeypatch.setattr(_checksum, "_EXTEND", None)
    monkeypatch.setattr(_checksum, "_EXTEND_HELD", None)
    t = _random(n, seed=3)
    assert _checksum.crc32c(t.data_ptr(), n, 0) == google_crc32c.value(bytes(t.numpy()))
