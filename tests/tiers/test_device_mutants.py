"""Mutation checks of the GPU path: each mutant breaks one ordering rule of Note: [Copy ordering
on an accelerator] (``tiers/_device.py``), and the stream simulator must fail the scenario
written against it under both schedules: by the bytes where the schedule exposes it, by the
race checker everywhere.

The mutants are edits of the source in the form of ``tests/mutants.py`` (so
``mutants.run(mutant, [...])`` can also run any of them against a copy of the tree); here
they are applied in this process, by executing the edited module and swapping its names in,
which takes a fraction of a second instead of a fresh interpreter per mutant.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tierstore
from mutants import ROOT, Edit, Mutant, apply
from tierstore.tiers import _device
from tierstore.tiers._pinned import PinnedPool

from .test_device_sim import SCENARIOS, session

gpusim = pytest.importorskip("gpusim", exc_type=ImportError)

_DEVICE = "src/tierstore/tiers/_device.py"


@dataclass(frozen=True)
class GpuMutant:
    mutant: Mutant
    scenario: str
    """The scenario of test_device_sim.py written to catch it."""
    device: str = "cuda:1"
    layout: str = "strided"


def _m(name: str, what: str, old: str, new: str, scenario: str) -> GpuMutant:
    return GpuMutant(Mutant(name, what, (Edit(_DEVICE, old, new),)), scenario)


GPU_MUTANTS = (
    _m(
        "copy-without-wait",
        "the device-to-host copy does not wait on the event put recorded on the producer",
        "            stream.wait_event(ready)\n",
        "            pass\n",
        "put_get_each_tier",
    ),
    _m(
        "contiguous-outside-side-stream",
        "the bug that once shipped: a non-contiguous source is made contiguous on the loop "
        "thread's stream, after the ready event, outside the side stream",
        "    with _accelerator.use_stream(stream):\n        if ready is not None:\n"
        "            stream.wait_event(ready)\n"
        "        # After the wait, on the side stream (Note: [Copy ordering on an accelerator]).\n"
        "        src = t.resolve_conj().resolve_neg()\n"
        "        src = src if src.is_contiguous() else src.contiguous()\n",
        "    src = t.resolve_conj().resolve_neg()\n"
        "    src = src if src.is_contiguous() else src.contiguous()\n"
        "    with _accelerator.use_stream(stream):\n        if ready is not None:\n"
        "            stream.wait_event(ready)\n",
        "put_get_each_tier",
    ),
    _m(
        "source-freed-before-copy-ends",
        "copy_to_host returns before its copy has ended, so the store drops the source "
        "(and uses the host buffer) while the copy still runs",
        "    await _wait_event(done)\n    return host\n",
        "    return host\n",
        "put_get_each_tier",
    ),
    _m(
        "source-freed-at-cancel",
        "a copy cancelled by close() lets its source and buffer go without waiting for it",
        "        event.synchronize()\n        raise\n",
        "        raise\n",
        "close_with_copies_in_flight",
    ),
    _m(
        "reload-on-the-wrong-stream",
        "the host-to-device reload allocates its destination on the up stream, not the "
        "consumer's, so the consumer's free is not ordered after its own reads",
        "    with _accelerator.use_stream(consumer):\n        out = torch.empty(",
        "    with _accelerator.use_stream(side):\n        out = torch.empty(",
        "get_from_host",
    ),
    _m(
        "consumer-skips-the-wait",
        "the getter's stream does not wait on the reload's event",
        "    stream.wait_event(done)\n",
        "    pass\n",
        "get_from_host",
    ),
    _m(
        "no-record-stream",
        "a getter on another stream than the memory's is not recorded on it",
        "        t.record_stream(stream)\n",
        "        pass\n",
        "prefetched_on_another_stream",
    ),
    _m(
        "unclaimed-upload-freed-early",
        "a reload nobody took is dropped without its memory's stream waiting for the copy",
        "            _order_after_upload(t, pending[1])\n",
        "            pass\n",
        "prefetched_then_released",
    ),
    _m(
        "get-from-another-stream-unordered",
        "a get of an entry still on its device, on another stream than the put's, neither "
        "waits for the producer nor records the memory on the getter's stream",
        "    cur.wait_event(ready)\n    t.record_stream(cur)\n",
        "    pass\n",
        "device_tier_get_on_another_stream",
    ),
    _m(
        "ready-on-a-cached-stream",
        "put records its ready event on the stream current at the first put, not at each",
        "    event.record(_accelerator.current_stream(t.device))\n",
        "    event.record(ready_event.__dict__.setdefault(str(t.device), "
        "_accelerator.current_stream(t.device)))\n",
        "put_from_a_side_stream",
    ),
)


@contextlib.contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """Run ``_device`` as edited by ``mutant`` in this process for the block."""
    source = (ROOT / _DEVICE).read_text()
    for edit in mutant.edits:
        assert edit.path == _DEVICE and source.count(edit.old) == 1, mutant.name
        source = source.replace(edit.old, edit.new)
    edited = types.ModuleType(_device.__name__)
    edited.__file__ = _device.__file__
    exec(compile(source, _device.__file__, "exec"), edited.__dict__)
    names = [n for n in vars(edited) if not n.startswith("__") and hasattr(_device, n)]
    saved = {n: getattr(_device, n) for n in names}
    # Every module of the store that imported one of these names uses the edited one too.
    users = [
        (module, n)
        for name, module in list(sys.modules.items())
        if name.startswith("tierstore.") and module is not _device
        for n in names
        if getattr(module, n, None) is saved[n]
    ]
    try:
        for n in names:
            setattr(_device, n, getattr(edited, n))
        for module, n in users:
            setattr(module, n, getattr(edited, n))
        yield
    finally:
        for n, value in saved.items():
            setattr(_device, n, value)
        for module, n in users:
            setattr(module, n, saved[n])


@pytest.mark.parametrize("gm", GPU_MUTANTS, ids=lambda gm: gm.mutant.name)
def test_the_simulator_fails_each_mutant(gm: GpuMutant, tmp_path: Path) -> None:
    caught: dict[str, str] = {}
    with applied(gm.mutant):
        for schedule in ("lazy", "eager"):
            (tmp_path / schedule).mkdir()
            try:
                with session(schedule, tmp_path / schedule) as env:
                    SCENARIOS[gm.scenario](env, gm.device, gm.layout)
            except gpusim.Unsupported as exc:
                pytest.skip(str(exc))
            except (AssertionError, tierstore.TierStoreError) as exc:
                caught[schedule] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    assert set(caught) == {"lazy", "eager"}, f"{gm.mutant.name} survived: caught only {caught}"


def test_every_mutant_still_applies_to_the_source(tmp_path: Path) -> None:
    for gm in GPU_MUTANTS:
        (tmp_path / "src/tierstore/tiers").mkdir(parents=True, exist_ok=True)
        (tmp_path / _DEVICE).write_text((ROOT / _DEVICE).read_text())
        apply(gm.mutant, tmp_path)
        assert gm.scenario in SCENARIOS


def test_the_simulator_fails_a_close_that_leaves_copies_from_pinned_pieces_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mutant of the close, outside ``_device``: tear-down no longer waits for the copies
    still reading the pinned pool's pieces, which then go back to the host allocator while a
    copy reads them."""
    monkeypatch.setattr(PinnedPool, "synchronize", lambda self: None)
    caught: dict[str, str] = {}
    for schedule in ("lazy", "eager"):
        (tmp_path / schedule).mkdir()
        try:
            with session(schedule, tmp_path / schedule) as env:
                SCENARIOS["store_dropped_after_close_with_uploads_nobody_took"](
                    env, "cuda:1", "strided"
                )
        except gpusim.Unsupported as exc:
            pytest.skip(str(exc))
        except AssertionError as exc:
            caught[schedule] = str(exc)
    assert set(caught) == {"lazy", "eager"}, f"survived: caught only {caught}"
    assert all("touched pinned memory" in why for why in caught.values()), caught
