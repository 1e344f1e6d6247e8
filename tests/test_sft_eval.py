"""SFT lowers the loss, and the SFT checkpoint evaluates better than the random one through a
real vLLM server (the `trident eval` command, end to end)."""

import asyncio
import json
from pathlib import Path

import torch

from tests.conftest import run_cli
from trident.config import load_config
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer, prompt_messages
from trident.pipeline.eval import heldout_rows, pass_at_k
from trident.rewards import task_reward


def test_pass_at_k_estimator():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 4, 2) == 1.0
    assert abs(pass_at_k(4, 1, 2) - 0.5) < 1e-12  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k


def _hf_greedy_accuracy(model_path: str, rows: list[dict]) -> float:
    model, tok = load_causal_lm(model_path), load_tokenizer(model_path)
    correct = 0
    for row in rows:
        ids = torch.tensor([encode_chat(tok, prompt_messages(row["prompt"]))])
        out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
        correct += (
            asyncio.run(
                task_reward(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), **row)
            )
            > 0.5
        )
    return correct / len(rows)


def test_sft_lowers_loss_and_raises_accuracy(tiny_model, demo_sft_model, tmp_path):
    log = [
        json.loads(line)
        for line in (Path(demo_sft_model).parent / "sft_metrics.jsonl").read_text().splitlines()
    ]
    first = sum(r["loss"] for r in log[:20]) / 20
    last = sum(r["loss"] for r in log[-20:]) / 20
    assert last < 0.5 * first, (first, last)

    r = run_cli(
        "eval",
        f"model.path={demo_sft_model}",
        "eval.max_prompts=100",
        f"run.dir={tmp_path}",
        "run.name=ev",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert result["num_prompts"] == 100 and result["infra_errors"] == 0
    cfg = load_config([], ["eval.max_prompts=100"])
    base = _hf_greedy_accuracy(tiny_model, heldout_rows(cfg)[:50])
    assert result["accuracy"] >= base + 0.05, (base, result["accuracy"])
    assert result["pass@4"] >= result["mean_sample_accuracy"]


def test_sft_examples_mask_only_the_response(tiny_model):
    from trident.train.sft import encode_example

    tok = load_tokenizer(tiny_model)
    row = {"prompt": "12+30", "answer": "42"}
    ids, mask = encode_example(tok, row, "arithmetic")
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == "Answer: 42<|im_end|>"
    assert ids[: mask.index(1)] == encode_chat(
        tok, prompt_messages("12+30")
    )  # exactly what rollout sends
    formats = ["Answer: {answer}", "= {answer}", "{answer}"]
    seen = set()
    for a in range(10, 60):
        r = {"prompt": f"{a}+1", "answer": str(a + 1)}
        ids, mask = encode_example(tok, r, "arithmetic", formats)
        seen.add(tok.decode([t for t, m in zip(ids, mask, strict=True) if m]).split(str(a + 1))[0])
    assert seen == {"Answer: ", "= ", ""}  # every style is used, chosen per prompt
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                         {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]}  # fmt: skip
    ids, mask = encode_example(tok, chat)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert "yo" in trained and "ok" in trained and "hi" not in trained and "again" not in trained
