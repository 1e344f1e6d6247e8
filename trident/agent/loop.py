"""The agent loop: one multi-turn trajectory through a rollout engine, token-in/token-out.

    ids = chat_template(env.reset(row), tools)               loss_mask 0
    repeat:
        turn = engine.generate(ids)  (one session_id per trajectory: it stays on one server)
        ids += turn ids (exactly as the engine returned them)      loss_mask 1, engine logprobs
        run the turn's tool calls (concurrently); result = env.step(turn, tool results)
        stop if result.done or a budget is spent
        ids += template-rendered tool results + observations    loss_mask 0, logprob 0, version -1

Nothing the model wrote is ever re-tokenized. Observation ids are rendered by the chat template
as the difference between a conversation with and without the new messages, starting right
after the model's end-of-turn token (e.g. ChatML's ``\\n<|im_start|>tool\\n...<|im_start|>
assistant\\n``). The drift check then tokenizes the whole conversation with the template and
compares it with the trajectory; a difference (a template that is not append-only, a model that
wrote non-canonical JSON or an unusual BPE split) is reported as ``metrics["token_drift"]`` with a
dump in ``metadata["token_drift"]``. It never changes the trajectory.

Budgets (``AgentConfig``): tokens per turn, model tokens per trajectory, total sequence length,
and turns. A trajectory that runs out of one ends with status ``truncated`` and
``metadata["truncation"]`` naming it (``turn_tokens``, ``response_tokens``, ``context``,
``max_turns``); ``max_consecutive_tool_errors`` turns in a row whose calls all failed end it with
status ``tool_error`` (reason ``tool_errors``). A failure of the engine, a sandbox, an MCP server or
the environment itself marks the sample ``infra_error`` (reward None), never the model's fault.

The reward is the sum of the environment's step rewards (0.0 when it gave none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import Counter
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trident.envs import Env, Message, make_env
from trident.models.load import encode_chat
from trident.rollout.engine import Completion, EngineError, RolloutEngine, SamplingParams
from trident.sample import Sample, Status
from trident.sandbox import InfraError
from trident.tools.parsers import AssistantTurn, get_parser
from trident.tools.toolset import MCPClient, ToolInfraError, ToolResult


class TemplateError(ValueError):
    """The chat template cannot render observations incrementally (see ``ObservationRenderer``)."""


@dataclass
class AgentConfig:
    """Budgets and behaviour of the agent loop, per trajectory."""

    max_turns: int = 8
    max_turn_tokens: int | None = None  # None: the sampling params' max_tokens
    max_response_tokens: int = 1024  # model-written tokens over the whole trajectory
    max_total_tokens: int = 1024  # prompt + turns + observations (keep <= the server's context)
    max_consecutive_tool_errors: int = 3  # turns in a row whose tool calls all failed
    parser: str = "hermes"
    show_tools: bool = True  # render the tool schemas in the prompt (chat template's `tools`)
    env_timeout_s: float = 60.0  # each env.reset / env.step call
    drift_dump_dir: str | None = None  # write a JSON dump per drifting trajectory here
    # MCP servers ({command: [...]} or {url: ...}) connected per trajectory; their tools join the env's
    mcp_servers: tuple[dict[str, Any], ...] = ()


class Trajectory:
    """One trajectory under construction: the token sequence with its per-token fields, the
    conversation it corresponds to, counters, and how it ended. ``to_sample`` finishes it."""

    def __init__(self, tokenizer: Any, messages: list[Message], tools: list[dict] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.conversation = list(messages)
        self.renderer = ObservationRenderer(tokenizer, tools)
        prompt = encode_chat(tokenizer, self.conversation, True, tools=tools) if messages else []
        self.ids, self.mask = list(prompt), [0] * len(prompt)
        self.logprobs, self.versions = [0.0] * len(prompt), [-1] * len(prompt)
        self.generated = 0
        self.last_turn_ids: list[int] = []
        self.counts: Counter[str] = Counter()
        self.status: Status = "ok"
        self.truncation: str | None = None
        self.error: str | None = None  # the infrastructure failure behind an infra_error

    @property
    def turn_closed(self) -> bool:
        """The last model turn ended with the EOS token."""
        ids = self.last_turn_ids
        return bool(ids) and ids[-1] == self.tokenizer.eos_token_id

    def add_turn(self, completion: Completion, version: int) -> str:
        """Append the engine's tokens as they are; returns the turn's text (EOS removed)."""
        ids = completion.token_ids
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += completion.logprobs
        # an engine that resumes requests across weight updates knows each token's version
        versions = completion.versions
        self.versions += list(versions) if versions else [version] * len(ids)
        self.generated += len(ids)
        self.last_turn_ids = ids
        self.counts["turns"] += 1
        text_ids = ids[:-1] if self.turn_closed else ids
        return self.tokenizer.decode(text_ids, skip_special_tokens=False)

    def add_observations(self, ids: list[int]) -> None:
        """Append observation ids rendered by ``self.renderer`` (untrained)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)

    def count_calls(self, turn: AssistantTurn, results: list[ToolResult]) -> None:
        self.counts["tool_calls"] += len(turn.tool_calls)
        self.counts["tool_parse_errors"] += turn.parse_errors
        self.counts["tool_errors"] += sum(r.error for r in results)

    def end(self, status: Status, reason: str | None) -> None:
        self.status, self.truncation = status, reason

    def metrics(self) -> dict[str, float]:
        counts, calls = self.counts, self.counts["tool_calls"]
        metrics = {k: float(v) for k, v in counts.items()}
        for key in ("turns", "tool_calls", "tool_parse_errors", "tool_errors"):
            metrics.setdefault(key, 0.0)
        metrics["tool_parse_error_rate"] = counts["tool_parse_errors"] / calls if calls else 0.0
        metrics["tool_success_rate"] = (calls - counts["tool_errors"]) / calls if calls else 0.0
        metrics["response_tokens"] = float(self.generated)
        return metrics

    def to_sample(
        self,
        sample_id: str,
        group_id: str,
        reward: float | None,
        row: dict[str, Any],
        drift_dump_dir: str | None = None,
    ) -> Sample:
        metrics = self.metrics()
        metadata: dict[str, Any] = {
            "row": row,
            "messages": self.conversation,
            "response": self.tokenizer.decode(self.last_turn_ids, skip_special_tokens=True),
            "truncation": self.truncation,
        }
        if self.error:
            metadata["error"] = self.error
        if self.conversation:
            drift = check_drift(self.tokenizer, self.conversation, self.tools, self.ids)
            metrics["token_drift"] = float(drift is not None)
            if drift is not None:
                metadata["token_drift"] = drift
                _dump_drift(drift_dump_dir, sample_id, drift, self)
        return Sample(
            id=sample_id,
            group_id=group_id,
            token_ids=self.ids,
            loss_mask=self.mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=None if self.status == "infra_error" else reward,
            status=self.status,
            metrics=metrics,
            metadata=metadata,
        )


