"""Logprobs and entropies in vocabulary chunks (``trainer.logprob_chunk_tokens``) equal the
whole-grid path: values, and the gradients of a loss that uses both, on the tiny model."""

import pytest
import torch

from trident.models.load import load_causal_lm
from trident.train.batch import Batch
from trident.train.logprobs import chunked_logprobs
from trident.train.recompute import token_logprobs


def _batch(vocab: int, rows: int = 3, width: int = 37, seed: int = 0) -> Batch:
    """Right-padded rows of random tokens (T = 37 is prime: no chunk size divides T-1 = 36
    evenly except its divisors, and none divides B * (T-1) = 108 below)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    attention = torch.ones(rows, width, dtype=torch.long)
    attention[1, width - 9 :] = 0  # a padded row: its positions are still scored
    mask = attention[:, 1:].float()
    zeros = torch.zeros(rows, width - 1)
    return Batch(ids, attention, mask, zeros, zeros.long())


def _loss(logp: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A PPO-like loss using both outputs nonlinearly, so both gradient paths matter."""
    ratio = torch.exp(logp - logp.detach() + 0.1 * torch.sin(logp.detach()))
    return ((-ratio * torch.cos(logp.detach()) - 0.01 * entropy**2) * mask).sum()


def _logp_and_grads(model, batch: Batch, temperature: float, chunk: int):
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs(model, batch, temperature, with_entropy=True, chunk_tokens=chunk)
    assert entropy is not None
    _loss(logp, entropy, batch.mask).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.manual_seed(0)
    return load_causal_lm(tiny_model)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_whole_grid_with_gradients(model, temperature):
    batch = _batch(model.config.vocab_size)
    logp0, ent0, grads0 = _logp_and_grads(model, batch, temperature, 0)
    for chunk in (1, 5, 36, 64, 1024):  # 5 and 64 do not divide 108 tokens
        logp, ent, grads = _logp_and_grads(model, batch, temperature, chunk)
        torch.testing.assert_close(logp, logp0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent0, rtol=1e-5, atol=1e-5)
        assert grads.keys() == grads0.keys() and "lm_head.weight" in grads
        for name, g in grads.items():  # float32 rounding, relative to the tensor's scale
            scale = float(grads0[name].abs().max())
            assert float((g - grads0[name]).abs().max()) <= 1e-5 * scale, name


def test_no_grad_recompute_and_logprobs_alone(model):
    """The recompute path (no gradient, no entropy) gives the same logprobs."""
    batch = _batch(model.config.vocab_size, seed=1)
    with torch.no_grad():
        ref, none = token_logprobs(model, batch, 0.9)
        logp, entropy = token_logprobs(model, batch, 0.9, chunk_tokens=7)
    assert none is None and entropy is None
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_head_alone_against_autograd(dtype):
    """A biased head on random states: values and every gradient equal autograd through the
    whole grid (float64: to rounding; bfloat16: the head in bfloat16, statistics in float32)."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 11, 16, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(50, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (2, 11), generator=g)
    g_logp, g_ent = torch.randn(2, 11, generator=g), torch.randn(2, 11, generator=g)

    logits = (torch.nn.functional.linear(hidden, weight, bias).float() / 1.3).log_softmax(-1)
    ref = (logits.gather(-1, targets[..., None]).squeeze(-1), -(logits.exp() * logits).sum(-1))
    ref_grads = torch.autograd.grad(
        (ref[0] * g_logp).sum() + (ref[1] * g_ent).sum(), (hidden, weight, bias)
    )
    logp, entropy = chunked_logprobs(
        hidden, weight, bias, targets, temperature=1.3, chunk_tokens=4, with_entropy=True
    )
    assert entropy is not None
    grads = torch.autograd.grad(
        (logp * g_logp).sum() + (entropy * g_ent).sum(), (hidden, weight, bias)
    )
    tol = 1e-6 if dtype == torch.float64 else 2e-2
    torch.testing.assert_close(logp, ref[0], rtol=tol, atol=tol)
    torch.testing.assert_close(entropy, ref[1], rtol=tol, atol=tol)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _fsdp_rank(rank: int, world: int, root_only: bool, path: str, port: int, results) -> None:
    from torch.distributed.fsdp import fully_shard

    from trident.train.fsdp import init_distributed, shard
    from trident.weights.tensors import full_tensor

    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port)
    # one rank: trident's shard leaves a float32 model unwrapped; FSDP2 wraps the root alone
    # there only for mixed precision on a GPU, the path root_only runs here
    model = fully_shard(load_causal_lm(path)) if root_only else shard(load_causal_lm(path))
    batch = _batch(model.config.vocab_size, seed=rank)  # each rank its own rows
    runs = [_logp_and_grads(model, batch, 0.8, chunk) for chunk in (0, 5)]
    # the sharded gradients, whole (collective)
    grads = [{n: full_tensor(g) for n, g in run[2].items()} for run in runs]
    if rank == 0:  # plain numbers: tensors in the queue would outlive their process's memory
        (logp0, ent0, _), (logp, ent, _) = runs
        errors = {
            n: float((grads[1][n] - g).abs().max() / g.abs().max()) for n, g in grads[0].items()
        }
        results.put((float((logp - logp0).abs().max()), float((ent - ent0).abs().max()), errors))
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("world", "root_only"), [(1, False), (1, True), (2, False)])
def test_under_fsdp2(tiny_model, world, root_only):
    """One rank unwrapped, one rank with only the root wrapped (its backward hooks must still
    run), and two (layers and root sharded): the head, used after the root's forward, has its
    gradient reduced with the rest; chunked = whole grid, as without FSDP."""
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import start_processes

    from trident.cluster.net import free_port

    results = mp.get_context("spawn").SimpleQueue()
    start_processes(
        _fsdp_rank,
        args=(world, root_only, tiny_model, free_port(), results),
        nprocs=world,
        start_method="spawn",
    )
    logp_error, entropy_error, grad_errors = results.get()
    assert logp_error <= 1e-5 and entropy_error <= 1e-5
    names = {n for n, _ in load_causal_lm(tiny_model).named_parameters()}
    assert grad_errors.keys() == names  # every parameter, the head included
    assert max(grad_errors.values()) <= 1e-5, grad_errors
