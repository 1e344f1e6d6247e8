"""Model-based rewards with real parts: a sequence classifier in a real Ray actor (``reward_model``)
and a generative judge behind a real vLLM server (``judge``), each weighted with a rule reward.
The classifier is built here from the tiny checkpoint (a seeded random head), so the expected
score is its own unpadded forward pass; the judge is the teacher checkpoint (greedy 2-digit
addition, 100% measured), asked to add, so its verdict is known."""

import asyncio

import pytest
import torch

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
    import ray

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


def test_reward_model_that_cannot_load_is_an_infra_error(tmp_path, ray_instance):
    rm = resolve("reward_model", {"path": str(tmp_path / "missing"), "timeout_s": 60})
    model = RewardSum([(rm, 1.0)], timeout_s=10.0)
    assert asyncio.run(model.score("Answer: 1", {"prompt": "1+0"})) == (None, "infra_error")


@pytest.fixture(scope="module")
def judge_server(teacher_model, tmp_path_factory):
    from trident.rollout.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("judge") / "server.log"
    server = VLLMServer(teacher_model, log, weight_transfer_backend=None)
    url = server.start()
    yield url
    server.stop()


def test_judge_verdict_through_a_vllm_server(judge_server):
    """The 'judge' adds the two numbers the template gives it (row fields ``a`` and ``b``);
    ``Answer: N`` is its verdict, scaled by 100, weighted with the format rule."""
    judge = resolve(
        "judge",
        {"url": judge_server, "template": "{a}+{b}", "verdict": r"Answer:\s*(\d+)", "scale": 100},
    )
    model = RewardSum([(judge, 1.0), (resolve("format"), 0.5)], timeout_s=10.0)

    async def score_all():
        cases = [("Answer: 42", "30", "12"), ("66", "45", "21")]
        return await asyncio.gather(
            *(model.score(r, {"prompt": "p", "a": a, "b": b}) for r, a, b in cases)
        )

    assert asyncio.run(score_all()) == [
        (pytest.approx(0.42 + 0.5), "ok"),
        (pytest.approx(0.66), "ok"),
    ]
    dead = resolve("judge", {"url": "http://127.0.0.1:9", "template": "{response}"})
    assert asyncio.run(RewardSum([(dead, 1.0)], 10.0).score("x", {})) == (None, "infra_error")
