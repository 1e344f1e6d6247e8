"""``trident tinker serve`` on the tiny model, driven by the real ``tinker`` SDK (issue #51):
a LoRA model trained with cross_entropy and importance_sampling, its weights pushed to the vLLM
server trident started (verified) and sampled (n samples, tokens and logprobs, stop token ids
and stop strings honoured with the stop sequence returned, the engine's logprobs the trainer's),
its state saved, and a client created from that state continuing bitwise."""

from __future__ import annotations

import signal
import socket
import sys
import uuid

import pytest
import tinker
from tinker import types as sdk
from transformers import AutoTokenizer

from tests.conftest import Run, wait_gone

PROMPT = [11, 42, 7, 99, 23]


def _datum(tokens: list[int], **inputs: list[float]) -> sdk.Datum:
    """``tokens`` scored as next-token targets (position i predicts ``tokens[i + 1]``)."""
    fields: dict[str, list] = {"target_tokens": tokens[1:]}
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


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinker_sdk")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tag = f"tinker-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable, "-m", "trident.cli", "tinker", "serve", "-c", "configs/tinker.yaml",
        f"tinker.models={{tiny: {tiny_model}}}", f"tinker.port={port}",
        f"tinker.state_dir={tmp / 'state'}", f"run.dir={tmp}", "telemetry.progress=false",
    ]  # fmt: skip
    server = Run(cmd, tag, tmp)
    try:
        server.wait_for(lambda: "tinker service at" in server.output, timeout=300)
        yield f"http://127.0.0.1:{port}", tmp
        assert server.proc.poll() is None, server.output[-3000:]
        server.proc.send_signal(signal.SIGTERM)
    finally:
        server.finish(timeout=120)
    assert server.proc.returncode == 143, server.output[-3000:]
    assert wait_gone(tag) == set()  # the vLLM server and Ray went with it


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
    url, _ = served
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with tinker.ServiceClient(base_url=url, api_key="tml-test") as service:
        trainer = service.create_lora_training_client(base_model="tiny", rank=4).result()
        trainer.forward_backward(_ce_data(), "cross_entropy").result()
        trainer.forward_backward(_is_data(), "importance_sampling").result()
        step = trainer.optim_step(sdk.AdamParams(learning_rate=5e-2, eps=1e-8)).result()
        assert step.metrics["grad_norm"] > 0

        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = sdk.ModelInput.from_ints(PROMPT)
        params = sdk.SamplingParams(max_tokens=8, temperature=1.0, seed=7)
        many = sampler.sample(prompt, num_samples=3, sampling_params=params).result()
        assert len(many.sequences) == 3
        for seq in many.sequences:
            assert 0 < len(seq.tokens) <= 8 and len(seq.logprobs) == len(seq.tokens)

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

        logprobs = sampler.compute_logprobs(prompt).result()
        assert logprobs[0] is None and len(logprobs) == len(PROMPT)

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
