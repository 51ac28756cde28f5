"""Optional modules some tests need, or a clean skip where they are missing.

This folder is on ``sys.path`` (its conftest.py puts it there), so tests in every subfolder
import this module by its name.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def importorskip_transformers() -> ModuleType:
    """transformers, or a skip where it is missing or does not run on this torch (transformers
    5 needs torch 2.6). Works at module level too."""
    transformers = pytest.importorskip("transformers")
    if not transformers.utils.is_torch_available():
        pytest.skip(
            f"transformers {transformers.__version__} does not run on torch {torch.__version__}",
            allow_module_level=True,
        )
    return transformers
