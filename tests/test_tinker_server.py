"""The Tinker HTTP app: its handshake, auth and error mapping over httpx, and the real SDK's
client against it under uvicorn on 127.0.0.1.

The service behind it here is ``StandIn``: the ``TinkerService`` interface answered from memory,
so that every status code can be provoked (a conflict, an expired or pending future, a failed
request). ``test_tinker_sdk.py`` runs the SDK against the journaled service and real trainer.
"""

import asyncio
import hashlib
import socket
import threading
import time

import httpx
import pytest
import tinker
import torch
import uvicorn
from tinker import types as sdk
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from trident.config.tinker import TinkerConfig
from trident.tinker import wire
from trident.tinker.server import create_app
from trident.tinker.service import (
    ExpiredRequest,
    Op,
    RequestConflict,
    Result,
    UnknownRequest,
)

KEY = {"X-API-Key": "tml-test"}


class StandIn:
    """``TinkerService`` from memory: every call applied at once; ``pending`` ids never finish,
    ``expired`` ids are gone; ``forward_backward`` answers logprobs ``-token/10``."""

    def __init__(self, flags: dict | None = None) -> None:
        self.flags = flags or {}
        self.sessions: set[str] = set()
        self.digests: dict[str, str] = {}
        self.results: dict[str, Result] = {}
        self.ops: list[Op] = []
        self.models: dict[str, dict] = {}
        self.pending: set[str] = set()
        self.expired: set[str] = set()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def client_config(self) -> dict:
        return self.flags

    def create_session(self, body: dict) -> str:
        self.sessions.add(f"session-{len(self.sessions)}")
        return f"session-{len(self.sessions) - 1}"

    def heartbeat(self, session_id: str) -> bool:
        return session_id in self.sessions

    def finish_session(self, session_id: str) -> None:
        self.sessions.discard(session_id)

    async def submit(self, op: Op) -> str:
        request_id = f"{op.model_id}#{op.seq_id}"
        digest = hashlib.sha256(op.body).hexdigest()
        if self.digests.setdefault(request_id, digest) != digest:
            raise RequestConflict(request_id)
        if request_id not in self.results:
            self.ops.append(op)
            self.results[request_id] = self._apply(op)
        return request_id

    def _apply(self, op: Op) -> Result:
        if op.kind == "create_model":
            lora = op.args["lora"]
            self.models[op.model_id] = {
                "model_id": op.model_id,
                "base_model": op.args["base_model"],
                "is_lora": lora is not None,
                "lora_rank": lora.rank if lora else None,
            }
            return Result("json", {"model_id": op.model_id})
        if op.kind == "forward_backward":
            if op.args.loss_fn == "stable_reinforce":
                return Result(
                    "error", {"error": "stable_reinforce is not defined", "category": "user"}
                )
            outputs = [{"logprobs": -d.input_tokens.float() / 10} for d in op.args.data]
            return Result("forward_backward", (outputs, {"loss:sum": float(len(outputs))}))
        if op.kind == "optim_step":
            return Result("json", {"metrics": {"grad_norm": op.args.learning_rate}})
        if op.kind == "save_weights_for_sampler" and op.args["path"] is None:
            return Result("json", {"sampling_session_id": f"{op.model_id}:sample:{op.seq_id}"})
        raise ValueError(op.kind)

    async def result(self, request_id: str, timeout_s: float) -> Result | None:
        if request_id in self.expired:
            raise ExpiredRequest(request_id)
        if request_id in self.pending:
            await asyncio.sleep(timeout_s)
            return None
        if request_id not in self.results:
            raise UnknownRequest(request_id)
        return self.results[request_id]

    def model_info(self, model_id: str) -> dict:
        return self.models[model_id]


