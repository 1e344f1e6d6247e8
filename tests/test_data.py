import asyncio
import json

import pytest

from trident.data.loaders import DataError, PromptCursor, load_rows, load_split, write_jsonl
from trident.data.tasks import TASKS, Arithmetic, Countdown, generate_split, safe_eval_expression
from trident.rewards import task_reward


def _score(name, response, row):
    """What RL scores: the task reward (a task's verify, or the reward it names: code's sandbox)."""
    return asyncio.run(task_reward(response, **{**row, "task": name}))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_disjoint_and_verifiable(name):
    task = TASKS[name]
    train = generate_split(task, "train", 300, seed=3)
    assert train == generate_split(task, "train", 300, seed=3)
    assert train != generate_split(task, "train", 300, seed=4)
    test = generate_split(task, "test", 50, seed=3)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    checked = train[:3] + test[:3] if name == "code" else train[:50] + test  # code runs a sandbox
    for row in checked:
        assert _score(name, task.solution(row), row) == 1.0
        assert _score(name, "no answer here", row) == 0.0
        if name != "code":
            assert _score(name, task.solution(row).replace("Answer:", "Result:"), row) == 0.0


def test_arithmetic_rejects_wrong_value():
    row = {"prompt": "12+30", "answer": "42"}
    assert Arithmetic().verify("Answer: 42", row) == 1.0
    assert Arithmetic().verify("Answer: 43", row) == 0.0
    assert Arithmetic().verify("Answer: 42\nAnswer: 41", row) == 0.0  # the last line decides


def test_countdown_uses_each_number_at_most_once():
    row = {"prompt": "3 4 5 -> 17", "answer": "17", "numbers": [3, 4, 5]}
    c = Countdown()
    assert c.verify("Answer: 3*4+5", row) == 1.0
    assert c.verify("Answer: 4*4+1", row) == 0.0  # 4 twice, 1 not given
    assert c.verify("Answer: __import__('os')", row) == 0.0
    assert safe_eval_expression("2**100") is None  # no power: no huge numbers


def test_jsonl_parquet_and_datasets_load_the_same_rows(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": "1+1", "answer": "2"},
        {"prompt": [{"role": "user", "content": "2+2"}], "answer": "4"},
    ]
    jsonl = write_jsonl(rows, tmp_path / "d.jsonl")
    flat = [{"q": "1+1", "a": "2"}, {"q": "3+4", "a": "7"}]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "d.parquet")
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(jsonl) == rows
    expected = [{"prompt": "1+1", "answer": "2"}, {"prompt": "3+4", "answer": "7"}]
    assert load_rows(tmp_path / "d.parquet", "q", "a") == expected
    assert load_rows(tmp_path / "ds", "q", "a") == expected


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "1+1", "answer": "2"', "invalid JSON"),
        ('{"answer": "2"}', "missing key 'prompt'"),
        ('{"prompt": "", "answer": "2"}', "prompt is empty"),
        ('{"prompt": 7, "answer": "2"}', "must be a non-empty string or list"),
        ('{"prompt": [{"role": "robot", "content": "x"}], "answer": "2"}', "unknown role"),
        ('{"prompt": [{"content": "x"}], "answer": "2"}', "message 0"),
        ('{"prompt": "1+1"}', "missing key 'answer'"),
        ("[1, 2]", "expected a JSON object"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok", "answer": "1"}) + "\n\n" + line + "\n")
    with pytest.raises(DataError, match=message) as err:
        load_rows(path)
    assert f"{path}:3:" in str(err.value)


def test_malformed_parquet_row_names_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}]),
        tmp_path / "p.parquet",
    )
    with pytest.raises(DataError, match=r"p\.parquet: row 1: the prompt is empty"):
        load_rows(tmp_path / "p.parquet")


@pytest.mark.parametrize(
    "make", ["missing", "corrupt_parquet", "not_a_dataset", "unknown_suffix", "empty"]
)
def test_unreadable_sources_fail_clearly(tmp_path, make):
    path = {
        "missing": tmp_path / "nope.jsonl",
        "corrupt_parquet": tmp_path / "x.parquet",
        "not_a_dataset": tmp_path / "dir",
        "unknown_suffix": tmp_path / "x.txt",
        "empty": tmp_path / "e.jsonl",
    }[make]
    if make == "corrupt_parquet":
        path.write_bytes(b"not parquet")
    elif make == "not_a_dataset":
        path.mkdir()
    elif make in ("unknown_suffix", "empty"):
        path.write_text("")
    with pytest.raises(DataError, match=str(path)):
        load_rows(path)


