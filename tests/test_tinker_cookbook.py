"""tinker-cookbook against trident's training service (issue #51's acceptance): the warm-up model
``math_rl`` starts from, a journal replayed from the base model onto the served state bitwise,
and, through ``trident tinker serve``, the unmodified ``math_rl`` run with a rising reward, the
same run killed between a ``forward_backward`` and its ``optim_step`` (a fault point, not a
timer) and restarted, and an ``sl_loop``-style run killed mid-way ending on the uninterrupted
run's weights bitwise.

The recipe's pieces (warm-up, server process, recipe command, supervised client) are
``benchmarks/tinker_recipe.py``'s, which the service benchmark shares.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import uvicorn

from trident.config import load_config
from trident.tinker import wire
from trident.tinker.replay import replay, state_files
from trident.tinker.server import create_app
from trident.tinker.service import ServiceSettings, TinkerService
from trident.train.tinker_ops import local_trainer
from trident.weights.faults import fault_point

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import tinker_recipe as recipe  # noqa: E402

DETERMINISTIC = ["trainer.cpu_threads=1", "run.deterministic=true", "telemetry.progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def warm_model(tiny_model, tmp_path_factory) -> Path:
    """The acceptance run's warm-up (``recipe.WARM_UP``): minutes here."""
    return recipe.warm_model(tiny_model, tmp_path_factory.mktemp("warm"))


@pytest.fixture(scope="module")
def formatted_model(tiny_model, tmp_path_factory) -> Path:
    """A third of ``WARM_UP``, for the kill test at a CI price: what it needs is steps that carry
    gradients (groups whose rewards differ), not a good model. Not measured on its own: at 300
    steps every greedy answer was well-formed and 4 of 64 right."""
    return recipe.warm_model(tiny_model, tmp_path_factory.mktemp("formatted"), steps=100)


@pytest.mark.slow
def test_the_warm_model_answers_some_problems_right(warm_model):
    """The run's own problems (batches 0 on), greedy, scored by the cookbook's environment:
    some right, not all, so importance sampling has rewards to tell apart (measured: 4 of 64
    right, every answer well-formed; ``recipe.WARM_UP``)."""
    score = recipe.greedy_reward(warm_model, n=64)
    print(f"warm model on math_rl's first 64 problems, greedy: {score}")
    assert 1 / 64 <= score["correct"] <= 0.8, score
    assert score["format"] >= 0.5, score  # it stops where the recipe's sampler stops


