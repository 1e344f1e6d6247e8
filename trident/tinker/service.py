"""The service interface the HTTP layer calls, as issue #51's brief states it: sessions, models,
journaled training requests and their futures. Nothing here speaks HTTP.

This file holds only the contract (the request and result records, the three failures, and
the methods ``trident.tinker.server`` calls); the implementation (journal, scheduler, exactly-
once) replaces it, keeping these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class RequestConflict(Exception):
    """A request key (model id, seq id) seen before with another payload (HTTP 400)."""


class UnknownRequest(Exception):
    """A request id this service never acknowledged (HTTP 404)."""


class ExpiredRequest(Exception):
    """A request id acknowledged once whose result is gone, e.g. a sample lost in a restart
    (HTTP 410: the SDK resubmits a sample, a training call fails)."""


@dataclass(frozen=True)
class Op:
    """A training request: ``kind`` is ``create_model``, ``load_weights``, ``forward_backward``,
    ``optim_step``, ``save_weights`` or ``save_weights_for_sampler``; ``body`` the request's
    payload as received, decompressed (its sha256 is the digest); ``args`` the decoded call
    (``trident.tinker.wire.decode_call`` of ``kind`` and ``body``)."""

    kind: str
    model_id: str
    seq_id: int
    body: bytes
    args: Any


@dataclass(frozen=True)
class Result:
    """A finished request: ``json`` (payload a dict), ``forward_backward`` (payload
    ``(outputs, metrics)``), ``sample`` (payload ``(sequences, prompt_logprobs,
    topk_prompt_logprobs)`` for ``wire.encode_sample_response``) or ``error`` (payload
    ``{"error", "category"}``)."""

    kind: str
    payload: Any


class TinkerService(Protocol):
    def client_config(self) -> dict[str, Any]:
        """Flags for ``POST client/config``, over the SDK's defaults."""
        ...

    def create_session(self, body: dict[str, Any]) -> str:
        """A new session (journaled, so it survives restarts); returns its id."""
        ...

    def heartbeat(self, session_id: str) -> bool:
        """A session's heartbeat; False when the session is unknown or finished."""
        ...

    def finish_session(self, session_id: str) -> None:
        """The client closed its session."""
        ...

    async def submit(self, op: Op) -> str:
        """Journal (fsync) and schedule a training request; returns its request id. The same
        key and digest return the same id; the same key with another digest raises
        ``RequestConflict``."""
        ...

    async def result(self, request_id: str, timeout_s: float) -> Result | None:
        """A request's result, waiting up to ``timeout_s``; None when not done yet. Raises
        ``UnknownRequest`` or ``ExpiredRequest``."""
        ...

    def model_info(self, model_id: str) -> dict[str, Any]:
        """A model's ``model_id``, ``base_model``, ``is_lora``, ``lora_rank`` (and optionally
        ``tokenizer_id``, ``arch``, ``user_metadata``, ``last_request_time``); raises
        ``KeyError`` for an unknown model."""
        ...
