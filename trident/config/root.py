"""The root of the configuration tree, ``TridentConfig``: its sections (``trident.config.schema``),
the sizes derived from them (``derived``, computed once from the rest), and the checks across
sections: settings that are valid alone but not together.

``TridentConfig``'s validator calls ``combination_errors`` and raises one error listing them all,
so a user fixes every conflict in one pass, before anything heavy starts. The environment checks
look names up in the environment registry (lazily, so loading a config imports no torch).
"""

from __future__ import annotations

from pydantic import BaseModel, Field, computed_field, model_validator

from trident.config.algo import AlgoConfig
from trident.config.schema import (
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    ModelConfig,
    PipelineConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    Section,
    SFTConfig,
    SyncConfig,
    TelemetryConfig,
    TrainerConfig,
)
from trident.config.tinker import TinkerConfig


class Derived(BaseModel):
    samples_per_step: int
    total_samples: int
    run_dir: str


class TridentConfig(Section):
    """The whole configuration; each command uses the sections it needs."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    tinker: TinkerConfig = Field(default_factory=TinkerConfig)

    @computed_field
    @property
    def derived(self) -> Derived:
        per_step = self.pipeline.prompts_per_step * self.rollout.n
        return Derived(
            samples_per_step=per_step,
            total_samples=per_step * self.pipeline.steps,
            run_dir=f"{self.run.dir.rstrip('/')}/{self.run.name}",
        )

    @property
    def response_budget(self) -> int:
        """Max model-written tokens of one sample: L_max of the overlong penalty."""
        return self.env.max_response_tokens if self.env.name else self.rollout.max_tokens

    @model_validator(mode="after")
    def _check_combinations(self) -> TridentConfig:
        fill_dependent_defaults(self)
        if errors := combination_errors(self):
            raise ValueError("; ".join(errors))
        return self


HALF_PRECISION_TOLERANCE = 0.1  # sync.tolerance's default where model.dtype is half precision


def fill_dependent_defaults(cfg: TridentConfig) -> None:
    """Set the defaults that depend on another section, where the setting was left unset:
    ``sync.tolerance`` in half precision."""
    if cfg.model.dtype != "float32" and "tolerance" not in cfg.sync.model_fields_set:
        cfg.sync.tolerance = HALF_PRECISION_TOLERANCE


def combination_errors(cfg: TridentConfig) -> list[str]:
    """Every error among settings that are valid alone but not together (empty: none)."""
    errors: list[str] = []
    if cfg.pipeline.mode == "sync" and cfg.pipeline.max_staleness != 0:
        errors.append(
            "pipeline.mode=sync is strictly on-policy: set pipeline.max_staleness=0 or use an async mode"
        )
    if cfg.pipeline.mode == "colocate_async" and cfg.pipeline.max_staleness == 0:
        errors.append(
            "pipeline.mode=colocate_async trains every token one version stale: it needs "
            "pipeline.max_staleness >= 1 (η=0 is the sync trainer)"
        )
    algo = cfg.algo
    if (
        algo.advantage in ("grpo", "rloo", "reinforce_pp_baseline")
        and cfg.rollout.n < 2
        and algo.reward_coef > 0
    ):
        errors.append(
            f"algo.advantage={algo.advantage} compares samples of a group: set rollout.n >= 2 "
            "(or algo.advantage=running_baseline for single samples)"
        )
    if algo.name == "async_reinforce" and cfg.rollout.n > 1:
        errors.append(
            f"algo.name=async_reinforce trains one response per prompt: set rollout.n=1 (got "
            f"{cfg.rollout.n}; for groups of responses use grpo, rloo or reinforce_pp_baseline)"
        )
    if algo.advantage == "gae" and not algo.use_critic:
        errors.append("algo.advantage=gae needs a critic: set algo.use_critic=true")
    if algo.use_critic and algo.advantage != "gae":
        errors.append(
            f"algo.use_critic trains a critic that only algo.advantage=gae uses (got {algo.advantage})"
        )
    if algo.kl_target is not None and algo.kl_coef <= 0:
        errors.append(
            "algo.kl_target adapts the KL coefficient from algo.kl_coef: set algo.kl_coef > 0 "
            "(its initial value)"
        )
    if cfg.model.teacher_paths and algo.distill_coef == 0:
        errors.append(
            "model.teacher_paths is set but algo.distill_coef = 0: the teachers would be "
            "loaded and ignored (set algo.distill_coef > 0 or algo.name=opd)"
        )
    if algo.distill_coef == 0 and algo.reward_coef == 0:
        errors.append("algo.reward_coef = 0 and algo.distill_coef = 0: nothing to learn from")
    paths = cfg.model.teacher_paths
    if (
        algo.distill_coef > 0
        and paths
        and "default" not in paths
        and cfg.data.task
        and not cfg.data.train_path
        and cfg.data.task not in paths
    ):
        errors.append(
            f"data.task={cfg.data.task} has no teacher: model.teacher_paths has "
            f"{sorted(paths)}; add model.teacher_paths.{cfg.data.task}=PATH or .default=PATH"
        )
    if cfg.eval.pass_k > cfg.eval.samples:
        errors.append(f"eval.pass_k={cfg.eval.pass_k} exceeds eval.samples={cfg.eval.samples}")
    if cfg.algo.distill_coef > 0 and not cfg.model.teacher_paths:
        errors.append("algo.distill_coef > 0 needs a teacher: set model.teacher_paths.default=PATH")
    if cfg.pipeline.prompts_per_step * cfg.rollout.n < cfg.trainer.mini_batches:
        errors.append(
            "trainer.mini_batches exceeds the samples per step (pipeline.prompts_per_step * rollout.n)"
        )
    if not cfg.data.task and not cfg.data.train_path and not cfg.env.name:
        errors.append("no data: set data.task (a built-in task), data.train_path or env.name")
    errors += env_errors(cfg) + sleep_errors(cfg)
    if cfg.algo.overlong_penalty and cfg.algo.overlong_buffer > cfg.response_budget:
        errors.append(
            f"algo.overlong_buffer={cfg.algo.overlong_buffer} exceeds the response budget "
            f"{cfg.response_budget} ({'env.max_response_tokens' if cfg.env.name else 'rollout.max_tokens'})"
        )
    return errors


def sleep_errors(cfg: TridentConfig) -> list[str]:
    """``rollout.sleep_level`` with a mode or a sync it cannot go with (the plan it needs:
    ``trident.cluster.placement.plan_for``)."""
    errors = []
    sleep = cfg.rollout.sleep_level
    if sleep and cfg.pipeline.mode != "sync":
        errors.append(
            f"rollout.sleep_level={sleep}: the engines sleep while the trainer trains, which only "
            f"pipeline.mode=sync leaves them idle for (got {cfg.pipeline.mode})"
        )
    lora = cfg.model.lora
    if sleep == 2 and (cfg.sync.delta or (lora is not None and lora.sync == "adapter")):
        errors.append(
            "rollout.sleep_level=2 drops the engines' weights, so each sync must rewrite them "
            "whole: turn off sync.delta and model.lora.sync=adapter, or use rollout.sleep_level=1"
        )
    return errors


def env_errors(cfg: TridentConfig) -> list[str]:
    """The environment section against the rest: MCP server specs, the registry, budgets."""
    errors = [
        f"env.mcp_servers[{i}]: give exactly one of `command` (a list) or `url`, got {spec}"
        for i, spec in enumerate(cfg.env.mcp_servers)
        if ("command" in spec) == ("url" in spec)
        or not isinstance(spec.get("command", []), list)
        or set(spec) - {"command", "url", "env", "cwd", "timeout_s"}
    ]
    if cfg.env.mcp_servers and not cfg.env.name:
        errors.append("env.mcp_servers adds tools to an environment: set env.name too")
    if errors:
        return errors
    if not cfg.env.name:
        return []
    import difflib

    from trident.envs import AGENT_PROGRAM, REGISTRY, get_spec

    try:
        spec = get_spec(cfg.env.name)
    except KeyError:
        close = difflib.get_close_matches(cfg.env.name, list(REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [
            f"env.name={cfg.env.name!r} is not a registered environment{hint}; "
            f"registered: {', '.join(sorted(REGISTRY))}, or use module:Class"
        ]
    errors: list[str] = []
    if cfg.env.name == AGENT_PROGRAM:
        if not isinstance(cfg.env.kwargs.get("command"), list):
            errors.append("env.name=agent_program needs env.kwargs.command: [prog, arg, ...]")
        if cfg.eval.before_after:
            errors.append(
                "env.name=agent_program has no eval before/after yet: set eval.before_after=false"
            )
    if not spec.data and not cfg.data.task and not cfg.data.train_path:
        errors.append(
            f"env.name={cfg.env.name} has no data generator: set data.task or data.train_path"
        )
    if cfg.env.max_total_tokens > cfg.rollout.max_model_len:
        errors.append(
            f"env.max_total_tokens={cfg.env.max_total_tokens} exceeds rollout.max_model_len="
            f"{cfg.rollout.max_model_len}"
        )
    return errors
