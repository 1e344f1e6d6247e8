"""Adapters that run other frameworks' environments as trident environments (``Env``).

- ``trident.envs.adapters.verifiers_env``: ``VerifiersEnv`` runs a ``verifiers`` environment
  (PrimeIntellect's classic ``vf.Environment`` API: ``SingleTurnEnv``, ``MultiTurnEnv``,
  ``ToolEnv``; its rubric gives the reward). Extra: ``pip install 'trident[verifiers]'``.
- ``trident.envs.adapters.openenv_env``: ``OpenEnvEnv`` talks to an OpenEnv environment (an HTTP
  server's WebSocket session, or an ``Environment`` class run in-process); actions come from the
  assistant turn's text or from a tool call. Extra: ``pip install 'trident[openenv]'``.

Each module imports its framework only when an adapter is built, so importing trident never needs
the extras; a missing extra is an ``ImportError`` naming the ``pip install`` that adds it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or fail with the install command of the trident extra that provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"this environment adapter needs the {module!r} package: "
            f"pip install 'trident[{extra}]' ({e})"
        ) from e
