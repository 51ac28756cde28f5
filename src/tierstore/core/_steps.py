"""Training steps: what the store did in each and its peaks, and the warning given once per
store when a step or an offloading block stored nothing.

Note: [Say when offloading does nothing]
    A store that receives nothing looks exactly like one that works: training runs, memory
    stays high, and nothing says why. That happened when the Trainer's own checkpointing
    switch replaced tierstore's, and it happens when every saved tensor is under
    ``min_bytes`` or is a parameter. So a step (``end_step``) or an ``offload_activations``
    block with gradients on that stores nothing warns, once per store, naming what was
    left in place and why, or that nothing reached the store at all.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tierstore._fork_safe_lock import ForkSafeLock
from tierstore._state import Tier
from tierstore._stats import StepStats, format_size, format_skipped

if TYPE_CHECKING:
    from tierstore._stats import StoreStats
    from tierstore.core._core import StoreCore
    from tierstore.core._entries import EntryTable

__all__ = [
    "Steps",
    "check_step_number",
    "counts_since",
    "finish_step",
    "nothing_offloaded_message",
    "warn_nothing_offloaded",
]


def counts_since(now: Mapping[str, int], then: Mapping[str, int]) -> dict[str, int]:
    """The counts that changed from ``then`` to ``now`` (``stats().skipped`` and the like),
    by how much."""
    return {k: n - then.get(k, 0) for k, n in now.items() if n != then.get(k, 0)}


def check_step_number(step: object) -> int | None:
    """``step`` as a step number: None, or a non-negative int.

    Raises:
        ValueError: anything else (a bool, a float, a negative number).
    """
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: expected a non-negative integer or None")
    return step


class Steps:
    """Where the current step began: the store's counters then, and the last step's number.

    Args:
        start: the store's stats when it opened.
    """

    def __init__(self, start: StoreStats) -> None:
        self.start = start
        self.number = 0

    def stats(self, now: StoreStats, table: EntryTable, step: int | None) -> StepStats:
        """The step from ``self.start`` to ``now``, numbered ``step`` (default: the next)."""
        a = self.start
        return StepStats(
            step=self.number + 1 if step is None else step,
            puts=now.puts - a.puts,
            bytes_put=now.bytes_put - a.bytes_put,
            bytes_offloaded=now.bytes_offloaded - a.bytes_offloaded,
            bytes_to_disk=now.bytes_to_disk - a.bytes_to_disk,
            bytes_from_disk=now.bytes_from_disk - a.bytes_from_disk,
            get_wait_seconds=now.get_wait_seconds - a.get_wait_seconds,
            put_wait_seconds=now.put_wait_seconds - a.put_wait_seconds,
            prefetch_hits=now.prefetch_hits - a.prefetch_hits,
            prefetch_misses=now.prefetch_misses - a.prefetch_misses,
            kept_no_room=now.kept_no_room - a.kept_no_room,
            skipped=counts_since(now.skipped, a.skipped),
            skipped_bytes=counts_since(now.skipped_bytes, a.skipped_bytes),
            peak_off_device_bytes=table.step_peak_off_device,
            peak_device_bytes=table.step_peak[Tier.DEVICE],
            peak_host_bytes=table.step_peak[Tier.HOST],
            peak_disk_bytes=table.step_peak[Tier.DISK],
        )

    def advance(self, now: StoreStats, table: EntryTable, number: int) -> None:
        """End step ``number`` at ``now``: the next one counts from here."""
        self.start = now
        self.number = number
        table.start_step()


_ADVICE = {
    "below_min_bytes": (
        "tensors below min_bytes ({min_bytes}, TIERSTORE_MIN_BYTES) stay where they are: "
        "lower it (min_bytes='64KiB', say) if such tensors are what your model saves"
    ),
    "parameter_or_buffer": (
        "parameters and module buffers are in memory anyway, so they are never stored: only "
        "activations are"
    ),
    "unsupported": "sparse, nested, meta, quantized and subclass tensors cannot be stored",
    "no_room": "no tier had room: raise TIERSTORE_HOST_BYTES or TIERSTORE_DISK_BYTES",
}


def nothing_offloaded_message(
    where: str, skipped: Mapping[str, int], skipped_bytes: Mapping[str, int], min_bytes: int
) -> str:
    """What to say when ``where`` (``"step 3"``, ``"an offload_activations block"``) stored
    nothing: what was left in place and why, or that nothing reached the store."""
    if not sum(skipped.values()):
        return (
            f"tierstore: offloading is on, but {where} stored nothing: no tensor reached the "
            "store. Run the forward inside `with tierstore.offload_activations(store)` (or "
            "through tierstore.checkpoint) with gradients enabled, and check that the model "
            "uses this store. This warning is shown once per store."
        )
    advice = "; ".join(
        _ADVICE[r].format(min_bytes=format_size(min_bytes))
        for r in sorted(skipped, key=lambda r: -skipped_bytes.get(r, 0))
        if r in _ADVICE
    )
    return (
        f"tierstore: offloading is on, but {where} stored nothing: every tensor was left in "
        f"place ({format_skipped(skipped, skipped_bytes)}). {advice[:1].upper()}{advice[1:]}. "
        "This warning is shown once per store."
    )


_warned_lock = ForkSafeLock()
_warned: weakref.WeakSet[object] = weakref.WeakSet()


def warn_nothing_offloaded(
    store: object,
    where: str,
    skipped: Mapping[str, int],
    skipped_bytes: Mapping[str, int],
    min_bytes: int,
    *,
    stacklevel: int,
) -> bool:
    """Warn (``RuntimeWarning``) that ``where`` stored nothing, once per ``store``; return
    whether it warned (Note: [Say when offloading does nothing]).

    ``stacklevel`` counts as ``warnings.warn``'s does, from the caller of this function.
    """
    with _warned_lock:
        if store in _warned:
            return False
        _warned.add(store)
    message = nothing_offloaded_message(where, skipped, skipped_bytes, min_bytes)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
    return True


def finish_step(store: object, core: StoreCore, step: int | None, min_bytes: int) -> StepStats:
    """End a step of ``core``, the core of the facade ``store``: the step's stats, after a
    warning, once per store, if it stored nothing (Note: [Say when offloading does nothing]).

    Raises:
        ValueError: ``step`` is not a non-negative integer or None.
    """
    stats = core.step_stats(check_step_number(step), end=True)
    if stats.puts == 0:
        # stacklevel 3: the warning points at the code that called the facade's end_step.
        warn_nothing_offloaded(
            store,
            f"step {stats.step}",
            stats.skipped,
            stats.skipped_bytes,
            min_bytes,
            stacklevel=3,
        )
    return stats
