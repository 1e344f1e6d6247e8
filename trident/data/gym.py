"""reasoning-gym's procedural datasets as trident tasks: ``data.task=reasoning_gym:NAME``.

Every dataset of ``reasoning_gym`` (0.1.25: 106 of them, arithmetic to logic, graphs, puzzles and
``composite`` mixes) becomes a task; ``data.task_kwargs`` are the fields of its config (e.g.
``{min_terms: 2, max_terms: 3}`` for ``chain_sum``; for ``composite``, ``{datasets: [{name,
weight, config}, ...]}``).

Rows: the prompt is reasoning-gym's own answer-format instruction (its ``default`` system
prompt: the final answer inside ``<answer></answer>``; ``data.system_prompt=false`` leaves it
out) and the question; ``answer`` is the
dataset's reference answer (None for puzzles with many solutions); ``entry`` is the whole
generated item and ``gym_config`` the task kwargs, so the ``reasoning_gym`` reward
(``trident.rewards.gym``) can rebuild the dataset and call its own ``score_answer``.

Splits: train and test are generated from different seeds (derived from the split name and
``run.seed``) and additionally filtered by a hash of the question (``tasks.split_of``), so no
question is in both even when a small task repeats questions across seeds.
"""

from __future__ import annotations

import difflib
import zlib
from dataclasses import dataclass, field
from typing import Any

PREFIX = "reasoning_gym:"


def dataset_names() -> list[str]:
    """The names reasoning-gym can create (``trident data list``)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def gym_problem(name: str) -> str | None:
    """Why ``reasoning_gym:<name>`` is not a task, in one line; None if it is one."""
    try:
        names = dataset_names()
    except ImportError:
        return f"data.task={PREFIX}{name} needs reasoning-gym: pip install reasoning-gym"
    if name in names:
        return None
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"did you mean {PREFIX}{close[0]}? " if close else ""
    return f"unknown reasoning-gym dataset {name!r}; {hint}see `trident data list`"


def make_dataset(name: str, config: dict[str, Any], seed: int = 0, size: int = 1) -> Any:
    """A reasoning-gym dataset; a bad config raises ``ValueError`` naming the field."""
    import reasoning_gym

    kwargs = dict(config)
    if name == "composite" and "datasets" in kwargs:
        from reasoning_gym.composite import DatasetSpec

        kwargs["datasets"] = [
            d if isinstance(d, DatasetSpec) else DatasetSpec(**d) for d in kwargs["datasets"]
        ]
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **kwargs)
    except (TypeError, AssertionError, KeyError) as e:  # unknown field / failed validate()
        raise ValueError(f"reasoning-gym {name} config {config}: {e or type(e).__name__}") from None


def _system_prompt() -> str:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


@dataclass
class GymTask:
    """One reasoning-gym dataset, configured by ``config`` (``data.task_kwargs``)."""

    dataset: str
    config: dict[str, Any] = field(default_factory=dict)
    reward: str = "reasoning_gym"
    system_prompt: bool = (
        True  # reasoning-gym's answer-format instruction first (data.system_prompt)
    )

    @property
    def name(self) -> str:
        return PREFIX + self.dataset

    def generate(self, split: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
        """``n`` distinct rows of one split (see the module docstring for the split rule)."""
        from trident.data.tasks import split_of

        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', not {split!r}")
        split_seed = zlib.crc32(f"{self.name}:{split}:{seed}".encode())
        # Test keeps 1 in 8 questions, train 7 in 8; generate enough for either, with margin.
        size = 10 * n + 100 if split == "test" else 2 * n + 100
        dataset = make_dataset(self.dataset, self.config, seed=split_seed, size=size)
        system = [{"role": "system", "content": _system_prompt()}] if self.system_prompt else []
        rows, seen = [], set()
        for i in range(size):
            entry = dataset[i]
            question = entry["question"]
            if question in seen or split_of(question) != split:
                continue
            seen.add(question)
            rows.append(
                {
                    "id": f"{self.name}-{split}-{len(rows)}",
                    "prompt": [*system, {"role": "user", "content": question}],
                    "answer": entry["answer"],
                    "entry": entry,
                    "gym_config": dict(self.config),
                }
            )
            if len(rows) == n:
                return rows
        raise ValueError(
            f"task {self.name!r} gave only {len(rows)} distinct {split} questions in {size} "
            f"draws; asked for {n} (lower data.num_{split} or widen data.task_kwargs)"
        )

    def solution(self, row: dict[str, Any]) -> str:
        """The reference answer in the required format (the SFT target)."""
        if row.get("answer") is None:
            raise ValueError(f"{self.name} has no single reference answer to train on")
        return f"<answer>{row['answer']}</answer>"

    def verify(self, response: str, row: dict[str, Any]) -> float:
        """The dataset's own ``score_answer``, in this process (the reward runs it in a killable
        worker: ``trident.rewards.gym``)."""
        return score_response(self.dataset, row.get("gym_config") or {}, row["entry"], response)


_SCORERS: dict[tuple[str, str], Any] = {}


def score_response(
    name: str, config: dict[str, Any], entry: dict[str, Any], response: str
) -> float:
    """``dataset.score_answer`` of the ``<answer>`` in ``response`` (the dataset is built once
    per process and config)."""
    import json

    from reasoning_gym.utils import extract_answer

    key = (name, json.dumps(config, sort_keys=True, default=str))
    if key not in _SCORERS:
        _SCORERS[key] = make_dataset(name, config)
    return float(_SCORERS[key].score_answer(extract_answer(response), entry))
