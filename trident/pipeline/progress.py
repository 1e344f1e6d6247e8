"""The rich progress display of a training run: one bar, the headline metrics beside it."""

from __future__ import annotations

from typing import Any


class StepProgress:
    def __init__(self, total: int, enabled: bool = True) -> None:
        self.bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )  # fmt: skip
        self.task = self.bar.add_task("train", total=total, status="starting")
        self.bar.start()

    def update(self, step: int, m: dict[str, Any]) -> None:
        if self.bar is None:
            return
        status = (
            f"reward {m['reward_mean']:.3f}  acc {m['accuracy']:.1%}  len {m['response_len_mean']:.1f}  "
            f"|Δlogp| {m.get('mismatch_abs_logp_diff_mean', float('nan')):.1e}  sync {m['time/sync_s']:.2f}s"
        )
        if "agent/tool_success_rate" in m:
            status += f"  tools ok {m['agent/tool_success_rate']:.0%}"
        self.bar.update(self.task, completed=step + 1, status=status)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
