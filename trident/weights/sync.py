"""Trainer side of online weight sync into running vLLM servers, verified on every server.

One sync is ``WeightSync.push(named_tensors, version)`` followed by ``WeightSync.verify(...)``:

1. ``/pause`` every server (in-flight requests are aborted; new ones queue).
2. ``transport.send``: ``/start_weight_update``, the ``(name, tensor)`` stream, and
   ``/finish_weight_update {"weight_version": "N"}``, which bumps the served version. How the
   tensors travel is the transport's (``Transport``; ``backend.make_transport`` picks one):
   checksummed bucket files in shared memory (``trident.weights.shm``), or, on GPUs, vLLM's own
   trainer-side engines (``backend="nccl"`` / ``"ipc"``: ``trident.weights.nccl``), one NCCL
   group per server, through the same HTTP routes.
3. ``/resume``.
4. ``verify``: on every server, ``GET /weight_info`` must report N and the engine's logprobs of a
   fixed probe sequence must equal the trainer's (``probe_logprobs``) within a tolerance on
   max |Δlogp|. A sync that did not apply (not sent, lost, corrupted, half-applied, the LM head
   of a tied-embedding model left behind) fails here with ``WeightSyncError`` instead of being
   silently trained through. "Weights updated" from vLLM proves nothing on its own.

Verification runs after ``/resume`` because vLLM does not schedule requests while paused, so the
probe could not run before it. In the sync pipeline nothing generates between resume and verify;
in the async pipelines tokens generated in that window carry version N, and a failed verify stops
the run, so they are never trained on.

A failure of any step resumes every server before ``WeightSyncError`` is raised (the transport
first closes their update sessions), so a caller may retry the same version. A retry after a
failed verify (the push finished everywhere) sends only to the servers that do not hold the
version yet, so no server applies an update, a delta in particular, twice. A restarted server
is brought back to the last pushed version by ``rejoin``, from the transport's kept copy.
Tests kill servers at named moments of both (``trident.weights.faults``).

The public methods are synchronous (each runs its own event loops); async callers use
``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol, cast

import torch

from trident.rollout.engine import VLLMClient
from trident.weights.control import WeightRoutes, WeightSyncError, each, timed
from trident.weights.faults import fault_point
from trident.weights.tensors import NamedTensors, full_tensor


class Transport(Protocol):
    """How the weights reach the servers; ``WeightSync`` drives it. ``ShmTransport`` and
    ``VLLMEngineTransport`` implement it (and ``AdapterTransport``, a LoRA policy's adapters)."""

    served_model: str  # the model name the probe and the rollout's requests ask the servers for

    def passes(self, servers: int) -> int:
        """How many times one push to ``servers`` servers iterates, and so gathers, the weight
        stream; the ranks that only take part in the gathers drain it as many times."""
        ...

    def init(self, urls: list[str]) -> None:
        """Called once by ``WeightSync.init``, after the servers are up: set up each server's
        transfer engine (``/init_weight_transfer_engine``)."""
        ...

    def send(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, targets: list[str]
    ) -> dict[str, float]:
        """Called by ``WeightSync.push`` while every server in ``targets`` is paused: start an
        update on each, send the stream and finish it as ``version``. Raises
        ``WeightSyncError`` (having closed every target's update session) when a server refuses
        or fails a step. Returns bytes and seconds per phase; what it leaves of the stream,
        ``push`` drains."""
        ...

    def resend(self, url: str) -> tuple[int, Callable[[], dict[str, float]]]:
        """Called by ``WeightSync.rejoin`` for a restarted server, before it is paused: set up
        its transfer engine again; returns the last pushed version and the send (run while
        ``url`` is paused) that brings the server to it. Raises ``WeightSyncError`` when the
        transport keeps no whole copy of that version."""
        ...

    def close(self) -> None:
        """Called once, when the run ends (``WeightSender.close``): release what the
        transport holds outside the process (transfer groups, bucket files, the bucket
        server)."""
        ...


# ---------------------------------------------------------------------------------------------
# The (name, tensor) stream


def hf_named_tensors(
    weights: torch.nn.Module | Mapping[str, torch.Tensor] | NamedTensors,
    tie_word_embeddings: bool,
    *,
    embed_name: str = "model.embed_tokens.weight",
    head_name: str = "lm_head.weight",
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF name, tensor)`` for every weight of a model, a state dict or a stream of
    pairs (a LoRA policy's merged weights), with ``head_name`` always present when tied.

    ``dtype``: the engine's; each tensor is cast to it as it is yielded (lazily: one bucket at a
    time), so float32 master weights go to a bfloat16 engine at half the bytes, and an FSDP2
    shard is cast before it is gathered (the gather moves half the bytes too).

    vLLM's reload unties a tied LM head: an update that carries only the embedding leaves the
    head on the old weights (measured: the engine then silently mixes old and new). So for a
    model with ``tie_word_embeddings`` the head is sent explicitly, as the embedding tensor.
    """
    if isinstance(weights, torch.nn.Module):
        pairs: NamedTensors = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        pairs = cast("Mapping[str, torch.Tensor]", weights).items()
    else:
        pairs = weights
    embedding = None
    has_head = False
    for name, tensor in pairs:
        has_head = has_head or name == head_name
        if name == embed_name:
            embedding = tensor
        yield name, _cast(tensor.detach(), dtype)
    if tie_word_embeddings and not has_head:
        if embedding is None:
            raise ValueError(
                f"tied embeddings: neither {head_name!r} nor {embed_name!r} is in the state "
                "dict; pass embed_name= for this architecture"
            )
        yield head_name, _cast(embedding.detach(), dtype)


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    floating = tensor.is_floating_point() and dtype is not None
    return tensor.to(dtype) if floating and tensor.dtype != dtype else tensor


def drain(named_tensors: NamedTensors) -> None:
    """Take part in the gathers of a push without sending: what every FSDP rank but the sender
    does with the same stream (``full_tensor`` is a collective, called in the same order)."""
    for _, tensor in named_tensors:
        full_tensor(tensor)


# ---------------------------------------------------------------------------------------------
# The probe


def make_probe(tokenizer_or_vocab_size: Any, length: int, seed: int = 0) -> list[int]:
    """A fixed pseudo-random token sequence for ``verify``; a tokenizer's special tokens are
    left out (a bare vocabulary size excludes nothing)."""
    if length < 2:
        raise ValueError("a probe needs at least 2 tokens (the first has no logprob)")
    if isinstance(tokenizer_or_vocab_size, int):
        vocab_size, special = tokenizer_or_vocab_size, set()
    else:
        tok = tokenizer_or_vocab_size
        vocab_size = len(tok)
        special = set(tok.all_special_ids) | set(getattr(tok, "added_tokens_decoder", {}))
    allowed = [i for i in range(vocab_size) if i not in special]
    rng = random.Random(seed)
    return [rng.choice(allowed) for _ in range(length)]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, probe_ids: list[int]) -> list[float]:
    """The trainer's logprob of each probe token after the first (HF forward, eval mode)."""
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = torch.tensor([probe_ids], device=device)
        logits = model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    finally:
        model.train(was_training)
    return logp.cpu().tolist()


# ---------------------------------------------------------------------------------------------
# The protocol


class WeightSync:
    """Pushes weights to every vLLM server in ``urls`` through ``transport`` and verifies that
    they applied."""

    def __init__(
        self,
        urls: list[str],
        transport: Transport,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        """``timeout_s`` bounds every HTTP call of pause, resume and verify (the transport has
        its own); the probe asks for the transport's ``served_model``."""
        if not urls:
            raise ValueError("WeightSync needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.targets = self.urls  # the servers the last push went to (the others were down)
        self.transport = transport
        self.timeout_s = timeout_s
        self.model = transport.served_model
        self.version: int | None = None  # last version finished on every server
        self.holding: set[str] = set()  # the servers that hold it (pushed or rejoined)

    def init(self) -> None:
        """Called once, after the servers are up: ``/init_weight_transfer_engine`` on each."""
        self.transport.init(self.urls)

    def push(
        self, named_tensors: NamedTensors, version: int, urls: list[str] | None = None
    ) -> dict[str, float]:
        """Pause, transfer, bump to ``version``, resume, on ``urls`` (default: every server;
        fewer while one is down, none at all while every one is). Returns bytes and seconds per
        phase. The stream is consumed either way (the other ranks' gathers).

        Pushing the last pushed version again is a retry (its verification failed because a
        server died): it goes only to the servers in ``urls`` that do not hold it yet, so no
        server gets an update twice, a delta included; ``verify`` then checks them all.

        Raises ``WeightSyncError`` (servers resumed on their previous version) when any server
        refuses or fails a step. Follow with ``verify``.
        """
        if self.version is not None and version < self.version:
            raise ValueError(f"version {version} is older than the last pushed ({self.version})")
        self.targets = self.urls if urls is None else [u.rstrip("/") for u in urls]
        holding = self.holding if version == self.version else set()
        targets = [u for u in self.targets if u not in holding]
        stream = iter(named_tensors)
        try:
            if not targets and holding:  # a retry that every target already holds
                return {"servers_sent": 0.0}
            metrics = self._paused(targets, lambda: self._send(stream, version, targets))
        finally:
            drain(stream)  # a push that failed early still owes the other ranks its gathers
        metrics["servers_sent"] = float(len(targets))
        fault_point("pushed", self.targets)
        self.version, self.holding = version, holding | set(targets)
        return metrics

    def _send(
        self, stream: Iterator[tuple[str, torch.Tensor]], version: int, targets: list[str]
    ) -> dict[str, float]:
        fault_point("push", targets)
        return self.transport.send(stream, version, targets)

    def rejoin(
        self, url: str, probe_ids: list[int], expected_logprobs: list[float], tolerance: float
    ) -> dict[str, float]:
        """Bring a restarted server (``url``, serving its start-up weights) to the last pushed
        version: initialise its transfer engine again, send the kept copy of that version in
        full, and verify it against the probe logprobs the trainer computed for that version.
        Needs a transport that keeps a copy (shm with ``keep_served`` or ``delta``)."""
        version, send = self.transport.resend(url.rstrip("/"))
        fault_point("rejoin", [url.rstrip("/")])
        targets = self.targets
        self.targets = [url.rstrip("/")]
        try:
            m = self._paused(self.targets, send)
            m |= self.verify(probe_ids, expected_logprobs, version, tolerance)
        finally:
            self.targets = targets
        if version == self.version:
            self.holding.add(url.rstrip("/"))
        return m

    def close(self) -> None:
        """Release GPU transfer groups, stop serving buckets to other hosts, delete the bucket
        files (``Transport.close``)."""
        self.transport.close()

    def _paused(self, urls: list[str], send: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``send()`` between pausing and resuming ``urls``; when anything fails, every server
        is resumed before the error is raised."""
        m: dict[str, float] = dict.fromkeys(("pause_s", "resume_s"), 0.0)
        t_start = time.perf_counter()
        try:
            with timed(m, "pause_s"):
                asyncio.run(self._engines(urls, "pause"))
            m |= send()
        except BaseException:
            asyncio.run(self._engines(urls, "resume", quiet=True))
            raise
        with timed(m, "resume_s"):
            asyncio.run(self._engines(urls, "resume"))
        m["total_s"] = time.perf_counter() - t_start
        return m

    async def _engines(
        self, urls: list[str], method: Literal["pause", "resume"], quiet: bool = False
    ) -> None:
        """``method`` on every server in ``urls``; ``quiet``: ignore failures (a resume after
        one)."""
        engines = {url: VLLMClient(url, timeout_s=self.timeout_s) for url in urls}
        try:
            if quiet:
                calls = (getattr(engine, method)(self.timeout_s) for engine in engines.values())
                await asyncio.gather(*calls, return_exceptions=True)
            else:
                await each(urls, method, lambda url: getattr(engines[url], method)(self.timeout_s))
        finally:
            for engine in engines.values():
                await engine.aclose()

    # -- verify --------------------------------------------------------------------------------

    def verify(
        self,
        probe_ids: list[int],
        expected_logprobs: list[float],
        version: int,
        tolerance: float,
    ) -> dict[str, float]:
        """Called after ``push``: every server it went to must report ``version`` and reproduce
        the trainer's probe logprobs within ``tolerance`` (max |Δlogp|); raises
        ``WeightSyncError`` naming each server that does not. Returns max/mean |Δlogp| over the
        servers (zeros when the push went to none)."""
        if len(expected_logprobs) != len(probe_ids) - 1:
            raise ValueError(
                f"expected_logprobs has {len(expected_logprobs)} values; a probe of "
                f"{len(probe_ids)} tokens has {len(probe_ids) - 1}"
            )
        return asyncio.run(self._verify(probe_ids, expected_logprobs, version, tolerance))

    async def _verify(
        self, probe_ids: list[int], expected: list[float], version: int, tolerance: float
    ) -> dict[str, float]:
        t0 = time.perf_counter()
        engines = {
            url: VLLMClient(url, timeout_s=self.timeout_s, model=self.model) for url in self.targets
        }
        async with WeightRoutes(self.timeout_s) as routes:

            async def check(url: str) -> tuple[float, float]:
                served = (await routes.get(url, "/weight_info")).get("weight_version")
                if served != str(version):
                    raise WeightSyncError(
                        f"{url}: version check failed: /weight_info reports {served!r}, "
                        f"expected {str(version)!r} (the update did not reach this server)"
                    )
                got = await engines[url].prompt_logprobs(probe_ids)
                return _compare_probe(url, version, expected, got, tolerance)

            try:
                results = await each(self.targets, "verify", check)
            finally:
                for engine in engines.values():
                    await engine.aclose()
        maxima = [r[0] for r in results.values()] or [0.0]
        means = [r[1] for r in results.values()] or [0.0]
        return {
            "max_abs_dlogp": max(maxima),
            "mean_abs_dlogp": sum(means) / len(means),
            "verify_s": time.perf_counter() - t0,
        }


def _compare_probe(
    url: str, version: int, expected: list[float], got: list[float], tolerance: float
) -> tuple[float, float]:
    if len(got) != len(expected):
        raise WeightSyncError(
            f"{url}: probe check failed: engine returned {len(got)} logprobs, "
            f"expected {len(expected)}"
        )
    diffs = [abs(g - e) for g, e in zip(got, expected, strict=True)]
    worst = max(range(len(diffs)), key=lambda i: diffs[i] if math.isfinite(diffs[i]) else math.inf)
    # A NaN compares false with everything: test finiteness explicitly, never `diff > tol` alone.
    if not math.isfinite(diffs[worst]) or diffs[worst] > tolerance:
        raise WeightSyncError(
            f"{url}: probe check failed at version {version}: max |Δlogp| = {diffs[worst]:.3g} "
            f"> tolerance {tolerance:g} at probe position {worst + 1}: expected "
            f"{expected[worst]:.5f} (trainer), got {got[worst]:.5f} (engine); "
            f"mean |Δlogp| = {sum(diffs) / len(diffs):.3g}"
        )
    return diffs[worst], sum(diffs) / len(diffs)
