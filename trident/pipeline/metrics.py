"""The per-step and per-run figures of a training run: one definition for every mode.

Two populations, named apart because they differ whenever something is filtered:

- **trained**: the samples the step's loss used. ``reward_mean``, ``reward_std``, ``accuracy``,
  ``response_len_*``, ``truncated_fraction``, ``response_tokens`` and ``trained_samples`` are
  over these.
- **generated**: every sample whose generation finished since the previous step, whatever
  became of it (trained now or later, dropped by dynamic sampling, an infrastructure failure,
  nothing to train on). ``generated/*`` keys are over these: the policy's performance as sampled.

In ``sync`` the two differ only by the filters; in the async modes a generated sample may also be
trained in a later step.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from trident.pipeline.buffer import RolloutBuffer
from trident.sample import Sample
from trident.telemetry.trace import Trace

# Trainer spans that are work; the rest of its time ("queue wait" or nothing) is idle.
TRAINER_BUSY = {"train", "weight sync", "checkpoint"}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def trained_metrics(samples: list[Sample]) -> dict[str, float]:
    """Reward, accuracy (reward > 0.5), lengths and truncation of the samples a step trained on."""
    rewards = [s.reward for s in samples if s.reward is not None] or [0.0]
    mean = _mean(rewards)
    lengths = [s.num_response_tokens for s in samples] or [0]
    return {
        "reward_mean": mean,
        "reward_std": _mean([(r - mean) ** 2 for r in rewards]) ** 0.5,
        "accuracy": _mean([float(r > 0.5) for r in rewards]),
        "response_len_mean": _mean([float(n) for n in lengths]),
        "response_len_max": float(max(lengths)),
        "truncated_fraction": _mean([float(s.status == "truncated") for s in samples]),
        "response_tokens": float(sum(lengths)),
        "trained_samples": float(len(samples)),
    }


def generated_metrics(samples: list[Sample]) -> dict[str, float]:
    """``generated/*``: every sample generated in the window (rewards of the scored ones)."""
    rewards = [s.reward for s in samples if s.reward is not None]
    return {
        "generated/samples": float(len(samples)),
        "generated/tokens": float(sum(s.num_response_tokens for s in samples)),
        "generated/reward_mean": _mean(rewards),
        "generated/accuracy": _mean([float(r > 0.5) for r in rewards]),
    }


def overlong_metrics(samples: list[Sample]) -> dict[str, float]:
    """Mean overlong penalty and the fraction of samples it touched (``algo.overlong_penalty``)."""
    penalties = [s.metrics["overlong_penalty"] for s in samples if "overlong_penalty" in s.metrics]
    if not penalties:
        return {}
    return {
        "overlong/penalty_mean": _mean(penalties),
        "overlong/penalized_fraction": _mean([float(p < 0) for p in penalties]),
    }


def staleness_metrics(samples: list[Sample], version: int, max_staleness: int) -> dict[str, float]:
    """Per-token staleness of a batch trained at ``version``: mean, max and histogram."""
    ages = Counter(
        version - v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m
    )
    total = sum(ages.values()) or 1
    out = {
        "staleness/mean": sum(a * n for a, n in ages.items()) / total,
        "staleness/max": float(max(ages, default=0)),
    }
    out |= {f"staleness/frac_{a}": ages.get(a, 0) / total for a in range(max_staleness + 1)}
    return out


@dataclass
class RolloutStats:
    """Counts over the whole run: request segments, interruptions, tokens generated."""

    segments: int = 0
    aborted: int = 0
    resumed: int = 0
    failed_segments: int = 0
    resubmitted: int = 0  # requests whose server died, sent again to another (or it restarted)
    generated_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/segments": float(self.segments),
            "rollout/aborted": float(self.aborted),
            "rollout/resumed": float(self.resumed),
            "rollout/resubmitted": float(self.resubmitted),
            "rollout/generated_tokens": float(self.generated_tokens),
        }


def pipeline_summary(
    trace: Trace,
    buffer: RolloutBuffer,
    stats: RolloutStats,
    servers: list[str],
    start: float,
    end: float,
) -> dict[str, Any]:
    """The run's pipeline figures: throughput, idle fractions, staleness, interruptions, waste."""
    wall = end - start
    trained = buffer.stats.trained_samples
    thrown_away = max(stats.generated_tokens - buffer.stats.trained_tokens, 0)
    return {
        "wall_s": wall,
        "trained_samples": trained,
        "seconds_per_trained_sample": wall / max(trained, 1),
        "trainer_idle_fraction": trace.idle_fraction(["trainer"], start, end, TRAINER_BUSY),
        "rollout_idle_fraction": trace.idle_fraction(
            [f"rollout {url}" for url in servers], start, end, {"generate"}
        ),
        "staleness_histogram": {str(a): n for a, n in sorted(buffer.stats.staleness.items())},
        "staleness_fractions": {str(a): f for a, f in buffer.stats.staleness_fractions().items()},
        "aborted_requests": stats.aborted,
        "resumed_requests": stats.resumed,
        "failed_requests": stats.failed_segments,
        "resubmitted_requests": stats.resubmitted,
        "generated_tokens": stats.generated_tokens,
        "trained_tokens": buffer.stats.trained_tokens,
        "tokens_thrown_away": thrown_away,
        "wasted_token_fraction": thrown_away / max(stats.generated_tokens, 1),
        "dropped_groups": buffer.stats.dropped_groups,
    }
