"""The Tinker API over HTTP: the endpoints SDK 0.38 and tinker-cookbook call (issue #51), each a
thin route from the wire codec to the ``TinkerService``; this module owns the status codes and
nothing else.

How answers map onto what the SDK does with them (``tinker/lib/api_future_impl.py``,
``_base_client.py``):

- a training POST is journaled by the service before it answers with its future
  ``{request_id, model_id}``, in milliseconds (the SDK resends a POST slower than 60 s);
- ``retrieve_future`` long-polls up to ``long_poll_s`` (30 s, under the SDK's 45 s read
  timeout), then answers **408** ``{"type": "try_again", ...}``: the SDK polls again at once and
  logs nothing. A result is 200: JSON, or protobuf for ``ForwardBackwardOutput`` and
  ``SampleResponse`` when the ``Accept`` header asks for it (SDK 0.38 always does);
- a request that failed is 200 ``{"error", "category": "user" | "server"}``, which fails that one
  call in the client. Never a 5xx for a deterministic failure: the SDK retries a 5xx at once,
  forever. An exception no route expected is a 400 with its message, for the same reason;
- a body the codec cannot read, or a request key reused with another payload
  (``RequestConflict``), is 400 with a JSON body (a 409 would be retried for 5 minutes, an empty
  400 is taken for a dropped connection); an unknown request id 404, an expired one 410 (the SDK
  resubmits a sample, fails a training call); a session the service does not know answers its
  heartbeat 410, which stops the SDK's heartbeat loop;
- auth: ``X-API-Key`` must be one of ``tinker.api_keys``, or with none listed start with
  ``tml-`` (as the SDK itself checks); otherwise 401. ``healthz`` is open;
- every other path is a 404 that names it. ``client/dynamic_config`` is one on purpose (the SDK
  reads 404 as "use the defaults"). The sampling routes and checkpoint deletion call these
  service methods when the service has them, and answer 404 "not served yet" when it does not:
  ``create_sampling_session(body) -> sampling_session_id``, ``sampler_info(id) -> {base_model,
  model_path}``, ``async asample(wire.SampleCall) -> (request_id, sample_sequence_ids)`` (one id
  per sample, as the SDK asserts) and ``delete_checkpoint(model_id, checkpoint_id)``.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from tinker import types as sdk

from trident.config.tinker import TinkerConfig
from trident.tinker import wire
from trident.tinker.service import (
    ExpiredRequest,
    Op,
    RequestConflict,
    Result,
    TinkerService,
    UnknownRequest,
)

log = logging.getLogger(__name__)

API = "/api/v1"
TRAINING_CALLS = (
    "create_model",
    "load_weights",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
)


class NotServed(Exception):
    """A route whose service method does not exist (yet)."""


def create_app(service: TinkerService, cfg: TinkerConfig, long_poll_s: float = 30.0) -> FastAPI:
    """The HTTP app over ``service``; ``long_poll_s`` bounds one ``retrieve_future`` wait. Its
    lifespan (uvicorn's start and stop) starts the service, so a previous life's journal is
    replaying before the first request, and closes it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await service.start()
        yield
        await service.close()

    app = FastAPI(
        title="trident tinker", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    _add_error_mapping(app)
    _add_auth_and_last_resort(app, cfg)
    _add_handshake(app, service)
    _add_training(app, service, cfg)
    _add_futures(app, service, long_poll_s)
    _add_models(app, service, cfg)
    _add_sampling(app, service)
    return app


def _detail(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def _add_error_mapping(app: FastAPI) -> None:
    @app.exception_handler(wire.WireError)
    async def _bad_request(_: Request, e: Exception) -> Response:
        return _detail(400, str(e))

    @app.exception_handler(RequestConflict)
    async def _conflict(_: Request, e: Exception) -> Response:
        return _detail(400, f"request key reused with another payload: {e}")

    @app.exception_handler(NotServed)
    async def _not_served(_: Request, e: Exception) -> Response:
        return _detail(404, f"{e} is not served yet by trident's Tinker service")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> Response:
        if e.status_code == 404:
            return _detail(
                404, f"{request.method} {request.url.path} is not a Tinker endpoint trident serves"
            )
        return _detail(e.status_code, str(e.detail))


def _add_auth_and_last_resort(app: FastAPI, cfg: TinkerConfig) -> None:
    keys = [k.encode() for k in cfg.api_keys]

    def admitted(key: str) -> bool:
        if not keys:
            return key.startswith("tml-")
        return any(hmac.compare_digest(key.encode(), k) for k in keys)

    @app.middleware("http")
    async def _auth(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path != f"{API}/healthz" and not admitted(
            request.headers.get("x-api-key", "")
        ):
            return _detail(401, "missing or unknown X-API-Key")
        try:
            return await call_next(request)
        except Exception as e:  # what no route expected: a 400 that says so, never a 5xx loop
            log.exception("%s %s failed", request.method, request.url.path)
            return _detail(400, f"{request.url.path}: {type(e).__name__}: {e}")


def _add_handshake(app: FastAPI, service: TinkerService) -> None:
    @app.post(f"{API}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        wire.parse_json(sdk.ClientConfigRequest, await request.body())
        # Plain httpx: the pyqwest transport buys nothing on loopback and is one more moving part.
        flags = {"use_pyqwest_transport": False, **service.client_config()}
        return wire.dump_json(sdk.ClientConfigResponse(**flags))

    @app.post(f"{API}/client/dynamic_config")
    async def dynamic_config() -> Response:
        return _detail(404, "no dynamic config: use the defaults")

    @app.get(f"{API}/healthz")
    async def healthz() -> dict[str, Any]:
        return wire.dump_json(sdk.HealthResponse(status="ok"))

    @app.post(f"{API}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req = wire.parse_json(sdk.CreateSessionRequest, await request.body())
        session_id = service.create_session(req.model_dump(mode="json"))
        return wire.dump_json(sdk.CreateSessionResponse(session_id=session_id))

    @app.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        req = wire.parse_json(sdk.SessionHeartbeatRequest, await request.body())
        if not service.heartbeat(req.session_id):
            return _detail(410, f"session {req.session_id} is unknown or finished")
        return wire.dump_json(sdk.SessionHeartbeatResponse())

    @app.post(f"{API}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}  # dropped: nothing here reads the SDK's events

    @app.post(f"{API}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> dict[str, Any]:
        service.finish_session(session_id)
        return {}


def _add_training(app: FastAPI, service: TinkerService, cfg: TinkerConfig) -> None:
    def route(kind: str) -> Callable[[Request], Awaitable[dict[str, Any]]]:
        async def submit(request: Request) -> dict[str, Any]:
            body = wire.decompress(await request.body(), request.headers.get("content-encoding"))
            call = wire.decode_call(kind, body, lora_alpha=cfg.lora_alpha)
            request_id = await service.submit(Op(kind, call.model_id, call.seq_id, body, call.args))
            return wire.dump_json(
                sdk.UntypedAPIFuture(request_id=request_id, model_id=call.model_id)
            )

        return submit

    for kind in TRAINING_CALLS:
        app.add_api_route(f"{API}/{kind}", route(kind), methods=["POST"], name=kind)


def _add_futures(app: FastAPI, service: TinkerService, long_poll_s: float) -> None:
    @app.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = wire.parse_json(sdk.FutureRetrieveRequest, await request.body())
        try:
            result = await service.result(req.request_id, timeout_s=long_poll_s)
        except UnknownRequest:
            return _detail(404, f"unknown request {req.request_id}")
        except ExpiredRequest:
            return _detail(410, f"request {req.request_id} expired: its result is gone")
        if result is None:
            body = {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
            return JSONResponse(body, status_code=408)
        proto = wire.PROTO_CONTENT_TYPE in request.headers.get("accept", "")
        return _result_response(result, proto)


def _result_response(result: Result, proto: bool) -> Response:
    if result.kind == "forward_backward":
        outputs, metrics = result.payload
        if proto:
            body = wire.encode_forward_backward_output(outputs, metrics)
            return Response(body, media_type=wire.PROTO_CONTENT_TYPE)
        return JSONResponse(wire.forward_backward_output_json(outputs, metrics))
    if result.kind == "sample":
        sequences, prompt_logprobs, topk_prompt = result.payload
        body = wire.encode_sample_response(sequences, prompt_logprobs, topk_prompt)
        return Response(body, media_type=wire.PROTO_CONTENT_TYPE)
    if result.kind in ("json", "error"):
        return JSONResponse(result.payload)
    raise ValueError(f"a result of unknown kind {result.kind!r}")


def _model_info(service: TinkerService, model_id: str) -> dict[str, Any] | None:
    try:
        return service.model_info(model_id)
    except KeyError:
        return None


def _add_models(app: FastAPI, service: TinkerService, cfg: TinkerConfig) -> None:
    @app.post(f"{API}/get_info")
    async def get_info(request: Request) -> Any:
        req = wire.parse_json(sdk.GetInfoRequest, await request.body())
        info = _model_info(service, req.model_id)
        if info is None:
            return _detail(404, f"unknown model {req.model_id}")
        return wire.get_info_response(info)

    @app.get(f"{API}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        models = [
            sdk.SupportedModel(model_name=name, trainable=True, sampleable=True)
            for name in cfg.models
        ]
        return wire.dump_json(sdk.GetServerCapabilitiesResponse(supported_models=models))

    @app.get(f"{API}/training_runs/{{model_id}}")
    async def training_run(model_id: str) -> Any:
        info = _model_info(service, model_id)
        if info is None:
            return _detail(404, f"unknown training run {model_id}")
        return wire.training_run_response(info)

    # A checkpoint id is "weights/<name>" or "sampler_weights/<name>": it holds a slash.
    @app.delete(f"{API}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> dict[str, Any]:
        _method(service, "delete_checkpoint")(model_id, checkpoint_id)
        return {}


def _method(service: TinkerService, name: str) -> Callable[..., Any]:
    method = getattr(service, name, None)
    if method is None:
        raise NotServed(name)
    return method


def _add_sampling(app: FastAPI, service: TinkerService) -> None:
    @app.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = wire.parse_json(sdk.CreateSamplingSessionRequest, await request.body())
        sampler_id = _method(service, "create_sampling_session")(req.model_dump(mode="json"))
        return wire.dump_json(sdk.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    @app.get(f"{API}/samplers/{{sampler_id}}")
    async def sampler(sampler_id: str) -> dict[str, Any]:
        info = _method(service, "sampler_info")(sampler_id)
        return wire.dump_json(sdk.GetSamplerResponse(sampler_id=sampler_id, **info))

    @app.post(f"{API}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        method = _method(service, "asample")
        request_id, sequence_ids = await method(wire.decode_sample(await request.body()))
        future = sdk.UntypedAPIFuture(request_id=request_id, sample_sequence_ids=sequence_ids)
        return wire.dump_json(future)
