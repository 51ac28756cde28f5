"""The save semaphore: bytes moving down at once are bounded, and put waits behind them.

Note: [The save semaphore]
    Every copy to the host tier and every spill takes its bytes from the semaphore when it
    starts and gives them back when it ends. When the next move would pass
    ``max_inflight_bytes``, the cascade stops there and ``put`` waits until a move ends and the
    backlog has started moving; an empty semaphore takes any move, so a tensor bigger than the
    limit still moves. So the forward pass cannot outrun the disk: host memory holds at most
    its capacity plus the bytes in flight, plus the tensor of each put that waits (a put is
    admitted, then waits). ``put`` never fails for this; the time it waited shows in
    ``stats().put_wait_seconds``. Only a move in flight wakes the waiting puts when it ends,
    so the cascade marks the semaphore full only while one is.
"""

from __future__ import annotations

import concurrent.futures as cf

from tierstore.errors import StoreClosedError

__all__ = ["SaveSemaphore", "has_room"]


def has_room(inflight: int, nbytes: int, limit: int) -> bool:
    """Whether a move of ``nbytes`` may start with ``inflight`` bytes moving (Note: [The save
    semaphore])."""
    return not inflight or inflight + nbytes <= limit


class SaveSemaphore:
    """The bytes moving down now, and the puts waiting for them to move (under the store's
    lock).

    Args:
        limit: ``max_inflight_bytes``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0
        """Bytes of copies and spills in flight."""
        self.full = False
        """The last cascade stopped here: the next put waits."""
        self._waiters: list[cf.Future[None]] = []

    def take(self, nbytes: int) -> None:
        self.inflight += nbytes

    def give(self, nbytes: int) -> None:
        self.inflight -= nbytes

    def settle(self, full: bool) -> None:
        """Record whether the cascade just stopped here; when not, the waiting puts go on."""
        self.full = full
        if not full and self._waiters:
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def waiter(self) -> cf.Future[None] | None:
        """What a put waits on while the semaphore is full, or None."""
        if not self.full:
            return None
        waiter: cf.Future[None] = cf.Future()
        self._waiters.append(waiter)
        return waiter

    def close(self) -> None:
        """Fail the waiting puts: the store is closing."""
        for w in self._waiters:
            if not w.done():
                w.set_exception(StoreClosedError("the store was closed while put waited"))
        self._waiters = []
