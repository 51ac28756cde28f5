"""Carrying out the cascade's plans under the store's lock: relabels on the CPU, copies to host
memory and spills begun, and entries kept where they are for want of room."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tierstore._state import TensorState, Tier
from tierstore._stats import format_size
from tierstore.core._cascade import Limits, Move, plan_device, plan_spills
from tierstore.core._checks import version_of
from tierstore.errors import TierFullError
from tierstore.tiers._device import compact

if TYPE_CHECKING:
    import torch

    from tierstore.core._core import StoreCore
    from tierstore.core._entries import Entry

__all__ = ["cascade", "tier_full"]

log = logging.getLogger("tierstore")

S = TensorState


def cascade(core: StoreCore, new: Entry | None) -> None:
    """Move the oldest entries of over-full tiers down (Note: [The cascade]).

    Args:
        core: the store, its lock held.
        new: the entry ``put`` is adding now, if any.

    Raises:
        TierFullError: the compact host copy of ``new`` could not be made (Note: [A failed
            host copy keeps nothing]); the caller undoes its put.
    """
    cfg, table, semaphore = core.config, core.table, core.semaphore
    limits = Limits(cfg.device_bytes, cfg.host_bytes, cfg.max_inflight_bytes)
    down = plan_device(
        limits,
        table.resting[Tier.DEVICE],
        semaphore.inflight,
        table.resting_oldest_first(Tier.DEVICE),
    )
    copies_paused = core.transfers.copies_paused()
    for step in down.steps:
        e = step.entry
        if step.move is Move.COPY:
            if copies_paused:  # a copy just failed: the oldest stay on their device for now
                core.retry_later()  # Note: [Tried again after a pause]
                break
            table.set_state(e, S.MOVING_TO_HOST)
            semaphore.take(e.nbytes)
            table.host_reserved += e.nbytes
            core.handoff.spawn(core.transfers.copy_to_host, e)
        elif not _relabel(core, e, new):
            break
    blocked = down.blocked
    # Copies still on their way count: they land in the host tier.
    host_load = table.resting[Tier.HOST] + table.host_reserved
    if host_load > cfg.host_bytes and core.disk.recheck():
        spills = plan_spills(
            limits,
            host_load,
            semaphore.inflight,
            table.used[Tier.DISK],
            table.resting_oldest_first(Tier.HOST),
            core.disk,
        )
        for step in spills.steps:
            e = step.entry
            table.set_state(e, S.MOVING_TO_DISK)
            table.set_disk(e, step.footprint)
            semaphore.take(e.nbytes)
            core.handoff.spill(e)
        if spills.kept is not None:
            _note_kept(core)
        blocked = blocked or spills.blocked
    if core.disk.paused and table.resting[Tier.HOST] + table.host_reserved > cfg.host_bytes:
        core.retry_later()  # Note: [Tried again after a pause]
    # Only a move in flight wakes a waiting put when it ends. A plan blocked behind copies it
    # did not start (paused after a failed copy) has none: that put would wait its whole
    # timeout. It goes on instead, and the next put, get or release runs the cascade again.
    semaphore.settle(blocked and semaphore.inflight > 0)


def tier_full(core: StoreCore, nbytes: int, dtype: torch.dtype) -> TierFullError:
    """The error of a put no tier has room for: what each tier holds, and what to do."""
    used, cfg = core.table.used, core.config
    off, advice = core.disk.advice()
    return TierFullError(
        f"no tier has room for a {format_size(nbytes)} {str(dtype).removeprefix('torch.')} "
        f"tensor: device {format_size(used[Tier.DEVICE])} of {format_size(cfg.device_bytes)}, "
        f"host {format_size(used[Tier.HOST])} of {format_size(cfg.host_bytes)}, "
        f"disk {format_size(used[Tier.DISK])} of {format_size(core.disk.capacity)} used{off}; "
        f"{advice}"
    )


def _relabel(core: StoreCore, e: Entry, new: Entry | None) -> bool:
    """Make CPU entry ``e`` a host entry: the host tier holds the tensor itself, no I/O.

    A view becomes a compact copy first. Returns False when that copy could not be made: the
    cascade stops there for now.
    """
    assert e.data is not None
    # The entry put is adding now cannot have changed: no caller code ran since its version
    # was taken, under this same lock.
    if e is not new and not core.table.check_unchanged(e, e.data):
        return True  # it failed (Note: [Writes after put]); the cascade goes on
    try:
        host = compact(e.data)
    except (RuntimeError, MemoryError) as exc:
        _host_copy_failed(core, e, exc, new)
        return False
    if host is not e.data:
        e.version = version_of(host)  # a copy of the store's own
        e.address = host.data_ptr()
    table = core.table
    table.set_state(e, S.MOVING_TO_HOST)
    table.set_copy(e, "host", host)
    table.set_copy(e, "data", None)
    table.set_state(e, S.HOST)
    return True


def _host_copy_failed(core: StoreCore, e: Entry, exc: BaseException, new: Entry | None) -> None:
    """The compact host copy of CPU entry ``e`` could not be made; it stays on DEVICE.

    Note: [A failed host copy keeps nothing]
        On the CPU the host tier holds the tensor itself, but a view is copied out of its
        base first, so that the store does not keep a larger storage alive (releasing a
        tensor must free its storage, views of a larger base included). That copy can fail
        for want of memory (a view of a 1 GiB base under a tight ``RLIMIT_AS``). When it is
        the tensor being put, ``put`` raises ``TierFullError`` and undoes itself: no entry, no
        counted bytes. Nor does the error pin the view: a notebook keeps the last exception,
        and with it every frame of its traceback, so the frames it passes drop the tensor
        before it leaves, and the allocator's own traceback is cut from its cause. The
        adapters then keep the tensor where it is, as for any full store. An older entry whose
        copy fails stays in the device tier, holding the caller's view, and is tried again at
        the next put; the cascade stops there for now.

    Raises:
        TierFullError: ``e`` is ``new``.
    """
    if e is new:
        # The allocator's traceback holds the frame that held the view.
        exc.__traceback__ = None
        raise TierFullError(
            f"no room in host memory for a {e.nbytes}-byte "
            f"{str(e.dtype).removeprefix('torch.')} view: the store keeps a view as a "
            "compact copy, so as not to keep the larger storage behind it alive, and "
            f"allocating that copy failed ({exc}). Nothing was stored; free host memory, "
            "or keep this tensor yourself"
        ) from exc
    if not core.warned_copy:
        core.warned_copy = True
        log.warning(
            "tierstore: copying %s into host memory failed (%s); it stays where it is and "
            "is tried again at the next put (warned once)",
            e.describe(),
            exc,
        )


def _note_kept(core: StoreCore) -> None:
    """Count the host entries over capacity that the disk cannot take.

    Note: [Counting what stays for want of room]
        The spill plan names only the oldest host entry the disk cannot take, but as many of
        the oldest as the host tier is over its capacity stay: each counts in
        ``kept_no_room``, once however many cascades meet it. (Counting the one the plan
        named at every cascade made one tensor read as six; counting it alone, three as
        one.) While the disk is paused no spill is planned, so this runs only when a spill
        was refused.
    """
    cfg, table = core.config, core.table
    over = table.resting[Tier.HOST] + table.host_reserved - cfg.host_bytes
    for e in table.resting_oldest_first(Tier.HOST):
        if over <= 0:
            break
        _note_no_room(core, e)
        over -= e.nbytes


def _note_no_room(core: StoreCore, e: Entry) -> None:
    if not e.kept:
        e.kept = True
        core.counters.kept_no_room += 1
    if not core.warned_no_room:
        core.warned_no_room = True
        log.warning(
            "tierstore: the disk tier is full (%s of %s); %s stays in host memory. "
            "Raise TIERSTORE_DISK_BYTES or free disk space. (warned once)",
            format_size(core.table.used[Tier.DISK]),
            format_size(core.disk.capacity),
            e.describe(),
        )
