"""Black-box agent programs in training (``env.name=agent_program``): an unmodified program
written with the ``openai`` client, run once per trajectory against its own proxy session.

End to end (real vLLM server: the session's ``demo_server``; FSDP2 trainer, Ray): two GRPO steps
of the demo's warm-up on arithmetic, where each trajectory is the program below. The proxy
serves its calls token-in/token-out, so the engine's logprobs sit exactly under the loss mask
(step-0 |Δlogp| ~1e-7) and the trajectories train like the agent loop's; the program's stdout is
scored by the run's reward (the program prints its reply's last number as ``Answer: N``, the
form the task's verifier reads; each sample's reward is checked against it); every sample
carries the weight version it was generated at. A program that crashes makes its samples
``infra_error``, never a zero reward.
"""

from __future__ import annotations

import asyncio
import re
import sys
from pathlib import Path

import pytest

from trident.config import ConfigError, load_config
from trident.pipeline.run import run_train
from trident.telemetry.metrics import read_metrics

AGENT = """
import json, re, sys
from openai import OpenAI

row = json.loads(sys.stdin.read())
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from trident
reply = client.chat.completions.create(
    model="policy", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=12
)
if "--crash" in sys.argv:
    sys.exit("the agent crashed")
numbers = re.findall(r"-?[0-9]+", reply.choices[0].message.content or "")
print(f"Answer: {numbers[-1]}" if numbers else reply.choices[0].message.content)
"""

STEP0_MEAN_ABS_DLOGP = 1e-4  # as in test_rl_e2e: measured ~1e-7 (same float32 weights)


def _cfg(model: str, url: str, run_dir, *command: str, steps: int = 2):
    return load_config(
        [],
        [
            f"model.path={model}",
            f"run.dir={run_dir}",
            "run.name=agent",
            f"rollout.server_urls=[{url}]",
            "env.name=agent_program",
            f"env.kwargs={{command: [{', '.join(command)}], timeout_s: 60}}",
            "data.task=arithmetic",
            f"pipeline.steps={steps}",
            "pipeline.prompts_per_step=4",
            "rollout.n=4",
            "rollout.max_tokens=12",
            "trainer.cpu_threads=1",
            # 4 groups of 4 may all score alike: train every trajectory, whose ratio is checked
            "trainer.skip_zero_advantage=false",
            "eval.before_after=false",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
        ],
    )


def test_an_openai_client_agent_trains_through_trident_train(demo_sft_model, demo_server, tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    cfg = _cfg(demo_sft_model, demo_server, tmp_path, sys.executable, str(tmp_path / "agent.py"))
    run_train(cfg)
    metrics = read_metrics(cfg.derived.run_dir)
    assert [m["version"] for m in metrics] == [1, 2]
    assert metrics[0]["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    for m in metrics:
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        assert m["trained_samples"] == 16 and m["infra_errors"] == 0
    import pandas as pd

    samples = sorted(Path(cfg.derived.run_dir).glob("samples/*.parquet"))
    lineage = pd.concat(pd.read_parquet(p) for p in samples)
    for row in lineage.itertuples():  # each scored by the task's verifier on what the program said
        a, b = map(int, row.prompt.rsplit("\n", 1)[-1].split("+"))
        numbers = re.findall(r"-?[0-9]+", row.response)
        assert row.reward == float(bool(numbers) and int(numbers[-1]) == a + b), row
    assert set(lineage.version_min) == {0, 1}  # each step's programs ran on that step's weights
    assert lineage.groupby("step").group_id.nunique().tolist() == [4, 4]  # 4 prompts x n=4


def test_a_crashing_program_is_an_infra_error_and_a_bad_config_fails_early(
    demo_sft_model, demo_server, tmp_path
):
    from trident.models.load import load_tokenizer
    from trident.pipeline.groups import GroupRollout, split_rows
    from trident.rollout.engine import VLLMClient

    (tmp_path / "agent.py").write_text(AGENT)
    cfg = _cfg(
        demo_sft_model, demo_server, tmp_path, sys.executable, str(tmp_path / "agent.py"), "--crash"
    )
    rollout = GroupRollout(cfg, load_tokenizer(demo_sft_model))
    row = split_rows(cfg, "train")[0]
    samples = asyncio.run(rollout(VLLMClient(demo_server), row, 0))
    assert len(samples) == 4  # the program called the model, then crashed
    for s in samples:
        assert s.status == "infra_error" and s.reward is None
        assert "the agent crashed" in s.metadata["error"]
    with pytest.raises(ConfigError, match="needs env.kwargs.command"):
        load_config([], ["env.name=agent_program", "eval.before_after=false"])
    with pytest.raises(ConfigError, match="set eval.before_after=false"):
        load_config([], ["env.name=agent_program", "env.kwargs={command: [x]}"])
