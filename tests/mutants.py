"""Mutation check of the correctness net: break the data path on purpose, see the suite fail.

Each mutant is a small edit of the source that a careless speed change could make: a read
shifted by 64 bytes, the lead dropped, two chunks swapped, a tail zeroed, a pooled buffer
handed to a second reader while the first still holds it, and the shifted-view bug that once
shipped (a view at the lead rebuilt with an absolute ``as_strided`` offset). For each one, the
repository is copied to a temporary directory, the edit applied, and the suite run there with
``-x``; a mutant the suite does not fail on is a hole in the net. Results go to stdout and,
with ``--json``, to a file; docs/reliability.md records the latest run.

    python tests/mutants.py                     # every mutant against the whole suite
    python tests/mutants.py --only zero-tail -- tests/adapters/test_bitexact.py

Takes a few minutes per mutant that survives (the whole suite runs); a killed mutant stops at
the first failing test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (which must occur exactly once) by ``new`` in ``path``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    edits: tuple[Edit, ...]


_POOL = "src/tierstore/tiers/_readpool.py"
_LAYOUT = "src/tierstore/tiers/raw/_layout.py"
_CHUNK_IO = "src/tierstore/tiers/raw/_chunk_io.py"
_STORAGE = "src/tierstore/adapters/_storage.py"

MUTANTS = (
    Mutant(
        "shift-read-64",
        "a tensor read back from disk at a lead is taken 64 bytes off where its bytes landed",
        (Edit(_POOL, "count=nbytes, offset=lead)", "count=nbytes, offset=lead ^ 64)"),),
    ),
    Mutant(
        "drop-lead",
        "the engine reports no lead, so a read is taken from the start of its first page",
        (
            Edit(
                _LAYOUT,
                "return self.lead, pad(self.lead + self.size)",
                "return 0, pad(self.lead + self.size)",
            ),
        ),
    ),
    Mutant(
        "swap-chunks",
        "chunks 1 and 2 of a blob of four or more are written to each other's places, each "
        "with a checksum of what was written (so only a value check sees it)",
        (
            Edit(
                _CHUNK_IO,
                "            self._write_chunk(blob, i, view, address + c.start, c)\n",
                "            j = {1: 2, 2: 1}.get(i, i) if len(blob.chunks) > 3 else i\n"
                "            self._write_chunk(blob, i, view, address + blob.chunks[j].start, c)\n",
            ),
        ),
    ),
    Mutant(
        "zero-tail",
        "the last 64 bytes of a blob's last chunk are zeroed after its checksum was verified",
        (
            Edit(
                _CHUNK_IO,
                "    def verify(self, blob: Blob, i: int, address: int) -> None:\n",
                "    def verify(self, blob: Blob, i: int, address: int) -> None:\n"
                "        self.verify_real(blob, i, address)\n"
                "        n = blob.chunks[i].length\n"
                "        if i == len(blob.chunks) - 1 and n >= 64:\n"
                "            memset(address + n - 64, 0, 64)\n\n"
                "    def verify_real(self, blob: Blob, i: int, address: int) -> None:\n",
            ),
        ),
    ),
    Mutant(
        "shared-read-buffer",
        "the read pool hands out a buffer that a tensor read earlier still uses",
        (
            Edit(
                _POOL,
                "self._busy.add(lease)",
                "self._busy.add(lease)\n            free.appendleft(m)",
            ),
        ),
    ),
    Mutant(
        "shrink-busy-buffer",
        "the read pool unmaps buffers at the end of a backward sweep whether or not a tensor "
        "still uses them",
        (
            Edit(
                _POOL,
                "free = sum(size * len(maps) for size, maps in self._free.items())",
                "free = self.mapped_bytes\n            for lease in list(self._busy):\n"
                "                lease.free.append(lease.buffer)",
            ),
        ),
    ),
    Mutant(
        "absolute-offset",
        "the bug that once shipped: get returns a view at the lead, and the adapters rebuild "
        "saved views with an absolute as_strided offset",
        (
            Edit(
                _POOL,
                "return window, torch.frombuffer("
                "view, dtype=torch.uint8, count=nbytes, offset=lead)",
                "return window, window.narrow(0, lead, nbytes)",
            ),
            Edit(
                _STORAGE,
                "typed.storage_offset() + self.offset)",
                "self.offset)",
            ),
        ),
    ),
    Mutant(
        "scatter-tail",
        "a packed blob read in place keeps the bytes of its last partial page from the bounce "
        "buffer instead of copying them in",
        (Edit(_CHUNK_IO, "if head and b.size > head:  # its last partial page", "if False:"),),
    ),
)


def apply(mutant: Mutant, root: Path) -> None:
    """Apply ``mutant``'s edits to the tree at ``root``.

    Raises:
        ValueError: an edit's text is not found exactly once (the source moved on; update
            the mutant).
    """
    for edit in mutant.edits:
        path = root / edit.path
        text = path.read_text()
        if text.count(edit.old) != 1:
            raise ValueError(
                f"mutant {mutant.name}: {edit.path} contains {edit.old!r} "
                f"{text.count(edit.old)} times, not once; update the mutant"
            )
        path.write_text(text.replace(edit.old, edit.new))


def run(mutant: Mutant | None, pytest_args: list[str], timeout: float) -> dict[str, object]:
    """Run the suite on a copy of the repository with ``mutant`` applied (None: unmutated)."""
    with tempfile.TemporaryDirectory(prefix="tierstore-mutant-") as tmp:
        root = Path(tmp)
        for name in ("src", "tests", "examples", "benchmarks", "pyproject.toml"):
            source = ROOT / name
            if source.is_dir():
                shutil.copytree(source, root / name, ignore=shutil.ignore_patterns("__pycache__"))
            elif source.exists():
                shutil.copy2(source, root / name)
        if mutant is not None:
            apply(mutant, root)
        env = {**os.environ, "PYTHONPATH": str(root / "src")}
        # pytest-benchmark, where installed, refuses to run under an xdist worker's environment,
        # and the suite turns its warning into an error.
        no_plugins = ["-p", "no:cacheprovider", "-p", "no:benchmark"]
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", *no_plugins, *pytest_args]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
            code: int | None = proc.returncode
            tail = (proc.stdout + proc.stderr).strip().splitlines()
        except subprocess.TimeoutExpired:
            code, tail = None, [f"timed out after {timeout:.0f} s"]
    failed = [ln.split(" - ")[0] for ln in tail if ln.startswith(("FAILED", "ERROR"))]
    return {
        "mutant": mutant.name if mutant else "(none)",
        "killed": code not in (0, None),
        "exit": code,
        "seconds": round(time.monotonic() - t0, 1),
        "first_failure": failed[0] if failed else (tail[-1] if tail else ""),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", action="append", help="run only this mutant (repeatable)")
    p.add_argument("--baseline", action="store_true", help="first check the unmutated suite")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("pytest_args", nargs="*", help="after --: what pytest runs (default: all)")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        p.error(f"unknown mutants {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
    results = []
    if args.baseline:
        base = run(None, args.pytest_args, args.timeout)
        print(json.dumps(base), flush=True)
        if base["killed"]:
            print("the unmutated suite fails; fix that first", file=sys.stderr)
            return 2
    for m in mutants:
        result = run(m, args.pytest_args, args.timeout)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    survivors = [r["mutant"] for r in results if not r["killed"]]
    print(f"{len(results) - len(survivors)} of {len(results)} mutants killed", end="")
    print(f"; survivors: {', '.join(map(str, survivors))}" if survivors else "")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