class ObservationRenderer:
    """Template-rendered ids of observation messages, to append after a model turn.

    Renders a fixed two-message conversation with and without the observations (and the next
    generation prompt); the difference is the observation text. What the template puts after
    the assistant's end-of-turn token (ChatML: a newline) is prepended, since the model's turn
    stopped at that token.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.base = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        self.before = self._render(self.base, False)
        eos = tokenizer.eos_token
        cut = self.before.rfind(eos) if eos else -1
        if cut < 0:
            raise TemplateError(
                f"the chat template does not end an assistant turn with the EOS token {eos!r}"
            )
        self.after_eos = self.before[cut + len(eos) :]
        self.eos = eos

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
        )

    def ids(self, observations: list[Message], turn_closed: bool) -> list[int]:
        """``turn_closed``: the model's turn ended with the EOS token (else it is added here)."""
        after = self._render(self.base + observations, True)
        if not after.startswith(self.before):
            raise TemplateError(
                "the chat template re-renders earlier turns when messages are appended "
                "(it is not append-only), so observations cannot be rendered incrementally"
            )
        closing = self.after_eos if turn_closed else self.eos + self.after_eos
        return self.tokenizer.encode(closing + after[len(self.before) :], add_special_tokens=False)


def check_drift(
    tokenizer: Any, conversation: list[Message], tools: list[dict] | None, token_ids: list[int]
) -> dict[str, Any] | None:
    """Compare the trajectory with the whole conversation tokenized by the chat template.

    The trajectory must be a prefix of the template's tokens (which may add the closing of the
    last turn). Returns None when it is, else where and how they differ.
    """
    generation_prompt = conversation[-1]["role"] != "assistant"
    full = encode_chat(tokenizer, conversation, generation_prompt, tools=tools)
    n = min(len(full), len(token_ids))
    first = next((i for i in range(n) if full[i] != token_ids[i]), None)
    if first is None and len(token_ids) <= len(full):
        return None
    at = n if first is None else first
    lo = max(0, at - 8)
    return {
        "position": at,
        "trajectory_len": len(token_ids),
        "template_len": len(full),
        "trajectory_text": tokenizer.decode(token_ids[lo : at + 24]),
        "template_text": tokenizer.decode(full[lo : at + 24]),
        "trajectory_ids": token_ids[lo : at + 24],
        "template_ids": full[lo : at + 24],
    }


