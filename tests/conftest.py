"""Shared fixtures: one tiny checkpoint and one SFT-warmed checkpoint per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from trident.models.factory import init_model

    return str(init_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=0))


def _sft(tiny_model: str, run_dir: Path, *overrides: str) -> str:
    from trident.config import load_config
    from trident.train.sft import run_sft

    base = [f"model.path={tiny_model}", f"run.dir={run_dir}", "run.name=sft", "sft.steps=300"]
    base += ["trainer.cpu_threads=1", "telemetry.progress=false"]
    return str(run_sft(load_config([], [*base, *overrides])))


@pytest.fixture(scope="session")
def sft_model(tiny_model, tmp_path_factory) -> str:
    """The tiny model warmed up with SFT on 2-digit addition, answering in the required format."""
    return _sft(tiny_model, tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="session")
def sft_mixed_model(tiny_model, tmp_path_factory) -> str:
    """Warmed up on answers in two styles, only one of which the verifier accepts: the RL
    starting point of the end-to-end tests (reward has somewhere to go within a few steps)."""
    return _sft(
        tiny_model,
        tmp_path_factory.mktemp("sft_mixed"),
        "sft.answer_formats=['Answer: {answer}', '= {answer}']",
    )


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
