"""Rewards: plain (sync or async) functions ``fn(response: str, **row) -> float | None``.

``response`` is the decoded completion; ``row`` holds the dataset row's fields (``answer``,
``tests``, ``task``, ...). ``None`` means "not applicable" and contributes nothing to the sum.
Functions are found by registered name or as ``module:function``; ``RewardModel`` combines the
configured ones as a weighted sum, every call under a timeout. A timeout or a crash inside a reward
function is the infrastructure's failure (``infra_error``), never a zero for the model.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trident.data.tasks import extract_answer, get_task
from trident.sandbox import InfraError

RewardFn = Callable[..., Any]
REGISTRY: dict[str, RewardFn] = {}


class RewardInfraError(RuntimeError):
    """A reward could not be computed for reasons that are not the model's (timeout, crash)."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn

    return deco


def resolve(name: str) -> RewardFn:
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    if name == "code":  # registered on import of its module (it pulls in the sandbox)
        importlib.import_module("trident.rewards.code")
        return REGISTRY[name]
    raise KeyError(
        f"unknown reward {name!r}; registered: {', '.join(sorted(REGISTRY))}, or use module:function"
    )


@register("task")
def task_reward(response: str, task: str = "", **row: Any) -> float | None:
    """The built-in task's own verifier (exact answer in the required format)."""
    if not task:
        return None
    return get_task(task).verify(response, row)


@register("math")
def math_reward(response: str, answer: Any = None, **_: Any) -> float | None:
    """Free-form math answers checked with ``math-verify`` (LaTeX, fractions, sets...)."""
    if answer is None:
        return None
    from math_verify import parse, verify

    candidate = extract_answer(response) or response
    return float(verify(parse(str(answer)), parse(candidate)))


@register("format")
def format_reward(response: str, **_: Any) -> float:
    """1.0 when the last line is ``Answer: <something>``."""
    return float(extract_answer(response) is not None)


def regex_reward(pattern: str) -> RewardFn:
    compiled = re.compile(pattern, re.DOTALL)
    return lambda response, **_: float(bool(compiled.search(response)))


async def call_reward(
    fn: RewardFn, response: str, row: dict[str, Any], timeout_s: float
) -> float | None:
    """Run one reward function (async, or sync in a thread) under a timeout."""
    kwargs = {k: v for k, v in row.items() if k not in ("prompt", "id")}
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(response, **kwargs), timeout_s)
        return await asyncio.wait_for(asyncio.to_thread(fn, response, **kwargs), timeout_s)
    except TimeoutError:
        raise RewardInfraError(
            f"reward {getattr(fn, '__name__', fn)} timed out after {timeout_s:.1f} s"
        ) from None
    except RewardInfraError:
        raise
    except InfraError as e:  # the sandbox failed, not the model's code
        raise RewardInfraError(str(e)) from e
    except Exception as e:
        raise RewardInfraError(
            f"reward {getattr(fn, '__name__', fn)} raised {type(e).__name__}: {e}"
        ) from e


@dataclass
class RewardModel:
    """Weighted sum of reward functions; ``score`` returns (reward, status)."""

    fns: list[tuple[RewardFn, float]]
    timeout_s: float = 10.0

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardModel:
        if not reward_cfg.fns:
            return cls([(task_reward, 1.0)], reward_cfg.timeout_s)
        return cls([(resolve(f.name), f.weight) for f in reward_cfg.fns], reward_cfg.timeout_s)

    async def score(self, response: str, row: dict[str, Any]) -> tuple[float | None, str]:
        try:
            values = await asyncio.gather(
                *(call_reward(fn, response, row, self.timeout_s) for fn, _ in self.fns)
            )
        except RewardInfraError:
            return None, "infra_error"
        applicable = [(v, w) for v, (_, w) in zip(values, self.fns, strict=True) if v is not None]
        if not applicable:
            return None, "ok"
        return sum(v * w for v, w in applicable), "ok"
