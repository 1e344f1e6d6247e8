"""``trainer.packing`` against padded micro-batches on long-tailed response lengths: the train
stage's tokens per second and the share of computed positions that are padding.

    python benchmarks/packing.py [--preset tiny|small] [--steps 3] [--samples 128]

Both sides train the same samples in one process, alternating (padded, packed, padded, ...), each
after one warm-up step, so load on the machine falls on both alike. The samples are the demo's
prompts with responses of random tokens whose lengths follow RL's long tail (most short, a few
near the 256-token cap: a log-normal, median 40, capped), with group rewards so the loss is real.
Writes ``benchmarks/results/packing.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import REPO, provenance

sys.path.insert(0, str(REPO))

from trident.cluster.net import free_port  # noqa: E402
from trident.config import load_config  # noqa: E402
from trident.data.tasks import generate_split, get_task  # noqa: E402
from trident.models.factory import init_model  # noqa: E402
from trident.models.load import encode_chat, load_tokenizer, prompt_messages  # noqa: E402
from trident.sample import Sample  # noqa: E402
from trident.train.batch import collate, micro_batches, pack  # noqa: E402
from trident.train.policy import PolicyWorker  # noqa: E402

MAX_TOKENS = 256
GROUP = 8


def long_tailed_samples(model: str, count: int, seed: int) -> list[Sample]:
    """``count`` samples in groups of ``GROUP``: demo prompts, random responses of long-tailed
    lengths (log-normal, median 40, capped at ``MAX_TOKENS``), rewards 0/1 at random."""
    rng = random.Random(seed)
    tokenizer = load_tokenizer(model)
    rows = generate_split(get_task("arithmetic"), "train", count // GROUP, seed=seed)
    samples = []
    for g, row in enumerate(rows):
        prompt = encode_chat(tokenizer, prompt_messages(row["prompt"]))
        for k in range(GROUP):
            n = min(MAX_TOKENS, max(1, int(rng.lognormvariate(3.7, 0.9))))
            response = [rng.randrange(3, len(tokenizer)) for _ in range(n)]
            tokens = prompt + response
            samples.append(
                Sample(
                    id=f"{g}-{k}",
                    group_id=str(g),
                    token_ids=tokens,
                    loss_mask=[0] * len(prompt) + [1] * n,
                    logprobs=[0.0] * len(tokens),
                    versions=[-1] * len(prompt) + [0] * n,
                    reward=float(rng.random() < 0.5),
                    metadata={"row": {**row, "task": "arithmetic"}},
                )
            )
    return samples


def padding_fraction(samples: list[Sample], budget: int, packed: bool) -> tuple[float, int]:
    """Share of the positions the model computes that are padding, and the micro-batch count."""
    lengths = [len(s.token_ids) for s in samples]
    groups = micro_batches(lengths, budget, packed)
    if packed:
        computed = sum(pack(collate([samples[i] for i in g], 0))[0].numel() for g in groups)
    else:
        computed = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return 1 - sum(lengths) / computed, len(groups)


def measure(model: str, samples: list[Sample], steps: int) -> dict[str, Any]:
    """Seconds per ``train_step`` for padded and packed, alternating, after one warm-up each."""
    workers = {}
    for packed in (False, True):
        overrides = [
            f"model.path={model}",
            f"trainer.packing={str(packed).lower()}",
            "trainer.cpu_threads=0",
            "algo.is_level=none",
            "telemetry.progress=false",
        ]
        cfg = load_config([], overrides)
        workers[packed] = PolicyWorker(cfg, 0, 1, "127.0.0.1", free_port())
    seconds: dict[bool, list[float]] = {False: [], True: []}
    try:
        for step in range(steps + 1):
            for packed, worker in workers.items():
                t0 = time.perf_counter()
                worker.train_step(samples)
                if step > 0:  # the first is the warm-up
                    seconds[packed].append(time.perf_counter() - t0)
        budget = workers[False].cfg.trainer.micro_batch_tokens
    finally:
        for worker in workers.values():
            worker.shutdown()
    lengths = [len(s.token_ids) for s in samples]
    tokens = sum(lengths)
    out: dict[str, Any] = {"tokens": tokens, "micro_batch_tokens": budget}
    for packed, name in ((False, "padded"), (True, "packed")):
        fraction, count = padding_fraction(samples, budget, packed)
        mean = statistics.mean(seconds[packed])
        out[name] = {
            "seconds": seconds[packed],
            "mean_s": mean,
            "tokens_per_s": tokens / mean,
            "padding_fraction": fraction,
            "micro_batches": count,
        }
    out["speedup"] = out["padded"]["mean_s"] / out["packed"]["mean_s"]
    return out


def markdown(results: dict[str, Any]) -> str:
    prov, r = results["provenance"], results["result"]
    lines = [
        f"# Packing vs padded micro-batches (benchmarks/packing.py, {prov['date']}, "
        f"commit `{prov['commit']}`)",
        "",
        f"Host: {prov['host']['cpu']}, {prov['host']['cores']} cores, load {prov['load_average']}. "
        f"Preset `{results['preset']}`, {results['samples']} samples in groups of {GROUP}, "
        f"response lengths long-tailed (median 40, cap {MAX_TOKENS}); {r['tokens']:,} real tokens "
        f"a step; `trainer.micro_batch_tokens={r['micro_batch_tokens']}`; mean of "
        f"{results['steps']} `train_step`s each after one warm-up, alternating.",
        "",
        "| micro-batches | count | padding (share of computed positions) | s / step | real tokens / s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("padded", "packed"):
        x = r[name]
        lines.append(
            f"| {name} | {x['micro_batches']} | {x['padding_fraction']:.1%} | "
            f"{x['mean_s']:.2f} | {x['tokens_per_s']:,.0f} |"
        )
    lines += ["", f"Packed is **{r['speedup']:.2f}×** the padded step's speed."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(init_model(Path(tmp) / args.preset, args.preset, seed=0))
        samples = long_tailed_samples(model, args.samples, args.seed)
        result = measure(model, samples, args.steps)
    results = {
        "provenance": provenance(),
        "preset": args.preset,
        "samples": args.samples,
        "steps": args.steps,
        "result": result,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "packing.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out_dir / "packing.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
