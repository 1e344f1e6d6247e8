"""What a training service's caller sends the trainer, in trident's own types: the datums of a
``forward_backward`` call, the Adam parameters of an ``optim_step`` and the LoRA shape of a new
model (the Tinker API's ``Datum``, ``AdamParams`` and ``LoraConfig``; the wire format itself is
``trident.tinker.wire``'s, so the trainer never imports the Tinker SDK).

Alignment is the caller's: position ``i`` of ``input_tokens`` predicts ``loss_inputs
["target_tokens"][i]``; the client has already shifted the sequence, and every loss input has
one value per input position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Datum:
    """One sequence of a ``forward_backward`` call.

    ``input_tokens``: int64 ``[T]``. ``loss_inputs``: name -> ``[T]`` tensor, e.g.
    ``target_tokens`` (int64), ``weights``, ``logprobs`` (the sampler's), ``advantages``
    (float32), as the loss named by the call requires."""

    input_tokens: torch.Tensor
    loss_inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamParams:
    """An ``optim_step``'s AdamW settings (``torch.optim.AdamW`` semantics); ``grad_clip_norm``
    0 means no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass(frozen=True)
class LoraShape:
    """The adapters a new model trains: ``rank`` 0 means full fine-tuning. ``alpha`` is not on
    the Tinker wire; the service's config supplies it."""

    rank: int = 32
    alpha: float = 32.0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
