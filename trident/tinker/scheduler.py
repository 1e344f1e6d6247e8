"""When each training request runs, and how a client waits for its result.

One ``ModelExecutor`` per model applies its requests strictly in ``seq = last + 1`` order: the
SDK reserves seq ids in program order but POSTs a ``forward_backward``'s chunks concurrently,
first chunk last, so arrivals 2, 3, 1 are held in a reorder buffer and applied 1, 2, 3. A gap
that does not fill within ``gap_timeout_s`` (measured from the oldest request waiting behind it)
fails every request waiting behind it: ``on_gap`` journals them as skipped, so a replay skips
them too and the model's history stays one sequence. The missing seq itself stays expected: if
it arrives late it runs, and the skipped ones after it are passed over.

``Futures`` is the long poll: ``wait(request_id, timeout_s)`` returns the result, or None when
it is not ready within the timeout (HTTP 408, the SDK polls again).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from trident.tinker.journal import Result


@dataclass(frozen=True)
class Queued:
    """A request waiting for its turn."""

    request_id: str
    seq_id: int
    kind: str
    args: Any
    arrived: float  # time.monotonic() when it was queued


class Futures:
    """The results not yet delivered, awaited by long polls."""

    def __init__(self) -> None:
        self._pending: dict[str, asyncio.Future[Result]] = {}

    def expect(self, request_id: str) -> None:
        if request_id not in self._pending:
            self._pending[request_id] = asyncio.get_running_loop().create_future()

    def pending(self) -> list[str]:
        return list(self._pending)

    def knows(self, request_id: str) -> bool:
        return request_id in self._pending

    def resolve(self, request_id: str, result: Result) -> None:
        """Deliver ``result`` to the waiters; later readers find it in the result store."""
        future = self._pending.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    async def wait(self, request_id: str, timeout_s: float) -> Result | None:
        future = self._pending[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return None


class ModelExecutor:
    """Applies one model's requests in seq order (module docstring). ``apply`` runs a request
    and delivers its result; ``on_gap`` fails the requests a gap held too long."""

    def __init__(
        self,
        model_id: str,
        next_seq: int,
        apply: Callable[[Queued], Awaitable[None]],
        on_gap: Callable[[list[Queued], int], None],
        gap_timeout_s: float,
    ) -> None:
        self.model_id = model_id
        self.next_seq = next_seq
        self._apply = apply
        self._on_gap = on_gap
        self._gap_timeout_s = gap_timeout_s
        self._waiting: dict[int, Queued] = {}
        self._skipped: set[int] = set()
        self._arrival = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def put(self, item: Queued) -> None:
        self._waiting[item.seq_id] = item
        self._arrival.set()

    def skip(self, seq_id: int) -> None:
        """A seq journaled as failed without running: passed over when its turn comes."""
        self._skipped.add(seq_id)

    def start(self, prologue: Callable[[], Awaitable[None]] | None = None) -> None:
        """Run the loop; ``prologue`` (restoring the model's snapshot) runs first."""
        self._task = asyncio.create_task(self._run(prologue), name=f"tinker {self.model_id}")
        self._task.add_done_callback(self._report)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _report(self, task: asyncio.Task[None]) -> None:
        """An executor that dies leaves its model's requests unanswered: say so, loudly."""
        if not task.cancelled() and task.exception() is not None:
            print(
                f"tinker: the executor of {self.model_id} stopped at seq {self.next_seq}: "
                f"{task.exception()!r}; its requests wait until a restart replays them",
                file=sys.stderr,
                flush=True,
            )

    async def _run(self, prologue: Callable[[], Awaitable[None]] | None) -> None:
        if prologue is not None:
            await prologue()
        while True:
            if self.next_seq in self._skipped:
                self.next_seq += 1
            elif (item := self._waiting.pop(self.next_seq, None)) is not None:
                await self._apply(item)
                self.next_seq += 1
            else:
                await self._await_gap()

    async def _await_gap(self) -> None:
        """Wait for the next seq; fail what waits behind a gap older than the timeout."""
        self._arrival.clear()
        if not self._waiting:
            await self._arrival.wait()
            return
        oldest = min(item.arrived for item in self._waiting.values())
        left = oldest + self._gap_timeout_s - time.monotonic()
        try:
            await asyncio.wait_for(self._arrival.wait(), max(left, 0.0))
        except TimeoutError:
            held = sorted(self._waiting.values(), key=lambda item: item.seq_id)
            self._waiting.clear()
            self._skipped.update(item.seq_id for item in held)
            self._on_gap(held, self.next_seq)
