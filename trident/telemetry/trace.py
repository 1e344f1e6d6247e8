"""A timeline of a run: spans of every pipeline stage, written as a Chrome/Perfetto trace.

``Trace`` records complete spans (``"ph": "X"`` trace events, microseconds) on named processes
(``trainer``, ``rollout <url>``, ``reward``, ...). Stages that overlap on one process, such as many
generation requests on one server, get lanes: a span takes the lowest lane that is free when it
begins, so spans on one lane never overlap and Perfetto draws each lane as a thread.
``write(path)`` produces JSON that ui.perfetto.dev and chrome://tracing open directly.

The same spans give the pipeline's utilisation figures:

    busy(P)        = length of the union of process P's spans (seconds)
    idle fraction  = 1 - busy(P) / wall

so "trainer idle" and "rollout idle" are measured from the timeline itself, not kept as separate
counters that could disagree with it. Spans are stored in the order they end, so the busy time of
a recent window (one training step) costs only the spans in that window.

Simplifications: one clock for everything (the event loop's, so a simulated run on a virtual clock
gets a virtual timeline); spans are recorded by the controller, so a Ray trainer rank's work
appears as the controller's call to it, not as spans inside the rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Span:
    name: str
    process: str
    lane: int
    start: float
    end: float
    args: dict[str, Any]


class Trace:
    """Spans on processes and lanes, timed by ``clock`` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.origin = clock()
        self.spans: list[Span] = []
        self.counters: list[tuple[str, str, float, dict[str, float]]] = []
        self._busy_lanes: dict[str, set[int]] = {}
        self.running: dict[object, tuple[str, str, float]] = {}  # open spans: name, process, start

    def now(self) -> float:
        """Seconds since the trace began."""
        return self.clock() - self.origin

    @contextmanager
    def span(self, name: str, process: str, **args: Any) -> Iterator[None]:
        """Record the ``with`` block as one span named ``name`` on ``process``."""
        lanes = self._busy_lanes.setdefault(process, set())
        lane = next(i for i in range(len(lanes) + 1) if i not in lanes)
        lanes.add(lane)
        start = self.now()
        key = object()
        self.running[key] = (name, process, start)
        try:
            yield
        finally:
            del self.running[key]
            lanes.discard(lane)
            self.spans.append(Span(name, process, lane, start, self.now(), args))

    def oldest_running(self) -> tuple[str, str, float] | None:
        """The span that has been open longest: (name, process, seconds open), or None."""
        if not self.running:
            return None
        name, process, start = min(self.running.values(), key=lambda v: v[2])
        return name, process, self.now() - start

    def counter(self, name: str, process: str, **values: float) -> None:
        """A sampled value (buffer depth, ...), drawn by Perfetto as a counter track."""
        self.counters.append((name, process, self.now(), values))

    def busy_seconds(
        self,
        process: str,
        names: set[str] | None = None,
        start: float = float("-inf"),
        end: float = float("inf"),
    ) -> float:
        """Length of the union of ``process``'s spans (only ``names`` if given), clipped to
        [start, end]: the time at least one of them was running."""
        intervals = []
        for s in reversed(self.spans):  # spans are appended as they end: newest last
            if s.end <= start:
                break
            if s.process == process and (names is None or s.name in names) and s.start < end:
                intervals.append((max(s.start, start), min(s.end, end)))
        intervals.sort()
        total, run_start, run_end = 0.0, 0.0, None
        for a, b in intervals:
            if run_end is None or a > run_end:
                total += 0.0 if run_end is None else run_end - run_start
                run_start, run_end = a, b
            else:
                run_end = max(run_end, b)
        return total + (0.0 if run_end is None else run_end - run_start)

    def idle_fraction(
        self, processes: list[str], start: float, end: float, names: set[str] | None = None
    ) -> float:
        """Mean over ``processes`` of the fraction of [start, end] with none of its spans
        (of ``names``, if given) running."""
        if not processes:
            return 0.0
        wall = max(end - start, 1e-12)
        busy = [self.busy_seconds(p, names, start, end) for p in processes]
        return sum(1.0 - b / wall for b in busy) / len(processes)

    def processes(self, prefix: str = "") -> list[str]:
        return sorted({s.process for s in self.spans if s.process.startswith(prefix)})

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace-event JSON: one pid per process, one tid per lane."""
        names = sorted({s.process for s in self.spans} | {c[1] for c in self.counters})
        pid = {name: i + 1 for i, name in enumerate(names)}
        events: list[dict[str, Any]] = []
        for name in names:
            events.append(
                {"ph": "M", "name": "process_name", "pid": pid[name], "args": {"name": name}}
            )
        for process, lane in sorted({(s.process, s.lane) for s in self.spans}):
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid[process],
                    "tid": lane,
                    "args": {"name": f"{process} #{lane}" if lane else process},
                }
            )
        for s in self.spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": pid[s.process],
                    "tid": s.lane,
                    "ts": round(s.start * 1e6, 3),
                    "dur": round((s.end - s.start) * 1e6, 3),
                    "args": s.args,
                }
            )
        for name, process, at, values in self.counters:
            events.append(
                {
                    "ph": "C",
                    "name": name,
                    "pid": pid[process],
                    "ts": round(at * 1e6, 3),
                    "args": values,
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | Path) -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.to_chrome()))
        return out
