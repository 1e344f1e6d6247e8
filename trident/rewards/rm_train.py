"""Training a reward model for the ``reward_model`` reward: a sequence classifier (one logit)
fitted to responses labelled correct or incorrect.

Loss: binary cross-entropy between the logit r(x, y) of prompt x and response y and its label
l ∈ {0, 1}, L = −[l·log σ(r) + (1 − l)·log(1 − σ(r))]: the pointwise form of reward modelling,
for labels given per response (a verifier's verdict); σ(r) is the model's probability that the
response is correct. The pairwise Bradley-Terry loss of InstructGPT (Ouyang et al., 2022, eq. 1),
−log σ(r(x, y_w) − r(x, y_l)), is the form for preferences between two responses to one prompt.

The body is initialised from a causal-LM checkpoint (``base``; the head is new), so a model that
already does the task starts from its features. Pairs are rendered as the ``reward_model`` actor
renders them (``render_pair``), so the scores it serves are the ones trained. Deliberate
simplifications: one process, float32, AdamW at a constant rate, batches drawn with replacement
from a seeded generator; no validation split (the caller holds rows out).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from trident.rewards.model import render_pair


def train_reward_model(
    base: str | Path,
    rows: list[dict[str, Any]],
    out: str | Path,
    steps: int = 200,
    batch_size: int = 32,
    lr: float = 1e-3,
    seed: int = 0,
    max_length: int = 1024,
) -> Path:
    """Fit a classifier from ``base`` to ``rows`` (``prompt``, ``response``, ``label`` 0 or 1)
    for ``steps`` batches; write it, with its tokenizer, to ``out`` and return ``out``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        base, num_labels=1, dtype=torch.float32
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    texts = [render_pair(tokenizer, r["prompt"], r["response"]) for r in rows]
    labels = torch.tensor([float(r["label"]) for r in rows])
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        pick = [rng.randrange(len(rows)) for _ in range(batch_size)]
        batch = tokenizer(
            [texts[i] for i in pick],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="pt",
            add_special_tokens=False,
        )
        logits = model(**batch).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[pick])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
