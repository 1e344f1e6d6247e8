"""Tensor plumbing shared by the trainer and the sync: FSDP2's DTensor shards made whole."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: an FSDP2 ``DTensor`` shard is all-gathered (a collective: every rank
    must call it), a plain tensor is returned as it is; detached either way."""
    full = getattr(tensor, "full_tensor", None)
    return cast(torch.Tensor, full() if callable(full) else tensor).detach()


NamedTensors = Iterable[tuple[str, torch.Tensor]]  # a weight stream: (HF name, tensor or shard)
