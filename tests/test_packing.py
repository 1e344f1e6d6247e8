"""``trainer.packing``: a micro-batch's samples in one row with no padding computes what the
padded micro-batch computes: logprobs, entropies, their gradients, and a whole training step."""

from __future__ import annotations

import pytest
import torch

from tests.test_algo_learning import BASE, make_samples
from trident.cluster.net import free_port
from trident.config import load_config
from trident.models.load import load_causal_lm, load_tokenizer
from trident.train.batch import collate, micro_batches, pack
from trident.train.policy import PolicyWorker
from trident.train.recompute import token_logprobs


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
    results = []
    for packed in (False, True):
        model.zero_grad()
        logp, entropy = token_logprobs(
            model, batch, 0.7, with_entropy=True, chunk_tokens=chunk_tokens, packed=packed
        )
        assert entropy is not None
        loss = ((logp * 0.3 + entropy * 0.1) * batch.mask).sum()
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append((logp * batch.mask, entropy * batch.mask, grads))
    (logp_a, ent_a, grads_a), (logp_b, ent_b, grads_b) = results
    torch.testing.assert_close(logp_b, logp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
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
