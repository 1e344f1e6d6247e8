"""Prompt sources and the resumable cursor over them.

Sources: JSONL, Parquet, CSV, HF ``datasets`` saved with ``save_to_disk`` (a directory), and hub
datasets (``hf:NAME[:CONFIG][@SPLIT]``, or a bare ``owner/name`` that is not a local path; the
split defaults to the one being loaded, ``train`` or ``test``). Every row is validated when
loaded; a bad row fails with the file and its line (JSONL) or row number.

A prompt is a string or a list of chat messages (``{"role", "content"}``). Columns are mapped
by ``data.prompt_key`` / ``data.answer_key``; with the defaults (``prompt`` / ``answer``) the
common public layouts load as they are:

- GSM8K: ``question`` is the prompt; ``answer`` ends in ``#### 42``, so the reference answer is
  ``42`` (the worked solution is kept as ``solution``).
- MATH: ``problem`` is the prompt; without an ``answer`` column the reference answer is the last
  ``\\boxed{...}`` of ``solution``.

The cursor walks the rows in a seeded per-epoch permutation; its state (epoch, position, seed) is
three integers, stored in checkpoints, and restoring it continues exactly where it stopped.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from pathlib import Path
from typing import Any

from trident.data.gym import GymTask
from trident.data.tasks import generate_split, get_task, last_boxed

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


# With the default keys, the prompt and answer columns of GSM8K- and MATH-style rows.
_PROMPT_ALIASES = ("question", "problem")


def _reference_answer(row: Row, answer_key: str | None) -> tuple[str | None, Any]:
    """(the column the reference answer comes from, the answer) or (None, None)."""
    if answer_key and answer_key in row:
        answer = row[answer_key]
        if isinstance(answer, str) and "####" in answer:  # GSM8K: "...reasoning\n#### 42"
            return answer_key, answer.rsplit("####", 1)[1].strip()
        return answer_key, answer
    if answer_key == "answer" and isinstance(row.get("solution"), str):
        boxed = last_boxed(row["solution"])  # MATH
        if boxed is not None:
            return "solution", boxed
    return None, None


def validate_row(row: Any, where: str, prompt_key: str, answer_key: str | None) -> Row:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if prompt_key not in row and prompt_key == "prompt":
        prompt_key = next((k for k in _PROMPT_ALIASES if k in row), prompt_key)
    if prompt_key not in row:
        raise DataError(
            f"{where}: missing key {prompt_key!r} (keys: {', '.join(sorted(row)) or 'none'}; "
            "set data.prompt_key)"
        )
    problem = _validate_prompt(row[prompt_key])
    if problem:
        raise DataError(f"{where}: {problem}")
    source, answer = _reference_answer(row, answer_key)
    if answer_key and source is None:
        raise DataError(
            f"{where}: missing key {answer_key!r} (keys: {', '.join(sorted(row))}; "
            "set data.answer_key, or data.answer_key='' for none)"
        )
    out = dict(row)
    out["prompt"] = out.pop(prompt_key)
    if source is not None:
        if source == answer_key and answer != row[answer_key]:
            out["solution"] = out.get("solution", row[answer_key])  # GSM8K's worked solution
        if source == answer_key:
            out.pop(answer_key)
        out["answer"] = answer
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


def _read_csv(path: Path, prompt_key: str, answer_key: str | None) -> list[Row]:
    """Every field as text ("0042" and "1,000" are answers, not numbers to reinterpret)."""
    rows = []
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        for record in reader:
            where = f"{path}:{reader.line_num}"
            if None in record or None in record.values():
                raise DataError(
                    f"{where}: {len(reader.fieldnames or [])} columns in the header, "
                    "a different number in this row"
                )
            rows.append(validate_row(record, where, prompt_key, answer_key))
    return rows


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


HUB_PREFIX = "hf:"
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(?::[\w.-]+)?(?:@[\w.\[\]:%+-]+)?$")


def is_hub_dataset(path: str) -> bool:
    """``hf:NAME...``, or ``owner/name[:config][@split]`` that is not a local path or file name."""
    if path.startswith(HUB_PREFIX):
        return True
    local = Path(path)
    return (
        not local.exists()
        and local.suffix not in _SUFFIXES
        and not path.startswith((".", "/", "~"))
        and bool(_HUB_NAME.match(path))
    )


def load_hub_rows(
    spec: str, split: str, prompt_key: str = "prompt", answer_key: str | None = "answer"
) -> list[Row]:
    """Rows of a hub dataset ``NAME[:CONFIG][@SPLIT]`` (``datasets.load_dataset``). Unreachable
    hub: a one-line ``DataError`` at once, unless ``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE``
    asks for the local cache."""
    spec = spec.removeprefix(HUB_PREFIX)
    name, _, given_split = spec.partition("@")
    split = given_split or split
    name, _, config = name.partition(":")
    offline = any(
        os.environ.get(v, "") not in ("", "0") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )
    if not offline:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            HfApi().dataset_info(name, timeout=10)
        except RepositoryNotFoundError:
            raise DataError(f"{spec}: no such dataset on the hub (nor a local path)") from None
        except Exception as e:  # no network, DNS, proxy: the same one line
            raise DataError(
                f"{spec}: not a local path, and the hub is unreachable ({_one_line(e)}); "
                "download it elsewhere and point data.*_path at the files"
            ) from None
    import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # missing config or split, a cache miss offline
        raise DataError(f"{spec}: cannot load split {split!r} ({_one_line(e)})") from None
    return [
        validate_row(r, f"{spec}@{split}: row {i}", prompt_key, answer_key)
        for i, r in enumerate(ds.to_list())
    ]


_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def load_rows(
    path: str | Path,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    split: str = "train",
) -> list[Row]:
    """Rows of a JSONL, Parquet or CSV file, a saved ``datasets`` directory or a hub dataset
    (its ``split`` unless the name gives one), validated."""
    if isinstance(path, str) and is_hub_dataset(path):
        return load_hub_rows(path, split, prompt_key, answer_key)
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    try:
        if path.suffix in (".jsonl", ".json") and path.is_file():
            rows = _read_jsonl(path, prompt_key, answer_key)
        elif path.suffix == ".parquet" or path.is_dir():
            rows = _read_table(path, prompt_key, answer_key)
        elif path.suffix == ".csv":
            rows = _read_csv(path, prompt_key, answer_key)
        else:
            raise DataError(
                f"{path}: unknown format (use .jsonl, .parquet, .csv, a datasets directory "
                "or a hub dataset)"
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
        return load_rows(path, data_cfg.prompt_key, data_cfg.answer_key or None, split)
    if not data_cfg.task:
        raise DataError(f"no {split} data: set data.task or data.{split}_path")
    n = data_cfg.num_train if split == "train" else data_cfg.num_test
    task = get_task(data_cfg.task, **data_cfg.task_kwargs)
    try:
        if isinstance(task, GymTask):
            task.system_prompt = data_cfg.system_prompt
            rows = task.generate(split, n, seed)
        else:
            rows = generate_split(task, split, n, seed)
    except ValueError as e:  # too few distinct prompts, a bad reasoning-gym config
        raise DataError(f"data.task={data_cfg.task}: {e}") from None
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
