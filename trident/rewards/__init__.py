"""Rewards: plain (sync or async) functions ``fn(response: str, **row) -> float | None``.

``response`` is the decoded completion; ``row`` holds the dataset row's fields (``answer``,
``tests``, ``task``, ...). ``None`` means "not applicable" and contributes nothing to the sum.
Functions are found by registered name or as a ``module:function`` entry point
(``trident.registry.load_entry_point``); ``RewardSum`` combines the configured ones as a
weighted sum, every call under a timeout. A timeout or a crash inside a reward function is the
infrastructure's failure (``infra_error``), never a zero for the model.

Registered: ``task`` (the row's task scores it: its ``verify``, or the reward the task names),
``format``, and, imported on first use, ``math`` (``trident.rewards.math``), ``code``
(``trident.rewards.code``, the sandbox) and ``reasoning_gym`` (``trident.rewards.gym``).

Model-based rewards hold a model, so they are factories: ``reward_model`` (a sequence
classifier in a Ray actor, ``trident.rewards.model``) and ``judge`` (a generative model behind
an OpenAI-compatible server, ``trident.rewards.judge``) build their reward function from the
entry's ``kwargs`` (``reward.fns=[{name: judge, kwargs: {url: ..., template: ...}}]``); for a
plain function, ``kwargs`` are bound as keyword arguments. A function with a ``prompt``
parameter receives the row's prompt; one with a ``timeout_s`` attribute runs under that timeout
instead of ``reward.timeout_s`` (a model's first call includes loading it).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trident.data.tasks import extract_answer, get_task
from trident.registry import load_entry_point
from trident.sandbox import InfraError

RewardFn = Callable[..., Any]
REGISTRY: dict[str, RewardFn] = {}
FACTORIES: dict[str, Callable[..., RewardFn]] = {}
# Registered when their module is imported; kept out of ``import trident.rewards`` because they
# pull in sympy, the sandbox or reasoning-gym.
LAZY = {
    "math": "trident.rewards.math",
    "code": "trident.rewards.code",
    "reasoning_gym": "trident.rewards.gym",
    "reward_model": "trident.rewards.model",
    "judge": "trident.rewards.judge",
}


class RewardInfraError(RuntimeError):
    """A reward could not be computed for reasons that are not the model's (timeout, crash)."""


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REGISTRY[name] = fn
        return fn

    return deco


def register_factory(name: str) -> Callable[[Callable[..., RewardFn]], Callable[..., RewardFn]]:
    """Register ``factory(**kwargs) -> reward function`` under ``name`` (model-based rewards)."""

    def deco(factory: Callable[..., RewardFn]) -> Callable[..., RewardFn]:
        FACTORIES[name] = factory
        return factory

    return deco


def names() -> list[str]:
    """Every reward name ``resolve`` accepts without an entry point."""
    return sorted({*REGISTRY, *FACTORIES, *LAZY})


def resolve(name: str, kwargs: dict[str, Any] | None = None) -> RewardFn:
    """The reward function registered as ``name`` (or the ``module:function`` entry point) with
    ``kwargs`` bound, or the one the factory ``name`` builds from ``kwargs``."""
    if name not in REGISTRY and name not in FACTORIES and name in LAZY:
        importlib.import_module(LAZY[name])
    if name in FACTORIES:
        return FACTORIES[name](**(kwargs or {}))
    if name in REGISTRY:
        fn = REGISTRY[name]
    elif ":" in name:
        fn = load_entry_point(name)
    else:
        raise KeyError(
            f"unknown reward {name!r}; registered: {', '.join(names())}, or module:function"
        )
    return functools.partial(fn, **kwargs) if kwargs else fn


def _wants_prompt(fn: RewardFn) -> bool:
    try:
        return "prompt" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False


@register("task")
async def task_reward(
    response: str, task: str = "", timeout_s: float = 10.0, **row: Any
) -> float | None:
    """The row's task scores the response: the reward function it names (``Task.reward``, e.g.
    the sandbox's ``code``), else its ``verify`` (in a thread: a user's task may be slow); either
    under ``timeout_s`` (``reward.timeout_s``), the named function by its own rule
    (``call_reward``)."""
    if not task:
        return None
    spec = get_task(task)
    if getattr(spec, "reward", ""):
        return await call_reward(resolve(spec.reward), response, {"task": task, **row}, timeout_s)
    return await asyncio.wait_for(
        asyncio.to_thread(spec.verify, response, {"task": task, **row}), timeout_s
    )


task_reward.timeout_s = None  # pyright: ignore[reportFunctionMemberAccess]  (bounded inside)


@register("format")
def format_reward(response: str, **_: Any) -> float:
    """1.0 when the last line is ``Answer: <something>``."""
    return float(extract_answer(response) is not None)


async def call_reward(
    fn: RewardFn, response: str, row: dict[str, Any], timeout_s: float
) -> float | None:
    """Run one reward function (async, or sync in a thread) under a timeout (the function's
    own ``timeout_s`` attribute if it has one). A function whose ``timeout_s`` attribute is None
    bounds its own work and is passed ``timeout_s=`` instead (the checker-pool rewards: waiting
    for a free worker must not count, or a burst of checks times out in the queue)."""
    hidden = ("id",) if _wants_prompt(fn) else ("prompt", "id")
    kwargs = {k: v for k, v in row.items() if k not in hidden}
    bound: float | None = getattr(fn, "timeout_s", None) or timeout_s
    if "timeout_s" in getattr(fn, "__dict__", {}) and fn.__dict__["timeout_s"] is None:
        kwargs["timeout_s"], bound = timeout_s, None
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(response, **kwargs), bound)
        return await asyncio.wait_for(asyncio.to_thread(fn, response, **kwargs), bound)
    except TimeoutError:
        raise RewardInfraError(
            f"reward {getattr(fn, '__name__', fn)} timed out after {bound} s"
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
class RewardSum:
    """Weighted sum of reward functions; ``score`` returns (reward, status), ``score_parts``
    also each function's own value (unweighted, by name; None = not applicable)."""

    fns: list[tuple[RewardFn, float]]
    timeout_s: float = 10.0
    names: list[str] | None = None  # per function, for ``score_parts`` (default: __name__)

    @classmethod
    def from_config(cls, reward_cfg: Any) -> RewardSum:
        if not reward_cfg.fns:
            return cls([(task_reward, 1.0)], reward_cfg.timeout_s, ["task"])
        fns = [(resolve(f.name, f.kwargs), f.weight) for f in reward_cfg.fns]
        return cls(fns, reward_cfg.timeout_s, [f.name for f in reward_cfg.fns])

    async def score(self, response: str, row: dict[str, Any]) -> tuple[float | None, str]:
        reward, status, _ = await self.score_parts(response, row)
        return reward, status

    async def score_parts(
        self, response: str, row: dict[str, Any]
    ) -> tuple[float | None, str, dict[str, float]]:
        try:
            values = await asyncio.gather(
                *(call_reward(fn, response, row, self.timeout_s) for fn, _ in self.fns)
            )
        except RewardInfraError:
            return None, "infra_error", {}
        names = self.names or [getattr(fn, "__name__", str(fn)) for fn, _ in self.fns]
        parts = {n: float(v) for n, v in zip(names, values, strict=True) if v is not None}
        applicable = [(v, w) for v, (_, w) in zip(values, self.fns, strict=True) if v is not None]
        if not applicable:
            return None, "ok", parts
        return sum(v * w for v, w in applicable), "ok", parts
