"""Per-sample lineage: each sample's story, from its prompt to the weights it changed.

The run harness hands ``SampleLog.write`` each step's trained samples and, when it drops them,
the discarded ones with the reason (``no_signal``, ``infra_error``, ``untrainable``, ...). Each
call adds one row per sample to ``RUN_DIR/samples/step_<k>.parquet``:

    step, sample_id, group_id, prompt_id, prompt, response, response_tokens,
    version_min, version_max    min/max of ``versions`` over ``loss_mask``: the policy versions
                                that wrote the sample's tokens (null without a model token)
    status (its finish: ok, truncated, ...), server (``metadata["server"]``: the rollout server
    that wrote it, the last one for a resumed response), reward, reward_parts   ``reward/<name>``
    of ``metrics``, one per reward function
    trained, reason             reason is null for a trained sample
    trained_step, version       the step that trained it and the weight version that step
                                produced; for a discarded sample trained_step is null and
                                version is the policy version when it was dropped
    advantage, mismatch         ``metrics["advantage"]`` / ``metrics["mismatch"]`` (mean
                                engine-vs-trainer |Δlogp|) when the trainer set them

``telemetry.samples`` picks what is kept (``all``, ``trained``, ``none``) and prompt and
response texts are cut to ``telemetry.sample_text_chars``, so a row's size is bounded: about
``2 × sample_text_chars`` bytes plus ~150 bytes of fixed fields, before Parquet's compression.

A Parquet file cannot be appended to in place: a second write to the same step reads that step's
file, adds the rows and writes it to a temporary name, then renames it over the old one. Each file
is therefore always a whole, readable table, in a run that is still going and in one that crashed.
A step's rows number in the hundreds, so the rewrite is cheap (measured in tests/test_lineage.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from trident.sample import Sample

SampleMode = Literal["all", "trained", "none"]

SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("sample_id", pa.string()),
        ("group_id", pa.string()),
        ("prompt_id", pa.string()),
        ("prompt", pa.string()),
        ("response", pa.string()),
        ("response_tokens", pa.int64()),
        ("version_min", pa.int64()),
        ("version_max", pa.int64()),
        ("status", pa.string()),
        ("server", pa.string()),
        ("reward", pa.float64()),
        ("reward_parts", pa.map_(pa.string(), pa.float64())),
        ("trained", pa.bool_()),
        ("reason", pa.string()),
        ("trained_step", pa.int64()),
        ("version", pa.int64()),
        ("advantage", pa.float64()),
        ("mismatch", pa.float64()),
    ]
)


class SampleLog:
    """Writes sample rows to ``run_dir/samples/step_<k>.parquet``."""

    def __init__(
        self, run_dir: str | Path, samples: SampleMode = "all", text_chars: int = 1000
    ) -> None:
        if samples not in ("all", "trained", "none"):
            raise ValueError(f"telemetry.samples must be all, trained or none, not {samples!r}")
        self.dir = Path(run_dir) / "samples"
        self.mode = samples
        self.text_chars = text_chars

    def write(
        self,
        step: int,
        samples: list[Sample],
        *,
        trained: bool,
        reason: str | None,
        version: int,
    ) -> Path | None:
        """Add ``samples`` to step ``step``'s file: trained by that step (producing weight
        ``version``), or discarded during it for ``reason``. Returns the file, or None when the
        mode keeps none of them."""
        if not samples or self.mode == "none" or (self.mode == "trained" and not trained):
            return None
        rows = [self._row(step, s, trained, reason, version) for s in samples]
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        path = step_path(self.dir, step)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            table = pa.concat_tables([pq.read_table(path, schema=SCHEMA), table])
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, path)
        return path

    def _row(
        self, step: int, s: Sample, trained: bool, reason: str | None, version: int
    ) -> dict[str, Any]:
        row = s.metadata.get("row") or {}
        own = [v for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
        parts = {
            k.removeprefix("reward/"): float(v)
            for k, v in s.metrics.items()
            if k.startswith("reward/")
        }
        prompt_id = row.get("id")
        return {
            "step": step,
            "sample_id": s.id,
            "group_id": s.group_id,
            "prompt_id": None if prompt_id is None else str(prompt_id),
            "prompt": self._cut(prompt_text(row.get("prompt", ""))),
            "response": self._cut(str(s.metadata.get("response", ""))),
            "response_tokens": s.num_response_tokens,
            "version_min": min(own) if own else None,
            "version_max": max(own) if own else None,
            "status": s.status,
            "server": s.metadata.get("server"),
            "reward": s.reward,
            "reward_parts": list(parts.items()),
            "trained": trained,
            "reason": None if trained else reason,
            "trained_step": step if trained else None,
            "version": version,
            "advantage": _float(s.metrics.get("advantage")),
            "mismatch": _float(s.metrics.get("mismatch")),
        }

    def _cut(self, text: str) -> str:
        if self.text_chars and len(text) > self.text_chars:
            return f"{text[: self.text_chars]}… [{len(text) - self.text_chars} more chars]"
        return text


def prompt_text(prompt: str | list[dict]) -> str:
    """A dataset prompt as text: a string as it is, chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def step_path(samples_dir: Path, step: int) -> Path:
    return samples_dir / f"step_{step}.parquet"


