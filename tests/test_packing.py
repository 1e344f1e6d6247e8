"""``trainer.packing`` (a micro-batch's samples in one row with no padding) and
``trainer.share_prompts`` (a prompt run once for the rows that share it) compute what the padded
micro-batch computes: logprobs, entropies, their gradients, and a whole training step."""

from __future__ import annotations

import pytest
import torch

from tests.test_algo_learning import BASE, make_samples
from trident.cluster.net import free_port
from trident.config import load_config
from trident.models.load import load_causal_lm, load_tokenizer
from trident.train.batch import collate, micro_batches, pack
from trident.train.policy import PolicyWorker
from trident.train.recompute import recompute, token_logprobs


def test_pack_places_rows_back_to_back_and_maps_each_predicted_column():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    attention = (ids != 0).long()
    batch = collate_like(ids, attention)
    input_ids, positions, where, at = pack(batch)
    # as wide as the longest row; longest first, each into the first row it fits
    assert input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 0], [8, 9, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 0]]
    assert where.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    # column t of a row is predicted by its token t, whose flat packed position is `at`
    assert at.tolist() == [4, 5, 8, 0, 1, 2]
    assert input_ids.flatten()[at + 1].tolist() == [6, 7, 9, 2, 3, 4]
    short = collate_like(torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 0, 0]]), attention)
    short.attention_mask = (short.input_ids != 0).long()
    assert pack(short)[0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]  # two rows share one


def collate_like(ids: torch.Tensor, attention: torch.Tensor):
    from trident.train.batch import Batch

    b, t = ids.shape
    zeros = torch.zeros(b, t - 1)
    return Batch(ids, attention, zeros, zeros, torch.zeros(b, t - 1, dtype=torch.long))


def test_packed_micro_batches_count_real_tokens():
    lengths = [10, 9, 3, 3, 3]
    assert micro_batches(lengths, 24) == [[0, 1], [2, 3, 4]]  # 2 x 10, then 3 x 10 > 24
    assert micro_batches(lengths, 24, packed=True) == [[0, 1, 2], [3, 4]]  # 10 + 9 + 3 = 22


@pytest.mark.parametrize("chunk_tokens", [0, 7])
def test_packed_equals_padded_values_and_gradients(tiny_model, chunk_tokens):
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, "float32", torch.device("cpu"))
    samples = make_samples(tokenizer, prompts=3, n=2)
    samples[0].token_ids = samples[0].token_ids[:-3]  # rows of different lengths: padding
    for s in samples:
        s.loss_mask, s.logprobs = s.loss_mask[: len(s.token_ids)], s.logprobs[: len(s.token_ids)]
        s.versions = s.versions[: len(s.token_ids)]
    batch = collate(samples, tokenizer.pad_token_id)
    assert (batch.attention_mask == 0).any()
    padded = _values_and_gradients(model, batch, chunk_tokens=chunk_tokens)
    _assert_same(
        _values_and_gradients(model, batch, chunk_tokens=chunk_tokens, packed=True), padded
    )


