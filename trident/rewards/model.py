"""The ``reward_model`` reward: a sequence classifier (``AutoModelForSequenceClassification``,
one output) scores prompt + response, in its own Ray actor.

``reward.fns=[{name: reward_model, kwargs: {path: DIR}, weight: 0.5}, {name: math}]``. The actor
loads the checkpoint once (float32; ``num_gpus: 1`` puts it on a GPU) and renders each pair
with the classifier's chat template (the prompt's messages, then the response as the assistant
turn; without a template, prompt + response as text). The score is the raw logit.

Batching: concurrent calls on one event loop are gathered for up to ``wait_ms`` or
``batch_size`` pairs and scored in one padded forward pass (the classifier reads the last
non-pad token, so padding does not change a score). Each call runs under the function's
``timeout_s`` (default 60 s: the first call includes starting the actor and loading the model);
a timeout, a dead actor or a failed forward pass is ``infra_error``.

Placement: in a training run the actor is scheduled into the run's placement group
(``RUN_PLACEMENT_GROUP``), whose last bundle the plan reserves for the run's reward models
(``trident.cluster.placement``), so a plan that took every GPU still has the reward model's;
outside a run it asks Ray for ``num_cpus``/``num_gpus`` directly. Uses the running Ray instance
(training and eval start one); starts a local one otherwise. Deliberate simplification: one
actor per configured entry, no replicas; every reward model of a run shares the one bundle.
"""

from __future__ import annotations

import asyncio
from typing import Any

from trident.rewards import RewardFn, register_factory

# The name trident.cluster.placement.reserve gives a run's placement group (Ray looks names up in
# the driver's namespace, where one run is reserved at a time).
RUN_PLACEMENT_GROUP = "trident-run"
DEFAULT_NUM_CPUS = 1.0


def actor_resources(kwargs: dict[str, Any]) -> dict[str, float]:
    """What the actor of a ``reward_model`` entry with ``kwargs`` asks Ray for (the plan
    reserves it)."""
    return {
        "num_cpus": float(kwargs.get("num_cpus", DEFAULT_NUM_CPUS)),
        "num_gpus": float(kwargs.get("num_gpus", 0.0)),
    }


def _run_group_options() -> dict[str, Any]:
    """Ray options that schedule an actor into the last bundle of the run's placement group;
    none outside a run."""
    from ray.util import get_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    try:
        group = get_placement_group(RUN_PLACEMENT_GROUP)
    except ValueError:  # no run's group in this namespace
        return {}
    bundle = group.bundle_count - 1
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, bundle)}


def render_pair(tokenizer: Any, prompt: str | list[dict], response: str) -> str:
    """The text a classifier scores: the prompt's messages and the response as the assistant
    turn, through the chat template; without one, prompt + response."""
    from trident.models.load import prompt_messages

    if tokenizer.chat_template:
        messages = [*prompt_messages(prompt), {"role": "assistant", "content": response}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return (prompt if isinstance(prompt, str) else "") + response


class RewardModelServer:
    """The Ray actor: a classifier and its tokenizer, scoring batches of (prompt, response)."""

    def __init__(self, path: str, max_length: int, device: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=1, dtype=torch.float32
        ).to(device)
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # for batches > 1
        self.model.eval()
        self.max_length, self.device = max_length, device

    def score(self, pairs: list[tuple[Any, str]]) -> list[float]:
        texts = [render_pair(self.tokenizer, prompt, response) for prompt, response in pairs]
        batch = self.tokenizer(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
            add_special_tokens=False,
        ).to(self.device)
        with self.torch.no_grad():
            return self.model(**batch).logits[:, 0].float().tolist()


class _Batcher:
    """Gathers concurrent ``score`` calls of one event loop into batches for ``submit``."""

    def __init__(
        self, submit: Any, batch_size: int, wait_s: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.submit, self.batch_size, self.wait_s, self.loop = submit, batch_size, wait_s, loop
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None

    async def score(self, item: Any) -> float:
        future = self.loop.create_future()
        self.pending.append((item, future))
        if len(self.pending) >= self.batch_size:
            self._flush()
        elif self.timer is None:
            self.timer = self.loop.call_later(self.wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        live = [(item, f) for item, f in batch if not f.done()]  # drop timed-out callers
        if live:
            self.loop.create_task(self._run(live))

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            scores = await self.submit([item for item, _ in batch])
        except Exception as e:  # every caller of the batch sees the failure: infra_error
            for _, f in batch:
                if not f.done():
                    f.set_exception(e)
            return
        for (_, f), value in zip(batch, scores, strict=True):
            if not f.done():
                f.set_result(value)


@register_factory("reward_model")
def reward_model(
    path: str,
    batch_size: int = 16,
    wait_ms: float = 20.0,
    max_length: int = 1024,
    timeout_s: float = 60.0,
    num_cpus: float = DEFAULT_NUM_CPUS,
    num_gpus: float = 0.0,
) -> RewardFn:
    """A reward function scoring ``(prompt, response)`` with the classifier at ``path``."""
    if not path:
        raise ValueError("reward_model needs kwargs.path: a sequence-classification checkpoint")
    actor: list[Any] = []  # created on first use, when Ray is up
    batchers: dict[int, _Batcher] = {}

    async def submit(pairs: list[tuple[Any, str]]) -> list[float]:
        if not actor:
            import ray

            if not ray.is_initialized():
                ray.init(include_dashboard=False, log_to_driver=False)
            remote = ray.remote(RewardModelServer).options(
                num_cpus=num_cpus, num_gpus=num_gpus, **_run_group_options()
            )
            actor.append(remote.remote(path, max_length, "cuda" if num_gpus else "cpu"))
        return await actor[0].score.remote(pairs)

    async def reward_model_score(response: str, prompt: Any = "", **_: Any) -> float:
        loop = asyncio.get_running_loop()
        batcher = batchers.get(id(loop))
        if batcher is None or batcher.loop is not loop:  # a new loop (ids are reused)
            batcher = batchers[id(loop)] = _Batcher(submit, batch_size, wait_ms / 1000, loop)
        return await batcher.score((prompt, response))

    # function attributes: call_reward reads timeout_s; tests and shutdown reach the actor
    reward_model_score.timeout_s = timeout_s  # pyright: ignore[reportFunctionMemberAccess]
    reward_model_score.actor = actor  # pyright: ignore[reportFunctionMemberAccess]
    return reward_model_score
