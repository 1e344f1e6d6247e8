"""Qwen2.5-0.5B's architecture (vocabulary 151,936) trains on this machine, full and LoRA:
``benchmarks/real_shapes.py --steps 1``, everything at once in the machine's memory (slow: two
0.5B runs, ~5 min on 2 cores)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_a_half_billion_model_trains_full_and_lora_on_this_machine(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "benchmarks/real_shapes.py", "--steps", "1", "--out-dir", str(out)]
    cmd += ["--work", str(tmp_path / "work")]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3000)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads((out / "real_shapes.json").read_text())
    runs = {run["name"]: run for run in result["runs"]}
    for run in runs.values():
        assert run["steps"] == 1
        dlogp = run["sync_max_abs_dlogp"]  # every sync verified, within sync.tolerance
        assert dlogp is not None and dlogp < 2e-3
    assert runs["lora"]["optimizer_state_gib"] < 0.05 * runs["full"]["optimizer_state_gib"]
    assert runs["lora"]["sync_gb"] < 0.05 * runs["full"]["sync_gb"]  # the adapters alone
    for row in result["logprob_memory"]:
        if row["tokens"] >= 4096:
            assert row["chunked_gib"] <= row["grid_gib"] / 4
