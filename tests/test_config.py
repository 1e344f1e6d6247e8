import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli
from trident.config import ConfigError, load_config, save_config
from trident.config.docs import BEGIN, END, render


def test_yaml_then_overrides_merge_in_order(tmp_path):
    a = tmp_path / "a.yaml"
    a.write_text("rollout:\n  n: 4\n  temperature: 0.7\npipeline:\n  steps: 5\n")
    b = tmp_path / "b.yaml"
    b.write_text("rollout:\n  n: 6\n")
    cfg = load_config([a, b], ["pipeline.steps=9", "rollout.stop=[x, y]", "run.name=r1"])
    assert cfg.rollout.n == 6  # later file wins
    assert cfg.rollout.temperature == 0.7  # earlier file's other keys survive
    assert cfg.pipeline.steps == 9  # overrides win over files
    assert cfg.rollout.stop == ["x", "y"]  # values parse as YAML
    assert cfg.derived.samples_per_step == cfg.pipeline.prompts_per_step * 6
    assert cfg.derived.total_samples == 9 * cfg.derived.samples_per_step


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("rollout.nn=3", "rollout.n"),
        ("rolout.n=3", "rollout"),
        ("algo.clip_eps_hi=0.3", "algo.clip_eps_high"),
    ],
)
def test_unknown_key_suggests_the_closest(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        load_config([], [override])


def test_unknown_key_in_yaml_names_its_path(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="'trainer.learning_rate'"):
        load_config([f])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["pipeline.max_staleness=2"], "strictly on-policy"),
        (["pipeline.mode=colocate_async"], "max_staleness >= 1"),
        (["rollout.n=1"], "rollout.n >= 2"),
        (["algo.name=ppo", "algo.use_critic=false"], "needs a critic"),
        (["eval.pass_k=8", "eval.samples=4"], "exceeds eval.samples"),
        (["rollout.n=0"], "rollout.n"),
        (
            ["rollout.sleep_level=1", "pipeline.mode=colocate_async", "pipeline.max_staleness=1"],
            "only pipeline.mode=sync leaves them idle",
        ),
        (["rollout.sleep_level=2", "sync.delta=true"], "each sync must rewrite them whole"),
    ],
)
def test_invalid_combinations_fail_early(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], overrides)


def test_presets_fill_only_unset_fields():
    cfg = load_config([], ["algo.name=gspo"])
    assert cfg.algo.policy_loss == "gspo" and cfg.algo.clip_eps_high == 4e-4
    cfg = load_config([], ["algo.name=gspo", "algo.clip_eps_high=0.4"])
    assert cfg.algo.clip_eps_high == 0.4 and cfg.algo.clip_eps_low == 3e-4


def test_every_preset_loads_as_a_config():
    from trident.config.algo import PRESETS

    for preset in PRESETS:
        extra = {
            "opd": ["model.teacher_paths.default=/teacher"],
            "async_reinforce": ["rollout.n=1"],  # one response per prompt; n > 1 is refused
        }.get(preset, [])
        assert load_config([], [f"algo.name={preset}", *extra]).algo.name == preset


def test_saved_config_round_trips(tmp_path):
    cfg = load_config([], ["rollout.n=3", "algo.name=gspo", f"run.dir={tmp_path}"])
    path = save_config(cfg, cfg.derived.run_dir)
    assert load_config([path]) == cfg


def test_config_imports_without_torch():
    code = "import sys, trident.config, trident.config.docs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_dry_run_prints_and_starts_nothing(tmp_path):
    r = run_cli(
        "sft",
        "--dry-run",
        "model.path=/does/not/matter",
        f"run.dir={tmp_path}",
        "rollout.n=3",
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "n: 3" in r.stderr and "samples_per_step: 48" in r.stderr
    assert not any(tmp_path.iterdir())  # no run directory was created


def test_docs_config_reference_is_generated():
    reference = (REPO / "docs" / "config.md").read_text()
    block = reference.split(BEGIN, 1)[1].split(END, 1)[0]
    assert block.strip() == render().strip(), (
        "docs/config.md is stale: python -m trident.config.docs"
    )


def test_override_syntax_error_is_one_line():
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        load_config([], ["rollout.n"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config([Path("/nonexistent.yaml")])


def test_sync_tolerance_defaults_to_the_dtype():
    """The probe's tolerance, unset, is float32's 2e-3 or half precision's wider bound; a
    value given is kept either way."""
    from trident.config.root import HALF_PRECISION_TOLERANCE

    assert load_config([], []).sync.tolerance == 2e-3
    assert load_config([], ["model.dtype=bfloat16"]).sync.tolerance == HALF_PRECISION_TOLERANCE
    given = ["model.dtype=bfloat16", "sync.tolerance=0.3"]
    assert load_config([], given).sync.tolerance == 0.3
