"""Prompts to scored Samples: the rollout and reward stages, shared by every driver.

Token-in/token-out: the prompt is rendered with the chat template once, the engine's completion
ids are appended as they came back, and nothing is re-tokenized afterwards.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from trident.models.load import encode_chat, prompt_messages
from trident.rewards import RewardModel
from trident.rollout.engine import RolloutEngine, SamplingParams
from trident.sample import Sample


def sampling_params(rollout_cfg: Any, seed: int | None = None) -> SamplingParams:
    rc = rollout_cfg
    return SamplingParams(
        n=rc.n,
        temperature=rc.temperature,
        top_p=rc.top_p,
        max_tokens=rc.max_tokens,
        stop=rc.stop,
        seed=seed,
    )


async def generate_group(
    engine: RolloutEngine, tokenizer, row: dict, params: SamplingParams, version: int
) -> list[Sample]:
    """``params.n`` Samples for one prompt, tagged with the policy version that produced them."""
    prompt_ids = encode_chat(tokenizer, prompt_messages(row["prompt"]))
    completions = await engine.generate(prompt_ids, params)
    group_id = f"{row.get('id', 'row')}-{uuid.uuid4().hex[:8]}"
    samples = []
    for k, c in enumerate(completions):
        p, n = len(prompt_ids), len(c.token_ids)
        samples.append(
            Sample(
                id=f"{group_id}-{k}",
                group_id=group_id,
                token_ids=prompt_ids + c.token_ids,
                loss_mask=[0] * p + [1] * n,
                logprobs=[0.0] * p + c.logprobs,
                versions=[-1] * p + [version] * n,
                status="truncated" if c.finish_reason == "length" else "ok",
                metadata={
                    "row": row,
                    "response": tokenizer.decode(c.token_ids, skip_special_tokens=True),
                },
            )
        )
    return samples


async def score(samples: list[Sample], rewards: RewardModel) -> None:
    """Fill ``reward`` (and ``status`` on infrastructure failure) for each sample, concurrently."""

    async def one(s: Sample) -> None:
        reward, status = await rewards.score(s.metadata["response"], s.metadata["row"])
        s.reward = reward if reward is not None else 0.0
        if status == "infra_error":
            s.status, s.reward = "infra_error", None

    await asyncio.gather(*(one(s) for s in samples))


async def rollout_batch(
    engine: RolloutEngine,
    tokenizer,
    rows: list[dict],
    params: SamplingParams,
    version: int,
    rewards: RewardModel,
) -> list[Sample]:
    groups = await asyncio.gather(
        *(generate_group(engine, tokenizer, r, params, version) for r in rows)
    )
    samples = [s for g in groups for s in g]
    await score(samples, rewards)
    return samples


def rollout_metrics(samples: list[Sample]) -> dict[str, float]:
    scored = [s for s in samples if s.reward is not None]
    rewards = [s.reward for s in scored] or [0.0]
    mean = sum(rewards) / len(rewards)
    lengths = [s.num_response_tokens for s in samples]
    return {
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "accuracy": sum(r > 0.5 for r in rewards) / len(rewards),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": max(lengths),
        "truncated_fraction": sum(s.status == "truncated" for s in samples) / len(samples),
        "infra_errors": sum(s.status == "infra_error" for s in samples),
        "response_tokens": sum(lengths),
    }
