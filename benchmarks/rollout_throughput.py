"""Rollout throughput: trident's vLLM rollout against HF ``generate`` (what TRL uses without
vLLM), same model, same prompts, same sampling settings, in one run.

    python benchmarks/rollout_throughput.py [--model DIR] [--prompts 64] [--n 8] [--max-tokens 32]

Writes ``benchmarks/results/rollout_throughput.{json,md}``. Tokens/s counts generated tokens
only; the vLLM side includes HTTP and the router, i.e. what the RL loop pays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from trident.config import load_config
from trident.data.loaders import load_split
from trident.models.factory import init_model
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer, prompt_messages
from trident.rollout.engine import SamplingParams

RESULTS = Path(__file__).parent / "results"


def hf_generate(
    model_path: str, prompts: list[list[int]], n: int, max_tokens: int, batch: int
) -> tuple[int, float]:
    model, tok = load_causal_lm(model_path).eval(), load_tokenizer(model_path)
    tok.padding_side = "left"
    generated, start = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(map(len, chunk))
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in chunk])
            attn = (
                torch.arange(width)[None, :]
                >= torch.tensor([width - len(p) for p in chunk])[:, None]
            ).long()
            out = model.generate(
                input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
                max_new_tokens=max_tokens, num_return_sequences=n, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
            new = out[:, width:]
            # count tokens up to and including EOS, as the engine reports them
            for row in new.tolist():
                generated += next(
                    (k + 1 for k, t in enumerate(row) if t in (tok.eos_token_id, tok.pad_token_id)),
                    len(row),
                )
    return generated, time.perf_counter() - start


async def vllm_generate(
    router, prompts: list[list[int]], n: int, max_tokens: int
) -> tuple[int, float]:
    params = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    start = time.perf_counter()
    results = await asyncio.gather(*(router.generate(p, params) for p in prompts))
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for group in results for c in group), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint (default: a fresh tiny model)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, default=16, help="prompts per HF generate call")
    args = ap.parse_args()

    from trident.cluster.ray_cluster import init_ray
    from trident.rollout.fleet import RolloutFleet

    work = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    model = args.model or str(init_model(work / "tiny", "tiny"))
    cfg = load_config(
        [],
        [
            f"model.path={model}",
            f"run.dir={work}",
            "run.name=bench",
            f"data.num_test={args.prompts}",
        ],
    )
    tok = load_tokenizer(model)
    prompts = [
        encode_chat(tok, prompt_messages(r["prompt"]))
        for r in load_split(cfg.data, "test")[: args.prompts]
    ]

    init_ray(cfg.cluster)
    with RolloutFleet(cfg, model, work) as fleet:
        asyncio.run(vllm_generate(fleet.router, prompts[:4], 1, 4))  # warm-up
        v_tokens, v_time = asyncio.run(
            vllm_generate(fleet.router, prompts, args.n, args.max_tokens)
        )
    hf_generate(model, prompts[:2], 1, 4, 2)  # warm-up
    h_tokens, h_time = hf_generate(model, prompts, args.n, args.max_tokens, args.hf_batch)

    rows = [
        {
            "engine": "trident rollout (vLLM server, HTTP)",
            "tokens": v_tokens,
            "seconds": v_time,
            "tokens_per_s": v_tokens / v_time,
        },
        {
            "engine": "HF generate (batched)",
            "tokens": h_tokens,
            "seconds": h_time,
            "tokens_per_s": h_tokens / h_time,
        },
    ]
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    result = {
        "benchmark": "rollout_throughput",
        "model": model,
        "prompts": args.prompts,
        "n": args.n,
        "max_tokens": args.max_tokens,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, cuda={torch.cuda.is_available()}",
        "rows": rows,
        "speedup_vs_hf_generate": ratio,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [
        f"Rollout throughput: {args.prompts} prompts x {args.n} samples, up to {args.max_tokens} new tokens, "
        f"temperature 1.0 ({result['machine']}).",
        "",
        "| engine | generated tokens | seconds | tokens/s |",
        "|---|---:|---:|---:|",
        *(
            f"| {r['engine']} | {r['tokens']} | {r['seconds']:.2f} | {r['tokens_per_s']:.0f} |"
            for r in rows
        ),
        "",
        f"**trident / HF generate: {ratio:.1f}x**",
        "",
    ]
    (RESULTS / "rollout_throughput.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
