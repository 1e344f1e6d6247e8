"""Model-based rewards with real parts: a sequence classifier in a real Ray actor (``reward_model``)
and a generative judge behind a real vLLM server (``judge``).
The classifier is built here from the tiny checkpoint (a seeded random head), so the expected
score is its own unpadded forward pass (the plumbing: batching, padding, placement; a trained
reward model is tests/test_rm_learning.py's). The judge is the demo's warm-up SFT-trained to
grade responses to 2-digit additions by the task verifier's verdicts, so its verdict depends
on the response it is shown."""

import asyncio
import random

import pytest
import ray
import torch

from trident.cluster.placement import PlacementError, check_fits, make_plan, reserve
from trident.data.tasks import Arithmetic, generate_split
from trident.rewards import RewardSum, resolve
from trident.rewards.judge import JudgeError, parse_verdict


@pytest.mark.parametrize(
    ("reply", "verdict", "scale", "score"),
    [
        ("Looks right. Score: 8", r"score:\s*(\d+)", 10, 0.8),
        ("verdict = yes", r"verdict\s*=\s*(\w+)", 1, 1.0),
        ("Score: 2 ... on reflection, Score: 9", r"score:\s*(\d+)", 10, 0.9),  # the last one
        ("Verdict: incorrect", r"verdict:\s*(\w+)", 1, 0.0),
    ],
)
def test_parse_verdict(reply, verdict, scale, score):
    assert parse_verdict(reply, verdict, scale) == pytest.approx(score)


def test_a_reply_without_a_verdict_is_the_judges_failure():
    with pytest.raises(JudgeError, match="no verdict"):
        parse_verdict("I cannot decide.", r"score:\s*(\d+)")
    with pytest.raises(JudgeError, match="neither a number"):
        parse_verdict("Score: maybe", r"score:\s*(\w+)")


@pytest.fixture(scope="module")
def ray_instance():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def classifier(tiny_model, tmp_path_factory) -> str:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=1)
    path = tmp_path_factory.mktemp("rm") / "classifier"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
    return str(path)


