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


def micro_batches(lengths: list[int], token_budget: int, packed: bool = False) -> list[list[int]]:
    """Group indices so that a micro-batch's tokens stay within ``token_budget``: rows x longest
    row (padded), or the sum of the rows' lengths (``packed``: one row, no padding). Longest
    first, so padding stays small. A row longer than the budget gets a micro-batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if packed:
            cost = sum(lengths[j] for j in current) + lengths[i]
        else:  # the first row of ``current`` is its longest
            cost = (len(current) + 1) * (lengths[current[0]] if current else lengths[i])
        if current and cost > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def pack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``trainer.packing``: the rows' tokens placed back to back in as few rows as hold them, each
    as wide as the longest row (first fit, longest first), so padding is only what the bins leave
    over. Rows are not made wider than the longest sample: attention costs rows x width², and on
    kernels without variable-length support (SDPA on CPU) one very long row costs more than the
    padding it saves (measured, ``benchmarks/packing.py``).

    Returns ``input_ids`` and ``position_ids`` [R, W] (positions restart at 0 with each sample,
    from which transformers masks attention between the samples when no attention mask is
    given; a bin's leftover is pad tokens, each its own sequence), ``where`` [B, T-1] (the
    predicted columns whose target token exists) and ``at`` (the flat [R * W] position whose
    logits predict each of them, in ``where``'s row-major order)."""
    lengths = batch.attention_mask.sum(1).tolist()
    width = max(lengths)
    bins: list[int] = []  # tokens used per packed row
    offsets = [0] * len(lengths)  # flat position of each sample's first token
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, used in enumerate(bins) if used + lengths[i] <= width), len(bins))
        if r == len(bins):
            bins.append(0)
        offsets[i] = r * width + bins[r]
        bins[r] += lengths[i]
    input_ids = torch.zeros(len(bins) * width, dtype=torch.long)
    position_ids = torch.zeros(len(bins) * width, dtype=torch.long)
    at = []
    for i, (n, start) in enumerate(zip(lengths, offsets, strict=True)):
        input_ids[start : start + n] = batch.input_ids[i, :n]
        position_ids[start : start + n] = torch.arange(n)
        at.append(torch.arange(start, start + n - 1))
    where = batch.attention_mask[:, 1:].bool()
    shape = (len(bins), width)
    return input_ids.view(shape), position_ids.view(shape), where, torch.cat(at)
