"""The engine-free paths run where neither Ray nor vLLM is installed (a GPU machine's image):
`trident model init`, `trident sft`, the trainer rank's modules, checkpoints and the CLI's error
handling. Each runs in a subprocess whose path finder refuses both packages
(tests/without_engines/sitecustomize.py), and a bad input there still gets its own one-line error,
not "No module named 'ray'"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

WITHOUT_ENGINES = REPO / "tests" / "without_engines"

# What a trainer measured alone imports: the rank, its FSDP2 wrapping and checkpoints, SFT, the
# model factory, the run directory's checkpoints, and the CLI with its error handler.
ENGINE_FREE_MODULES = (
    "trident.cli",
    "trident.train.policy",
    "trident.train.fsdp",
    "trident.train.lora",
    "trident.train.sft",
    "trident.models.factory",
    "trident.pipeline.checkpoint",
    "trident.weights.buckets",
    "trident.weights.shm",
    "trident.weights.vllm_plugin",
    "trident.cluster.net",
)


def without_engines_env() -> dict[str, str]:
    """The environment of a process (and its children) that cannot import ray or vllm."""
    path = os.pathsep.join([str(WITHOUT_ENGINES), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep)}


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=without_engines_env(),
    )


def _cli(*args: str) -> subprocess.CompletedProcess:
    return _run("-m", "trident.cli", *args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("engine_free") / "tiny"
    r = _cli("model", "init", str(out), "--preset", "tiny")
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def test_the_engines_are_refused_and_the_trainer_modules_import_without_them():
    code = f"""
import importlib, importlib.util, json, sys
refused = {{}}
for name in ("ray", "vllm"):
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        refused[name] = e.name == name and importlib.util.find_spec(name) is None
for module in {ENGINE_FREE_MODULES!r}:
    importlib.import_module(module)
engines = sorted(m for m in sys.modules if m.partition(".")[0] in ("ray", "vllm"))
print(json.dumps({{"refused": refused, "engines": engines}}))
"""
    r = _run("-c", code, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["refused"] == {"ray": True, "vllm": True}  # the condition holds, not vacuous
    assert seen["engines"] == []


def test_model_init_sft_and_eval_dry_run_run_without_the_engines(tiny, tmp_path):
    assert (tiny / "config.json").is_file()  # trident model init, under the same condition
    r = _cli(
        "sft",
        f"model.path={tiny}",
        f"run.dir={tmp_path}",
        "run.name=sft",
        "sft.steps=2",
        "sft.batch_size=8",
        "telemetry.progress=false",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "sft" / "sft_metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 2
    r = _cli("eval", f"model.path={tiny}", f"run.dir={tmp_path}", "--dry-run")  # before vLLM
    assert r.returncode == 0 and "model:" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("sft", "model.path=/no/such/model"), "/no/such/model: no such model directory"),
        (("eval", "model.path=/no/such/model"), "/no/such/model: no such model directory"),
        (("sft", "{tiny}", "sft.stepz=2"), "did you mean sft.steps?"),
        (("sft", "{tiny}", "data.train_path=/no/such.jsonl"), "/no/such.jsonl: no such file"),
    ],
)
def test_a_bad_input_gets_its_own_one_line_error_without_the_engines(
    tiny, tmp_path, args, fragment
):
    args = tuple(a.format(tiny=f"model.path={tiny}") for a in args)
    r = _cli(*args, f"run.dir={tmp_path}")
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and "No module named" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, last