def _values_and_gradients(model, batch, **kw) -> tuple:
    """``token_logprobs``' logprobs and entropies at the loss tokens, and the gradients of a
    loss of both."""
    model.zero_grad()
    logp, entropy = token_logprobs(model, batch, 0.7, with_entropy=True, **kw)
    assert entropy is not None
    ((logp * 0.3 + entropy * 0.1) * batch.mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return logp * batch.mask, entropy * batch.mask, grads


def _assert_same(got: tuple, expected: tuple) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    for b, a in zip(got[2], expected[2], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_a_packed_training_step_equals_a_padded_one(tiny_model):
    metrics = []
    for packed in (False, True):
        overrides = [f"model.path={tiny_model}", f"trainer.packing={str(packed).lower()}"]
        config = load_config([], [*BASE, *overrides])
        worker = PolicyWorker(config, 0, 1, "127.0.0.1", free_port())
        try:
            samples = make_samples(worker.tokenizer, prompts=2, n=3)
            metrics.append([worker.train_step(samples) for _ in range(2)])
        finally:
            worker.shutdown()
    for padded, packed in zip(*metrics, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key


def test_shared_prompts_equal_padded_values_and_gradients(tiny_model):
    """Groups of rows with one prompt each (prompts of different lengths), a response with a
    masked span inside (a tool's output), a one-token response and a row without loss tokens:
    the loss tokens' logprobs, entropies and the gradients are the padded pass's, from one
    forward pass over the 3 prompts and one over the 8 rows with loss tokens."""
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, "float32", torch.device("cpu"))
    samples = make_samples(tokenizer, prompts=3, n=3, seed=3)
    for s in samples[6:]:  # the third prompt two tokens longer
        s.token_ids = s.token_ids[:2] + s.token_ids
        s.loss_mask, s.logprobs = [0, 0] + s.loss_mask, [0.0, 0.0] + s.logprobs
        s.versions = [-1, -1] + s.versions
    samples[1].loss_mask[-3] = 0  # a span the model did not write
    cut = samples[4].loss_mask.index(1) + 1  # a one-token response
    samples[4].token_ids, samples[4].loss_mask = (
        samples[4].token_ids[:cut],
        samples[4].loss_mask[:cut],
    )
    samples[4].logprobs, samples[4].versions = samples[4].logprobs[:cut], samples[4].versions[:cut]
    samples[7].loss_mask = [0] * len(samples[7].token_ids)  # nothing to train
    batch = collate(samples, tokenizer.pad_token_id)
    rows: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    padded = _values_and_gradients(model, batch, chunk_tokens=7)
    _assert_same(_values_and_gradients(model, batch, chunk_tokens=7, shared=True), padded)
    assert rows == [9, 3, 8]  # padded: every row; shared: the prompts, then the rows' rest


def test_a_training_step_with_shared_prompts_equals_a_padded_one(tiny_model):
    """Through FSDP2 (two forward passes before one backward pass) and two optimizer steps."""
    weights, metrics = [], []
    for shared in (False, True):
        overrides = [f"model.path={tiny_model}", f"trainer.share_prompts={str(shared).lower()}"]
        worker = PolicyWorker(load_config([], [*BASE, *overrides]), 0, 1, "127.0.0.1", free_port())
        try:
            samples = make_samples(worker.tokenizer, prompts=2, n=4)
            metrics.append([worker.train_step(samples) for _ in range(2)])
            weights.append([p.detach().clone() for p in worker.model.parameters()])
        finally:
            worker.shutdown()
    for padded, shared in zip(*metrics, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert shared[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def _two_ranks(rank: int, model: str, port: int, out: str, shared: bool, extra: list) -> None:
    """One of two FSDP2 ranks: two training steps; rank 0 saves the whole weights."""
    from trident.weights.tensors import full_tensor

    torch.set_num_threads(1)
    overrides = [f"model.path={model}", f"trainer.share_prompts={str(shared).lower()}", *extra]
    worker = PolicyWorker(load_config([], [*BASE, *overrides]), rank, 2, "127.0.0.1", port)
    samples = make_samples(worker.tokenizer, prompts=2, n=4)  # rank r: samples r, r + 2, ...
    samples[5].loss_mask = [0] * len(samples[5].token_ids)  # rank 1: one prompt shared, not two
    worker.train_step(samples)  # both ranks share
    samples[3].loss_mask = [0] * len(samples[3].token_ids)  # rank 1: no prompt shared
    worker.train_step(samples)  # so neither does
    whole = {n: full_tensor(t) for n, t in worker.model.state_dict().items()}  # collective
    worker.shutdown()
    if rank == 0:
        torch.save(whole, out)


@pytest.mark.parametrize(
    "extra", [[], ["trainer.mini_batches=2", "algo.kl_coef=0.05"]], ids=["fused", "recomputed"]
)
def test_two_fsdp_ranks_share_prompts_together(tiny_model, tmp_path, extra):
    """Each forward pass is a collective on every rank: the ranks share prompts together or
    not at all (a step where only one of them could), and two steps on two ranks give the padded
    pass's weights. "recomputed": pi_old recomputed for every row before the first optimizer
    step (sharded: shared on both ranks or neither) and the reference's logprobs (unsharded:
    each rank decides alone)."""
    from torch.multiprocessing.spawn import start_processes

    weights = []
    for shared in (False, True):
        out = tmp_path / f"shared-{shared}.pt"
        args = (tiny_model, free_port(), str(out), shared, extra)
        start_processes(_two_ranks, args=args, nprocs=2, start_method="spawn")
        weights.append(torch.load(out))
    # AdamW divides by the gradient's own scale: where it is ~0, float noise moves an element by
    # a few % of one step (lr 1e-4), so 1e-5 (a tenth of a step)
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_the_passes_without_gradient_share_prompts_too(tiny_model):
    """pi_old, the reference and a teacher, recomputed with prompts shared: the padded pass's
    logprobs at the loss tokens, each model's micro-batch from one pass over its 2 prompts and
    one over its 6 rows."""
    tokenizer = load_tokenizer(tiny_model)
    model = load_causal_lm(tiny_model, "float32", torch.device("cpu"))
    batch = collate(make_samples(tokenizer, prompts=2, n=3), tokenizer.pad_token_id)
    rows: list[int] = []
    model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    out = {}
    for shared in (False, True):
        rows.clear()
        out[shared] = recompute(
            batch, model, ref=model, critic=None, teachers={"t": model}, teacher_paths=["t"] * 6,
            temperature=0.7, token_budget=10_000, world=1, device=torch.device("cpu"),
            chunk_tokens=7, shared=shared,
        )  # fmt: skip
    assert rows == [2, 6] * 3  # old, ref, teacher: the prompts, then the rows' rest
    for name in ("old", "ref", "teacher"):
        got, expected = out[True][name] * batch.mask, out[False][name] * batch.mask
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)