def test_a_fault_point_fires_on_the_nth_time_it_is_reached(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIDENT_FAULT_DIR", str(tmp_path))
    (tmp_path / recipe.FAULT).write_text("3")
    fired = []

    def watch() -> None:  # the test's side: see the hit, "kill", let it go on
        while not (tmp_path / f"{recipe.FAULT}.hit").exists():
            time.sleep(0.01)
        fired.append(len(reached))
        (tmp_path / f"{recipe.FAULT}.hit").unlink()

    reached: list[int] = []
    watcher = threading.Thread(target=watch)
    watcher.start()
    for k in range(5):
        reached.append(k)
        fault_point(recipe.FAULT, ["m"])
    watcher.join(10)
    assert fired == [3] and not (tmp_path / recipe.FAULT).exists()


# -- the journal replayed: in this process, through the real SDK and HTTP app ----------------


def serve_in_thread(service: TinkerService, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    """The app over ``service`` under uvicorn in a thread (its lifespan starts the service and
    closes it when the server stops)."""
    app = create_app(service, load_config([], []).tinker)
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return server, thread


def test_replaying_the_journal_from_the_base_model_gives_the_served_state_bitwise(
    tiny_model, tmp_path
):
    """An ``sl_loop``-style client (LoRA, cross_entropy, three steps, ``save_state``) against the
    journaled service on trident's trainer; the model's journal replayed onto a fresh trainer
    from the base model saves the same weights, Adam moments and RNG, file for file."""
    cfg = load_config([], [f"model.path={tiny_model}", *DETERMINISTIC])
    make = functools.partial(local_trainer, cfg=cfg)

    def decode(kind: str, body: bytes):
        return wire.decode_call(kind, body, lora_alpha=cfg.tinker.lora_alpha).args

    state = tmp_path / "state"
    before = torch.are_deterministic_algorithms_enabled()
    try:
        service = TinkerService(ServiceSettings(state_dir=state), make, decode)
        server, thread = serve_in_thread(service, port := free_port())
        try:
            saved = recipe.supervised_loop(f"http://127.0.0.1:{port}", tiny_model, steps=3)
        finally:
            server.should_exit = True
            thread.join(60)
        model_id, _, name = saved.removeprefix("tinker://").rpartition("/weights/")
        served = next((state / "models").iterdir()) / "weights" / name / "trainer"
        replayed = asyncio.run(replay(state, model_id, make, decode))
        out = tmp_path / "replayed"
        asyncio.run(replayed.save_state(str(out)))
        asyncio.run(replayed.close())
        assert state_files(out) == state_files(served)
        assert len(state_files(out)) > 1
    finally:  # run.deterministic switched torch's kernels process-wide
        torch.use_deterministic_algorithms(before)


# -- through `trident tinker serve` -----------------------------------------------------------


def serve_command_exists() -> bool:
    proc = subprocess.run(
        [sys.executable, "-m", "trident.cli", "tinker", "serve", "--help"],
        capture_output=True, cwd=REPO,
    )  # fmt: skip
    return proc.returncode == 0


def served_as_itself(path: str | Path) -> dict[str, str]:
    """The ``tinker.models`` map under which a recipe's ``model_name=<local dir>`` is served."""
    return {str(path): str(path)}


needs_serve = pytest.mark.skipif(
    not serve_command_exists(), reason="`trident tinker serve` is not on this branch yet"
)


class Supervisor:
    """Restarts a killed ``trident tinker serve`` on the same state directory: sees the fault
    point's hit file, SIGKILLs the server's process group there, starts it again."""

    def __init__(self, served: recipe.Served, fault_dir: Path) -> None:
        self.served, self.hit = served, fault_dir / f"{recipe.FAULT}.hit"
        self.restarts = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self.done.is_set():
            if self.hit.exists():
                self.served.kill()
                self.hit.unlink()
                self.served.start()
                self.restarts += 1
            time.sleep(0.05)


@needs_serve
@pytest.mark.slow
def test_math_rl_runs_unmodified_and_its_reward_rises(warm_model, tmp_path):
    served = recipe.Served(
        tmp_path / "state", free_port(), served_as_itself(warm_model), tmp_path / "serve.log"
    )
    served.start()
    try:
        log = tmp_path / "math_rl"
        cmd = recipe.math_rl_command(served.url, warm_model, log, steps=8)
        proc = subprocess.run(cmd, env=recipe.client_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        served.stop()
    rewards = [m[recipe.REWARD_KEY] for m in recipe.logged_metrics(log)]
    print(f"math_rl reward per step: {rewards}")
    assert len(rewards) == 8
    half = len(rewards) // 2
    assert sum(rewards[half:]) / half > sum(rewards[:half]) / half, rewards


@needs_serve
def test_math_rl_killed_between_forward_backward_and_optim_step_applies_each_seq_once(
    formatted_model, tmp_path
):
    """The recipe's server is killed (SIGKILL, its whole process group) when step 2's
    ``forward_backward`` has run and its ``optim_step`` has not, and restarted; the recipe
    finishes on the SDK's retries, and the journal replayed from the base model gives the
    server's final saved state bitwise."""
    faults, state = tmp_path / "faults", tmp_path / "state"
    faults.mkdir()
    (faults / recipe.FAULT).write_text("2")
    served = recipe.Served(
        state, free_port(), served_as_itself(formatted_model), tmp_path / "serve.log", faults
    )
    served.start()
    supervisor = Supervisor(served, faults)
    supervisor.thread.start()
    try:
        log = tmp_path / "math_rl"
        cmd = recipe.math_rl_command(served.url, formatted_model, log, steps=4)
        proc = subprocess.run(cmd, env=recipe.client_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        supervisor.done.set()
        supervisor.thread.join(10)
        served.stop()
    assert supervisor.restarts == 1 and not (faults / recipe.FAULT).exists()
    assert len(recipe.logged_metrics(log)) == 4
    check_replay(state, Path(formatted_model))


def check_replay(state: Path, base: Path) -> None:
    """Every seq of the journal's one trained model applied once, and its replay from the base
    model equal to its final save, file for file."""
    from trident.tinker.journal import Journal

    journal = Journal(state / "journal.log")
    ops = sorted(journal.ops.values(), key=lambda o: (o.model_id, o.seq_id))
    journal.close()
    (model_id,) = {o.model_id for o in ops}
    assert [o.seq_id for o in ops] == list(range(len(ops)))  # each seq journaled once
    cfg = load_config([], [f"model.path={base}", *DETERMINISTIC])
    make = functools.partial(local_trainer, cfg=cfg)

    def decode(kind: str, body: bytes):
        return wire.decode_call(kind, body, lora_alpha=cfg.tinker.lora_alpha).args

    before = torch.are_deterministic_algorithms_enabled()
    try:
        replayed = asyncio.run(replay(state, model_id, make, decode))
        out = state.parent / "replayed"
        asyncio.run(replayed.save_state(str(out)))
        asyncio.run(replayed.close())
    finally:
        torch.use_deterministic_algorithms(before)
    final = next((state / "models").iterdir()) / "weights" / "final" / "trainer"
    assert state_files(out) == state_files(final)


@needs_serve
def test_a_supervised_run_killed_mid_way_ends_on_the_uninterrupted_weights(tiny_model, tmp_path):
    def run(name: str, kill_at: int | None) -> dict[str, bytes]:
        faults, state = tmp_path / name / "faults", tmp_path / name / "state"
        faults.mkdir(parents=True)
        if kill_at is not None:
            (faults / recipe.FAULT).write_text(str(kill_at))
        served = recipe.Served(
            state, free_port(), served_as_itself(tiny_model), tmp_path / name / "serve.log", faults
        )
        served.start()
        supervisor = Supervisor(served, faults)
        supervisor.thread.start()
        try:
            saved = recipe.supervised_loop(served.url, tiny_model, steps=4)
        finally:
            supervisor.done.set()
            supervisor.thread.join(10)
            served.stop()
        assert supervisor.restarts == (kill_at is not None)
        name_ = saved.rpartition("/weights/")[2]
        return state_files(next((state / "models").iterdir()) / "weights" / name_ / "trainer")

    clean, killed = run("clean", None), run("killed", 3)
    assert killed == clean and len(clean) > 1
