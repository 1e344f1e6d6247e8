"""Prompts to scored groups of Samples: the rollout and reward stages, shared by every driver.

Token-in/token-out: the prompt is rendered with the chat template once, the engine's completion
ids are appended as they came back, and nothing is re-tokenized afterwards.

``GroupRollout`` makes one prompt's group either way the config asks: single-turn (generate, then
the reward functions) or, with ``env.name``, multi-turn trajectories of an environment through the
agent loop (``trident.agent``; the environment sets the rewards). Then the reward shaping
(``algo.overlong_penalty``). ``trainable`` says which samples the loss can use (no infrastructure
error, at least one model-written token), and ``SignalFilter`` is DAPO's dynamic sampling: a
group whose rewards are all equal is dropped and replaced by a fresh prompt's group.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from trident.agent.loop import AgentConfig, rollout_env_group
from trident.agent.program import rollout_program_group
from trident.config import TridentConfig
from trident.config.algo import AlgoConfig
from trident.config.schema import RolloutConfig
from trident.data.loaders import load_split
from trident.envs import AGENT_PROGRAM, env_rows, get_spec
from trident.models.load import encode_chat, prompt_messages
from trident.rewards import RewardSum
from trident.rollout.engine import RolloutEngine, SamplingParams
from trident.sample import Sample


def split_rows(cfg: TridentConfig, split: str) -> list[dict]:
    """The train or test prompt rows: ``data.*_path`` if set, else the environment's data
    generator (``env.name``, ``env.data_kwargs``), else the built-in task's split."""
    path = cfg.data.train_path if split == "train" else cfg.data.test_path
    if cfg.env.name and not path and get_spec(cfg.env.name).data:
        n = cfg.data.num_train if split == "train" else cfg.data.num_test
        return env_rows(
            cfg.env.name, n, split, cfg.run.seed, cfg.env.show_tools, **cfg.env.data_kwargs
        )
    return load_split(cfg.data, split, cfg.run.seed)


def agent_config(cfg: TridentConfig) -> AgentConfig:
    """The agent loop's budgets from ``cfg.env`` (per-turn tokens default to the sampling
    params' ``max_tokens``)."""
    e = cfg.env
    return AgentConfig(
        max_turns=e.max_turns,
        max_turn_tokens=e.max_turn_tokens or None,
        max_response_tokens=e.max_response_tokens,
        max_total_tokens=e.max_total_tokens or cfg.rollout.max_model_len,
        max_consecutive_tool_errors=e.max_consecutive_tool_errors,
        parser=e.parser,
        show_tools=e.show_tools,
        env_timeout_s=e.timeout_s,
        drift_dump_dir=str(Path(cfg.derived.run_dir) / "token_drift"),
        mcp_servers=tuple(e.mcp_servers),
    )


def sampling_params(rollout_cfg: RolloutConfig, seed: int | None = None) -> SamplingParams:
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
    engine: RolloutEngine,
    tokenizer: Any,
    row: dict,
    params: SamplingParams,
    version: int,
    group_id: str | None = None,
) -> list[Sample]:
    """``params.n`` Samples for one prompt, tagged with the policy version that produced them
    (or, where a completion carries per-token ``versions``, with those); sample ``k`` of the
    group is ``<group_id>-<k>``."""
    prompt_ids = encode_chat(tokenizer, prompt_messages(row["prompt"]))
    completions = await engine.generate(prompt_ids, params)
    group_id = group_id or f"{row.get('id', 'row')}-{uuid.uuid4().hex[:8]}"
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
                versions=[-1] * p + (c.versions or [version] * n),
                status="truncated" if c.finish_reason == "length" else "ok",
                metadata={
                    "row": row,
                    "response": tokenizer.decode(c.token_ids, skip_special_tokens=True),
                },
            )
        )
    return samples


async def score(samples: list[Sample], rewards: RewardSum) -> None:
    """Fill ``reward`` (and ``status`` on infrastructure failure) for each sample, concurrently."""

    async def one(s: Sample) -> None:
        reward, status, parts = await rewards.score_parts(s.metadata["response"], s.metadata["row"])
        s.metrics |= {f"reward/{name}": value for name, value in parts.items()}
        s.reward = reward if reward is not None else 0.0
        if status == "infra_error":
            s.status, s.reward = "infra_error", None

    await asyncio.gather(*(one(s) for s in samples))


