"""``scripts/gpu_trainer_check.py --smoke``: the GPU trainer check's every part on tiny shapes in
float32 on CPU, with ray and vllm unimportable as on the GPU machine: each case has finite
figures, trident's cases agree on the first step's loss and gradient norm (the floors on the
gradient norm: the same gradient in plain PyTorch), the deterministic case passes, the
checkpoint round trip is bit-equal and the weight stream reads back with its checksums."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.conftest import REPO
from tests.test_engine_free import without_engines_env

FIGURES = ("step_s", "tokens_per_s", "mfu", "hfu", "loss", "grad_norm", "model_flops")


def test_the_smoke_run_measures_every_case_and_the_round_trip_is_bit_equal(tmp_path):
    script = REPO / "scripts" / "gpu_trainer_check.py"
    r = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=without_engines_env(),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| shape | case |" in r.stdout.strip().split("\n\n")[-2]  # the table comes last
    result = json.loads((tmp_path / "gpu_trainer_check.json").read_text())
    cases = {(row["shape"], row["case"]): row for row in result["cases"]}
    first, second = result["shapes"]
    expected = {
        (first, name)
        for name in ("padded", "packed", "shared prompts", "packed + AC", "LoRA r16, packed",
                     "padded, run.deterministic", "floor, padded", "floor, packed")
    } | {(second, "LoRA r16, packed + AC")}  # fmt: skip
    assert set(cases) == expected
    for key, row in cases.items():
        assert "error" not in row, (key, row["error"])
        for figure in FIGURES:
            assert math.isfinite(row[figure]) and row[figure] != 0, (key, figure, row[figure])
    agreeing = [row for row in cases.values() if not row["case"].startswith("LoRA")]
    assert all(row["agrees"] is True for row in agreeing)
    # run.deterministic set cuBLAS's fixed workspace, which CUDA's deterministic mode requires
    deterministic = cases[(first, "padded, run.deterministic")]
    assert deterministic["cublas_workspace_config"] in (":4096:8", ":16:8")
    assert result["matmul_peak"]["tflops"] > 0
    once = result["once"]
    assert once["round_trip"]["params_bit_equal"] and once["round_trip"]["moments_bit_equal"]
    assert once["round_trip"]["next_step_bit_equal"]
    assert once["stream"]["checksums_equal"] and once["stream"]["gb"] > 0
    assert "skipped" in once["ipc"]  # CUDA IPC needs a GPU
    assert result["sft"]["returncode"] == 0 and result["sft"]["steps"] == 2
    assert all(
        row["grid_tracked_gib"] > row["chunked_tracked_gib"] for row in result["logprob_memory"]
    )


def test_flops_are_counted_as_the_check_states():
    """Qwen2.5-0.5B: N = 24 layers x (2·896² + 2·896·128 + 3·896·4864) + 151,936·896 (the tied
    head once) = 494 M; one 1,024-token sample costs 6·N·T + 6·L·d·T² (causal attention), LoRA
    4·N·T + the same attention, and activation checkpointing's HFU adds a forward."""
    sys.path.insert(0, str(REPO / "scripts"))
    import trainer_check_parts as parts

    from trident.models.factory import LIKE, hf_config

    config = hf_config(LIKE["qwen2.5-0.5b"])
    n = 24 * (2 * 896**2 + 2 * 896 * 128 + 3 * 896 * 4864) + 151_936 * 896
    assert parts.matmul_parameters(config) == n == 493_961_216
    attention = 6 * 24 * 896 * 1024**2
    full = parts.step_flops(config, [1024], chunked_head=False)
    assert full["model_flops"] == full["hardware_flops"] == 6 * n * 1024 + attention
    lora = parts.step_flops(config, [1024], lora=True, ac=True, chunked_head=False)
    assert lora["model_flops"] == 4 * n * 1024 + attention
    assert lora["hardware_flops"] == lora["model_flops"] + 2 * n * 1024 + attention / 3
    padded = parts.step_flops(config, [1024], chunked_head=False, slots=2048)
    assert padded["hardware_flops"] == full["model_flops"] + 6 * n * 1024