class SamplingStandIn(StandIn):
    """With the sampling methods the integrator adds: sample ``i`` is ``[last prompt token, i]``,
    each token at logprob -0.5; prompt logprobs ``-token/10`` (none at position 0)."""

    async def asample(self, call: wire.SampleCall) -> tuple[str, list[str]]:
        request_id = f"{call.sampling_session_id}#{call.seq_id}"
        sequences = [
            wire.SampledOutput([call.prompt_tokens[-1], i], [-0.5, -0.5], "length")
            for i in range(call.num_samples)
        ]
        prompt = [None] + [-t / 10 for t in call.prompt_tokens[1:]]
        self.results[request_id] = Result(
            "sample", (sequences, prompt if call.prompt_logprobs else None, None)
        )
        return request_id, [f"{request_id}/{i}" for i in range(call.num_samples)]


def _client(service, **cfg) -> httpx.AsyncClient:
    app = create_app(service, TinkerConfig(**cfg), long_poll_s=0.05)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/api/v1")


def test_handshake_and_auth():
    asyncio.run(_handshake_and_auth())


async def _handshake_and_auth():
    async with _client(StandIn()) as c:
        config = (
            await c.post("/client/config", json={"sdk_version": "0.38.0"}, headers=KEY)
        ).json()
        assert config["use_pyqwest_transport"] is False
        assert config["parallel_fwdbwd_chunks"] is True  # the SDK's defaults otherwise
        assert (await c.post("/client/dynamic_config", json={}, headers=KEY)).status_code == 404
        assert (await c.get("/healthz")).json() == {"status": "ok"}  # open: a liveness probe
        session = {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
        assert (await c.post("/create_session", json=session)).status_code == 401
        assert (
            await c.post("/create_session", json=session, headers={"X-API-Key": "sk-1"})
        ).status_code == 401
        sid = (await c.post("/create_session", json=session, headers=KEY)).json()["session_id"]
        assert (
            await c.post("/session_heartbeat", json={"session_id": sid}, headers=KEY)
        ).status_code == 200
        assert (await c.post("/telemetry", json={"events": []}, headers=KEY)).json() == {
            "status": "accepted"
        }
        finish = {"reason": {"type": "success"}, "detail": None}
        assert (
            await c.post(f"/sessions/{sid}/finish", json=finish, headers=KEY)
        ).status_code == 200
        gone = await c.post("/session_heartbeat", json={"session_id": sid}, headers=KEY)
        assert gone.status_code == 410  # stops the SDK's heartbeat loop
        missing = await c.post("/unload_model", json={}, headers=KEY)
        assert missing.status_code == 404 and "/api/v1/unload_model" in missing.json()["detail"]
    async with _client(StandIn(), api_keys=["tml-only-this"]) as c:
        assert (await c.post("/create_session", json=session, headers=KEY)).status_code == 401
        ok = await c.post("/create_session", json=session, headers={"X-API-Key": "tml-only-this"})
        assert ok.status_code == 200
    async with _client(StandIn(), models={"Qwen/Qwen3-8B-Base": "/models/tiny"}) as c:
        served = (await c.get("/get_server_capabilities", headers=KEY)).json()["supported_models"]
        assert [m["model_name"] for m in served] == ["Qwen/Qwen3-8B-Base"]


def test_training_calls_and_futures_map_onto_status_codes():
    asyncio.run(_training_calls_and_futures_map_onto_status_codes())


async def _training_calls_and_futures_map_onto_status_codes():
    service = StandIn()
    async with _client(service) as c:
        create = {
            "session_id": "s",
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 4},
        }
        future = (await c.post("/create_model", json=create, headers=KEY)).json()
        assert future == {"request_id": "s:train:0#0", "model_id": "s:train:0"}
        done = await c.post(
            "/retrieve_future", json={"request_id": future["request_id"]}, headers=KEY
        )
        assert done.json() == {"model_id": "s:train:0"}
        info = (await c.post("/get_info", json={"model_id": "s:train:0"}, headers=KEY)).json()
        assert (info["model_data"]["model_name"], info["is_lora"], info["lora_rank"]) == (
            "tiny",
            True,
            4,
        )
        run = (await c.get("/training_runs/s:train:0", headers=KEY)).json()
        assert (run["training_run_id"], run["base_model"]) == ("s:train:0", "tiny")
        assert (
            await c.post("/get_info", json={"model_id": "nope"}, headers=KEY)
        ).status_code == 404

        step = {"model_id": "s:train:0", "seq_id": 2, "adam_params": {"learning_rate": 0.5}}
        assert (await c.post("/optim_step", json=step, headers=KEY)).json()[
            "request_id"
        ] == "s:train:0#2"
        assert (await c.post("/optim_step", json=step, headers=KEY)).status_code == 200  # a retry
        other = {**step, "adam_params": {"learning_rate": 0.25}}
        conflict = await c.post("/optim_step", json=other, headers=KEY)
        assert conflict.status_code == 400 and "another payload" in conflict.json()["detail"]
        assert len(service.ops) == 2  # the retry applied nothing

        garbage = await c.post("/forward_backward", content=b"\xff\x00", headers=KEY)
        assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.json()["detail"]

        service.pending.add("slow")
        wait = await c.post("/retrieve_future", json={"request_id": "slow"}, headers=KEY)
        assert wait.status_code == 408
        assert wait.json() == {"type": "try_again", "request_id": "slow", "queue_state": "active"}
        service.expired.add("old")
        assert (
            await c.post("/retrieve_future", json={"request_id": "old"}, headers=KEY)
        ).status_code == 410
        assert (
            await c.post("/retrieve_future", json={"request_id": "x"}, headers=KEY)
        ).status_code == 404