def _reference_score(path: str, prompt: str, response: str) -> float:
    """One unpadded forward pass of the classifier on the chat-rendered pair."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    text = tok.apply_chat_template(messages, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        return model(ids).logits[0, 0].item()


def test_reward_model_scores_in_batches_weighted_with_a_rule(classifier, ray_instance):
    rows = [{"prompt": f"{a}+{a}", "answer": str(2 * a)} for a in (11, 23, 35, 47, 59)]
    responses = ["Answer: 22", "23 and 23 make 46", "= 70", "I think 94", "Answer: 1"]
    rm = resolve("reward_model", {"path": classifier, "batch_size": 4, "timeout_s": 120})
    model = RewardSum([(rm, 0.5), (resolve("math"), 1.0)], timeout_s=10.0)

    async def score_all():
        return await asyncio.gather(
            *(model.score(r, row) for r, row in zip(responses, rows, strict=True))
        )

    scored = asyncio.run(score_all())  # 5 concurrent calls: a batch of 4 (padded), then 1
    math_scores = [1.0, 1.0, 1.0, 1.0, 0.0]
    for (value, status), row, response, m in zip(scored, rows, responses, math_scores, strict=True):
        assert status == "ok"
        expected = 0.5 * _reference_score(classifier, row["prompt"], response) + m
        assert value == pytest.approx(expected, abs=1e-4)
    again = asyncio.run(model.score(responses[1], rows[1]))  # alone, on a new event loop
    assert again[0] == pytest.approx(scored[1][0], abs=1e-4)


def test_a_plan_keeps_a_bundle_for_the_reward_models():
    """The reward models' last bundle counts in the plan: with 8 GPUs, 4 ranks, 3 servers and
    a 1-GPU reward model, each gets its own device; with 4 servers the run must colocate."""
    rm = {"num_cpus": 1.0, "num_gpus": 1.0}
    plan = make_plan("auto", 4, 3, {"GPU": 8, "CPU": 16}, reward_models=[rm])
    assert plan.mode == "disaggregated" and len(plan.bundles) == 8
    assert plan.bundles[-1] == {"CPU": 1.0, "GPU": 1.0} and plan.slot("reward", 0).bundle == 7
    plan = make_plan("auto", 4, 4, {"GPU": 8, "CPU": 16}, reward_models=[rm, rm])
    assert plan.mode == "colocated" and plan.bundles[-1] == {"CPU": 2.0, "GPU": 2.0}
    with pytest.raises(PlacementError, match="2 reward models \\+ 8 rollout servers"):
        check_fits(
            make_plan("disaggregated", 8, 8, {"GPU": 16}, reward_models=[rm, rm]), {"GPU": 16}
        )


def test_reward_model_is_scheduled_in_the_runs_placement_group(classifier, ray_instance):
    """A plan that reserves every CPU of the cluster (a trainer rank, a server, the reward
    model): nothing is left outside the group, and the reward model's actor still runs, in the
    bundle kept for it."""
    cluster = ray.cluster_resources()
    rest = {"num_cpus": cluster["CPU"] - 1.0}  # the trainer's and the server's halves take 1
    plan = make_plan("auto", 1, 1, cluster, reward_models=[rest])
    with reserve(plan):
        assert ray.available_resources().get("CPU", 0.0) == 0.0
        rm = resolve("reward_model", {"path": classifier, "timeout_s": 120})
        value, status = asyncio.run(
            RewardSum([(rm, 1.0)], 10.0).score("Answer: 2", {"prompt": "1+1"})
        )
        assert status == "ok"
        assert value == pytest.approx(_reference_score(classifier, "1+1", "Answer: 2"), abs=1e-4)
        ray.kill(rm.actor[0])


def test_reward_model_that_cannot_load_is_an_infra_error(tmp_path, ray_instance):
    rm = resolve("reward_model", {"path": str(tmp_path / "missing"), "timeout_s": 60})
    model = RewardSum([(rm, 1.0)], timeout_s=10.0)
    assert asyncio.run(model.score("Answer: 1", {"prompt": "1+0"})) == (None, "infra_error")


STYLES = ("Answer: {}", "= {}", "{}")  # the warm-up's answer styles (configs/demo.yaml)
ERRORS = (-11, -10, -9, -2, -1, 1, 2, 9, 10, 11)  # a missed or extra carry, a slip of one
JUDGE_TEMPLATE = "Grade the answer to {prompt}: {response}"


def labelled(rows: list[dict], seed: int, per_row: int = 3) -> list[dict]:
    """``per_row`` responses per task row as the demo's warm-up writes them, labelled by the
    task's verifier (``label`` 1 or 0): one of its three styles, with the right sum 4 times in 5
    (else a slip, ``ERRORS``)."""
    task = Arithmetic()
    rng = random.Random(seed)
    out = []
    for row in rows:
        for _ in range(per_row):
            value = int(row["answer"]) + (0 if rng.random() < 0.8 else rng.choice(ERRORS))
            response = rng.choice(STYLES).format(value)
            label = int(task.verify(response, row))
            out.append({"prompt": row["prompt"], "response": response, "label": label})
    return out


@pytest.fixture(scope="module")
def judge_server(demo_sft_model, tmp_path_factory):
    """A vLLM server of a judge: the demo's warm-up SFT-trained on ``JUDGE_TEMPLATE`` filled
    with labelled responses (``labelled``, 256 training prompts), answering ``yes`` where the
    verifier accepts the response and ``no`` where it does not. (Taught ``Verdict: yes`` in 100
    steps, it stuttered on 4 replies in 80, ``Verdict: dict:``: no verdict, an infra_error.)"""
    from tests.conftest import _sft
    from trident.data.loaders import write_jsonl
    from trident.rollout.vllm_server import VLLMServer

    out = tmp_path_factory.mktemp("judge")
    verdict = ("no", "yes")
    rows = [
        {"prompt": JUDGE_TEMPLATE.format(**r), "response": verdict[r["label"]]}
        for r in labelled(generate_split(Arithmetic(), "train", 256, 0), 0)
    ]
    data = write_jsonl(rows, out / "judge.jsonl")
    sft = ["sft.steps=150", "sft.batch_size=32", "sft.lr=1e-3", "sft.warmup_steps=5"]
    judge = _sft(
        demo_sft_model, out, "data.task=", f"data.train_path={data}", "data.answer_key=",
        "trainer.cpu_threads=1", *sft,
    )  # fmt: skip
    server = VLLMServer(judge, out / "server.log", weight_transfer_backend=None)
    url = server.start()
    yield url
    server.stop()


def test_judge_verdict_depends_on_the_response(judge_server):
    """Same prompts, responses the verifier accepts and rejects: the judge, trained on the
    verifier's verdicts, says yes to the first and no to the second. What tells them apart in
    its training data, and what it learned, is the required style: ``Answer: <sum>`` is yes,
    ``= <sum>`` and ``<sum>`` are no; a wrong sum in the required style it does not catch
    (printed: its yes rate there is the share of slips it misses)."""
    judge = resolve(
        "judge",
        {"url": judge_server, "template": JUDGE_TEMPLATE, "verdict": r"^\s*(\w+)"},
    )
    rows = generate_split(Arithmetic(), "test", 20, 0)
    cases = [
        (row, response, kind)
        for row in rows
        for response, kind in (
            (f"Answer: {row['answer']}", "correct"),
            (f"= {row['answer']}", "other style"),
            (row["answer"], "bare number"),
            (f"Answer: {int(row['answer']) + 10}", "wrong sum"),
        )
    ]

    async def score_all():
        model = RewardSum([(judge, 1.0)], timeout_s=30.0)
        return await asyncio.gather(*(model.score(resp, row) for row, resp, _ in cases))

    verdicts: dict[str, list[float]] = {}
    silent: list[str] = []  # cases the judge gave no verdict for, scored infra_error
    for (row, response, kind), (value, status) in zip(cases, asyncio.run(score_all()), strict=True):
        if status == "ok":
            verdicts.setdefault(kind, []).append(value)
            continue
        assert status == "infra_error", (kind, response, status)
        try:  # the judge's own error says why: its reply, or the HTTP failure
            asyncio.run(judge(response, **row))
        except JudgeError as e:
            silent.append(f"{kind} {response!r}: {e}")
        else:
            raise AssertionError(
                f"{kind} {response!r}: infra_error, then a verdict when asked again"
            )
    # This tiny judge (150 SFT steps) at times ends its reply at once, on a prompt or two that
    # vary with the host's float kernels ("10+40" on one): no verdict, scored infra_error, never
    # a 0. An unreachable or failing judge would fail every case.
    print(f"no verdict: {silent}")
    assert len(silent) <= len(cases) // 20, silent  # one case in 20 at most
    assert all("in the judge's reply ''" in x for x in silent), silent
    yes_rate = {kind: sum(v) / len(v) for kind, v in verdicts.items()}
    print(f"judge's yes rate by response kind over {len(rows)} held-out prompts: {yes_rate}")
    assert yes_rate["correct"] >= 0.9, yes_rate
    assert yes_rate["other style"] <= 0.1 and yes_rate["bare number"] <= 0.1, yes_rate
    dead = resolve("judge", {"url": "http://127.0.0.1:9", "template": "{response}"})
    assert asyncio.run(RewardSum([(dead, 1.0)], 10.0).score("x", {})) == (None, "infra_error")
