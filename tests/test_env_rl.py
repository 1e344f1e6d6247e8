"""Agentic RL through ``trident train``: ``env.name`` drives multi-turn rollouts of an environment
(the agent loop) in the real pipeline (vLLM server, FSDP2 trainer, Ray, verified weight sync).

CI: a model warmed up for a few steps on calc_lookup demonstrations writes tool calls (about
half of them malformed at that point, and keys it cannot copy yet, so trajectories have several
turns: call, error, call again). Two GRPO steps must train on those trajectories with the
engine's logprobs exactly where the loss mask is (step-0 mismatch ~1e-7, ratio 1), log the agent
metrics, and evaluate the environment's success rate before and after. The run's ``lookup`` is an
MCP server started from ``env.mcp_servers``; its log and the trajectories show that the model
read its answers. The same rollout, run against a server directly, shows the masks:
one trained span per model turn, tool results untrained.

Slow: the recipe of ``configs/agent_demo.yaml`` end to end — SFT on demonstrations, then GRPO —
raises the tool-call success rate and the reward.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, mask_spans
from trident.config import load_config
from trident.data.loaders import write_jsonl
from trident.envs import env_rows
from trident.models.load import load_tokenizer
from trident.pipeline.groups import GroupRollout, split_rows
from trident.pipeline.run import run_train
from trident.telemetry.lineage import read_samples
from trident.telemetry.metrics import read_metrics

AGENT_DEMO = REPO / "configs" / "agent_demo.yaml"
STEP0_MEAN_ABS_DLOGP = 1e-4  # as in test_rl_e2e: measured ~1e-7 (same float32 weights)

ENV = [
    "env.name=calc_lookup",
    "env.data_kwargs={parallel_fraction: 1.0}",
    "env.show_tools=false",  # the model learns the tools by SFT; their schemas cost ~170 tokens
    "env.max_turns=4",
    "env.max_response_tokens=128",
    "rollout.max_tokens=40",
    "rollout.max_model_len=1024",
    "eval.max_tokens=40",
]


def _sft_on_env_data(base: str, out: Path, options: dict, *overrides: str) -> str:
    from trident.train.sft import run_sft

    rows = env_rows("calc_lookup", 400, "train", 0, show_tools=False, **options)
    data = write_jsonl(rows, out / "demos.jsonl")
    cfg = load_config(
        [],
        [
            f"model.path={base}",
            f"run.dir={out}",
            "run.name=sft",
            "data.task=",
            f"data.train_path={data}",
            "trainer.cpu_threads=1",
            "telemetry.progress=false",
            *overrides,
        ],
    )
    return str(run_sft(cfg))


@pytest.fixture(scope="module")
def tool_caller(tiny_model, tmp_path_factory) -> str:
    """A few SFT steps on calc_lookup demonstrations: the tool-call format, not the task."""
    out = tmp_path_factory.mktemp("env_sft")
    steps = ["sft.steps=80", "sft.batch_size=8", "sft.lr=4e-3", "sft.warmup_steps=5"]
    return _sft_on_env_data(tiny_model, out, {"parallel_fraction": 1.0}, *steps)


# The lookup as an MCP server (a key-value service, as a real one would be: it does not know the
# episode's row): it replaces calc_lookup's built-in `lookup` (same name), answers from the union
# of the run's rows' corpora, and logs every call, so the test sees results only it produced.
MCP_LOOKUP = '''
import json, sys
try:
    from mcp.server.mcpserver import MCPServer
except ImportError:  # mcp 1.x
    from mcp.server.fastmcp import FastMCP as MCPServer

TABLE = json.load(open(sys.argv[1]))
server = MCPServer("lookup")

@server.tool()
def lookup(key: str) -> str:
    """Look up the value of a key in the corpus."""
    with open(sys.argv[2], "a") as log:
        log.write(json.dumps([key, TABLE.get(key)]) + "\\n")
    if key not in TABLE:
        raise ValueError(f"no entry {key}")
    return TABLE[key]

server.run()
'''


@pytest.fixture(scope="module")
def env_run(tool_caller, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("env_rl")
    (run_dir / "mcp_lookup.py").write_text(MCP_LOOKUP)
    rows = [r for split in ("train", "test") for r in split_rows(load_config([], ENV), split)]
    table = {k: v for r in reversed(rows) for k, v in r["corpus"].items()}
    (run_dir / "table.json").write_text(json.dumps(table))
    server = [sys.executable, run_dir / "mcp_lookup.py", run_dir / "table.json", run_dir / "calls"]
    mcp = f"{{command: [{', '.join(map(str, server))}]}}"
    cfg = load_config(
        [],
        [
            f"model.path={tool_caller}",
            f"run.dir={run_dir}",
            "run.name=env",
            *ENV,
            f"env.mcp_servers=[{mcp}]",
            "pipeline.steps=2",
            "pipeline.prompts_per_step=4",
            "rollout.n=4",
            "trainer.lr=1e-4",
            "trainer.cpu_threads=1",
            # two steps from a warm-up whose groups may all score alike: train every trajectory
            # (the ratio and mismatch are checked on them), none skipped for a zero advantage
            "trainer.skip_zero_advantage=false",
            "eval.max_prompts=4",
            "eval.samples=2",
            "eval.pass_k=2",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
        ],
    )
    results = run_train(cfg)
    return cfg, results, read_metrics(cfg.derived.run_dir)


def test_train_on_an_environment_end_to_end(env_run):
    cfg, results, metrics = env_run
    assert [m["version"] for m in metrics] == [1, 2]
    first = metrics[0]
    # multi-turn trajectories were trained on, with the engine's logprobs under the loss mask
    assert max(m["agent/turns_mean"] for m in metrics) > 1.0, metrics
    assert first["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    for m in metrics:
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        for key in ("agent/tool_calls_per_trajectory", "agent/tool_success_rate",
                    "tool_parse_error_rate", "untrainable_samples", "trained_samples",
                    "reward_mean", "response_len_mean"):  # fmt: skip
            assert key in m, key
        assert m["trained_samples"] + m["untrainable_samples"] + m["infra_errors"] == 16
    run_dir = Path(cfg.derived.run_dir)
    for key in ("before", "after"):
        saved = json.loads((run_dir / f"eval_{key}.json").read_text())
        assert saved["env"] == "calc_lookup" and saved["num_prompts"] == 4
        assert {"accuracy", "pass@2", "tool_success_rate", "tool_calls_per_trajectory"} <= set(
            saved
        )
        assert saved["samples"][0]["greedy_messages"][0]["role"] == "assistant"
    # the lookups were the MCP server's (started from env.mcp_servers), and the model read its
    # answers: values from its table, or its own error message
    calls = [json.loads(line) for line in (run_dir.parent / "calls").read_text().splitlines()]
    assert calls, "no lookup reached the MCP server"
    table = json.loads((run_dir.parent / "table.json").read_text())
    assert all(value == table.get(key) for key, value in calls)
    results = [m["content"] for s in saved["samples"] for m in s["greedy_messages"]
               if m["role"] == "tool" and m.get("name") == "lookup"]  # fmt: skip
    assert results and all((r.startswith("Error: lookup: ") and "no entry" in r) or r in table.values()
                           for r in results), results  # fmt: skip


def test_an_environment_trains_in_separate_async(tool_caller, tmp_path):
    """Multi-turn trajectories streamed under live weight updates (each turn a request through
    the partial rollout, each trajectory its own session): every trajectory's turns are its own
    (one shared record once mixed them), the engine computes what the trainer computes at step
    0, every token within the staleness bound."""
    cfg = load_config(
        [],
        [
            f"model.path={tool_caller}", f"run.dir={tmp_path}", "run.name=env", *ENV,
            "pipeline.mode=separate_async", "pipeline.max_staleness=1", "pipeline.steps=3",
            "pipeline.prompts_per_step=4", "rollout.n=4", "trainer.cpu_threads=1",
            "eval.before_after=false", "telemetry.progress=false", "telemetry.tensorboard=false",
        ],
    )  # fmt: skip
    run_train(cfg)
    metrics = read_metrics(cfg.derived.run_dir)
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert max(m["agent/turns_mean"] for m in metrics) > 1.0
    assert metrics[0]["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP
    for m in metrics:
        assert m["trained_samples"] + m["untrainable_samples"] + m["infra_errors"] == 16
        assert m["staleness/max"] <= 1 and m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
    rows = [r for r in read_samples(cfg.derived.run_dir) if r["trained"]]
    assert len({r["sample_id"] for r in rows}) == len(rows)


def test_env_groups_have_one_trained_span_per_model_turn(tool_caller, tmp_path):
    from trident.rollout.engine import VLLMClient
    from trident.rollout.vllm_server import VLLMServer

    cfg = load_config([], [f"model.path={tool_caller}", f"run.dir={tmp_path}", *ENV, "rollout.n=6"])
    tokenizer = load_tokenizer(tool_caller)
    rollout = GroupRollout(cfg, tokenizer)
    rows = split_rows(cfg, "train")[:3]
    assert rows == env_rows("calc_lookup", 3, "train", 0, False, parallel_fraction=1.0)
    assert "tools" not in rows[0]
    server = VLLMServer(tool_caller, tmp_path / "server.log", weight_transfer_backend=None,
                        max_model_len=1024)  # fmt: skip
    url = server.start()
    try:
        client = VLLMClient(url)
        groups = [asyncio.run(rollout(client, row, 7)) for row in rows]
    finally:
        server.stop()
    samples = [s for g in groups for s in g]
    assert max(s.metrics["turns"] for s in samples) > 1
    for s in samples:
        assert tokenizer.decode(s.token_ids[: s.prompt_len]).startswith("<|im_start|>user\n")
        spans = mask_spans(s.loss_mask)
        assert len(spans) == s.metrics["turns"], s.metadata["messages"]
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            between = tokenizer.decode(s.token_ids[end:start])
            assert between.startswith("\n<|im_start|>tool"), between  # a tool result, untrained
            assert between.endswith("<|im_start|>assistant\n")
        for v, lp, m in zip(s.versions, s.logprobs, s.loss_mask, strict=True):
            assert (v, m == 1) in ((7, True), (-1, False))
            assert m or lp == 0.0
        assert s.reward in (0.0, 1.0)  # (token_drift may be 1: sampled non-canonical splits)


# -- the recipe (slow) ----------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_agent_demo_recipe_raises_tool_success_and_reward(tiny_model, tmp_path):
    """configs/agent_demo.yaml as scripts/agent_demo runs it: SFT on the environment's imperfect
    demonstrations (30% of them a broken tool strategy), then GRPO on whole trajectories: tool
    success and reward rise."""
    recipe = load_config([AGENT_DEMO])
    out = tmp_path / "sft"
    rows = env_rows("calc_lookup", 4000, "train", 0, False, **recipe.env.data_kwargs)
    data = write_jsonl(rows, out / "demos.jsonl")
    from trident.train.sft import run_sft

    common = [f"run.dir={tmp_path}", "telemetry.progress=false", "telemetry.tensorboard=false"]
    sft = load_config([AGENT_DEMO], [f"model.path={tiny_model}", "run.name=sft",
                                     f"data.train_path={data}", *common])  # fmt: skip
    model = str(run_sft(sft))
    cfg = load_config([AGENT_DEMO], [f"model.path={model}", "run.name=rl", *common])
    results = run_train(cfg)
    metrics = read_metrics(cfg.derived.run_dir)
    before, after = results["before"], results["after"]
    reward = [m["reward_mean"] for m in metrics]
    tools = [m["agent/tool_success_rate"] for m in metrics]
    print(f"\nreward per step {[round(r, 3) for r in reward]}")
    print(f"tool success per step {[round(t, 3) for t in tools]}")
    print({k: (before[k], after[k]) for k in ("accuracy", "mean_sample_accuracy",
                                              "tool_success_rate")})  # fmt: skip
    assert _mean(reward[-3:]) > _mean(reward[:3]) + 0.1, reward
    assert _mean(tools[-3:]) > _mean(tools[:3]) + 0.03, tools  # the broken strategy fades
    # greedy decoding already takes the working strategy (measured 64% -> 66%); sampling, where
    # the broken one shows, gains (24% -> 54%)
    assert after["mean_sample_accuracy"] > before["mean_sample_accuracy"] + 0.15
    assert after["accuracy"] >= before["accuracy"] - 0.05


# -- config ---------------------------------------------------------------------------------------


def test_env_config_is_checked_before_anything_starts():
    from trident.config import ConfigError
    from trident.pipeline.groups import agent_config

    with pytest.raises(ConfigError, match=r"env.name='calc_lookp'.*did you mean 'calc_lookup'"):
        load_config([], ["env.name=calc_lookp"])
    with pytest.raises(
        ConfigError, match="env.max_total_tokens=2048 exceeds rollout.max_model_len"
    ):
        load_config([], ["env.name=calc_lookup", "env.max_total_tokens=2048"])
    # an environment without a data generator reads the task's rows (or data.train_path)
    with pytest.raises(ConfigError, match="has no data generator"):
        load_config([], ["env.name=task", "data.task="])
    cfg = load_config([], ["env.name=task"])
    assert split_rows(cfg, "test")[0]["task"] == "arithmetic"
    cfg = load_config([], ["env.name=calc_lookup", "data.task=", "env.max_turn_tokens=20"])
    agent = agent_config(cfg)
    assert (agent.max_turn_tokens, agent.max_total_tokens, agent.show_tools) == (20, 512, True)
    assert split_rows(cfg, "test")[:2] == env_rows("calc_lookup", 2, "test")
    assert load_config([AGENT_DEMO]).env.data_kwargs["answer_formats"][0] == "Answer: {answer}"
    with pytest.raises(ConfigError, match=r"mcp_servers\[0\]: give exactly one of `command`"):
        load_config([], ["env.name=calc_lookup", "env.mcp_servers=[{command: [a], url: b}]"])
    with pytest.raises(ConfigError, match=r"mcp_servers\[0\]: give exactly one"):
        load_config([], ["env.name=calc_lookup", "env.mcp_servers=[{command: a}]"])
    with pytest.raises(ConfigError, match="env.mcp_servers adds tools to an environment"):
        load_config([], ["env.mcp_servers=[{url: http://h/mcp}]"])
    cfg = load_config([], ["env.name=calc_lookup", "env.mcp_servers=[{url: http://h/mcp}]"])
    assert agent_config(cfg).mcp_servers == ({"url": "http://h/mcp"},)
