"""``trident tinker serve`` on the tiny model, driven by the real ``tinker`` SDK (issue #51):
a LoRA model trained with cross_entropy and importance_sampling, its weights pushed to the vLLM
server trident started (verified) and sampled (n samples, tokens and logprobs, stop token ids
and stop strings honoured with the stop sequence returned, the engine's logprobs the trainer's),
its state saved, a client created from that state continuing bitwise, stale sampling sessions
refused; and (slow) a restart that pushes the weights again before any sample."""

from __future__ import annotations

import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types as sdk
from transformers import AutoTokenizer

from tests.conftest import Run, rollout_server, run_cli, wait_gone

PROMPT = [11, 42, 7, 99, 23]


def _datum(tokens: list[int], **inputs: list[float]) -> sdk.Datum:
    """``tokens`` scored as next-token targets (position i predicts ``tokens[i + 1]``)."""
    fields: dict[str, Any] = {"target_tokens": tokens[1:]}  # the SDK takes lists
    fields.update({k: v[: len(tokens) - 1] for k, v in inputs.items()})
    return sdk.Datum(model_input=sdk.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=fields)


def _ce_data() -> list[sdk.Datum]:
    rows = ([5, 17, 33, 4, 90, 12], [8, 8, 61, 200, 3], [70, 2, 19, 44, 45, 46, 47])
    return [_datum(list(r), weights=[1.0] * len(r)) for r in rows]


def _is_data() -> list[sdk.Datum]:
    rows = ([9, 30, 31, 32, 33], [100, 101, 7, 7])
    return [
        _datum(list(r), logprobs=[-2.0] * len(r), advantages=[0.5 - (i % 2)] * len(r))
        for i, r in enumerate(rows)
    ]


