"""Loading policies, references and tokenizers: ``from_pretrained(path_or_id)``, nothing else.

``check_model_path`` runs before any heavy work so that a typo fails in one line, not after a
server has spent a minute starting.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

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
        problem = _hub_problem(path)
        if problem is None:
            return path
        raise ModelPathError(
            f"{path}: neither a local directory nor a reachable hub id ({problem}; "
            f"create a local one: trident model init --preset tiny {path})"
        )
    raise ModelPathError(
        f"{path}: no such model directory (create one: trident model init --preset tiny {path})"
    )


@functools.cache
def _hub_problem(repo_id: str) -> str | None:
    """None if ``repo_id`` is in the local hub cache or the hub knows it; else why not, in a few
    words (asked once per process: loading the tokenizer and the model check it again)."""
    import os

    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
        return "not in the local hub cache, and HF_HUB_OFFLINE is set"
    try:
        HfApi().model_info(repo_id, timeout=10)
    except GatedRepoError:
        return None  # it exists; from_pretrained reports a missing token
    except RepositoryNotFoundError:
        return "no such model on the hub"
    except Exception as e:  # no network, DNS, proxy
        return f"the hub is unreachable: {' '.join(str(e).split()) or type(e).__name__}"
    return None


def dtype_of(name: str):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(check_model_path(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str, dtype: str = "float32", device: torch.device | None = None
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(check_model_path(path), dtype=dtype_of(dtype))
    if device is not None:
        # PreTrainedModel.to is wrapped in functools.wraps(nn.Module.to), which type checkers
        # read as the unbound nn.Module.to
        cast("torch.nn.Module", model).to(device)
    return model


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
