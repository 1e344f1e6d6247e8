"""Loss aggregation: how a [B, T] grid of per-token values becomes one scalar.

Every per-token quantity (policy loss, value loss, KL, entropy) is reduced here, so that the
choice of normaliser, which changes the effective weight of long against short responses,
lives in one place. With ``l`` the per-token loss, ``m`` the mask, ``n_i = sum_t m_it`` and
``S`` the number of sequences that have at least one valid token:

- ``token_mean``              sum_it m l / sum_it m              (DAPO; TRL/verl GRPO default)
- ``seq_mean_token_mean``     (1/S) sum_i (sum_t m l) / n_i      (original GRPO, GSPO)
- ``seq_mean_token_sum``      (1/S) sum_i sum_t m l
- ``seq_mean_token_sum_norm`` (1/S) sum_i sum_t m l / L          (Dr. GRPO, L a constant such as
                                                                   the maximum response length)

Gradient accumulation. The trainer splits a batch into micro-batches and *sums* their losses.
A per-micro-batch mean is then not the batch mean (micro-batches hold different numbers of
tokens). Passing ``global_tokens`` / ``global_seqs`` (from :func:`loss_denominators` on the whole
batch) replaces the local counts, so each micro-batch returns its share of the batch loss and
the sum over micro-batches equals the one-batch loss exactly. Under data parallelism with
gradient averaging, use the counts of the global batch and multiply by the world size.

Simplifications: rows with no valid token are excluded from ``S`` (their numerator is 0, so
they never produce NaN); ``seq_mean_token_sum_norm`` falls back to ``T = mask.shape[-1]`` when
no constant is given, which is only micro-batch-invariant if every micro-batch is padded to the
same ``T``.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 where nothing is valid)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_whiten(values: Tensor, mask: Tensor, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over valid positions (population std); 0 at masked positions.

    ``scale=False`` only centres.
    """
    mask = mask.to(values.dtype)
    centred = (values - masked_mean(values, mask)) * mask
    if not scale:
        return centred
    std = masked_mean(centred**2, mask).sqrt()
    return centred / (std + eps)


def loss_denominators(mask: Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token) of a whole batch.

    Pass them as ``global_tokens`` / ``global_seqs`` to every micro-batch's :func:`aggregate`.
    """
    per_seq = mask.sum(-1)
    return int(per_seq.sum().item()), int((per_seq > 0).sum().item())


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    norm_tokens: int | None = None,
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
) -> Tensor:
    """Reduce a per-token ``loss`` [B, T] to a scalar with the normaliser named by ``mode``.

    ``norm_tokens`` is Dr. GRPO's constant L (``seq_mean_token_sum_norm`` only).
    ``global_tokens`` / ``global_seqs`` replace the local token / sequence counts (see module
    docstring); both are clamped to at least 1 so an empty batch gives 0, not NaN.
    """
    mask = mask.to(loss.dtype)
    token_sums = (loss * mask).sum(-1)
    tokens_per_seq = mask.sum(-1)
    if mode == "token_mean":
        n_tokens = tokens_per_seq.sum() if global_tokens is None else global_tokens
        return token_sums.sum() / _at_least_one(n_tokens, loss)
    n_seqs = (tokens_per_seq > 0).sum() if global_seqs is None else global_seqs
    n_seqs = _at_least_one(n_seqs, loss)
    if mode == "seq_mean_token_mean":
        return (token_sums / tokens_per_seq.clamp(min=1.0)).sum() / n_seqs
    if mode == "seq_mean_token_sum":
        return token_sums.sum() / n_seqs
    if mode == "seq_mean_token_sum_norm":
        length = loss.shape[-1] if norm_tokens is None else norm_tokens
        return token_sums.sum() / (n_seqs * length)
    raise ValueError(f"unknown aggregation {mode!r}; expected one of {AGGREGATIONS}")


def _at_least_one(count: int | float | Tensor, like: Tensor) -> Tensor:
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1.0)
