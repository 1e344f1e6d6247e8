"""Build a TridentConfig from YAML files plus dotted command-line overrides.

``load_config(["a.yaml"], ["rollout.n=8", "algo.name=gspo"])``: files merge left to right,
then overrides; values are parsed as YAML (``8`` is an int, ``[a, b]`` a list). Unknown keys
fail with a did-you-mean before pydantic sees them, so the message names the exact dotted path.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from trident.config.root import TridentConfig


class ConfigError(ValueError):
    """A configuration problem, reported as one actionable line."""


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_override(text: str) -> dict[str, Any]:
    """``"a.b.c=1"`` -> ``{"a": {"b": {"c": 1}}}``."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. rollout.n=8)")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node: dict[str, Any] = {}
    cursor = node
    parts = key.split(".")
    for part in parts[:-1]:
        cursor[part] = {}
        cursor = cursor[part]
    cursor[parts[-1]] = value
    return node


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def check_keys(data: dict, model: type[BaseModel] = TridentConfig, prefix: str = "") -> None:
    """Raise ConfigError for the first key that is not a field, suggesting the closest one."""
    fields = {name: f for name, f in model.model_fields.items()}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            hint = (
                f"; did you mean {prefix}{close[0]}?"
                if close
                else f"; valid keys: {', '.join(sorted(fields))}"
            )
            raise ConfigError(f"unknown config key {path!r}{hint}")
        sub = _model_type(fields[key].annotation)
        if sub is not None and isinstance(value, dict):
            check_keys(value, sub, f"{path}.")
        elif get_origin(fields[key].annotation) is list and isinstance(value, list):
            (item_type,) = get_args(fields[key].annotation) or (None,)
            item_model = _model_type(item_type)
            for i, item in enumerate(value):
                if item_model is not None and isinstance(item, dict):
                    check_keys(item, item_model, f"{path}[{i}].")


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid config: " + "; ".join(parts)


def load_config(files: Sequence[str | Path] = (), overrides: Sequence[str] = ()) -> TridentConfig:
    data: dict[str, Any] = {}
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level")
        data = _merge(data, loaded)
    for text in overrides:
        data = _merge(data, parse_override(text))
    data.pop("derived", None)  # a saved config.yaml carries derived values; they are recomputed
    check_keys(data)
    try:
        return TridentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def dump_config(cfg: TridentConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def save_config(cfg: TridentConfig, run_dir: str | Path) -> Path:
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))
    return path
