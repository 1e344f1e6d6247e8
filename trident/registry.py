"""``"module:attr"`` entry points: the one loader behind every name a user can configure
(reward functions, environments, tool-call parsers, adapters' factories)."""

from __future__ import annotations

import importlib
from typing import Any


def load_entry_point(entry: str) -> Any:
    """The attribute ``attr`` of module ``module`` for ``entry = "module:attr"`` (``attr`` may be
    dotted, ``pkg.mod:Class.factory``). A malformed entry or a missing attribute raises a
    ``ValueError`` naming the entry; a missing module raises ``ModuleNotFoundError``."""
    module, sep, attr = entry.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"entry point {entry!r} is not of the form module:attribute")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"entry point {entry!r}: {module} has no attribute {attr!r}") from None
    return obj
