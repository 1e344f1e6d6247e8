"""Shared fixtures, built once per test session: the tiny checkpoint, the demo's SFT warm-up of
it and a better checkpoint to distil from."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:  # the marker, not a keyword: a directory named gpu is a keyword too
            if item.get_closest_marker("gpu") is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from trident.models.factory import init_model

    return str(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))


DEMO = REPO / "configs" / "demo.yaml"  # the demo's tiny task: warm-up, then 30 GRPO steps


def _sft(model: str, run_dir: Path, *overrides: str, configs: tuple[Path, ...] = ()) -> str:
    from trident.config import load_config
    from trident.train.sft import run_sft

    # every core (trainer.cpu_threads=0, auto): ~20% faster than one thread here, and the same
    # checkpoint byte for byte (checked: the demo's config, and 384-token browser demonstrations)
    base = [f"model.path={model}", f"run.dir={run_dir}", "run.name=sft", "telemetry.progress=false"]
    cache = os.environ.get("TRIDENT_TEST_CACHE")
    if not cache:
        return str(run_sft(load_config(list(configs), [*base, *overrides])))
    # A developer's cache across pytest sessions (CI sets none): the warm-ups take minutes, and
    # the same inputs (the base weights, the configs' text, the overrides, the code of trident's
    # training, data and models) give the same checkpoint, so it is keyed by their hash.
    key = hashlib.sha256("\0".join(overrides).encode())
    code = [p for d in ("train", "data", "models") for p in (REPO / "trident" / d).glob("*.py")]
    for path in [*sorted(Path(model).iterdir()), *map(Path, configs), *sorted(code)]:
        key.update(path.name.encode() + path.read_bytes())
    kept = Path(cache) / key.hexdigest()[:16]
    if not (kept / "config.json").exists():
        made = run_sft(load_config(list(configs), [*base, *overrides]))
        scratch = Path(cache) / f"{kept.name}.{os.getpid()}"
        shutil.copytree(made, scratch)
        try:
            scratch.rename(kept)
        except OSError:  # another session kept the same checkpoint first
            shutil.rmtree(scratch)
    return str(kept)


STEP0_MEAN_ABS_DLOGP = 1e-4  # as in test_rl_e2e: measured ~1e-7 (same float32 weights)


def train_on_env(
    tiny_model: str, out: Path, env: str, data_kwargs: dict, sft: list[str], overrides: list[str]
) -> tuple[Any, list[dict]]:
    """An environment's end-to-end run: SFT of the tiny model on 64 of the env's demonstrations
    (``data_kwargs``: the generator's options; ``sft``: more SFT settings), then two GRPO steps
    through ``trident train`` on the same generator (``overrides``); (config, metrics)."""
    from trident.config import load_config
    from trident.data.loaders import write_jsonl
    from trident.envs import env_rows
    from trident.pipeline.run import run_train
    from trident.telemetry.metrics import read_metrics

    demos = write_jsonl(env_rows(env, 64, "train", 0, False, **data_kwargs), out / "d.jsonl")
    warm_up = ["sft.batch_size=8", "sft.lr=4e-3", "sft.warmup_steps=5", *sft]
    model = _sft(
        tiny_model, out, "data.task=", f"data.train_path={demos}", "data.answer_key=", *warm_up
    )
    cfg = load_config(
        [],
        [
            f"model.path={model}",
            f"run.dir={out}",
            "run.name=rl",
            f"env.name={env}",
            f"env.data_kwargs={json.dumps(data_kwargs)}",
            "data.num_train=64",
            "data.num_test=16",
            "env.show_tools=false",
            "rollout.max_tokens=64",
            "rollout.max_model_len=1024",
            "pipeline.steps=2",
            "rollout.n=4",
            "trainer.lr=1e-4",
            "trainer.cpu_threads=1",
            # two steps from a warm-up whose groups may all score alike (a fresh clone's terminal
            # environment run did): train every trajectory, whose ratio check_env_steps reads
            "trainer.skip_zero_advantage=false",
            "eval.before_after=false",
            "telemetry.progress=false",
            "telemetry.tensorboard=false",
            *overrides,
        ],
    )
    run_train(cfg)
    return cfg, read_metrics(cfg.derived.run_dir)


def check_env_steps(cfg: Any, metrics: list[dict], samples_per_step: int) -> None:
    """What every environment's two steps must show: versions 1, 2; step-0 logprobs of the engine
    equal the trainer's under the loss mask (ratio 1); every sync verified; no infrastructure
    error; every sample accounted for; tool calls made."""
    assert [m["version"] for m in metrics] == [1, 2]
    assert metrics[0]["mismatch_abs_logp_diff_mean"] < STEP0_MEAN_ABS_DLOGP
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    for m in metrics:
        assert m["sync/max_abs_dlogp"] <= cfg.sync.tolerance
        assert m["infra_errors"] == 0
        assert m["trained_samples"] + m["untrainable_samples"] == samples_per_step
        assert m["agent/tool_calls_per_trajectory"] > 0


@pytest.fixture(scope="session")
def demo_sft_model(tiny_model, tmp_path_factory) -> str:
    """The demo's warm-up (configs/demo.yaml, 1000 steps) at the SFT rate the RL learning tests'
    thresholds were measured from, 4e-3 (the demo now uses 1e-3): the answers come in three
    styles and the verifier accepts only ``Answer: N``, so greedy accuracy starts at 23-49%
    (by host) and RL has accuracy to raise: the starting point of the RL learning tests. From the
    demo's own 1e-3 warm-up (40.5% greedy, pass@4 82%), the GRPO test's 20 constant-rate steps of
    16 prompts raised the format but not accuracy (0.36 -> 0.41 training) and distillation at lr
    5e-4 diverged (distill KL 1.05 -> 2.09): those recipes are tuned to this starting point."""
    return _sft(tiny_model, tmp_path_factory.mktemp("demo_sft"), "sft.lr=4e-3", configs=(DEMO,))


@pytest.fixture(scope="session")
def teacher_model(demo_sft_model, tmp_path_factory) -> str:
    """A better checkpoint for distillation: ``demo_sft_model`` plus 150 SFT steps in the
    required style only (greedy accuracy 100%, measured)."""
    return _sft(
        demo_sft_model,
        tmp_path_factory.mktemp("teacher"),
        "sft.steps=150",
        "sft.lr=1e-3",
        "sft.warmup_steps=5",
    )


@pytest.fixture(scope="session")
def demo_server(demo_sft_model, tmp_path_factory) -> Iterator[str]:
    """The URL of one vLLM server of ``demo_sft_model`` (``rollout_server``) for the whole
    session. Runs whose point is not the server's own life (learning, resume, rewards) attach
    to it with ``rollout.server_urls``, which saves each a server start-up (about 40 s). A run
    installs its own weights on the servers before its first request (``RunHarness.begin``), so
    what one run leaves on the server does not reach the next."""
    tag = uuid.uuid4().hex
    with rollout_server(demo_sft_model, tmp_path_factory.mktemp("demo_server"), tag) as url:
        yield url


def mask_spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1s in a loss mask: one per trained model turn."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def run_cli(
    *args: str, timeout: float = 600, cwd: str | Path | None = None
) -> subprocess.CompletedProcess:
    """Run the installed ``trident`` command the way a user does."""
    return subprocess.run(
        [sys.executable, "-m", "trident.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
    )


def tagged_processes(tag: str) -> set[int]:
    """Processes whose environment carries ``TRIDENT_TEST_TAG=tag``: the run's own driver, Ray
    processes, trainer actors and vLLM servers all inherit it; nothing else on the machine has it."""
    needle = f"TRIDENT_TEST_TAG={tag}".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":  # zombies hold no resources; pid 1 reaps them in its own time
                    pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def cmdline(pid: int) -> str:
    """``pid``'s command line, words joined by spaces; "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int | None:
    """``pid``'s parent, None once ``pid`` is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def process_table(tag: str) -> str:
    """The run's processes, one per line (pid, parent, command line): what a failing test
    prints so that a process it did not find explains itself."""
    return "\n".join(
        f"{p} <- {parent(p)}: {cmdline(p)[:160]}" for p in sorted(tagged_processes(tag))
    )


def engine_core(tag: str, run_dir: Path, port: int | None = None, timeout: float = 60) -> int:
    """The engine core of a run's (``run.name=r``) vLLM server on ``port`` (None: the only one),
    by the pid vLLM logs it under: the last ``(EngineCore pid=N)`` of the server's log (which a
    restarted server appends to), once that process is alive. Looked up by title and parent in
    ``/proc`` instead, it went unfound twice in full-suite runs, never alone. Waits for a server
    being restarted (its API server imports for ~20 s first); past ``timeout`` the failure
    lists every process of the run and the servers' log tails."""
    deadline = time.monotonic() + timeout
    while True:
        for log in run_dir.glob("r/logs/vllm_server_*.log"):
            text = log.read_text(errors="replace")
            if port is not None and f"'port': {port}," not in text:
                continue
            cores = re.findall(r"^\(EngineCore pid=(\d+)\)", text, re.M)
            if cores and cmdline(int(cores[-1])):  # "" once it is gone (or a zombie)
                return int(cores[-1])
        if time.monotonic() > deadline:
            from trident.rollout.vllm_server import log_tail

            logs = "\n".join(
                f"--- {log.name}\n{log_tail(log, 15)}"
                for log in sorted(run_dir.glob("r/logs/*.log"))
            )
            raise AssertionError(
                f"no live engine core in the log of the server on port {port}; the run's "
                f"processes:\n{process_table(tag)}\n{logs}"
            )
        time.sleep(0.5)


