"""The LIFO prefetch policy: which entries to bring back next, within the window.

Backward consumes newest first, so every get moves a cursor to its entry and the entries just
older than it are brought back (disk -> host -> device) until ``prefetch_bytes`` of fetched
and fetching copies exist.

Note: [Resumable prefetch walk]
    Backward moves the cursor down one entry at a time, and everything between the cursor and
    where the last walk stopped is already fetched or fetching. Walking from the cursor each
    time would make a backward sweep quadratic in the number of entries (thousands of small
    tensors in one window: seconds of pure bookkeeping), so the walk resumes where it stopped,
    and restarts at the cursor only when the cursor moves up (a new backward pass).

    One walk also starts at most ``STEP`` fetches: planning a whole window of small tensors at
    once held the store's lock so long that the first ``get`` of backward, whose own read
    waited behind it, was several times slower (docs/architecture.md, "LIFO prefetch"). The
    walk goes on when a fetch ends and at every ``get``, so the window still fills while the
    caller waits; 256 fetches are 16 MiB of 64 KiB tensors, and a whole window of big ones.

Note: [A tensor bigger than the window]
    The walk stops at the first entry that does not fit in what the window has left, so an
    entry bigger than the whole window would never be brought back ahead: every get of it
    waited for its read. In a long-context step those are the biggest activations (attention
    maps of 128 MiB against a 32 MiB window were a quarter of a backward's gets and all of
    its waits, docs/performance.md). So when the window is empty the walk starts such an
    entry alone: at most one tensor over the window, the one backward needs next.

Note: [An entry on its way down]
    When backward begins, the last activations of forward are often still being written to
    disk. The walk cannot fetch such an entry yet and goes on to older ones; had it resumed
    below them, it would never have come back to it, and the get of the very entry backward
    needed next read it from disk itself while older ones sat fetched. So the walk keeps the
    entries it passed on their way down, and each walk first fetches those that have landed
    (a spill's or a copy's end runs the walk); the walk itself still resumes where it
    stopped. (Resuming at such an entry instead rescanned the whole window at every get
    while its spill ran.)

Note: [Held back]
    The walk brings back every older entry, but a caller may have some of those tensors at
    hand: a checkpoint's input that is still alive at backward (a mask or position table
    handed to every layer, an input the caller keeps) is given to the recompute as the live
    object, and a copy read back for it is taken by nobody. It held window room and a read
    buffer until its release, at the end of backward, and cost a read for nothing (a 4-D
    attention mask of a long sequence is hundreds of MiB, read when the window reaches the
    first layer, just as the last layer inputs are needed). ``hold_back`` marks such entries:
    the walk passes over them, a copy already brought back (with no get waiting on it) is
    dropped, and one whose read is running is dropped when it lands. A get still returns the
    tensor, read on demand, and clears the mark, as an explicit ``prefetch`` does.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

__all__ = ["PENDING", "SCAN_LIMIT", "STEP", "PrefetchWalk", "newest_first_within"]

PENDING = -1
"""What ``fetch_size`` says of an entry still on its way down (its spill, or its copy to the
host tier, in flight): nothing to fetch yet, but soon (Note: [An entry on its way down])."""

SCAN_LIMIT = 4096
"""A walk looks at most this many older entries, so one get never walks a huge table."""
STEP = 256
"""One walk starts at most this many fetches (Note: [Resumable prefetch walk])."""


class PrefetchWalk:
    """The cursor (the entry of the last get), where the last walk below it stopped, and the
    entries it passed on their way down."""

    def __init__(self) -> None:
        self.cursor: int | None = None
        """The key of the last entry a get asked for."""
        self._walked_from: int | None = None
        self._resume_at: int | None = None
        self._pending: list[int] = []
        """Keys passed on their way down, newest first (Note: [An entry on its way down])."""
        self.steps = 0
        """Entries looked at by every walk so far (a backward sweep stays linear)."""

    def restart(self) -> None:
        """Walk from the cursor at the next plan, as for a cursor that moved up: a new sweep
        (Note: [Got once a sweep]) may fetch entries the last walks passed over."""
        self._walked_from = self._resume_at = None
        self._pending = []

    @property
    def exhausted(self) -> bool:
        """Whether the last walk reached the oldest entry and left none on its way down:
        nothing older than the cursor is left to bring back, so a backward sweep is at its
        end. A cursor above where that walk began is a new sweep, which no walk has looked at
        yet (its first walks may find no room in the window)."""
        return (
            self.cursor is not None
            and self._walked_from is not None
            and self.cursor <= self._walked_from
            and self._resume_at == 0
            and not self._pending
        )

    def plan(
        self,
        live_keys: Sequence[int],
        fetch_size: Callable[[int], int | None],
        budget: int,
        window_empty: bool = False,
    ) -> list[int]:
        """The keys to fetch now, newest first.

        Args:
            live_keys: every live key, ascending.
            fetch_size: an entry's bytes if it needs fetching (on disk, or an accelerator
                tensor in host memory), ``PENDING`` if it will once its move down ends,
                else None.
            budget: bytes the window has left (0 or less: plan nothing).
            window_empty: nothing is fetched or being fetched, so the first entry may be
                bigger than ``budget`` (Note: [A tensor bigger than the window]).
        """
        if self.cursor is None:
            return []
        resuming = (
            self._walked_from is not None
            and self._resume_at is not None
            and self.cursor <= self._walked_from
        )
        if not resuming:
            self._pending = []
        if budget <= 0:
            return []
        chosen: list[int] = []
        # First the entries passed on their way down that have landed, the newest first:
        # they are newer than where the walk resumes. Those the cursor has passed (their get
        # came first) or that are gone are dropped; those still moving stay.
        pending, self._pending = self._pending, []
        for n, key in enumerate(pending):
            j = bisect.bisect_left(live_keys, key)
            if key >= self.cursor or j == len(live_keys) or live_keys[j] != key:
                continue
            nbytes = fetch_size(key)
            if nbytes == PENDING:
                self._pending.append(key)
            elif nbytes is not None:
                if _stops(chosen, nbytes, budget, window_empty):
                    self._pending += pending[n:]
                    return chosen
                budget -= nbytes
                chosen.append(key)
        start = self.cursor
        if resuming:
            assert self._resume_at is not None
            start = min(start, self._resume_at)
        i = bisect.bisect_left(live_keys, start) - 1
        scanned = 0
        while i >= 0 and scanned < SCAN_LIMIT:
            key = live_keys[i]
            nbytes = fetch_size(key)
            if nbytes == PENDING:
                self._pending.append(key)
            elif nbytes is not None:
                if _stops(chosen, nbytes, budget, window_empty):
                    break
                # One bigger than the window comes alone: the budget goes below zero.
                budget -= nbytes
                chosen.append(key)
            i -= 1
            scanned += 1
        self.steps += scanned
        self._walked_from = self.cursor
        # Resume at the entry that did not fit (or below the last one looked at).
        self._resume_at = live_keys[i] + 1 if i >= 0 else 0
        self._pending.sort(reverse=True)
        return chosen


def _stops(chosen: list[int], nbytes: int, budget: int, window_empty: bool) -> bool:
    """Whether a walk stops before an entry of ``nbytes``: it has ``STEP`` fetches, or the
    entry does not fit in ``budget`` (but one alone while the window is empty, Note: [A
    tensor bigger than the window])."""
    return len(chosen) == STEP or (nbytes > budget and (bool(chosen) or not window_empty))


def newest_first_within(
    sizes: Iterable[tuple[int, int]], budget: int, window_empty: bool = False
) -> list[int]:
    """Of ``(key, nbytes)`` pairs a caller asked to prefetch, the keys that fit in ``budget``
    bytes, newest first; the first that does not fit ends the list, unless it is the first
    and the window is empty (Note: [A tensor bigger than the window]): it comes alone."""
    chosen: list[int] = []
    for key, nbytes in sorted(dict(sizes).items(), reverse=True):
        if nbytes > budget and (chosen or not window_empty or budget <= 0):
            break
        budget -= nbytes
        chosen.append(key)
    return chosen
