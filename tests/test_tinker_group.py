"""The training service's trainer over two FSDP2 ranks as Ray actors
(``trident.train.tinker_group``) computes what the in-process trainer computes."""

from __future__ import annotations

import asyncio

import pytest
import ray
import torch

from tests.test_tinker_trainer import ADAM, SETTINGS, make_model, rl_datums, sequences, weights
from trident.config import load_config
from trident.models.load import load_causal_lm
from trident.train.tinker_group import group_trainer


def test_two_ray_ranks_train_as_the_local_trainer(tiny_model, tmp_path):
    cfg = load_config([], [*SETTINGS, f"model.path={tiny_model}", "trainer.num_ranks=2"])
    data = rl_datums(sequences(7))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = group_trainer(tiny_model, None, cfg)

        async def run() -> tuple:
            first = await trainer.forward_backward(data[:5], "importance_sampling", {}, False)
            second = await trainer.forward_backward(data[5:], "importance_sampling", {}, False)
            step = await trainer.optim_step(ADAM)
            await trainer.save_hf(str(tmp_path / "hf"))
            await trainer.close()
            return first, second, step

        first, second, step = asyncio.run(run())
    finally:
        ray.shutdown()
    local = make_model(tiny_model)
    for (outputs, metrics), part in zip((first, second), (data[:5], data[5:]), strict=True):
        expected, expected_metrics = local.forward_backward(part, "importance_sampling", {}, False)
        assert metrics["loss:sum"] == pytest.approx(expected_metrics["loss:sum"], rel=1e-5)
        for got, want in zip(outputs, expected, strict=True):
            torch.testing.assert_close(got["logprobs"], want["logprobs"])
    assert step["grad_norm"] == pytest.approx(local.optim_step(ADAM)["grad_norm"], rel=1e-4)
    exported = dict(load_causal_lm(str(tmp_path / "hf")).named_parameters())
    for name, w in weights(local).items():  # a tenth of one step (lr 1e-2)
        torch.testing.assert_close(exported[name].detach(), w, rtol=0, atol=1e-3, msg=name)
