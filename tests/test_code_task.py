"""RL on the built-in code task, end to end: rollout -> sandboxed unit tests -> FSDP2 -> sync.
The random tiny model writes no working program, so the reward stays near 0; what is checked is
that the loop runs and its metrics are honest (scores in range, no infrastructure failures)."""

from trident.config import load_config
from trident.pipeline.run import run_train
from trident.telemetry.metrics import read_metrics


def test_rl_on_code_task_runs_end_to_end(tiny_model, tmp_path):
    cfg = load_config(
        [],
        [
            f"model.path={tiny_model}",
            f"run.dir={tmp_path}",
            "data.task=code",
            "data.num_train=200",
            "data.num_test=20",
            "rollout.max_tokens=24",
            "rollout.n=4",
            "pipeline.steps=2",
            "pipeline.prompts_per_step=4",
            "trainer.cpu_threads=1",
            "eval.before_after=false",
            "telemetry.progress=false",
        ],
    )
    run_train(cfg)
    metrics = read_metrics(cfg.derived.run_dir)
    assert [m["version"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["infra_errors"] == 0
        assert 0.0 <= m["reward_mean"] <= 1.0
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        assert m["response_tokens"] > 0
