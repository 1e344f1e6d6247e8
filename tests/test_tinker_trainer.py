"""The trainer primitives of the training service (``trident.train.tinker_ops``) on the tiny
model: gradients accumulate across ``forward_backward`` calls and ``forward_only`` leaves them
alone; the logprobs are the model's; LoRA trains the adapters alone; ``optim_step`` takes the
call's Adam parameters and clips only when asked; ``save_state`` → ``load_state`` continues
bitwise; an undefined loss is one clear error through the async trainer."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from trident.algorithms.tinker_losses import UnsupportedLoss
from trident.config import load_config
from trident.train.batch import Batch
from trident.train.datum import AdamParams, Datum, LoraShape
from trident.train.recompute import token_logprobs
from trident.train.tinker_ops import TinkerModel, local_trainer

# micro-batches of at most 48 padded tokens: a call of 6 datums runs several
SETTINGS = ["trainer.cpu_threads=1", "trainer.micro_batch_tokens=48", "telemetry.progress=false"]
ADAM = AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.01)


@pytest.fixture
def deterministic():
    """``run.deterministic`` switches torch's kernels process-wide: back as they were after."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def make_model(path: str, shape: LoraShape | None = None, *extra: str) -> TinkerModel:
    return TinkerModel(path, shape, load_config([], [*SETTINGS, f"model.path={path}", *extra]))


def sequences(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(rng.randint(4, 12))] for _ in range(n)]


def sft_datums(seqs: list[list[int]]) -> list[Datum]:
    """Shifted by the caller, weights summing to 1 per example (the cookbook's SFT datums)."""
    out = []
    for s in seqs:
        tokens, targets = torch.tensor(s[:-1]), torch.tensor(s[1:])
        weights = torch.full((len(tokens),), 1.0 / len(tokens))
        out.append(Datum(tokens, {"target_tokens": targets, "weights": weights}))
    return out


def rl_datums(seqs: list[list[int]], seed: int = 1) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for d in sft_datums(seqs):
        n = len(d.input_tokens)
        d.loss_inputs = {
            "target_tokens": d.loss_inputs["target_tokens"],
            "logprobs": -6.0 - torch.rand(n, generator=gen),  # near the tiny model's ~ -6.2
            "advantages": torch.randn(n, generator=gen),
        }
        out.append(d)
    return out


def grads(model: TinkerModel) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.clone() for n, p in model.model.named_parameters()
    }


def weights(model: TinkerModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.model.named_parameters()}


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_only_leaves_gradients_untouched(tiny_model, dtype):
    """bfloat16: FSDP2 wraps the root (mixed precision over float32 master weights)."""
    model = make_model(tiny_model, None, f"model.dtype={dtype}")
    data = rl_datums(sequences())
    outputs, _ = model.forward_backward(data, "importance_sampling", {}, forward_only=True)
    assert all(g is None for g in grads(model).values())  # none made
    model.forward_backward(data[:3], "importance_sampling", {}, forward_only=False)
    before = grads(model)
    assert all(g is not None for g in before.values())
    again, metrics = model.forward_backward(data, "importance_sampling", {}, forward_only=True)
    assert_bitwise(grads(model), before)  # none changed
    for o, a in zip(outputs, again, strict=True):  # the weights did not move: same outputs
        assert torch.equal(o["logprobs"], a["logprobs"])
    assert metrics["loss:sum"] == pytest.approx(
        sum(float(a["elementwise_loss"].sum()) for a in again)
    )


