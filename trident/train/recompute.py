"""Recompute: the per-token quantities of the models a rank holds, with no gradient, and the
sharding and micro-batching that keep the ranks in step.

Given the step's samples (the same list on every rank), each rank takes its shard (:func:`shard`)
and scores its rows with every model the configuration holds (:func:`recompute`): the logprobs
of the policy about to be updated (the PPO "old" policy; in sync mode the sampler's weights, so
the engine-vs-trainer gap measured here is pure numerical mismatch), of the frozen reference,
of each row's teacher, and the critic's values. :func:`gather` then sums the ranks' rows into
[B, T] grids of the whole batch, so the advantages see whole groups.

Logits are divided by the sampling temperature, so the trainer's policy is the distribution the
engine sampled from (the server reports processed logprobs); the reference and teachers are
scored at the same temperature, so every KL compares the same kind of distribution. ``top_p`` < 1
is not modelled.

Every FSDP2 forward and backward is a collective, so every rank runs the same number of
micro-batches (:func:`even_micro_batches`).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trident.train.batch import Batch, micro_batches, pack
from trident.train.critic import token_values
from trident.train.logprobs import chunked_logprobs, grid_logprobs, output_head


def token_logprobs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 0,
    packed: bool = False,
    shared: bool = False,
    world: int = 1,
    targets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token logprobs [B, T-1] of ``batch.input_ids[:, 1:]`` (and entropies if asked), or
    [B, T] of ``targets`` [B, T], the token each input position is scored on, for a caller
    that aligned its targets itself (the Tinker API's datums; padded only, not ``packed`` or
    ``shared``).
    ``chunk_tokens`` > 0: the vocabulary projection ``chunk_tokens`` positions at a time, forward
    and backward (:mod:`trident.train.logprobs`), for models whose logits are the plain head of
    the last hidden state; 0 (or another head): the whole [B, T, V] grid at once. ``packed``
    (``trainer.packing``): the model runs on the rows packed into fewer (:func:`pack`), so
    little padding is computed; the outputs come back in the padded layout (0 where no token
    is). ``shared`` (``trainer.share_prompts``): rows with the same prompt run it once
    (:func:`_shared_prompt_logprobs`), only the predictions of loss tokens' spans computed; with
    ``world`` FSDP ranks, all of them or none (collective)."""
    if targets is not None and (packed or shared):
        raise ValueError("token_logprobs: explicit targets are scored padded only")
    head = output_head(model) if chunk_tokens > 0 else None
    if shared and head is not None and not packed:
        out = _shared_prompt_logprobs(
            model, head, batch, temperature, with_entropy, chunk_tokens, world
        )
        if out is not None:
            return out
    last = -1 if targets is None else None  # padded: the positions that predict a target
    if packed:
        input_ids, position_ids, where, at = pack(batch)
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        targets = input_ids.flatten()[at + 1]  # the token after each predicting position
    else:
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        where, at = None, None
        if targets is None:
            targets = batch.input_ids[:, 1:]
    if head is not None:
        hidden = _last_hidden_state(model, inputs)
        hidden = hidden[:, :last] if at is None else hidden.flatten(0, 1)[at]
        logp, entropy = chunked_logprobs(
            hidden, head.weight, head.bias, targets, temperature=temperature,
            chunk_tokens=chunk_tokens, with_entropy=with_entropy,
        )  # fmt: skip
    else:
        logits = model(**inputs, use_cache=False).logits
        logits = logits[:, :last] if at is None else logits.flatten(0, 1)[at]
        logp, entropy = grid_logprobs(logits, targets, temperature, with_entropy)
    if where is None:
        return logp, entropy
    return _unpack(logp, where), None if entropy is None else _unpack(entropy, where)


