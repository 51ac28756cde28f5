"""The mutation harness (tests/mutants.py) stays usable: every mutant still applies, and one
is killed by the test written against it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mutants import MUTANTS, ROOT, apply, run


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_every_mutant_still_applies_to_the_source(tmp_path: Path, mutant: object) -> None:
    shutil.copytree(ROOT / "src", tmp_path / "src")
    apply(mutant, tmp_path)  # type: ignore[arg-type]


def test_a_shifted_read_is_caught_by_the_get_contract_test() -> None:
    shifted = next(m for m in MUTANTS if m.name == "shift-read-64")
    test = "tests/test_store.py::test_get_returns_a_tensor_that_owns_exactly_its_bytes"
    result = run(shifted, [test], timeout=300)
    assert result["killed"], result
    assert "owns_exactly_its_bytes" in str(result["first_failure"])