def test_two_calls_then_a_step_equal_one_call_with_every_datum(tiny_model):
    data = rl_datums(sequences(8))
    split, whole = make_model(tiny_model), make_model(tiny_model)
    first, m1 = split.forward_backward(data[:5], "ppo", {}, forward_only=False)
    second, m2 = split.forward_backward(data[5:], "ppo", {}, forward_only=False)
    both, m = whole.forward_backward(data, "ppo", {}, forward_only=False)
    assert m1["loss:sum"] + m2["loss:sum"] == pytest.approx(m["loss:sum"], rel=1e-5)
    for a, b in zip(first + second, both, strict=True):
        torch.testing.assert_close(a["logprobs"], b["logprobs"])
        torch.testing.assert_close(a["elementwise_loss"], b["elementwise_loss"])
    g_split, g_whole = grads(split), grads(whole)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_split[name], g, rtol=1e-4, atol=1e-5, msg=name)
    n1, n2 = split.optim_step(ADAM)["grad_norm"], whole.optim_step(ADAM)["grad_norm"]
    assert n1 == pytest.approx(n2, rel=1e-5) and n1 > 0
    # Adam divides by the gradient's own scale: where it is ~0, float noise moves an element by
    # a part of one step (lr 1e-2), so a tenth of a step
    w_split, w_whole = weights(split), weights(whole)
    for name, w in w_whole.items():
        torch.testing.assert_close(w_split[name], w, rtol=0, atol=1e-3, msg=name)
    assert all(g is None for g in grads(split).values())  # the step dropped them


def test_returned_logprobs_are_the_models_token_logprobs(tiny_model):
    model = make_model(tiny_model)
    seqs = sequences(5, seed=2)
    outputs, metrics = model.forward_backward(sft_datums(seqs), "cross_entropy", {}, True)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    zeros = torch.zeros(len(seqs), width - 1)
    with torch.no_grad():
        expected, _ = token_logprobs(
            model.model, Batch(ids, attention, zeros, zeros, zeros.long()), 1.0
        )
    nll = 0.0
    for k, (s, out) in enumerate(zip(seqs, outputs, strict=True)):
        assert out["logprobs"].dtype == torch.float32 and out["logprobs"].shape == (len(s) - 1,)
        torch.testing.assert_close(out["logprobs"], expected[k, : len(s) - 1])
        nll -= float(expected[k, : len(s) - 1].mean())
    assert metrics["loss:sum"] == pytest.approx(nll, rel=1e-5)  # weights 1/n: Σ mean NLL