def shape_rewards(samples: list[Sample], algo_cfg: AlgoConfig, max_len: int) -> None:
    """Add DAPO's overlong penalty (``trident.algorithms.overlong_penalty``) to scored samples'
    rewards when ``algo.overlong_penalty`` is on; ``max_len`` is the response budget L_max."""
    if not algo_cfg.overlong_penalty:
        return
    from torch import tensor

    from trident.algorithms import overlong_penalty

    scored = [s for s in samples if s.reward is not None]
    if not scored:
        return
    lengths = tensor([s.num_response_tokens for s in scored])
    penalties = overlong_penalty(lengths, max_len, algo_cfg.overlong_buffer).tolist()
    for s, p in zip(scored, penalties, strict=True):
        s.reward += p
        s.metrics["overlong_penalty"] = p


class GroupRollout:
    """One prompt row -> one scored group of ``rollout.n`` Samples (see the module docstring)."""

    def __init__(
        self, cfg: TridentConfig, tokenizer: Any, rewards: RewardSum | None = None
    ) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.rewards = rewards or RewardSum.from_config(cfg.reward)
        self.params = sampling_params(cfg.rollout)
        self.env = cfg.env.name
        self.agent = agent_config(cfg) if self.env else None
        self.max_len = cfg.response_budget

    async def generate(
        self,
        engine: RolloutEngine,
        row: dict,
        version: int,
        group_id: str | None = None,
        params: SamplingParams | None = None,
    ) -> list[Sample]:
        """The group's samples (with ``rollout.*`` sampling unless ``params`` says otherwise);
        an environment's already carry its rewards (infrastructure failures: status
        ``infra_error``, reward None)."""
        params = params or self.params
        if not self.env:
            return await generate_group(engine, self.tokenizer, row, params, version, group_id)
        if self.env == AGENT_PROGRAM:
            kwargs = self.cfg.env.kwargs
            return await rollout_program_group(
                engine, self.tokenizer, row, params, version, self.cfg.rollout.n,
                command=kwargs.get("command", []), timeout_s=kwargs.get("timeout_s", 120.0),
                parser=self.cfg.env.parser, group_id=group_id,
            )  # fmt: skip
        return await rollout_env_group(
            engine,
            self.tokenizer,
            self.env,
            row,
            params,
            version,
            self.cfg.rollout.n,
            config=self.agent,
            env_kwargs=self.cfg.env.kwargs,
            group_id=group_id,
        )

    async def finish(self, samples: list[Sample]) -> list[Sample]:
        """Rewards of single-turn samples (the reward functions), then shaping."""
        if not self.env:
            await score(samples, self.rewards)
        elif self.env == AGENT_PROGRAM:  # the program's stdout, like a single-turn response
            await score([s for s in samples if s.status != "infra_error"], self.rewards)
        shape_rewards(samples, self.cfg.algo, self.max_len)
        return samples

    async def __call__(
        self, engine: RolloutEngine, row: dict, version: int, group_id: str | None = None
    ) -> list[Sample]:
        return await self.finish(await self.generate(engine, row, version, group_id))


# ---------------------------------------------------------------------------------------------
# The step's batch: what can be trained on, and dynamic sampling


def trainable(samples: list[Sample], exclude_infra_errors: bool = True) -> list[Sample]:
    """Samples the loss can use: at least one model-written token (``loss_mask``), and no
    infrastructure failure unless ``reward.exclude_infra_errors`` is off."""
    return [
        s
        for s in samples
        if s.num_response_tokens > 0 and (s.status != "infra_error" or not exclude_infra_errors)
    ]


def no_tokens(sample: Sample) -> bool:
    """No model-written token to train on (e.g. the context was full before the first turn);
    infrastructure failures are counted separately."""
    return sample.num_response_tokens == 0 and sample.status != "infra_error"


def has_signal(group: list[Sample]) -> bool:
    """At least two scored samples whose rewards differ (else every group-relative advantage
    is zero: DAPO's dynamic sampling drops the group)."""
    rewards = [s.reward for s in group if s.reward is not None]
    return len(rewards) >= 2 and max(rewards) - min(rewards) > 1e-9


class SignalFilter:
    """Dynamic sampling for the streaming drivers: a group without signal is dropped (and
    replaced by a fresh prompt), at most ``limit`` in a row; past that, groups without signal
    are kept until one with signal resets the count, so a saturated policy cannot stall a run."""

    def __init__(self, limit: int) -> None:
        self.limit, self.run = limit, 0
        self.kept = self.dropped = 0

    def keep(self, group: list[Sample]) -> bool:
        if has_signal(group):
            self.run = 0
        elif self.run < self.limit:
            self.run += 1
            self.dropped += 1
            return False
        self.kept += 1
        return True

    def metrics(self) -> dict[str, float]:
        """Counts since the previous call (the kept fraction only if a group was judged)."""
        kept, dropped = self.kept, self.dropped
        self.kept = self.dropped = 0
        out = {"dynamic_sampling/dropped_groups": float(dropped)}
        if kept + dropped:
            out["dynamic_sampling/kept_fraction"] = kept / (kept + dropped)
        return out