def test_a_missing_checkpoint_fails_before_anything_starts(tmp_path):
    done = run_cli(
        "tinker", "serve", "-c", "configs/tinker.yaml", f"tinker.models={{tiny: {tmp_path}}}",
        f"run.dir={tmp_path}", timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "is not a model checkpoint (no config.json)" in done.stderr
    assert "Ray" not in done.stderr and "rollout server" not in done.stderr


class Serve:
    """``trident tinker serve`` in a subprocess (tagged), stopped with SIGTERM and started
    again on the same state directory (``restart``)."""

    def __init__(self, tiny_model: str, tmp: Path, *overrides: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tag, self.tmp, self.lives = f"tinker-{uuid.uuid4().hex[:8]}", tmp, 0
        self.cmd = [
            sys.executable, "-m", "trident.cli", "tinker", "serve", "-c", "configs/tinker.yaml",
            f"tinker.models={{tiny: {tiny_model}}}", f"tinker.port={self.port}",
            f"tinker.state_dir={tmp / 'state'}", f"run.dir={tmp}", "telemetry.progress=false",
            *overrides,
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        self.lives += 1
        out = self.tmp / f"life{self.lives}"
        out.mkdir()
        self.run = Run(self.cmd, self.tag, out)
        self.run.wait_for(lambda: "tinker service at" in self.run.output, timeout=300)

    def stop(self) -> None:
        try:
            assert self.run.proc.poll() is None, self.run.output[-3000:]
            self.run.proc.send_signal(signal.SIGTERM)
        finally:
            self.run.finish(timeout=120)
        assert self.run.proc.returncode == 143, self.run.output[-3000:]
        assert wait_gone(self.tag) == set()  # the vLLM server and Ray went with it

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    server = Serve(tiny_model, tmp_path_factory.mktemp("tinker_sdk"))
    try:
        yield server
    finally:
        server.stop()


def _step(client, data: list[sdk.Datum]) -> tuple[list[list[float]], float, float]:
    fb = client.forward_backward(data, "cross_entropy").result()
    step = client.optim_step(sdk.AdamParams(learning_rate=5e-2, eps=1e-8)).result()
    logprobs = [out["logprobs"].tolist() for out in fb.loss_fn_outputs]
    return logprobs, fb.metrics["loss:sum"], step.metrics["grad_norm"]


def _ascii_token(tokenizer, tokens: list[int], start: int) -> int | None:
    """The first position from ``start`` whose token decodes to printable ASCII."""
    for i in range(start, len(tokens)):
        text = tokenizer.decode([tokens[i]])
        if text.strip() and text.isascii() and text.isprintable():
            return i
    return None


def test_the_sdk_trains_samples_and_resumes_bitwise(served, tiny_model, monkeypatch):
    url = served.url
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with tinker.ServiceClient(base_url=url, api_key="tml-test") as service:
        with pytest.raises(Exception, match="unknown base_model 'other'"):
            service.create_lora_training_client(base_model="other", rank=4).result()
        trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
        trainer.forward_backward(_ce_data(), "cross_entropy").result()
        trainer.forward_backward(_is_data(), "importance_sampling").result()
        step = trainer.optim_step(sdk.AdamParams(learning_rate=5e-2, eps=1e-8)).result()
        assert step.metrics is not None and step.metrics["grad_norm"] > 0

        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = sdk.ModelInput.from_ints(PROMPT)
        params = sdk.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
        many = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        assert len(many.sequences) == 3
        for seq in many.sequences:
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            assert 0 < len(seq.tokens) <= 8

        # The engine's logprobs of its samples are the trainer's: the push delivered the weights.
        ref = sampler.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
        sequence = PROMPT + ref.tokens
        scored = trainer.forward([_datum(sequence, weights=[1.0] * len(sequence))], "cross_entropy")
        scored = scored.result()
        trainer_logprobs = scored.loss_fn_outputs[0]["logprobs"].tolist()[-len(ref.tokens) :]
        assert ref.logprobs == pytest.approx(trainer_logprobs, abs=2e-3)

        # A stop token id: the sample ends with it (same seed: the same draws up to there).
        assert len(ref.tokens) >= 4, ref
        stop_id = ref.tokens[2]
        cut = ref.tokens.index(stop_id) + 1
        stopped = sampler.sample(
            prompt, 1, sdk.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[stop_id])
        ).result()
        assert stopped.sequences[0].tokens == ref.tokens[:cut]
        assert stopped.sequences[0].stop_reason == "stop"

        # A stop string: the returned tokens run through it (role_colon's parser needs it).
        at = _ascii_token(tokenizer, ref.tokens, 1)
        assert at is not None, tokenizer.decode(ref.tokens)
        stop_text = tokenizer.decode([ref.tokens[at]])
        by_string = sampler.sample(
            prompt, 1, sdk.SamplingParams(max_tokens=8, temperature=1.0, seed=7, stop=[stop_text])
        ).result().sequences[0]  # fmt: skip
        assert by_string.stop_reason == "stop"
        assert by_string.tokens == ref.tokens[: len(by_string.tokens)]
        assert stop_text in tokenizer.decode(by_string.tokens)
        assert stop_text not in tokenizer.decode(by_string.tokens[:-1])

        # A resent asample (same session and seq_id) is the same request, its ids the same
        body = {
            "sampling_session_id": sampler._sampling_session_id,
            "seq_id": 10**6,
            "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 4, "seed": 3},
        }
        posts = [
            httpx.post(f"{url}/api/v1/asample", json=body, headers={"X-API-Key": "tml-test"})
            for _ in range(2)
        ]
        assert [p.status_code for p in posts] == [200, 200], posts[0].text
        assert posts[0].json() == posts[1].json()
        assert len(posts[0].json()["sample_sequence_ids"]) == 2

        logprobs = sampler.compute_logprobs(prompt).result()
        assert logprobs is not None and len(logprobs) == len(PROMPT) and logprobs[0] is None

        # save_state, a client from it with its optimizer: the next step bitwise the original's
        saved = trainer.save_state("after-1").result().path
        loaded = service.create_training_client_from_state_with_optimizer(saved).result()
        original = _step(trainer, _ce_data())
        resumed = _step(loaded, _ce_data())
        assert resumed == original  # logprobs, loss and grad_norm, bitwise
        after = [trainer, loaded]
        outs = [c.forward(_ce_data(), "cross_entropy").result() for c in after]
        first, second = ([o["logprobs"].tolist() for o in out.loss_fn_outputs] for out in outs)
        assert first == second  # the weights after the step, too

        # A named save: the export and the push; a session on its path samples. Once another
        # push replaces the weights, the sessions on the old ones are refused, clearly.
        named = trainer.save_weights_for_sampler("named").result().path
        from_path = service.create_sampling_client(model_path=named).result()
        assert len(from_path.sample(prompt, 2, params).result().sequences) == 2
        fresh = loaded.save_weights_and_get_sampling_client().result()
        assert fresh.sample(prompt, 1, params).result().sequences
        with pytest.raises(tinker.RequestFailedError, match="no longer on the rollout servers"):
            sampler.sample(prompt, 1, params).result()
        _step(trainer, _ce_data())  # the named weights are no longer the model's
        with pytest.raises(Exception, match="older weights"):
            service.create_sampling_client(model_path=named).result()


@pytest.mark.slow  # a rollout server and two lives of the service: 45-85 s on 2 shared cores
def test_a_restart_pushes_the_weights_again_before_any_sample(tiny_model, tmp_path, monkeypatch):
    """Attached to a ``trident rollout serve`` (no vLLM cold start, no Ray), the service is
    stopped after a push and started again on its state directory: the journal is replayed and
    the model's weights pushed again (verified) before the sampling session from before samples;
    it samples what it sampled before, and training goes on."""
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    vllm_tag = f"tinker-vllm-{uuid.uuid4().hex[:8]}"
    (tmp_path / "vllm").mkdir()
    with rollout_server(tiny_model, tmp_path / "vllm", vllm_tag) as vllm_url:
        server = Serve(tiny_model, tmp_path, f"rollout.server_urls=[{vllm_url}]")
        try:
            with tinker.ServiceClient(base_url=server.url, api_key="tml-test") as service:
                trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
                first = _step(trainer, _ce_data())
                sampler = trainer.save_weights_and_get_sampling_client().result()
                prompt = sdk.ModelInput.from_ints(PROMPT)
                params = sdk.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
                before = sampler.sample(prompt, 2, params).result().sequences
                server.restart()
                after = sampler.sample(prompt, 2, params).result().sequences
                assert "pushed again after the restart (verified)" in server.run.output
                assert [s.tokens for s in after] == [s.tokens for s in before]
                for a, b in zip(after, before, strict=True):
                    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
                assert _step(trainer, _ce_data())[1] != first[1]  # the model trains on
        finally:
            server.stop()
