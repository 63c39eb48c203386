"""A package's public names, imported on first use (PEP 562's module ``__getattr__``).

``elmo-pretrain prepare`` and ``--help`` import the command modules of every package; a
package whose ``__init__`` imported its model code eagerly would load torch (~2 s of CPU)
into processes that never use it (the job runner's ``prepare`` phase, every ``--help``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(
    package: str, where: dict[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``where`` maps each submodule to the names
    it defines; a name is imported from its submodule when first read."""
    owner = {name: f"{package}.{module}" for module, names in where.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in owner:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(owner[name]), name)

    return __getattr__, sorted(owner)
