"""The real Tinker SDK against trident's whole training service on 127.0.0.1: the HTTP app under
uvicorn, the journaled ``TinkerService`` and trident's own trainer (``local_trainer``, the tiny
checkpoint, deterministic). A client trains, saves its state, and a second client created from
that state continues exactly as the first does, bitwise."""

import functools
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import tinker
import torch
import uvicorn
from tinker import types as sdk

from trident.config import load_config
from trident.tinker import wire
from trident.tinker.server import create_app
from trident.tinker.service import ServiceSettings, TinkerService
from trident.train.tinker_ops import local_trainer


@pytest.fixture
def server_url(tmp_path, tiny_model) -> Iterator[str]:
    overrides = ["trainer.cpu_threads=1", "run.deterministic=true", "telemetry.progress=false"]
    cfg = load_config([], [f"model.path={tiny_model}", *overrides])
    service = TinkerService(
        ServiceSettings(state_dir=tmp_path / "state", models={"tiny": tiny_model}),
        functools.partial(local_trainer, cfg=cfg),
        lambda kind, body: wire.decode_call(kind, body, lora_alpha=cfg.tinker.lora_alpha).args,
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(service, cfg.tinker)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    deterministic = torch.are_deterministic_algorithms_enabled()
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        torch.use_deterministic_algorithms(deterministic)  # run.deterministic is process-wide


def _batch(step: int) -> list[sdk.Datum]:
    """Two ragged sequences whose tokens depend on ``step``; targets are the next tokens."""
    gen = torch.Generator().manual_seed(step)
    data = []
    for length in (7, 5):
        tokens = torch.randint(1, 200, (length + 1,), generator=gen).tolist()
        weights = [1.0 / length] * length
        data.append(
            sdk.Datum(
                model_input=sdk.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return data


def _train(client: tinker.TrainingClient, steps: range) -> list[list[float]]:
    """``steps`` of cross entropy + Adam; the logprobs of each step's first datum."""
    seen = []
    for step in steps:
        fb = client.forward_backward(_batch(step), "cross_entropy")
        client.optim_step(sdk.AdamParams(learning_rate=1e-2, eps=1e-8)).result()
        seen.append(fb.result().loss_fn_outputs[0]["logprobs"].tolist())
    return seen


def test_sdk_trains_saves_and_a_client_from_the_state_continues_bitwise(server_url, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with tinker.ServiceClient(base_url=server_url, api_key="tml-test") as service:
        first = service.create_lora_training_client(base_model="tiny", rank=4).result()
        assert first.get_info().model_data.model_name == "tiny"
        before = first.forward(_batch(0), "cross_entropy").result()
        trained = _train(first, range(2))
        assert trained[0] == before.loss_fn_outputs[0]["logprobs"].tolist()  # the same weights
        assert trained[1] != trained[0]
        path = first.save_state("mid").result().path
        assert path == f"tinker://{first.model_id}/weights/mid"

        second = service.create_training_client_from_state_with_optimizer(path).result()
        assert second.model_id != first.model_id
        assert _train(second, range(2, 4)) == _train(first, range(2, 4))  # bitwise
        with pytest.raises(tinker.RequestFailedError, match="stable_reinforce"):
            first.forward_backward(_batch(9), "stable_reinforce").result()
