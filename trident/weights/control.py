"""The weight-update routes of vLLM servers, as one client, and the fan-out over servers.

The routes (a server run with ``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` and ``/weight_info``.
``WeightRoutes`` is the only code that calls them: every failure, of the connection or an HTTP
status other than 200, becomes a ``WeightSyncError`` that names the server and the route. The
shm transport and ``WeightSync.verify`` call them from an event loop; vLLM's trainer-side engines
(nccl, ipc) call them from worker threads, hence ``post_blocking``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from trident.rollout.engine import http_client


class WeightSyncError(RuntimeError):
    """A weight sync failed or did not apply; the message names the server and the step."""


class WeightRoutes:
    """One client for the weight-update routes: ``async with WeightRoutes(timeout_s)`` opens one
    HTTP client for an event loop; ``post_blocking`` needs none. ``timeout_s`` bounds every
    call."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> WeightRoutes:
        self._http = http_client(self.timeout_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    @property
    def http(self) -> httpx.AsyncClient:
        assert self._http is not None, "WeightRoutes: call it inside `async with`"
        return self._http

    async def post(self, url: str, path: str, payload: dict | None = None) -> dict[str, Any]:
        try:
            r = await self.http.post(f"{url}{path}", json=payload or {})
        except httpx.HTTPError as e:
            raise _failed(url, path, e) from e
        _check(url, path, r)
        # some routes answer in plain text (vLLM's /v1/load_lora_adapter)
        return r.json() if "json" in r.headers.get("content-type", "") else {}

    async def get(self, url: str, path: str) -> dict[str, Any]:
        try:
            r = await self.http.get(f"{url}{path}")
        except httpx.HTTPError as e:
            raise _failed(url, path, e) from e
        _check(url, path, r)
        return r.json()

    def post_blocking(self, url: str, path: str, payload: dict) -> None:
        try:
            r = httpx.post(f"{url}{path}", json=payload, timeout=self.timeout_s)
        except httpx.HTTPError as e:
            raise _failed(url, path, e) from e
        _check(url, path, r)


def _failed(url: str, path: str, error: httpx.HTTPError) -> WeightSyncError:
    return WeightSyncError(f"{url}: {path} failed: {type(error).__name__}: {error}")


def _check(url: str, path: str, r: httpx.Response) -> None:
    if r.status_code != 200:
        raise WeightSyncError(f"{url}: {path} failed: HTTP {r.status_code}: {r.text[:1000]}")


async def each(urls: list[str], step: str, call: Callable[[str], Awaitable[Any]]) -> dict[str, Any]:
    """Run ``call(url)`` on every server at once; raise one error naming every failure."""
    results = await asyncio.gather(*(call(url) for url in urls), return_exceptions=True)
    errors = []
    for url, result in zip(urls, results, strict=True):
        if isinstance(result, WeightSyncError):
            errors.append(str(result))
        elif isinstance(result, BaseException):
            errors.append(f"{url}: {step} failed: {type(result).__name__}: {result}")
    if errors:
        raise WeightSyncError("\n".join(errors))
    return dict(zip(urls, results, strict=True))


class timed:  # noqa: N801 (used as a statement: `with timed(m, "pause_s"):`)
    """Adds the seconds spent in the ``with`` block to ``metrics[key]``."""

    def __init__(self, metrics: dict[str, float], key: str) -> None:
        self.metrics, self.key = metrics, key

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.metrics[self.key] += time.perf_counter() - self.t0
