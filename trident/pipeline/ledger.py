"""The token ledger: every sample generated is trained, waiting in the buffer, or discarded for a
named reason, and so is every response token, at every step and over the run and its resumes.

    generated = trained + waiting + discarded[infra_error] + discarded[untrainable]
                + discarded[no_signal]

holds twice: in samples and in response tokens. A sample's response tokens are
``Sample.num_response_tokens``, the tokens the model wrote (the loss mask's ones: not the prompt,
not an environment's tool output), counted once, when the sample is complete and scored. A
response that ``separate_async`` resumed across weight updates (or from a checkpoint's prefix,
or on another server after its own died) is generated in segments; its tokens are counted once,
as the whole response, when it completes. Counting segments as they arrive could not balance
exactly: a partial response in flight is in no bucket yet, and the work a resumed run or a
restarted group generates again (a group caught in flight without a streamed prefix, a dead
server's whole group) would count twice. The segments' throughput is ``rollout/generated_tokens``
(``trident.pipeline.metrics.RolloutStats``), which therefore may exceed the ledger's.

The counts are kept per step (``ledger/*``) and over the run (``ledger/run/*``, saved in every
checkpoint and continued by a resume). An imbalance is a bug between generation and the trainer
(a sample lost, counted twice, or changed on its way): the run stops with ``LedgerError``, whose
message says which count does not balance and by how much.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from trident.sample import Sample

DISCARD_REASONS = ("infra_error", "untrainable", "no_signal")
UNITS = ("samples", "tokens")


class LedgerError(RuntimeError):
    """Samples or tokens went missing or were counted twice between generation and the trainer
    (a bug)."""


class Ledger:
    """The counts over the run (``run``); ``account`` adds a step's and checks the balance."""

    def __init__(self, run: Mapping[str, int] | None = None) -> None:
        self.run: Counter[str] = Counter(run or {})

    def account(
        self,
        generated: Sequence[Sample],
        trained: Sequence[Sample],
        discarded: Sequence[tuple[str, Sample]],
        waiting: Sequence[Sample],
        steps: int,
        mask_truncated: bool = False,
    ) -> dict[str, float]:
        """Called once per step, after it trained on ``trained``: add the samples ``generated``
        and ``discarded`` (reason, sample) since the previous step, then check the run's totals
        against the samples ``waiting`` in the buffer (``steps``: steps taken, for the message).
        Returns the ``ledger/*`` metrics; raises ``LedgerError`` on an imbalance."""
        step: Counter[str] = Counter()
        for reason in DISCARD_REASONS:  # every key in every step, zero or not
            step[f"discarded/{reason}_samples"] = step[f"discarded/{reason}_tokens"] = 0
        for prefix, group in (("generated", generated), ("trained", trained)):
            step[f"{prefix}_samples"] += len(group)
            step[f"{prefix}_tokens"] += tokens(group)
        for reason, s in discarded:
            step[f"discarded/{reason}_samples"] += 1
            step[f"discarded/{reason}_tokens"] += s.num_response_tokens
        step["truncated_masked_samples"] = sum(
            s.status == "truncated" and mask_truncated for s in trained
        )
        self.run.update(step)
        out = {f"ledger/{k}": float(v) for k, v in step.items()}
        out |= {f"ledger/run/{k}": float(v) for k, v in self.run.items()}
        in_buffer = {"samples": len(waiting), "tokens": tokens(waiting)}
        for unit in UNITS:
            waiting_now = self.waiting(unit)
            if waiting_now != in_buffer[unit]:
                raise LedgerError(self._imbalance(unit, in_buffer[unit], steps))
            out[f"ledger/run/waiting_{unit}"] = float(waiting_now)
        return out

    def waiting(self, unit: str) -> int:
        """What the counts say is waiting in the buffer: generated - trained - discarded."""
        return self.run[f"generated_{unit}"] - self.run[f"trained_{unit}"] - self.discarded(unit)

    def discarded(self, unit: str) -> int:
        return sum(self.run[f"discarded/{r}_{unit}"] for r in DISCARD_REASONS)

    def _imbalance(self, unit: str, in_buffer: int, steps: int) -> str:
        what = "response tokens" if unit == "tokens" else "samples"
        reasons = ", ".join(f"{self.run[f'discarded/{r}_{unit}']} {r}" for r in DISCARD_REASONS)
        return (
            f"token ledger does not balance after {steps} steps: "
            f"{self.run[f'generated_{unit}']} {what} generated, {self.run[f'trained_{unit}']} "
            f"trained, {self.discarded(unit)} discarded ({reasons}), but {in_buffer} waiting in "
            f"the buffer instead of {self.waiting(unit)}"
        )

    def state_dict(self) -> dict[str, int]:
        return dict(self.run)


def tokens(samples: Sequence[Sample]) -> int:
    """The response tokens of ``samples`` (the model's own: ``Sample.num_response_tokens``)."""
    return sum(s.num_response_tokens for s in samples)
