"""The I/O tasks on the store's loop: copies to host memory, spills, fetches, deletes, and what
each outcome does to its entries.

A task takes the store's lock only to record what its I/O did; the I/O itself runs outside
it, on the engine's threads or a device's side streams (Note: [Threading model]).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import TYPE_CHECKING

import torch

from tierstore._malloc import trim_soon
from tierstore._state import TERMINAL, TensorState
from tierstore.core._checks import change_of, changed_error
from tierstore.errors import CorruptTensorError, SpillIOError, TensorModifiedError
from tierstore.errors import TensorReleasedError as Released
from tierstore.tiers import WriteRequest
from tierstore.tiers._device import (
    as_bytes,
    copy_to_host,
    current_stream,
    discard,
    from_bytes,
    upload,
)

if TYPE_CHECKING:
    from collections.abc import Sized

    from tierstore.core._core import StoreCore
    from tierstore.core._entries import Entry

__all__ = ["COPY_RETRY_SECONDS", "POOLED_READ_BYTES", "Transfers"]

log = logging.getLogger("tierstore")

S = TensorState

POOLED_READ_BYTES = 32 << 10
"""CPU reads of at least this many bytes land in the read pool; smaller ones in plain
allocations. A pooled buffer is whole pages, so below 8 pages the rounding would waste more than
an eighth of it. From glibc's heap, which the trim after spilling hands back to the OS (Note:
[Returning host memory]), a small read faults in every page afresh, about 37 us for 64 KiB on
the development VM; a pooled buffer faults once per backward sweep (docs/performance.md,
"Small tensors")."""


COPY_RETRY_SECONDS = 1.0
"""After a copy to the host fails for an unchanged tensor, no copy starts for this long: the
entry stays on its device, and a failure that persists is not retried in a loop."""


class Transfers:
    """The coroutines that move bytes for one store, and the bookkeeping of their outcomes."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core
        self.copies_paused_until = 0.0
        """``time.monotonic()`` before which the cascade starts no copy to the host."""

    def copies_paused(self) -> bool:
        """Whether a recent failed copy to the host holds new ones back (the store's lock held)."""
        return time.monotonic() < self.copies_paused_until

    # ------------------------------------------------------------------ down

    async def copy_to_host(self, e: Entry) -> None:
        """Copy an accelerator entry into host memory (Note: [Copy ordering on an
        accelerator])."""
        core = self._core
        assert e.data is not None
        t0 = time.perf_counter()
        try:
            host = await copy_to_host(e.data, e.ready, core.pinned)
        except Exception as exc:
            with core.lock:
                core.semaphore.give(e.nbytes)
                core.table.host_reserved -= e.nbytes
                if e.state in TERMINAL:
                    core.table.free_copies(e)
                elif core.table.check_unchanged(e, e.data):
                    log.error(
                        "tierstore: copying %s to host failed: %s; it stays on its device, and "
                        "no copy to the host starts for %.0fs",
                        e.describe(),
                        exc,
                        COPY_RETRY_SECONDS,
                    )
                    core.table.set_state(e, S.DEVICE)
                    self.copies_paused_until = time.monotonic() + COPY_RETRY_SECONDS
                # else: the copy failed because the tensor changed after put (its storage
                # freed, Note: [Writes after put]); the entry failed with that error, for good.
                core.cascade()
            return
        with core.lock:
            core.semaphore.give(e.nbytes)
            core.table.host_reserved -= e.nbytes
            core.counters.bytes_to_host += e.nbytes
            core.counters.seconds_to_host += time.perf_counter() - t0
            if e.state in TERMINAL:
                core.table.free_copies(e)
            elif core.table.check_unchanged(e, e.data):
                core.table.set_copy(e, "host", host)
                core.table.set_copy(e, "data", None)
                e.ready = None
                e.version = e.address = None  # the host copy is the store's own
                core.table.set_state(e, S.HOST)
            core.cascade()
            core.plan_prefetch()  # Note: [An entry on its way down]

    async def spill_many(self, entries: list[Entry]) -> None:
        """Write entries to disk, in one engine call (Note: [Batched hand-offs])."""
        core = self._core
        assert core.engine is not None
        requests, written = [], []
        refused: list[tuple[Entry, BaseException]] = []
        for e in entries:
            assert e.host is not None
            try:
                src = as_bytes(e.host)
            except RuntimeError as exc:
                # Its storage was resized since put, and the byte view no longer fits in it
                # (Note: [Writes after put]); the others of the batch go on.
                refused.append((e, TensorModifiedError(change_of(e, e.host) or str(exc))))
                continue
            requests.append(WriteRequest(e.key, src, e.dtype, e.shape))
            written.append(e)
        t0 = time.perf_counter()
        outcomes: list[BaseException | None] = []
        if requests:
            try:
                outcomes = await core.engine.write_many(requests)
                _check_answered(core.engine, "write_many", outcomes, requests)
            except Exception as err:  # an engine's bug: every entry of the batch must end
                outcomes = [err] * len(requests)
                # It may have stored some: a later spill of those keys would be refused.
                try:
                    await core.engine.delete_many([r.key for r in requests])
                except Exception:
                    log.exception("tierstore: deleting a failed batch's blobs failed")
        with core.lock:
            core.counters.seconds_to_disk += time.perf_counter() - t0
            for e, outcome in [*zip(written, outcomes, strict=True), *refused]:
                self._spill_ended(e, outcome)
            core.cascade()
            core.plan_prefetch()
        trim_soon()  # Note: [Returning host memory]

    def _spill_ended(self, e: Entry, exc: BaseException | None) -> None:
        core = self._core
        core.semaphore.give(e.nbytes)
        changed = exc if isinstance(exc, TensorModifiedError) else None
        if exc is None:
            core.counters.bytes_to_disk += e.nbytes
            core.disk.write_succeeded()
        else:
            footprint = e.disk
            core.table.set_disk(e, 0)  # the engine keeps nothing of a failed write
            if changed is None:
                core.counters.write_errors += 1
                core.disk.write_failed(e.describe(), footprint, exc)
        if e.state in TERMINAL:
            core.table.free_copies(e)  # released, or failed, while the write ran
        elif changed is not None:
            core.table.fail(e, changed_error(e, str(changed)))
        elif e.host is not None and not core.table.check_unchanged(e, e.host):
            pass  # the bytes written are not those put (Note: [Writes after put])
        elif exc is not None:
            core.table.set_state(e, S.HOST)
        else:
            core.table.set_copy(e, "host", None)
            core.table.set_state(e, S.DISK)

    async def delete_many(self, deletes: list[tuple[int, int]]) -> None:
        """Free the spill space of released entries: ``(key, footprint)`` pairs, one call."""
        core = self._core
        outcomes: list[BaseException | None] = []
        try:
            if core.engine is not None:
                outcomes = await core.engine.delete_many([key for key, _ in deletes])
        except Exception as exc:  # the file goes at close anyway
            outcomes = [exc] * len(deletes)
        finally:
            with core.lock:
                core.disk.deleting -= sum(footprint for _, footprint in deletes)
        for (key, _), err in zip(deletes, outcomes, strict=False):
            if err is not None:
                log.warning("tierstore: freeing spill space of tensor #%d failed: %s", key, err)

    # ------------------------------------------------------------------ up

    async def fetch_many(self, entries: list[Entry]) -> None:
        """Bring entries back, the disk reads in one engine call (Note: [Batched hand-offs])."""
        core = self._core
        with core.lock:
            live = []
            for e in entries:
                if _released(e):
                    # Released before the read began: skip it (a prefetch nobody will consume).
                    fut = e.fetch_future
                    core.table.free_copies(e)
                    if fut is not None and not fut.done():
                        fut.set_exception(Released(f"{e.describe()} was released"))
                else:
                    live.append(e)
            if len(live) < len(entries):
                core.plan_prefetch()
        if not live:
            return
        disk = [e for e in live if e.disk]
        targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        read_error: dict[int, BaseException | None] = {}
        for e in disk:
            try:
                targets[e.key] = self._read_buffer(e)
            except Exception as exc:
                # No memory for the buffer: this read fails and the entry stays on disk, as
                # after a read error; a get waiting on it raises instead of waiting forever.
                read_error[e.key] = exc
        reading = [e for e in disk if e.key in targets]
        t0 = time.perf_counter()
        if reading:
            assert core.engine is not None
            requests = [(e.key, targets[e.key][0]) for e in reading]
            try:
                read_errors = await core.engine.read_many(requests)
                _check_answered(core.engine, "read_many", read_errors, requests)
            except Exception as err:  # an engine's bug: every entry of the batch must end
                read_errors = [err] * len(requests)
            del requests
            read_error.update({e.key: err for e, err in zip(reading, read_errors, strict=True)})
        t1 = time.perf_counter()
        buffers = {key: data for key, (_, data) in targets.items()}
        del targets  # the read windows: only ``data`` may keep a pooled buffer busy now
        results = self._fetched(live, buffers, read_error)
        buffers.clear()
        t2 = time.perf_counter()
        with core.lock:
            st = core.counters
            if disk:
                st.bytes_from_disk += sum(e.nbytes for e in disk if read_error[e.key] is None)
                st.seconds_from_disk += t1 - t0
            if any(not e.on_cpu for e in live):
                st.seconds_to_device += t2 - t1
            ready, answered = self._record_fetched(results)
            results.clear()
            read_error.clear()
            core.plan_prefetch()  # keep the window full while the caller waits
        _hand_over(ready)
        # Note: [The last read's buffer]
        #     A get may end the backward sweep (and the read pool's buffers with it) while
        #     this frame still holds the tensor it read: the getter wakes on ``set_result``
        #     and can drop the tensor and release its entry before this line. Its buffer,
        #     busy then, would stay mapped until the next sweep; the check is made again
        #     here, once this task holds none of the tensors it read. Only for a get of the
        #     sweep's oldest entry (none older is live): after any other, the reads planned
        #     but not yet started (the window full with the answer not yet consumed) would
        #     find the free buffers of the last sweep unmapped, and fault in new ones (the
        #     steady rounds of 256 MiB tensors read at 0.15-0.20 CPU-s/GB instead of 0.07).
        if answered is not None:
            with core.lock:
                keys = core.table.live_keys
                if not keys or keys[0] >= answered:
                    core.end_of_sweep()

    def _fetched(
        self,
        live: list[Entry],
        buffers: dict[int, torch.Tensor],
        read_error: dict[int, BaseException | None],
    ) -> list[tuple[Entry, torch.Tensor | Exception]]:
        """What each entry's fetch gave: its tensor on its device, or the exception.

        Raises:
            BaseException: a read was cancelled (the store is closing).
        """
        results: list[tuple[Entry, torch.Tensor | Exception]] = []
        for e in live:
            err = read_error.get(e.key)
            if err is not None and not isinstance(err, Exception):
                # Cancelled at close: the uploads already queued are taken by nobody.
                for _, out in results:
                    if isinstance(out, torch.Tensor):
                        discard(out)
                raise err
            if err is not None:
                results.append((e, err))
                continue
            try:
                buf = buffers.get(e.key)
                src = e.host if buf is None else from_bytes(buf, e.dtype, e.shape)
                assert src is not None
                if e.on_cpu:
                    results.append((e, src))
                else:
                    # Allocated on the stream that will consume it, most likely; a getter on
                    # another stream is ordered by hand_over.
                    consumer = e.stream if e.stream is not None else current_stream(e.device)
                    results.append((e, upload(src, e.device, consumer, self._core.pinned)))
            except Exception as exc:
                results.append((e, exc))
        return results

    def _record_fetched(
        self, results: list[tuple[Entry, torch.Tensor | Exception]]
    ) -> tuple[list[tuple[cf.Future[torch.Tensor], torch.Tensor]], int | None]:
        """Record each fetch's outcome (the store's lock held).

        Returns:
            The gets to answer, and the key of the oldest of their entries (None: none).
        """
        core = self._core
        st = core.counters
        ready: list[tuple[cf.Future[torch.Tensor], torch.Tensor]] = []
        answered: int | None = None
        for e, out in results:
            fut = e.fetch_future
            if isinstance(out, Exception):
                self._fetch_failed(e, fut, out)
                continue
            if not e.on_cpu:
                st.bytes_to_device += e.nbytes
            if e.state is S.RELEASED:
                discard(out)
                core.table.free_copies(e)
                if fut is not None and not fut.done():
                    fut.set_exception(Released(f"{e.describe()} was released"))
                continue
            core.table.set_copy(e, "fetched", out)
            core.table.set_state(e, S.FETCHED)
            if fut is not None:
                ready.append((fut, out))
                answered = e.key if answered is None else min(answered, e.key)
            else:
                core.drop_prefetched(e)  # held back while its read ran (Note: [Held back])
        return ready, answered

    def _read_buffer(self, e: Entry) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, data)``: what a disk read of ``e`` fills, and the entry's bytes in it.

        Big CPU tensors read into a pooled buffer spanning the pages the engine's layout asks
        for (``read_window``), so the read goes straight into it; ``data`` is then a tensor
        whose storage is exactly the entry's bytes inside that buffer (Note: [What get
        returns]). Accelerator tensors read the same way into the pinned pool (Note: [The
        pinned pool]), whose buffer the copy to the device holds until it ends; a full pool
        gives pageable memory. Small CPU tensors read into a plain allocation, where ``out``
        and ``data`` are the same tensor.
        """
        core = self._core
        assert core.engine is not None
        if not e.on_cpu or e.nbytes >= POOLED_READ_BYTES:
            lead, span = core.engine.read_window(e.key, e.nbytes)
            pool = core.read_pool if e.on_cpu else core.pinned
            got = pool.take(e.nbytes, lead=lead, span=span)
            if got is not None:
                return got
        buf = torch.empty(e.nbytes, dtype=torch.uint8)
        return buf, buf

    def _fetch_failed(self, e: Entry, fut: cf.Future[torch.Tensor] | None, exc: Exception) -> None:
        """Record a failed fetch: FAILED if the copy is corrupt, else back to its home tier.

        Note: [A failed prefetch is retried once]
            A get may find its entry already being fetched by a prefetch that began before the
            disk recovered. When such a prefetch fails while a get waits on it, its future is
            handed to one fresh read, as if the get had started it; only that read's failure
            reaches the get. A failed read the get began itself raises at once, and a corrupt
            copy is final.

        Note: [A failed read keeps no buffer]
            The engine's error carries a traceback whose frames held the read's buffer (every
            buffer of a grouped read), and the error a get raises has it as its cause: a
            caller keeping that error (a notebook's last traceback, a log record) kept the
            buffers busy, and on a GPU their room in the pinned pool. The engine's
            tracebacks are cut here, as a failed host copy's are: clearing the frames'
            locals instead would finalize any suspended coroutine among them. The errors
            themselves, their messages and errnos, stay.
        """
        _cut_tracebacks(exc)
        core = self._core
        core.counters.read_errors += 1
        if e.state is S.RELEASED:
            core.table.free_copies(e)
            if fut is not None and not fut.done():
                fut.set_exception(Released(f"{e.describe()} was released"))
            return
        if isinstance(exc, CorruptTensorError):
            e.error = CorruptTensorError(f"{e.describe()}: spilled copy is corrupt: {exc}")
            core.table.set_state(e, S.FAILED)
            core.table.free_copies(e)
            log.error("tierstore: %s", e.error)
            err: BaseException = e.failure()  # Note: [A failed entry raises a copy]
        else:
            core.table.set_state(e, e.home())
            if e.prefetched and fut is not None:
                core.start_fetch(e, fut)
                return
            err = SpillIOError(
                f"reading {e.describe()} back from disk failed: {exc}; it stays on disk and "
                "the next get reads it again (check the disk and the kernel log if this repeats)"
            )
            err.__cause__ = exc
        e.fetch_future = None
        if fut is not None and not fut.done():
            fut.set_exception(err)


def _cut_tracebacks(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and the errors it chains (Note: [A failed read keeps no
    buffer])."""
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        err.__traceback__ = None
        err = err.__cause__ or err.__context__


def _hand_over(ready: list[tuple[cf.Future[torch.Tensor], torch.Tensor]]) -> None:
    """Answer the waiting gets, emptying ``ready``: the caller's frame keeps none of them."""
    while ready:
        fut, out = ready.pop()
        if not fut.done():
            fut.set_result(out)


def _released(e: Entry) -> bool:
    # A function, not an inline test: the state changes across the task's awaits, and an
    # inline test would let the type checker narrow it for the rest of the coroutine.
    return e.state is S.RELEASED


def _check_answered(engine: object, call: str, outcomes: Sized, requests: Sized) -> None:
    """Raise if an engine's batch call did not answer each request once.

    Raises:
        RuntimeError: ``outcomes`` and ``requests`` differ in length (an engine's bug, which
            would otherwise leave some entries of the batch moving for the store's life).
    """
    if len(outcomes) != len(requests):
        raise RuntimeError(
            f"{type(engine).__name__}.{call} answered {len(outcomes)} of {len(requests)} requests"
        )
