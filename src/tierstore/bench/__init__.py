"""The ``tierstore-bench`` command (``python -m tierstore.bench``); see ``__main__``."""