def _turn_seed(params: SamplingParams, seed_offset: int, turn: int) -> int | None:
    return None if params.seed is None else params.seed + 10_007 * seed_offset + turn


def _room(config: AgentConfig, per_turn: int, traj: Trajectory) -> tuple[str, int]:
    """The binding budget and how many tokens the next turn may have."""
    room = {
        "turn_tokens": per_turn,
        "response_tokens": config.max_response_tokens - traj.generated,
        "context": config.max_total_tokens - len(traj.ids),
    }
    limit = min(room, key=lambda k: room[k])
    return limit, room[limit]


async def run_trajectory(
    engine: RolloutEngine,
    tokenizer: Any,
    env: Env,
    row: dict[str, Any],
    params: SamplingParams,
    version: int,
    *,
    sample_id: str,
    group_id: str,
    config: AgentConfig | None = None,
    seed_offset: int = 0,
) -> Sample:
    """One trajectory of ``env`` on ``row``; the caller closes ``env``."""
    config = config or AgentConfig()
    parser = get_parser(config.parser)
    per_turn = config.max_turn_tokens or params.max_tokens
    traj = Trajectory(tokenizer, [], None)
    rewards: list[float] = []
    mcp = AsyncExitStack()
    try:
        messages = await asyncio.wait_for(env.reset(row), config.env_timeout_s)
        for spec in config.mcp_servers:
            server = spec.get("url") or spec["command"]
            options = {k: spec[k] for k in ("env", "cwd", "timeout_s") if k in spec}
            client = await mcp.enter_async_context(MCPClient(server, **options))
            for t in client.tools():
                env.tools.add(t)
        schemas = env.tools.schemas() if config.show_tools else None
        traj = Trajectory(tokenizer, messages, schemas or None)
        consecutive_errors = 0
        for turn_index in range(config.max_turns):
            limit, room = _room(config, per_turn, traj)
            if room <= 0:
                traj.end("truncated", limit)
                break
            seed = _turn_seed(params, seed_offset, turn_index)
            turn_params = replace(params, n=1, max_tokens=room, seed=seed)
            completion = (await engine.generate(traj.ids, turn_params, session_id=sample_id))[0]
            turn = parser.parse(traj.add_turn(completion, version))
            if completion.finish_reason != "stop":
                traj.conversation.append(turn.message())
                length = completion.finish_reason == "length"
                traj.end("truncated" if length else "aborted", limit if length else "abort")
                break
            results = await env.tools.run(turn.tool_calls)
            traj.count_calls(turn, results)
            step = await asyncio.wait_for(env.step(turn, results), config.env_timeout_s)
            if step.reward is not None:
                rewards.append(step.reward)
            traj.counts.update({f"env/{k}": v for k, v in step.metrics.items()})
            observations = [r.message() for r in results] + step.observations
            traj.conversation += [turn.message(), *observations]
            if step.done:
                break
            failed = bool(results) and all(r.error for r in results)
            consecutive_errors = consecutive_errors + 1 if failed else 0
            if consecutive_errors >= config.max_consecutive_tool_errors:
                traj.end("tool_error", "tool_errors")
                break
            if turn_index + 1 == config.max_turns:
                traj.end("truncated", "max_turns")
                break
            obs_ids = traj.renderer.ids(observations, traj.turn_closed)
            if len(traj.ids) + len(obs_ids) >= config.max_total_tokens:
                traj.end("truncated", "context")
                break
            traj.add_observations(obs_ids)
    except (EngineError, ToolInfraError, InfraError, TimeoutError) as e:
        traj.end("infra_error", None)
        traj.error = f"{type(e).__name__}: {e}"
    finally:
        end_session = getattr(engine, "end_session", None)
        if end_session is not None:
            end_session(sample_id)
        with contextlib.suppress(Exception):  # a dead server's transport may fail to close
            await mcp.aclose()
    return traj.to_sample(
        sample_id, group_id, float(sum(rewards)), row, drift_dump_dir=config.drift_dump_dir
    )


