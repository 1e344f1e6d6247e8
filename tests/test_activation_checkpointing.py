"""``trainer.activation_checkpointing``: the same training step, with each decoder layer
recomputed in the backward pass instead of keeping its activations."""

from __future__ import annotations

import pytest

from tests.test_algo_learning import BASE, make_samples
from trident.cluster.net import free_port
from trident.config import load_config
from trident.train.policy import PolicyWorker


def _step(tiny_model: str, checkpointing: bool, shared: bool = False) -> tuple[dict, int]:
    """One ``train_step`` on fixed samples: its metrics and how often decoder layer 0 ran."""
    overrides = [
        f"model.path={tiny_model}",
        f"trainer.activation_checkpointing={str(checkpointing).lower()}",
        f"trainer.share_prompts={str(shared).lower()}",  # two forward passes, counted apart
    ]
    worker = PolicyWorker(load_config([], [*BASE, *overrides]), 0, 1, "127.0.0.1", free_port())
    try:
        calls = []
        layer = worker.model.model.layers[0]
        layer.register_forward_pre_hook(lambda *_: calls.append(1))  # a recompute may stop early
        samples = make_samples(worker.tokenizer, prompts=2, n=3)
        metrics = worker.train_step(samples)
    finally:
        worker.shutdown()
    return metrics, len(calls)


def test_checkpointing_recomputes_the_layers_and_trains_the_same(tiny_model):
    plain, plain_calls = _step(tiny_model, False)
    checkpointed, calls = _step(tiny_model, True)
    # the recompute pass runs no grad; the grad pass runs each layer once more in the backward
    assert calls > plain_calls, (calls, plain_calls)
    for key in ("loss", "grad_norm", "entropy"):
        assert checkpointed[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
    # a recomputed layer keeps no keys and values: shared prompts give way to the padded pass
    shared, _ = _step(tiny_model, True, shared=True)
    for key in ("loss", "grad_norm", "entropy"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-7), key
