"""The rollout seam: token ids in, token ids + per-token logprobs + finish reason out.

``RolloutEngine`` is what the pipeline and the agent loop call. ``VLLMClient`` speaks to one vLLM
server over HTTP (``/v1/completions`` with a token-id prompt, ``return_token_ids``, ``logprobs``);
``Router`` (trident.rollout.router) spreads requests over several and has the same interface.
Nothing is re-tokenized: the ids the engine returns are the ids that get trained on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import ssl
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import aiohttp
import httpx

FinishReason = Literal["stop", "length", "abort"]


class EngineError(RuntimeError):
    """The inference server failed a request (an infrastructure failure, never the model's)."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int = 0
    # the policy version of each token, where they differ along one completion (a request
    # resumed across weight updates: ``trident.pipeline.partial.PartialRollout``)
    versions: list[int] | None = None


class RolloutEngine(Protocol):
    """What the group rollout, the agent loop and eval call: ``VLLMClient``, ``Router``, or a
    wrapper such as the async driver's ``PartialRollout``. The servers' control calls
    (pause/resume/abort, prefix-cache reset, health) are ``VLLMClient``'s and ``Router``'s own
    methods, used by the weight gate, the sync and server recovery."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        """Called for every prompt (or agent turn); ``session_id`` keeps a trajectory on one server."""
        ...


SERVED_MODEL = "policy"  # the model name trident's servers answer to, whatever the checkpoint
# what a LoRA policy's requests name under model.lora.sync=adapter (trident.weights.adapter)
ADAPTER_MODEL = "policy-lora"

# what an engine's progress is read from (``VLLMClient.progress``), summed over engines
PROGRESS_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:kv_cache_usage_perc",
)

# a pooled connection the server closed as it was reused (retried once, on a new one)
DROPPED_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
HTTP_ERRORS = (aiohttp.ClientError, TimeoutError)


def metric_sums(page: str, names: Collection[str]) -> dict[str, float]:
    """Each of ``names`` in a Prometheus ``/metrics`` page, summed over its labels (a name the
    page lacks is left out)."""
    found: dict[str, float] = {}
    for line in page.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


@functools.cache
def _tls() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def http_client(timeout_s: float, **kwargs: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` sharing one TLS context per process. httpx builds a context
    for every client, loading the CA bundle (~40 ms on 2 CPU cores), and a client lives as
    long as its event loop: the trainer's weight sync, one loop per call, made four a step,
    measured as 0.2 s of a 0.57 s sync. Certificates are still verified."""
    return httpx.AsyncClient(timeout=timeout_s, verify=_tls(), **kwargs)


def engine_error(where: str, error: Exception) -> EngineError:
    return EngineError(f"{where}: {type(error).__name__}: {error}")


def within(timeout_s: float) -> aiohttp.ClientTimeout:
    """At most ``timeout_s`` to connect and between two reads (not for the whole request: a
    long generation answers once, when it is done, so its wait is one read)."""
    return aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)


_closers: set[asyncio.Task] = set()  # the sessions' closers (a task needs a reference)


