"""Integrations with training frameworks; each submodule imports its framework only when used.

- :mod:`tierstore.integrations.transformers`: Hugging Face transformers models and ``Trainer``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["transformers"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"tierstore.integrations.{name}")
    raise AttributeError(f"module 'tierstore.integrations' has no attribute {name!r}")
