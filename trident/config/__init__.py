"""Typed configuration (pydantic). Importable without torch."""

from trident.config.loader import ConfigError, dump_config, load_config, parse_override, save_config
from trident.config.root import TridentConfig

__all__ = [
    "ConfigError",
    "TridentConfig",
    "dump_config",
    "load_config",
    "parse_override",
    "save_config",
]