def test_results_errors_and_routes_not_served():
    asyncio.run(_results_errors_and_routes_not_served())


async def _results_errors_and_routes_not_served():
    service = StandIn()
    service.results["fb"] = Result(
        "forward_backward", ([{"logprobs": torch.tensor([-1.0, -2.0])}], {"loss:sum": 3.0})
    )
    service.results["bad"] = Result("error", {"error": "no such loss", "category": "user"})
    sampled = [wire.SampledOutput([5, 6], [-0.5, -0.25], "stop")]
    service.results["smp"] = Result("sample", (sampled, [None, -1.5], None))
    async with _client(service) as c:
        proto = {**KEY, "Accept": wire.PROTO_CONTENT_TYPE}
        r = await c.post("/retrieve_future", json={"request_id": "fb"}, headers=proto)
        assert r.headers["content-type"] == wire.PROTO_CONTENT_TYPE
        out = deserialize_forward_backward_output(r.content)
        assert out.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0]
        sample = await c.post("/retrieve_future", json={"request_id": "smp"}, headers=proto)
        decoded = deserialize_sample_response(sample.content)
        assert decoded.sequences[0].tokens == [5, 6] and decoded.prompt_logprobs == [None, -1.5]
        as_json = (await c.post("/retrieve_future", json={"request_id": "fb"}, headers=KEY)).json()
        assert as_json["metrics"] == {"loss:sum": 3.0}
        failed = await c.post("/retrieve_future", json={"request_id": "bad"}, headers=KEY)
        assert failed.status_code == 200  # fails this call in the client, never a retry loop
        assert failed.json() == {"error": "no such loss", "category": "user"}
        for method, path in [
            ("POST", "/asample"),
            ("POST", "/create_sampling_session"),
            ("GET", "/samplers/x"),
        ]:
            body = {"session_id": "s", "sampling_session_seq_id": 0} if "session" in path else None
            r = await c.request(method, path, json=body, headers=KEY)
            assert r.status_code == 404 and "not served yet" in r.json()["detail"], path
        r = await c.delete("/training_runs/m/checkpoints/weights/000002", headers=KEY)
        assert r.status_code == 404 and "delete_checkpoint" in r.json()["detail"]
        # An exception no route expected (the stand-in cannot apply a save_weights) is a 400
        # with the error, not a 5xx the SDK would retry at once, forever.
        broken = {"model_id": "m", "seq_id": 1, "path": "x"}
        r = await c.post("/save_weights", json=broken, headers=KEY)
        assert r.status_code == 400 and "ValueError: save_weights" in r.json()["detail"]


