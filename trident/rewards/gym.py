"""The ``reasoning_gym`` reward: a reasoning-gym dataset's own ``score_answer`` of the response's
``<answer>...</answer>`` (``trident.data.gym`` makes the rows; each row carries its generated
``entry`` and the dataset config). Scores are the dataset's (usually 0 or 1; some give partial
credit, e.g. countdown's 0.01 for a malformed answer).

Some scorers are symbolic (sympy) and can hang on a pathological answer, so the check runs in a
killable ``trident.rewards.pool`` worker, like ``math``: a hung or crashed scorer is
``infra_error``, never 0.
"""

from __future__ import annotations

from typing import Any

from trident.data.gym import PREFIX, score_response
from trident.rewards import register
from trident.rewards.pool import CHECKERS

TIMEOUT_S = 30.0


@register("reasoning_gym")
async def reasoning_gym_reward(
    response: str,
    task: str = "",
    entry: dict[str, Any] | None = None,
    gym_config: dict[str, Any] | None = None,
    timeout_s: float = TIMEOUT_S,
    **_: Any,
) -> float | None:
    """The dataset's score of ``response``; None for a row that is not a reasoning-gym row."""
    if not task.startswith(PREFIX) or entry is None:
        return None
    name = task.removeprefix(PREFIX)
    return await CHECKERS.run(
        score_response, name, gym_config or {}, entry, response, timeout_s=timeout_s
    )


# Bounded per check by the pool (reward.timeout_s of work, the worker killed past it); the wait
# for a free worker is not part of it (an eval scores hundreds of responses at once on a few)
reasoning_gym_reward.timeout_s = None  # pyright: ignore[reportFunctionMemberAccess]
