"""The RL loop end to end: real vLLM server, real FSDP2 trainer, real Ray, GRPO on 2-digit
addition from the demo's warm-up (``demo_sft_model``: the arithmetic is learned, the answers come
in three styles and only ``Answer: N`` is accepted). The reward is the task's verifier plus a
format reward (DeepSeek-R1 style). This is the GRPO learning test of the algorithms: accuracy
must rise within 20 steps, on the training samples and on held-out prompts. (20, not 12: the
warm-up the installed libraries produce now starts at ~36% held-out instead of ~54%, and from
there 12 steps left the rise of training accuracy within run-to-run noise: 0.27 -> 0.30 in one
fresh-clone run.) Two optimizer steps per batch, as the demo takes: with one, accuracy rose only
0.13 -> 0.20 over the 20 steps in a CI run (0.17 -> 0.28 here), within reach of the noise of 128
samples; with two it rose 0.15 -> 0.33 (held-out greedy 23% -> 58%) in the same time."""

import json
from pathlib import Path

import pytest

from trident.config import load_config
from trident.models.load import load_causal_lm
from trident.pipeline.run import run_train
from trident.telemetry.metrics import read_metrics

STEPS = 20

# Step-0 engine-vs-trainer mismatch bound. Both sides run the same float32 weights; measured here:
# mean |Δlogp| ≈ 1e-7, max ≈ 4e-6 (kernel and summation-order differences only). 1e-4 on the mean
# is three orders above that and two below what a wrong weight, dtype or temperature produces.
STEP0_MEAN_ABS_DLOGP = 1e-4


@pytest.fixture(scope="module")
def grpo_run(demo_sft_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rl")
    cfg = load_config(
        [],
        [
            f"model.path={demo_sft_model}",
            f"run.dir={run_dir}",
            "run.name=grpo",
            f"pipeline.steps={STEPS}",
            # seeded sampling: the same run on every try on a host (23% -> 52% held-out here,
            # twice). Unseeded, three runs here ended at 45-57%, one earlier run at 32%: within
            # 0.1 of the start, the bound below
            "run.deterministic=true",
            "pipeline.prompts_per_step=16",
            "trainer.lr=3e-4",
            "trainer.warmup_steps=2",
            "trainer.mini_batches=2",
            "trainer.cpu_threads=1",
            "reward.fns=[{name: task, weight: 1.0}, {name: format, weight: 0.5}]",
            "checkpoint.every=10",
            "checkpoint.keep_last=1",
            "eval.max_prompts=100",
            "telemetry.progress=false",
        ],
    )
    results = run_train(cfg)
    return cfg, results, read_metrics(cfg.derived.run_dir)


def test_every_sync_is_verified_and_advances_the_version(grpo_run):
    cfg, _, metrics = grpo_run
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        assert m["sync/bytes"] > 0 and m["sync/num_tensors"] > 0


def test_step0_engine_trainer_mismatch_is_small(grpo_run):
    _, _, metrics = grpo_run
    first = metrics[0]
    assert first["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP
    # On-policy: old (the engine's) == current up to the mismatch in the first mini-batch (ratio
    # 1 within 1e-5: with one mini-batch test_env_rl and test_agent_program assert it); the
    # second follows one optimizer step.
    assert first["ratio_mean"] == pytest.approx(1.0, abs=0.05)  # measured 0.991 and 1.004
    assert first["clip_fraction"] < 0.1  # measured 0.017


def test_pi_old_is_the_engines_on_policy(grpo_run):
    """``sync`` mode, float32, every sync verified: ``algo.old_logprobs=auto`` takes the engine's
    sampled-token logprobs for pi_old on every step, so the policy is never recomputed, and the
    mismatch they carry is still measured (the first mini-batch's, before its update)."""
    _, _, metrics = grpo_run
    assert [m["old_logprobs_engine"] for m in metrics] == [1.0] * STEPS
    for m in metrics:
        assert m["time/recompute_s"] < 0.05 * m["time/optimize_s"]
        assert m["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP


def test_reward_and_accuracy_rise(grpo_run):
    _, results, metrics = grpo_run
    for key, margin in (("reward_mean", 0.1), ("accuracy", 0.08)):
        start = sum(m[key] for m in metrics[:3]) / 3
        end = sum(m[key] for m in metrics[-3:]) / 3
        assert end > start + margin, (key, [round(m[key], 3) for m in metrics])
    before, after = results["before"]["accuracy"], results["after"]["accuracy"]
    assert after > before + 0.1, (before, after)  # held-out, greedy


def test_run_directory_layout(grpo_run):
    cfg, results, metrics = grpo_run
    run_dir = Path(cfg.derived.run_dir)
    assert load_config([run_dir / "config.yaml"]) == cfg
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (run_dir / "logs" / "vllm_server_0.log").stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["final", "step_10"]
    load_causal_lm(results["final_checkpoint"])  # HF format
    keys = set(metrics[0])
    for key in ("reward_mean", "reward_std", "accuracy", "response_len_mean", "entropy", "mismatch_k3_kl",
                "clip_fraction", "grad_norm", "time/wait_s", "time/train_s", "time/sync_s", "rollout_tokens_per_s", "generated/reward_mean"):  # fmt: skip
        assert key in keys, key
    json.dumps(metrics)