def read_samples(run_dir: str | Path, step: int | None = None) -> list[dict[str, Any]]:
    """The rows of ``run_dir/samples`` (one step's with ``step``), in step order; each row's
    ``reward_parts`` as a dict."""
    samples_dir = Path(run_dir) / "samples"
    if step is not None:
        paths = [step_path(samples_dir, step)] if step_path(samples_dir, step).exists() else []
    else:
        paths = sorted(samples_dir.glob("step_*.parquet"), key=lambda p: int(p.stem[5:]))
    rows: list[dict[str, Any]] = []
    for path in paths:
        for row in pq.read_table(path, schema=SCHEMA).to_pylist():
            row["reward_parts"] = dict(row["reward_parts"] or [])
            rows.append(row)
    return rows


STEP_FIGURES = (
    "reward_mean",
    "accuracy",
    "loss",
    "entropy",
    "kl_ref",
    "grad_norm",
    "mismatch_abs_logp_diff_mean",
    "staleness/mean",
)


def story(row: dict[str, Any], step_metrics: dict[str, Any] | None = None) -> str:
    """One sample's lineage as text: prompt, response, reward, training, the weights it changed
    (and that step's figures from ``metrics.jsonl``)."""
    versions = (
        "no model-written token"
        if row["version_min"] is None
        else f"written by policy version {row['version_min']}"
        + ("" if row["version_min"] == row["version_max"] else f"..{row['version_max']}")
    )
    prompt_id = "" if row["prompt_id"] is None else f", prompt {row['prompt_id']}"
    lines = [
        f"sample {row['sample_id']}  (group {row['group_id']}{prompt_id})",
        "prompt:",
        _indent(row["prompt"]),
        f"response: {row['response_tokens']} tokens, status {row['status']}, {versions}"
        + (f", on {row['server']}" if row.get("server") else ""),
        _indent(row["response"]),
    ]
    reward = "none (not scored)" if row["reward"] is None else f"{row['reward']:.4g}"
    parts = ", ".join(f"{k} {v:.4g}" for k, v in sorted(row["reward_parts"].items()))
    lines.append(f"reward: {reward}" + (f"  ({parts})" if parts else ""))
    figures = []
    if row["advantage"] is not None:
        figures.append(f"advantage {row['advantage']:+.4g}")
    if row["mismatch"] is not None:
        figures.append(f"engine-vs-trainer mean |Δlogp| {row['mismatch']:.3g}")
    if figures:
        lines.append("; ".join(figures))
    if row["trained"]:
        lines.append(
            f"trained at step {row['trained_step']} -> produced weights version {row['version']}"
        )
    else:
        lines.append(
            f"not trained: {row['reason'] or 'no reason given'} "
            f"(dropped at step {row['step']}, policy version {row['version']})"
        )
    if step_metrics:
        shown = ", ".join(
            f"{k} {step_metrics[k]:.4g}"
            for k in STEP_FIGURES
            if isinstance(step_metrics.get(k), int | float)
        )
        if shown:
            lines.append(f"step {step_metrics['step']}: {shown}")
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in (text.splitlines() or [""]))
