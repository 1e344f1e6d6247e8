"""Per-token logprobs and entropies of a vocabulary projection, a chunk of tokens at a time.

For final hidden states ``h`` [N, H], the output head ``W`` [V, H] (and bias ``b``), targets
``y`` [N] and a sampling temperature τ, row i has logits ``z_i = (W h_i + b) / τ`` (projected in
the head's dtype, then taken in float32), ``logp_i = log_softmax(z_i)[y_i]`` and
``entropy_i = -Σ_v p_iv log p_iv``. The whole [N, V] float32 grid is never held: at V = 151,936
it is 0.6 MB a token, 2.5 GB for 4K tokens, and autograd's usual path keeps several copies of
it for the backward pass. Here the forward pass keeps only ``h``, ``W``, ``y`` and the [N]
results, and the backward pass projects each chunk again and writes its gradient in closed form:

    d logp_i / d z_i = onehot(y_i) - p_i
    d entropy_i / d z_i = -p_i * (log p_i + entropy_i)

so the peak is a few [chunk, V] float32 buffers whatever N is, for one more projection of the
head per step (its forward matmul runs twice). ``dW`` is summed over the chunks in float32 and
returned in the head's dtype, like the one matmul of the unchunked path.
"""

from __future__ import annotations

from typing import Any

import torch


def _chunk_logp(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """log_softmax of one chunk's logits [n, V], in float32."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


class _ChunkedHead(torch.autograd.Function):
    """(logp [N], entropy [N]) of the head over ``hidden`` [N, H], ``chunk`` rows at a time."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            logp_all = _chunk_logp(hidden[s : s + chunk], weight, bias, temperature)
            logp[s : s + chunk] = logp_all.gather(-1, targets[s : s + chunk, None]).squeeze(-1)
            if with_entropy:
                entropy[s : s + chunk] = -logp_all.exp().mul_(logp_all).sum(-1)
            del logp_all  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> Any:
        g_logp, g_entropy = grad_outputs  # None where that output is unused
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        f32, dev = torch.float32, weight.device
        grad_w = torch.zeros(weight.shape, dtype=f32, device=dev) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=f32, device=dev) if need_b else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s : s + ctx.chunk]
            gz = _chunk_logp(h, weight, bias, ctx.temperature)  # becomes d loss / d z in place
            p = gz.exp()
            if g_entropy is not None:
                gz.add_(entropy[s : s + ctx.chunk, None]).mul_(g_entropy[s : s + ctx.chunk, None])
            else:
                gz.zero_()
            if g_logp is not None:
                g = g_logp[s : s + ctx.chunk, None]
                gz.add_(g).mul_(p).neg_().scatter_add_(-1, targets[s : s + ctx.chunk, None], g)
            else:
                gz.mul_(p).neg_()
            del p
            if ctx.temperature != 1.0:
                gz.div_(ctx.temperature)
            gz = gz.to(weight.dtype)
            if grad_h is not None:
                grad_h[s : s + ctx.chunk] = gz @ weight
            if grad_w is not None:
                if gz.dtype == torch.float32:
                    grad_w.addmm_(gz.T, h)
                else:
                    grad_w += gz.T @ h
            if grad_b is not None:
                grad_b += gz.sum(0)
            del gz  # before the next chunk's logits exist
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            *[None] * 4,
        )


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of ``targets`` [...] under the head (``weight``, ``bias``) applied to ``hidden``
    [..., H] at ``temperature``, and their entropies if asked: tensors of ``targets``' shape,
    float32, differentiable in ``hidden``, ``weight`` and ``bias``; ``chunk_tokens`` rows of the
    [tokens, vocab] grid at a time."""
    shape = targets.shape
    logp, entropy = _ChunkedHead.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        temperature,
        chunk_tokens,
        with_entropy,
    )
    return logp.view(shape), entropy.view(shape) if with_entropy else None


def grid_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same from the whole [..., V] grid of ``logits`` at once (``chunk_tokens`` = 0)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)


def output_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output projection if its logits are exactly ``lm_head(last hidden state)``;
    None for heads that scale or soft-cap logits (Gemma-2, Cohere) or wrap the projection (an
    adapter on the head), which the chunked path does not model."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    config = getattr(model, "config", None)
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return None  # a quantized or adapted head (an FSDP-wrapped Linear is still a Linear)
    for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, name, None) not in (None, 1.0):
            return None
    return head
