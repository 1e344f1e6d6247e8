"""Rollout throughput: trident's vLLM rollout against HF ``generate`` (what TRL uses without
vLLM), same model, same prompts, same sampling settings, on two shapes in one run.

    python benchmarks/rollout_throughput.py [--long-model DIR] [--prompts 16] [--n 8]

- ``fixed``: the ``small`` preset (~25 M parameters) as initialised, whose responses all run to
  their 32-token cap: the kernels' shape;
- ``long-tailed``: the ``long`` recipe's warm-up of ``benchmarks/vs_trl.py`` (a scratch line of
  log-normal length before the answer, up to 256 new tokens; ``--long-model``, default
  ``runs/bench-vs-trl/long-sft/model``, built by ``vs_trl.py --recipe long``; the shape is
  skipped without it): HF ``generate`` pays each batch's longest response, vLLM's continuous
  batching does not.

Each side generates the same prompts once after a warm-up; trident's servers start as a run's
do (``rollout.cpu_threads`` auto: in ``sync`` mode every core while the trainer waits). Writes
``benchmarks/results/rollout_throughput.{json,md}``. Tokens/s counts generated tokens only; the
vLLM side includes HTTP and the router, i.e. what the RL loop pays.
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


def measure(model: str, work: Path, prompts: int, n: int, max_tokens: int) -> list[dict]:
    """Both sides on ``model``: the fleet a run would start, then HF ``generate`` in batches of
    16 prompts (``n`` samples each)."""
    from trident.rollout.fleet import RolloutFleet

    cfg = load_config(
        [],
        [f"model.path={model}", f"run.dir={work}", "run.name=bench", f"data.num_test={prompts}"],
    )
    tok = load_tokenizer(model)
    ids = [encode_chat(tok, prompt_messages(r["prompt"])) for r in load_split(cfg.data, "test")]
    ids = ids[:prompts]
    with RolloutFleet(cfg, model, work) as fleet:
        asyncio.run(vllm_generate(fleet.router, ids[:4], 1, 4))  # warm-up
        v_tokens, v_time = asyncio.run(vllm_generate(fleet.router, ids, n, max_tokens))
    hf_generate(model, ids[:2], 1, 4, 2)  # warm-up
    h_tokens, h_time = hf_generate(model, ids, n, max_tokens, 16)
    return [
        {"engine": "trident rollout (vLLM server, HTTP)", "tokens": v_tokens, "seconds": v_time},
        {"engine": "HF generate (batched)", "tokens": h_tokens, "seconds": h_time},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-model", default="runs/bench-vs-trl/long-sft/model")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()

    from trident.cluster.ray_cluster import init_ray

    work = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    shapes = {"fixed": ("small", str(init_model(work / "small", "small")), 32)}
    if (Path(args.long_model) / "config.json").exists():
        shapes["long-tailed"] = ("long-sft", args.long_model, 256)
    init_ray(load_config([], []).cluster)
    result: dict = {
        "benchmark": "rollout_throughput",
        "prompts": args.prompts,
        "n": args.n,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"cuda={torch.cuda.is_available()}",
        "shapes": [],
    }
    md = [
        f"Rollout throughput: {args.prompts} prompts x {args.n} samples at temperature 1.0 "
        f"({result['machine']}).",
        "",
        "| shape | model | max new tokens | engine | generated tokens | seconds | tokens/s |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for shape, (label, model, max_tokens) in shapes.items():
        rows = measure(model, work / shape, args.prompts, args.n, max_tokens)
        for r in rows:
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            md.append(
                f"| {shape} | {label} | "
                f"{max_tokens} | {r['engine']} | {r['tokens']} | {r['seconds']:.2f} | "
                f"{r['tokens_per_s']:.0f} |"
            )
        ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
        result["shapes"].append(
            {"shape": shape, "model": model, "max_tokens": max_tokens, "rows": rows,
             "speedup_vs_hf_generate": ratio}
        )  # fmt: skip
    md.append("")
    md += [
        f"**{s['shape']}: trident / HF generate {s['speedup_vs_hf_generate']:.2f}x**"
        for s in result["shapes"]
    ]
    md.append("")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rollout_throughput.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "rollout_throughput.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
