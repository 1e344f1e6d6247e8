import socket

from tests.conftest import run_cli


def _one_line_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ")
    for fragment in fragments:
        assert fragment in last, last


def test_help_lists_working_commands():
    r = run_cli("--help", timeout=60)
    assert r.returncode == 0
    for command in ("model", "sft", "eval"):
        assert command in r.stdout
    for command in ("sft", "eval"):
        r = run_cli(command, "--help", timeout=60)
        assert r.returncode == 0 and "--dry-run" in r.stdout and "KEY=VALUE" in r.stdout


def test_missing_model_path(tmp_path):
    r = run_cli("sft", "model.path=/no/such/model", f"run.dir={tmp_path}", timeout=120)
    _one_line_error(r, "/no/such/model", "trident model init")


def test_unreadable_dataset(tiny_model, tmp_path):
    r = run_cli(
        "sft",
        f"model.path={tiny_model}",
        "data.train_path=/no/such/data.jsonl",
        f"run.dir={tmp_path}",
        timeout=120,
    )
    _one_line_error(r, "/no/such/data.jsonl", "no such file")


def test_port_in_use(tiny_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli(
            "eval",
            f"model.path={tiny_model}",
            f"rollout.base_port={port}",
            f"run.dir={tmp_path}",
            timeout=180,
        )
    _one_line_error(r, f"port {port}", "in use")


def test_model_init_command(tmp_path):
    r = run_cli("model", "init", "--preset", "tiny", str(tmp_path / "m"), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "M parameters" in r.stdout
    assert (tmp_path / "m" / "config.json").is_file() and (
        tmp_path / "m" / "tokenizer.json"
    ).is_file()


def test_a_run_that_does_not_fit_the_cluster_fails_in_seconds(tiny_model, tmp_path):
    # 200 servers each asking for half a CPU of a local Ray instance that has a few
    r = run_cli(
        "train", f"model.path={tiny_model}", f"run.dir={tmp_path}", "rollout.num_servers=200",
        "cluster.num_cpus=4", "telemetry.progress=false", timeout=120,
    )  # fmt: skip
    _one_line_error(r, "does not fit", "200 rollout servers", "CPU needed", "4 in the cluster")


def test_flags_may_come_between_overrides(tmp_path):
    r = run_cli("train", "--dry-run", "rollout.n=3", "--resume", f"run.dir={tmp_path}", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "n: 3" in r.stderr and "resume: auto" in r.stderr
    bad = run_cli("train", "--dry-run", "rollout.n=3", "--no-such-flag", timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr


def test_a_run_directory_that_holds_a_run_is_refused_before_ray_starts(tiny_model, tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text('{"step": 0}\n')
    r = run_cli(
        "train", f"model.path={tiny_model}", f"run.dir={tmp_path}", "run.name=r", timeout=60
    )  # fmt: skip
    _one_line_error(r, "already holds a run", "--resume", "run.overwrite=true")
    assert "Ray" not in r.stderr  # refused before Ray (which starts while the pipeline imports)
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["metrics.jsonl"]


def test_every_expected_error_is_a_class_of_the_module_named_for_it():
    """The one-line errors are looked up by module (so the handler imports nothing): each name
    must be an exception class defined in that module, or it would never print one line."""
    import importlib

    from trident.cli.main import _EXPECTED_ERRORS

    for module, names in _EXPECTED_ERRORS.items():
        for name in names:
            cls = getattr(importlib.import_module(module), name)
            assert issubclass(cls, BaseException) and cls.__module__ == module, (module, name)
