"""Loading policies, references and tokenizers: ``from_pretrained(path_or_id)``, nothing else.

``check_model_path`` runs before any heavy work so that a typo fails in one line, not after a
server has spent a minute starting.
"""

from __future__ import annotations

import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelPathError(ValueError):
    """The model path is missing or not a checkpoint."""


def check_model_path(path: str) -> str:
    """Return ``path`` if it is a checkpoint directory or looks like a hub id; raise otherwise."""
    if not path:
        raise ModelPathError(
            "model.path is empty: set model.path=DIR (create one: trident model init --preset tiny DIR)"
        )
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelPathError(f"{path}: not a model checkpoint (no config.json)")
        return str(p)
    if p.exists():
        raise ModelPathError(
            f"{path}: is a file; model.path must be a checkpoint directory or hub id"
        )
    if _HUB_ID.match(path) and not path.startswith((".", "/", "~")):
        return path  # a hub id; from_pretrained resolves it (or reports that it cannot)
    raise ModelPathError(
        f"{path}: no such model directory (create one: trident model init --preset tiny {path})"
    )


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(check_model_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(check_model_path(path), dtype=dtype_of(dtype))


def encode_chat(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools=None
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def prompt_messages(prompt: str | list[dict]) -> list[dict]:
    """A dataset prompt (a string or chat messages) as chat messages."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
