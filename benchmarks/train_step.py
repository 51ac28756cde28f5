"""The training-step benchmark, kept at its old path: see ``tierstore-bench train --help``."""

from tierstore.bench.train import main

if __name__ == "__main__":
    raise SystemExit(main())
