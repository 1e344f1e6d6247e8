"""Prompt sources and the resumable cursor over them.

Sources: JSONL, Parquet, and HF ``datasets`` saved with ``save_to_disk`` (a directory). Every row
is validated when loaded; a bad row fails with the file and its line (JSONL) or row number.
A prompt is a string or a list of chat messages (``{"role", "content"}``).

The cursor walks the rows in a seeded per-epoch permutation; its state (epoch, position, seed) is
three integers, stored in checkpoints, and restoring it continues exactly where it stopped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from trident.data.tasks import generate_split, get_task

Row = dict[str, Any]


class DataError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""


def _validate_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty"
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                return f"message {i} of the prompt is not an object with 'role' and 'content'"
            if m["role"] not in ("system", "user", "assistant", "tool"):
                return f"message {i} has unknown role {m['role']!r}"
        return None
    return f"the prompt must be a non-empty string or list of messages, not {type(prompt).__name__}"


def validate_row(row: Any, where: str, prompt_key: str, answer_key: str | None) -> Row:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(
            f"{where}: missing key {prompt_key!r} (keys: {', '.join(sorted(row)) or 'none'})"
        )
    problem = _validate_prompt(row[prompt_key])
    if problem:
        raise DataError(f"{where}: {problem}")
    if answer_key and answer_key not in row:
        raise DataError(f"{where}: missing key {answer_key!r} (keys: {', '.join(sorted(row))})")
    out = dict(row)
    if prompt_key != "prompt":
        out["prompt"] = out.pop(prompt_key)
    if answer_key and answer_key != "answer":
        out["answer"] = out.pop(answer_key)
    return out


def _read_jsonl(path: Path, prompt_key: str, answer_key: str | None) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})"
                ) from None
            rows.append(validate_row(row, f"{path}:{lineno}", prompt_key, answer_key))
    return rows


def _read_table(path: Path, prompt_key: str, answer_key: str | None) -> list[Row]:
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:  # datasets raises several types for a non-dataset directory
            raise DataError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise DataError(f"{path}: holds splits {list(ds)}; point at one split's directory")
        records = ds.to_list()
    else:
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for corrupt files
            raise DataError(f"{path}: unreadable Parquet file ({e})") from None
    return [
        validate_row(r, f"{path}: row {i}", prompt_key, answer_key) for i, r in enumerate(records)
    ]


def load_rows(
    path: str | Path, prompt_key: str = "prompt", answer_key: str | None = "answer"
) -> list[Row]:
    """Rows of a JSONL file, a Parquet file or a saved ``datasets`` directory, validated."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    try:
        if path.suffix in (".jsonl", ".json") and path.is_file():
            rows = _read_jsonl(path, prompt_key, answer_key)
        elif path.suffix == ".parquet" or path.is_dir():
            rows = _read_table(path, prompt_key, answer_key)
        else:
            raise DataError(
                f"{path}: unknown format (use .jsonl, .parquet or a datasets directory)"
            )
    except (PermissionError, IsADirectoryError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: unreadable ({e})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def write_jsonl(rows: list[Row], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def load_split(data_cfg: Any, split: str, seed: int = 0) -> list[Row]:
    """The train or test rows that a ``DataConfig`` names: its path if set, else the task's split."""
    path = data_cfg.train_path if split == "train" else data_cfg.test_path
    if path:
        return load_rows(path, data_cfg.prompt_key, data_cfg.answer_key)
    if not data_cfg.task:
        raise DataError(f"no {split} data: set data.task or data.{split}_path")
    n = data_cfg.num_train if split == "train" else data_cfg.num_test
    rows = generate_split(get_task(data_cfg.task), split, n, seed)
    return [{**r, "task": data_cfg.task} for r in rows]


class PromptCursor:
    """Seeded epoch-wise walk over rows; ``state_dict()`` restores the exact position."""

    def __init__(self, rows: list[Row], seed: int = 0, shuffle: bool = True) -> None:
        if not rows:
            raise DataError("the prompt cursor needs at least one row")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, k: int) -> list[Row]:
        batch = []
        for _ in range(k):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            batch.append(self.rows[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