def loop_session(name: str) -> aiohttp.ClientSession:
    """An aiohttp session of the running loop, closed when that loop's ``asyncio.run`` ends
    (it cancels the tasks left, this session's closer among them): a client used by one
    ``asyncio.run`` after another (the fleet's, by the evals and the run) leaves no session open
    on a closed loop. Idle pooled connections expire after 2 s, before the server's keep-alive
    timeout (5 s in vLLM's uvicorn), so none is reused as the server closes it."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=512, keepalive_timeout=2.0)
    )

    async def close_at_end() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await session.close()

    closer = asyncio.get_running_loop().create_task(close_at_end(), name=f"close {name}")
    _closers.add(closer)
    closer.add_done_callback(_closers.discard)
    return session


class VLLMClient:
    """HTTP client of one vLLM server (``RolloutEngine``).

    Its requests go through aiohttp. With httpx, the driver spent 0.22 s of CPU on the demo's 32
    concurrent group requests (httpcore's pool re-checks every pooled connection for each queued
    request, each check a socket poll); with aiohttp, 0.02 s. On 2 cores, beside the API server
    and the engine core, the batch came back in 0.41 s instead of 0.51 s."""

    def __init__(self, url: str, timeout_s: float = 300.0, model: str = SERVED_MODEL) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.timeout_s = timeout_s
        self.outstanding = 0  # requests in flight, read by the router
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop:
            self._session, self._loop = loop_session(self.url), loop
        return self._session

    async def _get(self, path: str, timeout_s: float) -> tuple[int, str]:
        limit = within(timeout_s)
        async with self.http.get(f"{self.url}{path}", timeout=limit) as r:
            return r.status, await r.text()

    async def _post(
        self, path: str, payload: dict | None = None, timeout: float | None = None
    ) -> dict:
        limit = within(timeout or self.timeout_s)
        retried = False
        while True:
            try:
                async with self.http.post(
                    f"{self.url}{path}", json=payload or {}, timeout=limit
                ) as r:
                    status, body = r.status, await r.read()
                break
            except DROPPED_CONNECTION as e:
                # A connection that dropped without an answer is retried once, on a new one: a
                # pooled connection can be closed by the server as it is reused (seen under load
                # after a long pause, e.g. a checkpoint save). A dead server fails again.
                if retried:
                    raise engine_error(self.url + path, e) from e
                retried = True
            except HTTP_ERRORS as e:
                raise engine_error(self.url + path, e) from e
        if status != 200:
            text = body.decode(errors="replace")[:500]
            raise EngineError(f"{self.url}{path}: HTTP {status}: {text}")
        return json.loads(body) if body else {}

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> list[Completion]:
        payload = {
            "model": self.model,
            "prompt": prompt_ids,
            "n": params.n,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_tokens": params.max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.stop:
            payload["stop"] = params.stop
        if params.seed is not None:
            payload["seed"] = params.seed
        self.outstanding += 1
        try:
            body = await self._post("/v1/completions", payload)
        finally:
            self.outstanding -= 1
        out = []
        for choice in sorted(body["choices"], key=lambda c: c["index"]):
            reason = choice.get("finish_reason") or "abort"
            out.append(
                Completion(
                    token_ids=list(choice["token_ids"]),
                    logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                    finish_reason=reason if reason in ("stop", "length") else "abort",
                )
            )
        return out

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        payload = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        body = await self._post("/v1/completions", payload)
        entries = body["choices"][0]["prompt_logprobs"][1:]
        return [float(e[str(t)]["logprob"]) for e, t in zip(entries, token_ids[1:], strict=True)]

    async def pause(self, timeout_s: float = 60.0) -> None:
        await self._post("/pause", timeout=timeout_s)

    async def resume(self, timeout_s: float = 60.0) -> None:
        await self._post("/resume", timeout=timeout_s)

    async def abort(self, request_ids: list[str] | None = None) -> int:
        """Abort ``request_ids`` (all in-flight requests when None) without pausing the server.
        Each aborted ``generate`` returns its partial output with ``finish_reason="abort"``.
        Returns how many requests the server aborted."""
        body = await self._post("/abort_requests", {"request_ids": request_ids or []}, timeout=60)
        return int(body.get("aborted", 0))

    async def sleep(self, level: int) -> None:
        """Free the engine's GPU memory (vLLM's sleep mode, a server started with
        ``--enable-sleep-mode``): the KV cache, and the weights (level 1: kept on the CPU;
        2: dropped, for a sync to rewrite whole). Nothing may be running."""
        await self._post(f"/sleep?level={level}", timeout=self.timeout_s)

    async def wake_up(self) -> None:
        """Take the GPU memory back after ``sleep`` (the weights as they were at level 1)."""
        body = await self._post("/wake_up", timeout=self.timeout_s)
        if body.get("status") != "awake":
            raise EngineError(f"{self.url}/wake_up: still asleep after waking ({body})")

    async def reset_prefix_cache(self) -> bool:
        """Drop cached KV blocks (e.g. computed by older weights); False while requests hold
        blocks, so call it when nothing is running."""
        body = await self._post("/reset_prefix_cache", timeout=60)
        return bool(body.get("success", False))

    async def healthy(self) -> bool:
        try:
            status, _ = await self._get("/health", 5.0)
        except HTTP_ERRORS:
            return False
        return status == 200

    async def responsive(self, within_s: float) -> bool:
        """Whether the server answers ``/health`` and its engine generates one token within
        ``within_s``: a stopped (``SIGSTOP``) or wedged engine core leaves ``/health`` answering."""
        if not await self.healthy():
            return False
        try:
            await self._post(
                # the base model: a restarted server answers it before any adapter is loaded
                "/v1/completions",
                {"model": SERVED_MODEL, "prompt": [0], "max_tokens": 1},
                within_s,
            )
        except EngineError:
            return False
        return True

    async def progress(self) -> tuple[float, ...] | None:
        """The engine's work so far, from its Prometheus ``/metrics``: tokens prefilled and
        generated (``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``) and its KV-cache
        usage, which a prefill chunk changes before the prompt's first token counts. The API
        server keeps these from what its engine core sends each step, so they stand still when
        the core is frozen, while ``/health`` still answers. None if ``/metrics`` does not answer
        or lacks them (a server started with ``--disable-log-stats``)."""
        try:
            status, page = await self._get("/metrics", 5.0)
        except HTTP_ERRORS:
            return None
        if status != 200:
            return None
        found = metric_sums(page, PROGRESS_METRICS)
        return tuple(found[n] for n in PROGRESS_METRICS) if len(found) == 3 else None

    async def aclose(self) -> None:
        """Close the session of the running loop (another loop's closes as that loop ends)."""
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
