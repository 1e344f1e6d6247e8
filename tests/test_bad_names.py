"""A misspelt task or a model path that is neither a directory nor a hub id fails at once, in
one line, before anything starts (through the real CLI)."""

from tests.conftest import run_cli


def _last_line(r) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_unknown_task_fails_at_config_time_with_a_suggestion():
    last = _last_line(run_cli("train", "data.task=bogus", "--dry-run", timeout=120))
    assert last.startswith("error: invalid config: data.task: unknown task 'bogus'")
    assert "reasoning_gym:NAME" in last and "trident data list" in last
    last = _last_line(run_cli("train", "data.task=arithmetc", "--dry-run", timeout=120))
    assert "did you mean 'arithmetic'?" in last


def test_missing_relative_model_path_is_one_line(tmp_path):
    """``runs/x`` looks like a hub id; offline it used to end in a transformers traceback about
    the internet connection, after the config was printed and saved."""
    r = run_cli("train", "model.path=runs/x", f"run.dir={tmp_path}", timeout=120, cwd=tmp_path)
    last = _last_line(r)
    assert last.startswith("error: runs/x: neither a local directory nor a reachable hub id")
    assert not (tmp_path / "trident").exists()  # nothing started, nothing written


def test_unknown_reward_fails_at_config_time_with_a_suggestion():
    last = _last_line(run_cli("train", "reward.fns=[{name: mth}]", "--dry-run", timeout=120))
    assert "reward.fns.0.name: unknown reward 'mth'; did you mean 'math'?" in last