def wait_gone(tag: str, timeout: float = 60) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not tagged_processes(tag):
            return set()
        time.sleep(1)
    return tagged_processes(tag)


def tagged_env(tag: str) -> dict[str, str]:
    """The environment for a subprocess whose processes ``tagged_processes(tag)`` finds."""
    return {**os.environ, "TRIDENT_TEST_TAG": tag}


def start_until(
    cmd: list[str], tag: str, ready: Callable[[], bool], timeout: float = 600, poll: float = 0.2
) -> subprocess.Popen:
    """Start ``cmd`` (tagged, output captured) and return it once ``ready()`` (asked every
    ``poll`` seconds); a process that exits or takes longer first fails the test with its
    output."""
    proc = subprocess.Popen(
        cmd, env=tagged_env(tag), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=REPO,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError((proc.communicate()[0] or "")[-3000:] or "not ready in time")
        time.sleep(poll)
    return proc


class Run:
    """``trident train`` in a subprocess (tagged, see ``tagged_processes``), its output in a file
    (a pipe nobody reads while the test waits would fill up and stall the run)."""

    def __init__(self, cmd: list[str], tag: str, run_dir: Path) -> None:
        self.out_path = run_dir / "output.txt"
        with self.out_path.open("w") as out:
            self.proc = subprocess.Popen(
                cmd, env=tagged_env(tag), stdout=out, stderr=subprocess.STDOUT, cwd=REPO
            )

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_for(self, ready, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(self.output[-3000:] or "not ready in time")
            time.sleep(0.2)

    def finish(self, timeout: float = 600) -> str:
        """Wait for the run to end and return its output. Called from a test's ``finally``
        while the test is failing, it kills the run at once instead (a failed check must not
        wait for a run of hundreds of steps)."""
        if sys.exc_info()[1] is not None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # its output says where it is (stacks after SIGTERM)
            raise AssertionError(f"not ended in {timeout} s: {self.output[-6000:]}") from None
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.output


@contextmanager
def rollout_server(model: str, run_dir: Path, tag: str, nice: int = 0) -> Iterator[str]:
    """``trident rollout serve`` of ``model`` in its own (tagged) process, as a user starts one
    for attach mode; yields its URL, and stops it with SIGTERM on exit. Tests
    whose runs need nothing of a server of their own share one this way, which saves each run
    the server's start-up (about 40 s on 2 cores). ``nice``: the server's scheduling niceness
    (its vLLM processes inherit it)."""
    serve = [
        *(["nice", "-n", str(nice)] if nice else []), sys.executable, "-m", "trident.cli",
        "rollout", "serve", f"model.path={model}", f"run.dir={run_dir}", "run.name=server",
    ]  # fmt: skip
    server = Run(serve, tag, run_dir)
    try:
        server.wait_for(lambda: "serving at " in server.output)
        match = re.search(r"rollout\.server_urls=\[(\S+)\]", server.output)
        assert match, server.output[-3000:]
        yield match.group(1)
        assert server.proc.poll() is None, server.output[-3000:]  # it outlived every run
        server.proc.send_signal(signal.SIGTERM)
    finally:
        server.finish(timeout=120)
    assert server.proc.returncode == 143, server.output[-3000:]  # a clean stop on SIGTERM
    assert wait_gone(tag) == set()  # the vLLM processes went with it


SHORT_RUN_STEPS = 3


@pytest.fixture(scope="session")
def short_run(tiny_model, tmp_path_factory) -> Path:
    """``trident train`` of the tiny model, as a user runs it: 3 steps of 2 prompts x 4, with
    every installed tracker on (W&B in offline mode, MLflow on a ``file:`` store under the run's
    parent directory), so the report tests and the tracker tests read one real run."""
    import importlib.util

    runs = tmp_path_factory.mktemp("short_runs")
    trackers = []
    if importlib.util.find_spec("wandb") is not None:
        trackers.append("telemetry.wandb_project=trident-test")
    if importlib.util.find_spec("mlflow") is not None:
        trackers.append(f"telemetry.mlflow_uri=file:{runs / 'mlruns'}")
    with pytest.MonkeyPatch.context() as env:  # the run's process inherits these
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_SILENT", "true")
        # MLflow 3 refuses the file store unless asked (it wants a database backend, which
        # needs SQLAlchemy: the full `mlflow` package, not mlflow-skinny)
        env.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        r = run_cli(
            "train",
            f"model.path={tiny_model}",
            f"run.dir={runs}",
            "run.name=short",
            f"pipeline.steps={SHORT_RUN_STEPS}",
            "pipeline.prompts_per_step=2",
            "rollout.n=4",
            "eval.max_prompts=8",
            "eval.samples=2",
            "eval.pass_k=2",
            "trainer.cpu_threads=1",
            # the tiny model as initialised earns no reward: every advantage is 0, and skipping
            # those samples would leave the steps' token means (entropy) without a token
            "trainer.skip_zero_advantage=false",
            "telemetry.progress=false",
            *trackers,
            timeout=900,
        )
    assert r.returncode == 0, r.stderr[-3000:]
    return runs / "short"
