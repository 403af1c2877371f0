"""A mode package's public names, loaded on first use (PEP 562, as ``gridtrain/__init__.py``).

Importing a mode's torch-free ``geometry.py`` runs its package's ``__init__``; with the
names loaded lazily that runs no layer code, so the config and ``Layout`` stay torch-free
while ``from gridtrain.parallel.tensor.mode_1d import ColumnLinear`` works as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The package's ``__getattr__``: ``where`` maps each public name to its submodule."""

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
