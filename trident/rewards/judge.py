"""The ``judge`` reward: a generative model, served behind an OpenAI-compatible API (a vLLM
server), is asked about the response and its verdict parsed to a score.

``reward.fns=[{name: judge, kwargs: {url: http://HOST:PORT, template: "...{response}...",
verdict: "Score: (\\d+)", scale: 10}}]``. The template is filled with ``str.format`` from the
row (``{prompt}``, the last user message for a chat prompt; ``{response}``; ``{answer}``; any
other column; literal braces doubled), sent as one user message to ``/v1/chat/completions``
(greedy, ``max_tokens``), and the last match of ``verdict`` in the reply (one group) is the
verdict: a number, divided by ``scale``; or a word, ``yes/correct/true/pass`` = 1.0 and
``no/incorrect/false/fail`` = 0.0.

Whose fault: a judge that is unreachable, times out (``timeout_s``) or answers without a
parseable verdict has failed, not the policy: ``JudgeError``, scored ``infra_error``.
Deliberate simplifications: one request per sample (the server batches concurrent requests);
the served model is the first one ``/v1/models`` lists unless ``model`` is given.
"""

from __future__ import annotations

import re
from typing import Any

import httpx

from trident.rewards import RewardFn, register_factory

WORDS = {"yes": 1.0, "correct": 1.0, "true": 1.0, "pass": 1.0}
WORDS |= {"no": 0.0, "incorrect": 0.0, "false": 0.0, "fail": 0.0}


class JudgeError(RuntimeError):
    """The judge did not give a verdict (unreachable, an HTTP error, or no parseable verdict)."""


def parse_verdict(reply: str, verdict: str, scale: float = 1.0) -> float:
    """The score in ``reply``: the last match of ``verdict``'s group, a number (/ ``scale``) or
    a yes/no word; ``JudgeError`` when there is none."""
    matches = re.findall(verdict, reply, flags=re.IGNORECASE)
    if not matches:
        raise JudgeError(f"no verdict matching {verdict!r} in the judge's reply {reply[-200:]!r}")
    value = matches[-1] if isinstance(matches[-1], str) else matches[-1][0]
    word = value.strip().lower()
    if word in WORDS:
        return WORDS[word]
    try:
        return float(word) / scale
    except ValueError:
        raise JudgeError(f"the judge's verdict {value!r} is neither a number nor yes/no") from None


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt or [] if m.get("role") == "user"]
    return users[-1] if users else ""


@register_factory("judge")
def judge(
    url: str,
    template: str,
    verdict: str = r"(?:score|verdict)\s*[:=]\s*([\w.-]+)",
    scale: float = 1.0,
    model: str = "",
    max_tokens: int = 256,
    timeout_s: float = 60.0,
) -> RewardFn:
    """A reward function asking the judge at ``url`` (see the module docstring)."""
    if not url or not template:
        raise ValueError("judge needs kwargs.url (an OpenAI-compatible server) and kwargs.template")
    base = url.rstrip("/")
    served: list[str] = [model] if model else []

    async def judge_score(response: str, prompt: Any = "", **row: Any) -> float:
        text = template.format(**row, prompt=_prompt_text(prompt), response=response)
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as http:
                if not served:
                    listed = (await http.get(f"{base}/v1/models")).raise_for_status().json()
                    served.append(listed["data"][0]["id"])
                body = {
                    "model": served[0],
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                }
                reply = (
                    await http.post(f"{base}/v1/chat/completions", json=body)
                ).raise_for_status()
        except httpx.HTTPError as e:
            raise JudgeError(f"judge at {base}: {type(e).__name__}: {e}") from e
        content = reply.json()["choices"][0]["message"]["content"] or ""
        return parse_verdict(content, verdict, scale)

    # read by call_reward (getattr): the judge's own timeout
    judge_score.timeout_s = timeout_s  # pyright: ignore[reportFunctionMemberAccess]
    return judge_score
