"""The benchmark's progress bar: tqdm, on stderr, one tick per measurement."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from tqdm import tqdm

__all__ = ["progress_bar"]


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A callback that ticks a bar of ``total`` steps and shows the label of the one starting."""
    with tqdm(total=total, disable=not enabled, file=sys.stderr, unit="run", leave=True) as bar:

        def step(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)

        yield step