def test_lora_trains_the_adapters_alone_and_rank_zero_trains_everything(tiny_model):
    data = sft_datums(sequences())
    lora = make_model(tiny_model, LoraShape(rank=4, alpha=8.0, train_mlp=False))
    trained = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}  # no MLP asked
    before = weights(lora)
    lora.forward_backward(data, "cross_entropy", {}, forward_only=False)
    lora.optim_step(ADAM)
    after = weights(lora)
    for name in before:
        moved = not torch.equal(before[name], after[name])
        # lora_A moves at once; lora_B starts at 0, so its first step moves it too
        assert moved == (name in trained), name
    full = make_model(tiny_model, LoraShape(rank=0))
    before = weights(full)
    full.forward_backward(data, "cross_entropy", {}, forward_only=False)
    full.optim_step(ADAM)
    after = weights(full)
    assert all(p.requires_grad for p in full.model.parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_save_load_then_a_step_equals_no_save_bitwise(tiny_model, tmp_path, deterministic):
    data = [rl_datums(sequences(seed=s), seed=s) for s in range(4)]
    shape = LoraShape(rank=4, alpha=8.0)

    def step(model: TinkerModel, k: int) -> None:
        model.forward_backward(data[k], "importance_sampling", {}, forward_only=False)
        model.optim_step(ADAM)

    kept = make_model(tiny_model, shape, "run.deterministic=true")
    kept.save_state(str(tmp_path / "fresh"))  # before any step: no moments yet
    step(kept, 0)
    step(kept, 1)
    kept.save_state(str(tmp_path / "two"))
    step(kept, 2)
    resumed = make_model(tiny_model, shape, "run.deterministic=true")
    resumed.forward_backward(data[3], "importance_sampling", {}, forward_only=False)
    resumed.load_state(str(tmp_path / "two"), optimizer=True)  # pending gradients dropped
    step(resumed, 2)
    assert_bitwise(weights(resumed), weights(kept))
    moments = [resumed.opt.state_dict()["state"], kept.opt.state_dict()["state"]]
    for index, state in moments[1].items():
        for key, value in state.items():
            assert torch.equal(moments[0][index][key], value), (index, key)
    # without the moments the step differs; from the state before any step, it is the first
    fresh = make_model(tiny_model, shape, "run.deterministic=true")
    fresh.load_state(str(tmp_path / "two"), optimizer=False)
    step(fresh, 2)
    w_fresh, w_kept = weights(fresh), weights(kept)
    assert any(not torch.equal(w_fresh[n], w_kept[n]) for n in w_kept)
    restarted = make_model(tiny_model, shape, "run.deterministic=true")
    restarted.load_state(str(tmp_path / "fresh"), optimizer=True)
    replayed = make_model(tiny_model, shape, "run.deterministic=true")
    step(restarted, 0)
    step(replayed, 0)
    assert_bitwise(weights(restarted), weights(replayed))


def test_grad_clip_norm_zero_means_no_clipping(tiny_model):
    """eps = 1 makes Adam's update depend on the gradient's scale, so a clip shows."""
    data = sft_datums(sequences())
    results = []
    for clip in (0.0, 1e9, 1e-3):
        model = make_model(tiny_model)
        model.forward_backward(data, "cross_entropy", {}, forward_only=False)
        adam = AdamParams(learning_rate=1e-2, eps=1.0, grad_clip_norm=clip)
        results.append((model.optim_step(adam)["grad_norm"], weights(model)))
    (none, w_none), (huge, w_huge), (tight, w_tight) = results
    assert none == huge == tight > 1e-3  # the norm before clipping, every time
    assert_bitwise(w_none, w_huge)
    assert any(not torch.equal(w_none[n], w_tight[n]) for n in w_none)


def test_the_async_trainer_refuses_an_undefined_loss_and_runs_calls_in_order(tiny_model):
    cfg = load_config([], [*SETTINGS, f"model.path={tiny_model}"])
    data = sft_datums(sequences(3))

    async def run() -> tuple:
        trainer = local_trainer(tiny_model, LoraShape(rank=2), cfg)
        with pytest.raises(UnsupportedLoss, match="stable_reinforce.*cross_entropy"):
            await trainer.forward_backward(data, "stable_reinforce", {}, False)
        # issued together, they run in the order made: the step sees the gradients
        results = await asyncio.gather(
            trainer.forward_backward(data, "cross_entropy", {}, False),
            trainer.optim_step(ADAM),
        )
        await trainer.close()
        with pytest.raises(RuntimeError):
            await trainer.optim_step(ADAM)
        return results

    (_, metrics), step = asyncio.run(run())
    assert metrics["loss:sum"] > 0 and step["grad_norm"] > 0


def test_save_hf_exports_the_lora_model_merged(tiny_model, tmp_path):
    model = make_model(tiny_model, LoraShape(rank=4, alpha=8.0))
    data = sft_datums(sequences(4, seed=3))
    model.forward_backward(data, "cross_entropy", {}, forward_only=False)
    model.optim_step(ADAM)
    trained, _ = model.forward_backward(data, "cross_entropy", {}, forward_only=True)
    out = model.save_hf(str(tmp_path / "hf"))
    plain = make_model(out)  # a plain checkpoint now, no adapters
    assert not any("lora" in n for n, _ in plain.model.named_parameters())
    exported, _ = plain.forward_backward(data, "cross_entropy", {}, forward_only=True)
    base, _ = make_model(tiny_model).forward_backward(data, "cross_entropy", {}, True)
    for t, e, b in zip(trained, exported, base, strict=True):
        torch.testing.assert_close(e["logprobs"], t["logprobs"], rtol=1e-5, atol=1e-5)
        assert not torch.equal(b["logprobs"], t["logprobs"])  # the step moved them