def _shared_prompt_logprobs(
    model: torch.nn.Module,
    head: torch.nn.Linear,
    batch: Batch,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    world: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`token_logprobs` with each prompt run once for its rows (Prefix Grouper, Liu et
    al. 2025): one pass over the distinct prompts keeps their keys and values, selected per row
    for the rows' rest (the backward pass sums the rows' gradients into the prompt's); the first
    loss token is predicted from the prompt's last position. A row's prompt: its tokens up to
    the one predicting its first loss token; only predictions from there on are computed (0
    elsewhere). None when no two rows share a prompt on some rank (forward passes are
    collectives) or under activation checkpointing (no cache kept); recurrent cache layers give
    way to the padded pass after the prompts'."""
    from transformers import DynamicCache

    if getattr(model, "is_gradient_checkpointing", False) and model.training:
        return None  # transformers' checkpointed layers then drop the cache
    ids, lengths = batch.input_ids, batch.attention_mask.sum(1).tolist()
    has_loss = (batch.mask > 0).any(1).tolist()
    starts = (batch.mask > 0).int().argmax(1).tolist()  # first predicted column with a loss token
    rows = [i for i in range(len(ids)) if has_loss[i]]
    prompts: dict[tuple[int, ...], int] = {}
    group = [
        prompts.setdefault(tuple(ids[i, : starts[i] + 1].tolist()), len(prompts)) for i in rows
    ]
    share = torch.tensor([float(len(prompts) < len(rows))], device=ids.device)
    if world > 1:
        dist.all_reduce(share, op=dist.ReduceOp.MIN)
    if not share.item():
        return None
    width = max(len(p) for p in prompts)
    prompt_ids = torch.full((len(prompts), width), int(ids[0, -1]), dtype=ids.dtype)
    prompt_mask = torch.zeros((len(prompts), width), dtype=batch.attention_mask.dtype)
    for p, g in prompts.items():  # right-padded: no query without a key to attend to
        prompt_ids[g, : len(p)], prompt_mask[g, : len(p)] = torch.tensor(p), 1
    device = ids.device
    cache = DynamicCache(config=getattr(model, "config", None))
    first = _last_hidden_state(
        model, {"input_ids": prompt_ids.to(device), "attention_mask": prompt_mask.to(device)},
        past_key_values=cache,
    )  # fmt: skip
    if any(type(layer).__name__ not in _ATTENTION_CACHES for layer in cache.layers) or any(
        cache.get_seq_length(i) != width for i in range(len(cache.layers))
    ):
        return None  # recurrent state, or a layer that kept no keys: no prefix to share
    index = torch.tensor(group, device=device)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    hidden = [first[torch.arange(len(prompts), device=device), last][index]]  # [rows, H]
    spans = [lengths[i] - 2 - starts[i] for i in rows]  # inputs after the prompt, last one off
    rest = max(*spans, 1 if world > 1 else 0)  # every rank runs the second pass, if any does
    if rest > 0:
        cache.batch_select_indices(index)
        rest_ids = torch.full((len(rows), rest), int(ids[0, -1]), dtype=ids.dtype, device=device)
        rest_mask = torch.zeros((len(rows), rest), dtype=prompt_mask.dtype, device=device)
        for j, (i, n) in enumerate(zip(rows, spans, strict=True)):
            rest_ids[j, :n] = ids[i, starts[i] + 1 : starts[i] + 1 + n]
            rest_mask[j, :n] = 1
        positions = torch.tensor([starts[i] + 1 for i in rows], device=device)[:, None]
        inputs = {
            "input_ids": rest_ids,
            "attention_mask": torch.cat([prompt_mask.to(device)[index], rest_mask], 1),
            "position_ids": positions + torch.arange(rest, device=device),
        }
        hidden.append(_last_hidden_state(model, inputs, past_key_values=cache).flatten(0, 1))
    where = torch.zeros_like(batch.mask, dtype=torch.bool)
    at: list[int] = []
    for j, (i, n) in enumerate(zip(rows, spans, strict=True)):
        where[i, starts[i] : starts[i] + 1 + n] = True
        at += [j, *range(len(rows) + j * rest, len(rows) + j * rest + n)]
    logp, entropy = chunked_logprobs(
        torch.cat(hidden)[torch.tensor(at, device=device)], head.weight, head.bias,
        ids[:, 1:][where], temperature=temperature, chunk_tokens=chunk_tokens,
        with_entropy=with_entropy,
    )  # fmt: skip
    return _unpack(logp, where), None if entropy is None else _unpack(entropy, where)


# cache layers of per-position keys and values (full or sliding-window attention)
_ATTENTION_CACHES = ("DynamicLayer", "DynamicSlidingWindowLayer")


def _unpack(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Packed per-token ``values`` back into the padded [B, T-1] layout (differentiable)."""
    out = values.new_zeros(where.shape)
    out[where] = values
    return out


def _last_hidden_state(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], past_key_values: Any = None
) -> torch.Tensor:
    """The decoder's output [B, T, H] (after its final norm) as an output of the whole model's
    forward: under FSDP2 the root's pre-forward gathers the head too and keeps it unsharded until
    the backward pass, and the root's backward hooks (gradient reduction, reshard) sit on its
    outputs, so the state must be one of them (a forward hook on the decoder would bypass them
    when only the root is wrapped). ``logits_to_keep=1`` spares the full projection."""
    with warnings.catch_warnings():
        # FSDP2 warns that the hidden states are views: nothing writes to them in place
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
        out = model(
            **inputs, output_hidden_states=True, logits_to_keep=1,
            past_key_values=past_key_values, use_cache=past_key_values is not None,
        )  # fmt: skip
    return out.hidden_states[-1]


def shard(n: int, mini_batches: int, rank: int, world: int) -> tuple[list[int], list[list[int]]]:
    """This rank's samples of ``n`` and its rows of each mini-batch. Mini-batch k is
    samples[k::M] whatever the world size, and each rank takes every world-th sample of it, so N
    ranks train on the same mini-batches as one (with M = 1 the shard is samples[rank::world])."""
    mine: list[int] = []
    chunks: list[list[int]] = []
    for k in range(mini_batches):
        part = list(range(k, n, mini_batches))[rank::world]
        chunks.append(list(range(len(mine), len(mine) + len(part))))
        mine += part
    return mine, chunks


def even_micro_batches(
    lengths: list[int], token_budget: int, world: int, device: torch.device, packed: bool = False
) -> list[list[int] | None]:
    """``micro_batches`` by token budget, made equally many on every rank (collective when
    ``world`` > 1). A rank with fewer splits its largest micro-batches, then pads with ``None``
    (a zero-weight pass)."""
    groups = micro_batches(lengths, token_budget, packed)
    if world == 1:
        return list(groups)
    count = torch.tensor([len(groups)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    out: list[list[int] | None] = list(groups)
    while len(out) < int(count) and any(g is not None and len(g) > 1 for g in out):
        largest = max(range(len(out)), key=lambda i: len(out[i] or []))
        g = out.pop(largest)
        assert g is not None  # the largest has more than one sample
        out += [g[: len(g) // 2], g[len(g) // 2 :]]
    return out + [None] * (int(count) - len(out))


@torch.no_grad()
def recompute(
    batch: Batch,
    policy: torch.nn.Module | None,
    *,
    ref: torch.nn.Module | None,
    critic: torch.nn.Module | None,
    teachers: Mapping[str, torch.nn.Module],
    teacher_paths: Sequence[str],
    temperature: float,
    token_budget: int,
    world: int,
    device: torch.device,
    skip: Sequence[int] = (),
    chunk_tokens: int = 0,
    packed: bool = False,
    shared: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token quantities of this rank's rows [b, T] with no gradient: ``old`` (policy
    logprobs), ``ref``, ``values`` (critic), ``teacher`` (each row's teacher: ``teachers`` by
    path, ``teacher_paths`` the path of each row). Rows in ``skip`` are left at zero (their
    ``old`` is filled by the first optimizer step); ``policy`` None: no ``old`` (the engine's
    logprobs stand for it, ``algo.old_logprobs``). ``chunk_tokens``, ``packed``:
    :func:`token_logprobs`' (the critic runs padded)."""
    lengths = batch.attention_mask.sum(1).tolist()
    scored = policy is not None or ref is not None or critic is not None
    # nothing to score row by row: no micro-batch (the same on every rank, so do the collectives)
    todo = sorted(set(range(len(lengths))) - set(skip)) if scored else []
    parts: dict[str, list] = defaultdict(list)
    for part in even_micro_batches([lengths[i] for i in todo], token_budget, world, device, packed):
        idx = None if part is None else [todo[i] for i in part]
        mb = select_rows(batch, idx if idx is not None else [0])
        old = None
        if policy is not None:
            old = token_logprobs(
                policy, mb, temperature, chunk_tokens=chunk_tokens, packed=packed,
                shared=shared, world=world,
            )  # fmt: skip
        values = token_values(critic, mb) if critic is not None else None
        if idx is None:
            continue  # a zero-weight pass: only keeps the FSDP collectives in step
        if old is not None:
            parts["old"].append((idx, old[0]))
        if values is not None:
            parts["values"].append((idx, values))
        if ref is not None:
            ref_logp = token_logprobs(
                ref, mb, temperature, chunk_tokens=chunk_tokens, packed=packed, shared=shared
            )[0]
            parts["ref"].append((idx, ref_logp))
    # frozen, unsharded: each rank runs only its own rows
    for path, teacher in teachers.items():
        rows = [i for i, p in enumerate(teacher_paths) if p == path]
        for local in micro_batches([lengths[i] for i in rows], token_budget, packed):
            idx = [rows[i] for i in local]
            mb = select_rows(batch, idx)
            logp = token_logprobs(
                teacher, mb, temperature, chunk_tokens=chunk_tokens, packed=packed, shared=shared
            )[0]
            parts["teacher"].append((idx, logp))
    names = ["old"] if policy is not None else []
    if ref is not None:
        names.append("ref")
    if critic is not None:
        names.append("values")
    if teachers:
        names.append("teacher")
    return {name: scatter_rows(parts[name], batch.mask) for name in names}


def gather(
    local: Mapping[str, torch.Tensor],
    names: Sequence[str],
    mine: list[int],
    shape: torch.Size,
    world: int,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The whole batch's [B, T] grids (on CPU) of ``names`` from each rank's ``local`` rows:
    each rank fills its rows of a zero grid and one all_reduce sums them. The grids are [B, T]
    floats: a few MB even at a 512 x 8k batch, far below a forward pass."""
    if not names:
        return {}
    grid = torch.zeros((len(names), *shape), dtype=torch.float32, device=device)
    rows = torch.tensor(mine, device=device)
    for k, name in enumerate(names):
        values = local[name]
        grid[k, rows, : values.shape[1]] = values.float()
    if world > 1:
        dist.all_reduce(grid)
    return {name: grid[k].cpu() for k, name in enumerate(names)}


def select_rows(batch: Batch, idx: list[int]) -> Batch:
    """Rows ``idx`` of ``batch``, cut to their longest row."""
    width = int(batch.attention_mask[idx].sum(1).max())
    return Batch(
        batch.input_ids[idx, :width],
        batch.attention_mask[idx, :width],
        batch.mask[idx, : width - 1],
        batch.engine_logp[idx, : width - 1],
        batch.versions[idx, : width - 1],
    )


def scatter_rows(parts: list[tuple[list[int], torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
    """A zero grid like ``like`` with each part's values in its rows."""
    out = torch.zeros_like(like)
    for idx, values in parts:
        out[idx, : values.shape[1]] = values
    return out
