import json

import pytest

from trident.data.loaders import DataError, PromptCursor, load_rows, load_split, write_jsonl
from trident.data.tasks import TASKS, Arithmetic, Countdown, generate_split, safe_eval_expression


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
        assert task.verify(task.solution(row), row) == 1.0
        assert task.verify("no answer here", row) == 0.0
        if name != "code":
            assert task.verify(task.solution(row).replace("Answer:", "Result:"), row) == 0.0


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
        "unknown_suffix": tmp_path / "x.csv",
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
