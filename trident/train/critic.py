"""The critic of PPO (``algo.use_critic``): a language-model backbone with a scalar value head.

``ValueModel`` is the decoder of a causal LM (``model.critic_path``, default the policy's own
checkpoint, as in verl and OpenRLHF where the critic starts from the actor or a reward model)
without its LM head, followed by ``Linear(hidden, 1)`` on the last hidden state. The value at
position t is V(s_t), the expected return of the state *before* token t+1 is generated, so
``token_values`` is aligned like every other per-token tensor of the trainer (column t describes
token t+1 of ``input_ids``; see :mod:`trident.train.batch`).

The head is initialised to zero: the first step's values are exactly 0, so the first GAE
advantages are the (discounted, lambda-weighted) returns themselves, and the head learns the
scale of the rewards from there instead of starting from a random offset.

The critic is an ordinary ``nn.Module``: ``fsdp.shard`` wraps it like the policy (its decoder
layers are at ``.model.layers``), and it has its own AdamW (``trainer.critic_lr``).
"""

from __future__ import annotations

import torch
from torch import nn

from trident.models.load import load_causal_lm


class ValueModel(nn.Module):
    """Decoder of a causal LM + a zero-initialised scalar head."""

    def __init__(self, path: str, dtype: str = "float32") -> None:
        super().__init__()
        lm = load_causal_lm(path, dtype)
        self.config = lm.config
        self.model = getattr(lm, lm.base_model_prefix)  # the decoder; the LM head is dropped
        dtype_ = next(self.model.parameters()).dtype  # one dtype per FSDP unit
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=dtype_)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """V(s_t) for every position [B, T] (float32)."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # a fresh tensor, not a view: FSDP2 hooks the output for backward
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)


def token_values(critic: nn.Module, batch) -> torch.Tensor:
    """Values [B, T-1] aligned with the batch's predicted tokens (column t: V before token t+1)."""
    return critic(batch.input_ids, batch.attention_mask)[:, :-1]
