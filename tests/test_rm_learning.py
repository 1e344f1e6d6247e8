"""A reward model that is trained, then used as the only reward of a GRPO run.

The reward model is a sequence classifier whose body is the demo's warm-up (``demo_sft_model``:
it has learned the arithmetic), fitted with binary cross-entropy (``train_reward_model``) to
responses to 2-digit additions as the warm-up writes them, labelled by the task's verifier
(``labelled``): the required ``Answer: N`` with the right sum is 1; a wrong sum, or the other
styles ``= N`` and ``N``, is 0. Its accuracy is measured on held-out prompts (a disjoint split),
by kind of response: in 150 steps it learns the style, not the sum (a wrong sum in the
required style it scores as right; printed). Then 12 Dr. GRPO steps from the warm-up with
``reward.fns`` = the reward model alone: the reward model's score of the policy's samples must
rise. The task's accuracy of the same samples (the verifier, which the run never sees) is
computed from the run's per-sample lineage and reported.

Measured (warm-up of the conftest recipe): held-out accuracy 0.943 (Answer with the right sum
1.0, other styles 1.0, Answer with a wrong sum 0.0); over 12 Dr. GRPO steps the reward model's
score -3.32 -> -0.11 (mean of the first / last 3 steps) and the task's accuracy of the same
samples 0.161 -> 0.266.

Slow: its own cost (the classifier's 150 steps, then 12 steps of training) was 84 s on the
2-core machine when it was quiet and 174 s while other jobs ran, past the ~90 s a CI test may
take."""

import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.test_model_rewards import labelled
from trident.config import load_config
from trident.data.tasks import Arithmetic, generate_split
from trident.pipeline.run import run_train
from trident.rewards.model import RewardModelServer
from trident.rewards.rm_train import train_reward_model
from trident.telemetry.metrics import read_metrics

pytestmark = pytest.mark.slow

TASK = Arithmetic()
STEPS = 12  # as the GRPO recipes of tests/test_algo_learning.py (6 steps: no rise, measured)
RM_STEPS = 150


def scores(path: str, rows: list[dict]) -> list[float]:
    """The scores the ``reward_model`` actor would give (its class, in this process)."""
    server = RewardModelServer(path, 1024, "cpu")
    return server.score([(r["prompt"], r["response"]) for r in rows])


@pytest.fixture(scope="module")
def reward_model(demo_sft_model, tmp_path_factory) -> str:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on two shared cores ran 10x slower (measured)
    try:
        rows = labelled(generate_split(TASK, "train", 256, 0), 0)
        t0 = time.perf_counter()
        out = tmp_path_factory.mktemp("rm") / "rm"
        path = train_reward_model(demo_sft_model, rows, out, steps=RM_STEPS, lr=1e-3)
        print(f"reward model trained in {time.perf_counter() - t0:.0f} s")
    finally:
        torch.set_num_threads(threads)
    return str(path)


def kind(row: dict) -> str:
    """What a labelled response is: the required style with the right or a wrong sum, or
    another style (which the verifier rejects whatever the sum)."""
    if not row["response"].startswith("Answer"):
        return "other style"
    return "Answer, right sum" if row["label"] else "Answer, wrong sum"


def test_the_reward_model_separates_correct_from_incorrect_answers(reward_model):
    held_out = labelled(generate_split(TASK, "test", 100, 0), 1)
    scored = scores(reward_model, held_out)
    right = [(s > 0) == bool(r["label"]) for s, r in zip(scored, held_out, strict=True)]
    by_kind: dict[str, list[bool]] = {}
    for ok, row in zip(right, held_out, strict=True):
        by_kind.setdefault(kind(row), []).append(ok)
    accuracy = sum(right) / len(right)
    rate = {k: sum(v) / len(v) for k, v in by_kind.items()}
    print(f"held-out accuracy {accuracy:.3f}; by kind {rate} (of {len(held_out)})")
    assert accuracy > 0.85, rate
    assert rate["Answer, right sum"] > 0.9 and rate["other style"] > 0.95, rate


def task_accuracy(run_dir: Path) -> list[float]:
    """Per step, the verifier's accuracy on the samples the step trained on (its lineage)."""
    files = sorted(run_dir.glob("samples/step_*.parquet"), key=lambda f: int(f.stem[5:]))
    accuracy = []
    for file in files:
        rows = [r for r in pq.read_table(file).to_pylist() if r["trained"]]
        verdicts = [
            TASK.verify(r["response"], {"answer": str(sum(map(int, r["prompt"].split("+"))))})
            for r in rows
        ]
        accuracy.append(round(sum(verdicts) / len(verdicts), 3))
    return accuracy


@pytest.fixture(scope="module")
def rm_run(reward_model, demo_sft_model, demo_server, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rm_run")
    cfg = load_config(
        [],
        [
            f"model.path={demo_sft_model}",
            f"run.dir={run_dir}",
            "run.name=rm",
            f"rollout.server_urls=[{demo_server}]",
            f"pipeline.steps={STEPS}",
            # Dr. GRPO's advantage, r - mean (no division by the group's std): under GRPO's, the
            # reward model's small differences within one style (~0.3 logit) became advantages
            # of +-1 in groups of one style, noise that hid the style's ~8 (12 steps: no rise)
            "algo.name=dr_grpo",
            "pipeline.prompts_per_step=16",
            "trainer.lr=3e-4",
            "trainer.warmup_steps=2",
            "trainer.mini_batches=2",
            "trainer.cpu_threads=1",
            f"reward.fns=[{{name: reward_model, kwargs: {{path: {reward_model}}}}}]",
            "eval.before_after=false",
            "telemetry.samples=trained",
            "telemetry.progress=false",
        ],
    )
    t0 = time.perf_counter()
    run_train(cfg)
    print(f"GRPO run of {STEPS} steps in {time.perf_counter() - t0:.0f} s")
    return Path(cfg.derived.run_dir), read_metrics(cfg.derived.run_dir)


def test_grpo_on_the_reward_model_raises_its_score(rm_run):
    run_dir, metrics = rm_run
    assert [m["version"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["infra_errors"] == 0 for m in metrics)
    reward = [round(m["reward_mean"], 3) for m in metrics]
    accuracy = task_accuracy(run_dir)
    assert len(accuracy) == STEPS
    print(f"reward model's score per step {reward}; task accuracy per step {accuracy}")
    start, end = sum(reward[:3]) / 3, sum(reward[-3:]) / 3
    assert end > start + 0.5, reward  # logits: the required style scores ~8 above the others
