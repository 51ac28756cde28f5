"""Property: any view of any storage, at any page position, comes back bit-exact from every tier.

Hypothesis draws a storage of up to 6 MiB that starts anywhere in a page (a multiple of its
element size), a strided view of it (offset, step, 1-3 dimensions, transposed or not) or the
whole storage, and a dtype, and puts it into one store per path: device and host tiers, the
raw engine with O_DIRECT and without, two striped directories, and zarr, each with chunks of
2 MiB (1 MiB striped), so that big tensors cross chunk boundaries on every disk path. Each
get must return the exact bytes (NaN payloads included) and own exactly them
(Note: [What get returns]).

The store keeps a view of part of a storage as a compact copy (Note: [What get returns]),
which lands wherever the allocator puts it; only a whole storage reaches the engine at its own
page position. So half the draws are whole storages, and a fixed grid of whole storages puts
each size class (packed, at and past the 1 MiB pack limit, several chunks) at the start of a
page, 64 bytes into one and near its end.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierstore import Tier, TieredStore
from tierstore.testing import settled, wait_for

MiB = 1 << 20
STORES: dict[str, dict[str, object]] = {
    "device": {"device_bytes": "unlimited"},
    "host": {"host_bytes": "unlimited"},
    "raw-direct": {"host_bytes": 0, "direct_io": "on", "io_chunk_bytes": "2MiB"},
    "raw-buffered": {"host_bytes": 0, "direct_io": "off", "io_chunk_bytes": "2MiB"},
    "raw-striped": {"host_bytes": 0, "io_chunk_bytes": "1MiB", "stripes": 2},
    "zarr": {"host_bytes": 0, "disk_format": "zarr", "io_chunk_bytes": "2MiB"},
}
PATHS = {"device": Tier.DEVICE, "host": Tier.HOST}
"""Where each store's entries rest once settled; the others' on disk."""
DTYPES = (torch.uint8, torch.int16, torch.bfloat16, torch.float32, torch.int64)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, TieredStore]]:
    made: dict[str, TieredStore] = {}
    for name, config in STORES.items():
        settings_ = dict(config)
        stripes = int(settings_.pop("stripes", 1))  # type: ignore[call-overload]
        dirs = [tmp_path_factory.mktemp(f"{name}{i}") for i in range(stripes)]
        made[name] = TieredStore(
            disk_dir=[str(d) for d in dirs] if stripes > 1 else str(dirs[0]),
            **{"device_bytes": 0, "min_bytes": 0, **settings_},
        )
    yield made
    for store in made.values():
        store.close()


def _storage(n: int, lead: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` random elements of ``dtype``, owning their whole storage, ``lead`` bytes into a
    page."""
    size = torch.empty((), dtype=dtype).element_size()
    buf = mmap.mmap(-1, lead + n * size + 1, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=n * size, offset=lead)
    raw.copy_(torch.randint(0, 256, (n * size,), dtype=torch.uint8))
    return raw.view(dtype)


@st.composite
def views(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    size = torch.empty((), dtype=dtype).element_size()
    # Every size class: packed, around the 1 MiB pack limit, several chunks.
    nbytes = draw(
        st.one_of(
            st.integers(1, 64 << 10),
            st.integers(MiB - 8192, MiB + 8192),
            st.integers(2 * MiB, 6 * MiB),
        )
    )
    n = max(1, nbytes // size)
    lead = draw(st.integers(0, 4095 // size)) * size
    base = _storage(n, lead, dtype)
    if draw(st.booleans()):
        return base  # the whole storage: the engine sees it at its own page position
    start = draw(st.integers(0, n - 1))
    step = draw(st.integers(1, 3))
    length = draw(st.integers(1, (n - start + step - 1) // step))
    view = base[start : start + length * step : step]
    rows = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8) if length % d == 0]))
    view = view.reshape(rows, length // rows) if step == 1 else view.unflatten(0, (rows, -1))
    if draw(st.booleans()):
        view = view.t()
    return view


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
@given(view=views())
def test_any_view_round_trips_bit_exact_through_every_path(
    stores: dict[str, TieredStore], view: torch.Tensor
) -> None:
    _round_trip(stores, view)


@pytest.mark.parametrize("lead", [0, 64, 4032])
@pytest.mark.parametrize("nbytes", [64 << 10, MiB, MiB + 4, 4 * MiB + 4])
def test_a_whole_storage_at_any_page_position_round_trips(
    stores: dict[str, TieredStore], nbytes: int, lead: int
) -> None:
    t = _storage(nbytes // 4, lead, torch.int32)
    assert t.data_ptr() % 4096 == lead and t.untyped_storage().nbytes() == nbytes
    _round_trip(stores, t)


def _round_trip(stores: dict[str, TieredStore], view: torch.Tensor) -> None:
    expected = _bytes(view).clone()
    handles = {name: store.put(view) for name, store in stores.items()}
    for store in stores.values():
        wait_for(lambda s=store: settled(s))  # type: ignore[misc]
    for name, h in handles.items():
        # Each store really took its path: a configuration that silently stopped spilling
        # would otherwise pass on the faster tiers.
        assert stores[name].tier_of(h) is PATHS.get(name, Tier.DISK), name
        out = stores[name].get(h)
        assert out.dtype == view.dtype and out.shape == view.shape, name
        assert torch.equal(_bytes(out), expected), f"{name}: bytes differ"
        assert out.storage_offset() == 0, name
        assert out.untyped_storage().nbytes() == expected.numel(), name
        stores[name].release(h)