def _dump_drift(
    directory: str | None, sample_id: str, drift: dict[str, Any], traj: Trajectory
) -> None:
    if not directory:
        return
    path = Path(directory) / f"{sample_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    dump = {
        "drift": drift,
        "token_ids": traj.ids,
        "loss_mask": traj.mask,
        "messages": traj.conversation,
        "tools": traj.tools,
    }
    path.write_text(json.dumps(dump, indent=1, default=str))


async def rollout_env_group(
    engine: RolloutEngine,
    tokenizer: Any,
    env_name: str,
    row: dict[str, Any],
    params: SamplingParams,
    version: int,
    n: int,
    *,
    config: AgentConfig | None = None,
    env_kwargs: dict[str, Any] | None = None,
    group_id: str | None = None,
) -> list[Sample]:
    """``n`` trajectories of ``env_name`` on ``row``, concurrently, rewards set by the env.

    The multi-turn counterpart of ``trident.pipeline.groups.generate_group`` (same contract:
    Samples tagged with ``version``, rewards already set, so no separate scoring stage).
    ``params.n`` is ignored (each trajectory is its own request chain); ``params.max_tokens`` is
    the per-turn budget unless ``config.max_turn_tokens`` sets one.
    """
    group_id = group_id or f"{row.get('id', 'row')}-{uuid.uuid4().hex[:8]}"

    async def one(k: int) -> Sample:
        env = make_env(env_name, **(env_kwargs or {}))
        try:
            return await run_trajectory(
                engine,
                tokenizer,
                env,
                row,
                params,
                version,
                sample_id=f"{group_id}-{k}",
                group_id=group_id,
                config=config,
                seed_offset=k,
            )
        finally:
            await env.close()

    return list(await asyncio.gather(*(one(k) for k in range(n))))


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Batch metrics of agent trajectories (rates are over all calls, not means of rates)."""
    if not samples:
        return {}

    def total(key: str) -> float:
        return sum(s.metrics.get(key, 0.0) for s in samples)

    calls = total("tool_calls")
    reasons = Counter(s.metadata.get("truncation") for s in samples)
    out = {
        "agent/turns_mean": total("turns") / len(samples),
        "agent/tool_calls_per_trajectory": calls / len(samples),
        "tool_parse_error_rate": total("tool_parse_errors") / calls if calls else 0.0,
        "agent/tool_error_rate": total("tool_errors") / calls if calls else 0.0,
        "agent/tool_success_rate": (calls - total("tool_errors")) / calls if calls else 0.0,
        "agent/token_drift_fraction": total("token_drift") / len(samples),
        "agent/tool_error_status_fraction": sum(s.status == "tool_error" for s in samples)
        / len(samples),
    }
    for reason, count in reasons.items():
        if reason:
            out[f"agent/truncated_{reason}"] = count / len(samples)
    return out