def test_cursor_resume_continues_exactly():
    rows = [{"prompt": str(i), "answer": str(i)} for i in range(10)]
    straight = PromptCursor(rows, seed=7)
    expected = [r["prompt"] for _ in range(7) for r in straight.next_batch(4)]  # crosses two epochs

    first = PromptCursor(rows, seed=7)
    got = [r["prompt"] for _ in range(3) for r in first.next_batch(4)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    resumed = PromptCursor(rows, seed=0)
    resumed.load_state_dict(state)
    got += [r["prompt"] for _ in range(4) for r in resumed.next_batch(4)]
    assert got == expected
    assert sorted(expected[:10]) == sorted(
        r["prompt"] for r in rows
    )  # an epoch covers every row once
    assert expected[:10] != expected[10:20]  # each epoch reshuffles


def test_load_split_uses_task_or_path(tmp_path):
    from trident.config import load_config

    cfg = load_config([], ["data.num_test=20"])
    rows = load_split(cfg.data, "test")
    assert len(rows) == 20 and all(r["task"] == "arithmetic" for r in rows)
    path = write_jsonl([{"prompt": "p", "answer": "a"}], tmp_path / "t.jsonl")
    cfg = load_config([], [f"data.test_path={path}"])
    assert load_split(cfg.data, "test") == [{"prompt": "p", "answer": "a"}]


GSM8K = [
    {"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = 12\n#### 12"},
    {"question": "A car costs 1,000 dollars ...", "answer": "It is 1,000.\n#### 1,000"},
]
MATH = [
    {
        "problem": "What is $\\frac{1}{2}+\\frac{1}{4}$?",
        "solution": "So $\\boxed{\\frac{3}{4}}$.",
        "level": "Level 2",
    },
    {"problem": "Find $x$ if $x^2=4$, $x>0$.", "solution": "$x = \\boxed{2}$", "level": "Level 1"},
]


def test_gsm8k_and_math_rows_load_with_their_reference_answers(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    gsm8k = load_rows(write_jsonl(GSM8K, tmp_path / "gsm8k.jsonl"))
    assert [(r["prompt"], r["answer"]) for r in gsm8k] == [
        (GSM8K[0]["question"], "12"),
        (GSM8K[1]["question"], "1,000"),
    ]
    assert gsm8k[0]["solution"] == GSM8K[0]["answer"]  # the worked solution is kept
    pq.write_table(pa.Table.from_pylist(MATH), tmp_path / "math.parquet")
    math = load_rows(tmp_path / "math.parquet")
    assert [(r["prompt"], r["answer"]) for r in math] == [
        (MATH[0]["problem"], "\\frac{3}{4}"),
        (MATH[1]["problem"], "2"),
    ]
    assert math[1]["level"] == "Level 1"  # other columns reach the reward functions


def test_rows_score_with_the_math_reward(tmp_path):
    from trident.rewards import RewardSum, resolve

    rows = load_rows(write_jsonl(GSM8K, tmp_path / "gsm8k.jsonl"))
    model = RewardSum([(resolve("math"), 1.0)], timeout_s=10.0)
    assert asyncio.run(model.score("... so 1000 dollars.", rows[1])) == (1.0, "ok")
    assert asyncio.run(model.score("\\boxed{13}", rows[0])) == (0.0, "ok")


def test_csv_chat_prompts_and_key_mappings(tmp_path):
    csv_path = tmp_path / "d.csv"
    csv_path.write_text('q,gold,extra\n"What is 2+2,\nexactly?",0042,x\n3+4,7,y\n')
    rows = load_rows(csv_path, "q", "gold")
    assert rows == [
        {"prompt": "What is 2+2,\nexactly?", "answer": "0042", "extra": "x"},  # text stays text
        {"prompt": "3+4", "answer": "7", "extra": "y"},
    ]
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1"}], "ref": "2"}]  # fmt: skip
    assert load_rows(write_jsonl(chat, tmp_path / "chat.jsonl"), "messages", "ref") == [
        {"prompt": chat[0]["messages"], "answer": "2"}
    ]
    no_answer = write_jsonl([{"prompt": "hi"}], tmp_path / "p.jsonl")
    assert load_rows(no_answer, answer_key=None) == [{"prompt": "hi"}]


def test_malformed_rows_name_their_file_and_line(tmp_path):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text(json.dumps(GSM8K[0]) + "\n\n" + json.dumps({"question": ""}) + "\n")
    with pytest.raises(DataError, match=rf"^{jsonl}:3: the prompt is empty"):
        load_rows(jsonl)
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text("prompt,answer\n1+1,2\n2+2,4,extra\n")
    with pytest.raises(DataError, match=rf"^{csv_path}:3: 2 columns in the header"):
        load_rows(csv_path)
    with pytest.raises(DataError, match=rf"^{csv_path}:2: missing key 'gold'"):
        load_rows(csv_path, answer_key="gold")


def test_hub_dataset_loads_or_fails_in_one_line():
    """A hub id loads with ``datasets.load_dataset`` when the hub is reachable; without network
    (this CI machine) it fails at once with one line naming it."""
    try:
        rows = load_rows("openai/gsm8k:main", split="test")
    except DataError as e:
        message = str(e)
        assert message.startswith("openai/gsm8k:main: not a local path, and the hub is unreachable")
        assert "\n" not in message
        return
    assert (
        len(rows) > 1000 and isinstance(rows[0]["answer"], str) and "####" not in rows[0]["answer"]
    )
