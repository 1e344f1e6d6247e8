"""The config reference in Markdown, generated from the pydantic models into ``docs/config.md``
(a test keeps the two in sync: regenerate with ``python -m trident.config.docs``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_args

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from trident.config.root import TridentConfig

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return ""
    return f"`{json.dumps(value) if not isinstance(value, str) else value or chr(34) * 2}`"


def _rows(prefix: str, section: type[BaseModel]) -> list[str]:
    """A section's table rows; an optional sub-section (``model.lora``) gets its own rows
    below its key."""
    rows = []
    for key, f in section.model_fields.items():
        desc = (f.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}.{key}` | {_default(f)} | {desc} |")
        args = get_args(f.annotation)  # X | None
        for sub in args if type(None) in args else ():
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                rows += _rows(f"{prefix}.{key}", sub)
    return rows


def render() -> str:
    lines = []
    for name, field in TridentConfig.model_fields.items():
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        lines += [f"#### `{name}`", "", (section.__doc__ or "").strip().splitlines()[0], ""]
        lines += ["| key | default | description |", "|---|---|---|"]
        lines += _rows(name, section)
        lines.append("")
    return "\n".join(lines).strip() + "\n"


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def update_reference(path: str | Path = REFERENCE) -> bool:
    """Rewrite the generated block in ``docs/config.md``; returns whether it changed."""
    path = Path(path)
    text = path.read_text()
    block = f"{BEGIN}\n{render()}{END}"
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.DOTALL)
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    print("docs/config.md updated" if update_reference() else "docs/config.md already up to date")
