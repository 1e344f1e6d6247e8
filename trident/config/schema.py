"""trident's one configuration tree: typed sections, documentation and bounds on each field.

Every command reads the same tree and uses the sections it needs. This module holds the
sections; their root, ``TridentConfig``, with its derived sizes and the rules across sections, is
``trident.config.root``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    """Run identity (name, directory, seed) and what to do with a run directory that exists."""

    name: str = Field(
        default="trident", description="Run name; the run directory is `<dir>/<name>`."
    )
    dir: str = Field(default="runs", description="Parent directory of run directories.")
    seed: int = Field(default=0, description="Seed for data order, sampling and initialisation.")
    resume: str = Field(
        default="never",
        description="`auto`: continue from the newest complete checkpoint of the run directory "
        "(`trident train --resume`), or with none start over, its files moved to "
        "`<run dir>/attempts/<time>/`; `never`: a run directory that already holds a run is "
        "refused; or the path of a checkpoint directory to continue from.",
    )
    overwrite: bool = Field(
        default=False,
        description="Start over in a run directory that already holds a run (with "
        "resume=never); what it holds is moved to `<run dir>/attempts/<time>/`, not deleted.",
    )
    hang_timeout_s: float = Field(
        default=1800.0,
        ge=0,
        description="No step progress for this long: write every process's stacks to "
        "`<run dir>/hang-<time>/` and stop with the stage that hung (0 = never).",
    )
    deterministic: bool = Field(
        default=False,
        description="Seeded sampling per sample, deterministic torch kernels and a fixed batch "
        "order, so a run (and its resume) reproduces rewards and losses; slower.",
    )
    max_restarts: int = Field(
        default=0,
        ge=0,
        description="When a trainer rank dies: restart everything from the newest checkpoint this many times (an automatic --resume); 0 = stop with the checkpoint to resume from.",
    )


class LoraConfig(Section):
    """LoRA adapters on the policy (peft): only they train and carry optimizer state; each sync
    sends the servers the adapters alone (vLLM serves them) or the merged weights."""

    r: int = Field(default=16, ge=1, description="Rank of each adapter.")
    alpha: int = Field(
        default=32, ge=1, description="Scale numerator: an adapter adds (B @ A) * alpha / r."
    )
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input, in forward passes made in training mode "
        "(the RL policy is in it only with trainer.activation_checkpointing); 0 keeps the "
        "trainer's logprobs deterministic.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],  # fmt: skip
        min_length=1,
        description="Names of the nn.Linear layers that get an adapter (peft's target_modules; "
        "the default: every projection of a Llama/Qwen decoder layer).",
    )
    sync: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="What a sync sends: 'adapter', the adapters alone (~1-2% of the bytes), which the servers, started with --enable-lora, load in place; 'merged', the whole model with the adapters merged in, for servers that cannot serve adapters. Both verified.",
    )


class ModelConfig(Section):
    """The policy and the other models it trains with."""

    path: str = Field(
        default="", description="Local checkpoint directory or hub id of a causal LM (policy)."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Parameter dtype for training and serving (float32 on CPU keeps logprobs exact).",
    )
    ref_path: str = Field(
        default="",
        description="Frozen reference model; empty = the initial policy (used when algo.kl_coef > 0).",
    )
    teacher_paths: dict[str, str] = Field(
        default_factory=dict,
        description="Teachers for on-policy distillation, by task name (`default` for all).",
    )
    critic_path: str = Field(
        default="",
        description="Checkpoint the critic's backbone starts from (algo.use_critic); empty = model.path.",
    )
    lora: LoraConfig | None = Field(
        default=None,
        description="LoRA adapters on the policy (`model.lora={r: 16}`); absent = full "
        "fine-tuning. The critic, reference and teachers are unaffected.",
    )


class DataConfig(Section):
    """Prompt data: a built-in task or files."""

    task: str = Field(
        default="arithmetic",
        description="Built-in task (`arithmetic`, `countdown`, `code`) or `reasoning_gym:NAME` (`trident data list`); empty to use the paths only.",
    )
    task_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Config of a `reasoning_gym:NAME` task (the fields of its dataset config, e.g. `{min_terms: 2, max_terms: 3}`).",
    )
    system_prompt: bool = Field(
        default=True,
        description="A `reasoning_gym:NAME` prompt starts with reasoning-gym's answer-format instruction (off: the question alone, ~300 tokens shorter, for small models).",
    )
    train_path: str = Field(
        default="",
        description="Training prompts (JSONL, Parquet, CSV, a `datasets` directory or a hub dataset `hf:NAME[:CONFIG][@SPLIT]`); overrides the task's split.",
    )
    test_path: str = Field(
        default="", description="Held-out prompts for eval; overrides the task's test split."
    )
    prompt_key: str = Field(
        default="prompt",
        description="Column with the prompt (a string or a list of chat messages).",
    )
    answer_key: str = Field(
        default="answer",
        description="Column with the reference answer passed to reward functions (GSM8K's `#### N` is cut to N; MATH's `solution` \\boxed{} is used when there is no `answer`); empty = none.",
    )
    shuffle: bool = Field(
        default=True, description="Reshuffle prompts every epoch (seeded by run.seed)."
    )
    num_train: int = Field(
        default=4000, ge=1, description="Size of a built-in task's generated train split."
    )
    num_test: int = Field(
        default=200, ge=1, description="Size of a built-in task's generated test split."
    )

    @field_validator("task")
    @classmethod
    def _known_task(cls, task: str) -> str:
        from trident.data.tasks import task_problem

        problem = task_problem(task) if task else None
        if problem:
            raise ValueError(problem)
        return task

    @model_validator(mode="after")
    def _task_kwargs_fit(self) -> DataConfig:
        from trident.data.tasks import GYM_PREFIX

        if not self.task_kwargs:
            return self
        if not self.task.startswith(GYM_PREFIX):
            raise ValueError(
                f"data.task_kwargs configure a {GYM_PREFIX}NAME task, not {self.task!r}"
            )
        from trident.data.gym import make_dataset

        make_dataset(self.task.removeprefix(GYM_PREFIX), self.task_kwargs)  # a bad field fails now
        return self


class EnvConfig(Section):
    """Agentic RL: multi-turn rollouts of an environment (`trident env list`) through the agent loop."""

    name: str = Field(
        default="",
        description="Environment (registered name or `module:Class`); empty = single-turn prompts scored by `reward`. "
        "Its data generator supplies the prompts unless data.train_path / data.test_path are set.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the environment's constructor."
    )
    data_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the environment's data generator (`trident env data --options`, or `-c RECIPE` to take them from a config), e.g. an easier configuration.",
    )
    mcp_servers: list[dict[str, Any]] = Field(
        default_factory=list,
        description="MCP servers whose tools join the environment's in every trajectory (a tool of the same name replaces the environment's): `{command: [prog, arg, ...], env: {...}, cwd: ...}` (stdio, one server process per trajectory) or `{url: http://.../mcp}` (streamable HTTP). A server that fails or dies makes the trajectory an infra_error.",
    )
    max_turns: int = Field(default=8, ge=1, description="Assistant turns per trajectory.")
    max_turn_tokens: int = Field(
        default=0,
        ge=0,
        description="Tokens per assistant turn; 0 = rollout.max_tokens (eval.max_tokens in eval).",
    )
    max_response_tokens: int = Field(
        default=256, ge=1, description="Model-written tokens over a whole trajectory."
    )
    max_total_tokens: int = Field(
        default=0,
        ge=0,
        description="Prompt + turns + tool results per trajectory; 0 = rollout.max_model_len.",
    )
    max_consecutive_tool_errors: int = Field(
        default=3,
        ge=1,
        description="Turns in a row whose tool calls all failed before the trajectory ends.",
    )
    parser: str = Field(
        default="hermes", description="Tool-call parser (`hermes`/`qwen`, or `module:Class`)."
    )
    show_tools: bool = Field(
        default=True,
        description="Render the tool schemas in the prompt; false saves their tokens for a model fine-tuned on the tools (SFT data: `trident env data --no-tools`).",
    )
    timeout_s: float = Field(
        default=60.0, gt=0, description="Timeout of each env.reset / env.step call (infra_error)."
    )


class RolloutConfig(Section):
    """vLLM rollout servers and sampling."""

    num_servers: int = Field(default=1, ge=1, description="vLLM servers (each one Ray actor).")
    n: int = Field(default=8, ge=1, description="Samples per prompt (the group size).")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling.")
    max_tokens: int = Field(default=16, ge=1, description="Max new tokens per response.")
    stop: list[str] = Field(
        default_factory=list, description="Extra stop strings (the tokenizer's EOS always stops)."
    )
    base_port: int = Field(
        default=0, ge=0, le=65535, description="Port of server 0 (server i: base_port + i); 0: any."
    )
    max_model_len: int = Field(
        default=512, ge=16, description="Context length the servers allocate for."
    )
    kv_cache_gib: float = Field(
        default=1.0, gt=0, description="KV cache size per CPU server (VLLM_CPU_KVCACHE_SPACE)."
    )
    cpu_threads: int = Field(
        default=0,
        ge=0,
        description="Torch threads of each CPU server's engine (OMP_NUM_THREADS). 0 = auto: one for a model of hidden size under 512, whose matrices are too small for a second thread to pay; else the host's cores split among the processes generating at once (the servers; in async modes the trainer ranks too).",
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="Fraction of GPU memory per GPU server."
    )
    sleep_level: Literal[0, 1, 2] = Field(
        default=0,
        description="`sync` mode, colocated on GPUs: the engines sleep while the trainer trains, lending it their memory (vLLM's sleep mode; 1: weights to CPU, 2: weights dropped, each sync rewrites them whole). 0 = never.",
    )
    startup_timeout_s: float = Field(
        default=300, gt=0, description="Seconds to wait for a server to become healthy."
    )
    request_timeout_s: float = Field(
        default=300, gt=0, description="Seconds before a generation request is abandoned."
    )
    extra_server_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments for the vLLM server."
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts per server after it dies (then the run stops with its log); each restarted server is brought to the served weights, verified, and rejoins. Keeps a CPU copy of the served weights on trainer rank 0 (0 = off).",
    )
    health_check_s: float = Field(
        default=10.0,
        ge=0,
        description="Seconds between health checks of each server (two misses in a row take it out); a failed request checks at once (0 = only on failures).",
    )
    liveness_timeout_s: float = Field(
        default=60.0,
        ge=0,
        description="A server with requests of ours pending whose engine makes no progress (its /metrics token counters and KV-cache usage unchanged) for this long is frozen: taken out, its process group killed and restarted like a dead one (0 = off).",
    )
    server_urls: list[str] = Field(
        default_factory=list,
        description="Attach to vLLM servers started elsewhere (`trident rollout serve`) instead of starting rollout.num_servers: trident checks, syncs and verifies them like its own, and neither restarts nor stops them.",
    )
    min_servers: int = Field(
        default=0,
        ge=0,
        description="Below this many servers up (the others left or died, not restartable) the run waits for `trident rollout serve --join RUN_DIR`; 0: with none up it stops.",
    )
    max_servers: int = Field(
        default=0, ge=0, description="Joiners beyond this many servers are refused (0 = any)."
    )


class TrainerConfig(Section):
    """The FSDP2 trainer and its optimizer."""

    num_ranks: int = Field(
        default=1, ge=1, description="FSDP2 ranks (Ray actors); gloo on CPU, NCCL on GPU."
    )
    lr: float = Field(default=1e-4, gt=0, description="Learning rate of the (fused) AdamW.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(default=1.0, gt=0, description="Max global gradient norm.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warm-up steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="constant", description="Learning-rate schedule after warm-up."
    )
    micro_batch_tokens: int = Field(
        default=8192,
        ge=16,
        description="Token budget of one micro-batch (padding included, unless packing).",
    )
    mini_batches: int = Field(
        default=1,
        ge=1,
        description="Optimizer steps per training step (the batch is split into this many).",
    )
    skip_zero_advantage: bool = Field(
        default=True,
        description="Skip the forward and backward passes of samples whose every loss token has advantage 0 (a GRPO group whose rewards are all equal): the policy losses are advantage-weighted, so such a sample adds nothing to the gradient, while the loss's normalisers still count it. Only where the loss has no other term (no entropy bonus, no reference-KL term, no critic). Token means such as entropy then cover the samples trained.",
    )
    share_prompts: bool = Field(
        default=True,
        description="Run a prompt once for the samples of a micro-batch that share it (a GRPO group's), their responses against its keys and values (Prefix Grouper): the same function of the weights, without n copies of the prompt's compute. The policy's training passes and the passes without gradient (π_old when recomputed, the reference, teachers), where a model's logits are a plain head (trainer.logprob_chunk_tokens > 0) and trainer.packing is off.",
    )
    packing: bool = Field(
        default=False,
        description="Pack each micro-batch's samples into one row with no padding (positions restart per sample; attention stays within a sample), and fill micro_batch_tokens with real tokens instead of rows x longest row. The critic runs padded.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Keep only each decoder layer's input in the forward pass and recompute the layer in the backward pass (transformers' gradient checkpointing, non-reentrant): activation memory of one layer instead of all, for about one more forward pass of compute. Policy, critic and SFT.",
    )
    logprob_chunk_tokens: int = Field(
        default=1024,
        ge=0,
        description="Token positions whose vocabulary projection (logits, logprob, entropy) is held at once, forward and backward, each chunk projected again in the backward pass: memory bounded by a few chunk x vocab float32 grids instead of several micro-batch x vocab ones (1024 x 151,936 = 0.6 GB a grid). 0 = the whole micro-batch at once. Heads that scale or soft-cap logits always take the whole grid.",
    )
    cpu_threads: int = Field(
        default=0,
        ge=0,
        description="Torch CPU threads per rank on a CPU host, for SFT too. 0 = auto: the host's cores split among the processes computing at once (the ranks; in async modes the rollout servers too, since they generate while the ranks train).",
    )
    critic_lr: float = Field(
        default=1e-4, gt=0, description="Learning rate of the critic (algo.use_critic)."
    )


class PipelineConfig(Section):
    """The controller: mode, steps, batch, staleness bound."""

    mode: Literal["sync", "colocate_async", "separate_async"] = Field(
        default="sync", description="How rollout and training overlap."
    )
    steps: int = Field(
        default=20,
        ge=1,
        description="Training steps (one optimizer update round + one weight sync each).",
    )
    prompts_per_step: int = Field(
        default=16,
        ge=1,
        description="Prompts per step; samples per step = prompts_per_step * rollout.n.",
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        description="η: max policy versions between the token's sampler and the trained policy.",
    )
    max_running_groups: int = Field(
        default=0,
        ge=0,
        description="separate_async: groups generating at once (AReaL's max_concurrent_rollouts); 0 = prompts_per_step.",
    )
    dynamic_sampling_max_dropped: int = Field(
        default=0,
        ge=0,
        description="algo.dynamic_sampling: groups without signal dropped (and replaced by fresh prompts) in a row at most; past that they are trained on until a group with signal comes back, so a saturated policy cannot stall the run. 0 = 2 * prompts_per_step.",
    )


class RewardFn(Section):
    name: str = Field(
        description="Registered reward function (`trident.rewards`) or `module:function`."
    )
    weight: float = Field(default=1.0, description="Weight in the sum of rewards.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Options: the model of `reward_model` (`{path: DIR}`), the server and template of `judge` "
        "(`{url: URL, template: TEXT}`), else keyword arguments bound to the function.",
    )

    @field_validator("name")
    @classmethod
    def _known_reward(cls, name: str) -> str:
        import difflib

        from trident.rewards import names

        if ":" in name or name in names():
            return name
        close = difflib.get_close_matches(name, names(), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown reward {name!r}; {hint}registered: {', '.join(names())}, or module:function"
        )


class RewardConfig(Section):
    """Reward functions and their timeouts."""

    fns: list[RewardFn] = Field(
        default_factory=list, description="Reward functions; empty = the task's own verifier."
    )
    timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Timeout of one reward call; a timeout is an infra_error, not a zero.",
    )
    exclude_infra_errors: bool = Field(
        default=True, description="Drop infra_error samples from the loss instead of scoring them."
    )


class SyncConfig(Section):
    """Weight sync from trainer to servers, and its verification."""

    backend: Literal["auto", "shm", "nccl", "ipc"] = Field(
        default="auto",
        description="Weight transport: shm (trident's CPU shared memory) or vLLM's nccl/ipc on GPU; auto picks.",
    )
    verify: bool = Field(
        default=True,
        description="After each sync, compare the engine's probe logprobs with the trainer's.",
    )
    probe_tokens: int = Field(
        default=32, ge=4, description="Length of the probe sequence for verification."
    )
    timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Bound on each call of a sync to a server (pause, each bucket, verify): one that "
        "does not answer fails the sync, and is restarted like a dead one if it cannot then generate a token "
        "within rollout.liveness_timeout_s (a frozen engine); the sync is repeated without it.",
    )
    tolerance: float = Field(
        default=2e-3,
        gt=0,
        description="Max |Δlogp| on the probe after a sync. Unset: 2e-3 in float32, 0.1 in half precision "
        "(model.dtype), where engine and trainer round differently (bfloat16 on a CPU: ~0.01 seen).",
    )
    bucket_bytes: int = Field(
        default=256 << 20,
        ge=1 << 16,
        description="Bytes per bucket: each is gathered from the FSDP shards just before it is sent (shm).",
    )
    delta: bool = Field(
        default=False,
        description="Send only the changed bits (XOR, zstd) against what the servers hold; each server then keeps one CPU copy of the weights (shm).",
    )
    full_every: int = Field(
        default=10,
        ge=1,
        description="With sync.delta, every N-th sync is a full one (bounds drift; 1 = always full).",
    )
    on_base_mismatch: Literal["fail", "full"] = Field(
        default="fail",
        description="A server refuses a delta for a base it does not hold: stop the run (fail) or resend in full.",
    )


class CheckpointConfig(Section):
    """Checkpoints: the full training state (resumable) with an HF export beside it."""

    every: int = Field(
        default=0,
        ge=0,
        description="Save a checkpoint (full state + HF export) every N steps (0 = only the final one).",
    )
    keep_last: int = Field(default=2, ge=1, description="Periodic checkpoints kept on disk.")


class EvalConfig(Section):
    """Held-out evaluation."""

    max_prompts: int = Field(
        default=200, ge=1, description="Test prompts evaluated (the first N of the test split)."
    )
    samples: int = Field(default=4, ge=1, description="Sampled responses per prompt for pass@k.")
    pass_k: int = Field(
        default=4, ge=1, description="k of pass@k (unbiased estimator over `samples`)."
    )
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature for pass@k (accuracy is greedy)."
    )
    max_tokens: int = Field(default=16, ge=1, description="Max new tokens per response.")
    before_after: bool = Field(
        default=True, description="`trident train` evaluates before and after training."
    )


class SFTConfig(Section):
    """Supervised fine-tuning (`trident sft`)."""

    output: str = Field(
        default="",
        description="Where the fine-tuned checkpoint is written (default `<run dir>/model`).",
    )
    steps: int = Field(default=600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(default=64, ge=1, description="Sequences per optimizer step (global).")
    lr: float = Field(
        default=3e-3, gt=0, description="Peak AdamW learning rate (cosine decay after warm-up)."
    )
    warmup_steps: int = Field(default=20, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    num_ranks: int = Field(
        default=1, ge=1, description="FSDP2 ranks (processes); gloo on CPU, NCCL on GPU."
    )
    max_seq_len: int = Field(default=256, ge=8, description="Longer sequences are truncated.")
    answer_formats: list[str] = Field(
        default_factory=list,
        description="Response templates for a built-in task's SFT targets (`{answer}` and the row's other "
        "fields), one picked per prompt by a stable hash; empty = the task's required format.",
    )


class ClusterConfig(Section):
    """Ray: local instance or an existing cluster."""

    address: str = Field(
        default="",
        description="Ray address to join (`auto`, `ray://host:10001`); empty = start a local instance.",
    )
    num_cpus: int = Field(default=0, ge=0, description="CPUs for a local Ray instance (0 = all).")
    placement: Literal["auto", "colocated", "disaggregated"] = Field(
        default="auto",
        description="Where trainer ranks and rollout servers run on GPUs: `colocated` (rank i and server i share device i; the server keeps to rollout.gpu_memory_utilization), `disaggregated` (a device per actor), `auto` (disaggregated when every actor gets a device, else colocated: a one-GPU box colocates). `trident train --dry-run` prints the plan.",
    )
    role_resources: dict[Literal["trainer", "rollout"], dict[str, float]] = Field(
        default_factory=dict,
        description="Custom Ray resources each actor of a role also asks for, to pin roles to "
        "node types (`{rollout: {inference_node: 0.01}}` puts the servers on nodes started with "
        "`ray start --resources='{\"inference_node\": 1}'`).",
    )


class TelemetryConfig(Section):
    """Metrics sinks and progress display."""

    tensorboard: bool = Field(
        default=True, description="Write TensorBoard events to the run directory."
    )
    wandb_project: str = Field(
        default="",
        description="Also log to this Weights & Biases project (`pip install 'trident[wandb]'`; "
        "WANDB_MODE=offline keeps the run in <run dir>/wandb).",
    )
    mlflow_uri: str = Field(
        default="",
        description="Also log to MLflow at this tracking URI (a server URL or `file:/path`; "
        "`pip install 'trident[mlflow]'`), experiment `trident`, run named after the run directory.",
    )
    progress: bool = Field(default=True, description="Show rich progress bars.")
    samples: Literal["all", "trained", "none"] = Field(
        default="all",
        description="Which samples' lineage to keep in <run dir>/samples/step_<k>.parquet for "
        "`trident inspect`: all (trained and discarded, with why), trained only, or none.",
    )
    sample_text_chars: int = Field(
        default=1000,
        ge=0,
        description="Characters of each prompt and response kept in the sample lineage (0 = whole texts).",
    )