def test_sample_request_decodes_from_the_sdk_model():
    req = sdk.SampleRequest(
        sampling_session_id="ss",
        seq_id=3,
        num_samples=4,
        prompt=sdk.ModelInput(
            chunks=[sdk.EncodedTextChunk(tokens=[1, 2]), sdk.EncodedTextChunk(tokens=[3])]
        ),
        sampling_params=sdk.SamplingParams(max_tokens=5, stop="\n\nUser:", temperature=0.7),
        prompt_logprobs=True,
        topk_sample_logprobs=2,
    )
    call = wire.decode_sample(req.model_dump_json(exclude_none=True).encode())
    assert (call.sampling_session_id, call.seq_id, call.num_samples) == ("ss", 3, 4)
    assert call.prompt_tokens == [1, 2, 3] and call.stop == ["\n\nUser:"]
    assert (call.max_tokens, call.temperature, call.top_k) == (5, 0.7, -1)
    assert (
        call.prompt_logprobs and call.topk_sample_logprobs == 2 and call.topk_prompt_logprobs == 0
    )


@pytest.fixture
def served():
    """The app under uvicorn on a free loopback port, with the SDK asked to compress its
    forward_backward bodies and to split them one datum per request."""
    service = SamplingStandIn({"proto_compress_fwdbwd": True, "fwdbwd_max_chunk_len": 1})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(service, TinkerConfig()), port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield service, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_the_real_sdk_trains_through_the_app(served, monkeypatch):
    service, url = served
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=url, api_key="tml-test") as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=4).result()
        data = [
            sdk.Datum(
                model_input=sdk.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": tokens[1:] + [0], "weights": [1.0] * len(tokens)},
            )
            for tokens in ([1, 2, 3], [4, 5], [6, 7, 8, 9])
        ]
        fb = trainer.forward_backward(data, "cross_entropy").result()
        step = trainer.optim_step(sdk.AdamParams(learning_rate=0.125)).result()
        with pytest.raises(tinker.RequestFailedError, match="stable_reinforce is not defined"):
            trainer.forward_backward(data[:1], "stable_reinforce").result()
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = sdk.ModelInput.from_ints([3, 4, 5])
        params = sdk.SamplingParams(max_tokens=2, stop=["\n"], temperature=1.0)
        samples = sampler.sample(prompt, num_samples=2, sampling_params=params).result()
        prompt_logprobs = sampler.compute_logprobs(prompt).result()
    assert [s.tokens for s in samples.sequences] == [[5, 0], [5, 1]]
    assert [s.logprobs for s in samples.sequences] == [[-0.5, -0.5]] * 2
    assert [s.stop_reason for s in samples.sequences] == ["length"] * 2
    assert samples.sequences[1].sequence_id.endswith("/1")  # the ids asample's future carried
    assert prompt_logprobs == [None, pytest.approx(-0.4), pytest.approx(-0.5)]
    # Three chunks, zstd bodies: the SDK posts chunks 2 and 3 together, then 1 (the server
    # orders by seq_id), then the step (seq 4). The outputs come back in datum order.
    arrivals = [(op.kind, op.seq_id) for op in service.ops]
    assert arrivals[0] == ("create_model", 0)
    assert sorted(arrivals[1:3]) == [("forward_backward", 2), ("forward_backward", 3)]
    assert arrivals[3:5] == [("forward_backward", 1), ("optim_step", 4)]
    logprobs = [out["logprobs"].tolist() for out in fb.loss_fn_outputs]
    assert logprobs == [
        pytest.approx([-0.1, -0.2, -0.3]),
        pytest.approx([-0.4, -0.5]),
        pytest.approx([-0.6, -0.7, -0.8, -0.9]),
    ]
    assert step.metrics == {"grad_norm": 0.125}
