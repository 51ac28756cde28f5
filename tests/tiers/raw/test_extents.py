"""The extent allocator: first fit, and freed neighbours merge so the space is found again."""

from __future__ import annotations

from tierstore.tiers.raw._extents import Extents

PAGE = 4096


def test_the_first_extent_that_fits_is_taken_from_its_start() -> None:
    ext = Extents()
    ext.grown(10 * PAGE)
    assert ext.alloc(3 * PAGE) == 0
    assert ext.alloc(3 * PAGE) == 3 * PAGE
    assert ext.free_bytes == 4 * PAGE
    assert ext.alloc(5 * PAGE) is None  # 4 pages left: nothing is split across holes


def test_freed_neighbours_merge_into_one_extent() -> None:
    ext = Extents()
    ext.grown(9 * PAGE)
    a, b, c = (ext.alloc(3 * PAGE) for _ in range(3))
    assert (a, b, c) == (0, 3 * PAGE, 6 * PAGE) and ext.free_bytes == 0
    ext.free(6 * PAGE, 3 * PAGE)
    ext.free(0, 3 * PAGE)
    assert ext.alloc(6 * PAGE) is None  # two holes of three pages
    assert ext.free_bytes == 6 * PAGE and ext.largest() == 3 * PAGE  # free, not placeable
    ext.free(3 * PAGE, 3 * PAGE)  # the middle one joins both
    assert ext.largest() == 9 * PAGE
    assert ext.alloc(9 * PAGE) == 0
    assert ext.largest() == 0


def test_growth_adds_free_space_after_the_end() -> None:
    ext = Extents()
    ext.grown(2 * PAGE)
    assert ext.alloc(2 * PAGE) == 0
    ext.grown(4 * PAGE)
    assert ext.size == 6 * PAGE and ext.alloc(4 * PAGE) == 2 * PAGE
