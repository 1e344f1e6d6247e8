"""From Samples to padded tensors, and micro-batches by a token budget.

Per-token tensors are aligned to *predicted* positions: column ``t`` of ``mask``/``engine_logp``
/``advantages`` describes token ``t+1`` of ``input_ids``, the one the logits at position ``t``
predict. So every such tensor is [B, T-1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trident.sample import Sample


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1] float, 1 = trained token
    engine_logp: torch.Tensor  # [B, T-1]
    versions: torch.Tensor  # [B, T-1] long, -1 = not generated

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device) -> Batch:
        return Batch(
            *(
                t.to(device)
                for t in (
                    self.input_ids,
                    self.attention_mask,
                    self.mask,
                    self.engine_logp,
                    self.versions,
                )
            )
        )


def collate(samples: list[Sample], pad_id: int) -> Batch:
    width = max(len(s.token_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    logp = torch.zeros((b, width), dtype=torch.float32)
    versions = torch.full((b, width), -1, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s.token_ids)
        input_ids[i, :n] = torch.tensor(s.token_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        logp[i, :n] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions[i, :n] = torch.tensor(s.versions)
    return Batch(input_ids, attention, mask[:, 1:], logp[:, 1:], versions[:, 1:])


def micro_batches(lengths: list[int], token_budget: int) -> list[list[int]]:
    """Group indices so that (rows x longest row) stays within ``token_budget``; longest first,
    so padding stays small. A row longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]
        if current and (len(current) + 1) * width > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
