"""The Sample: one record that flows through rollout, reward, buffer and trainer.

Token-level truth, no prompt/completion split: ``token_ids`` is the whole sequence exactly as the
engine saw and produced it, ``loss_mask`` marks the tokens the policy is trained on (the model's
own tokens; never prompt or tool output), and ``logprobs``/``versions`` are per token (prompt and
tool tokens carry 0.0 and -1). Feature-specific data belongs in ``metadata``, not in new fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Status = Literal["ok", "truncated", "aborted", "tool_error", "timeout", "infra_error"]


@dataclass
class Sample:
    id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float | None = None
    status: Status = "ok"
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError(
                f"sample {self.id}: per-token fields differ in length "
                f"(token_ids={n}, loss_mask={len(self.loss_mask)}, "
                f"logprobs={len(self.logprobs)}, versions={len(self.versions)})"
            )

    @property
    def num_response_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def prompt_len(self) -> int:
        """Length of the leading run of non-trained tokens (the prompt)."""
        for i, m in enumerate(self.loss_mask):
            if m:
                return i
        return len(self.loss_mask)

    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]
