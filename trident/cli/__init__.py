"""The ``trident`` command line (``trident.cli.main``); ``trident.cli:main`` is its entry point."""

from trident.cli.main import main

__all__ = ["main"]
