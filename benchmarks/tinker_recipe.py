"""tinker-cookbook's ``math_rl`` recipe (``env=arithmetic``, ``renderer_name=role_colon``) on
trident's tiny model, offline: the warm-up model it starts from, and the reward the cookbook's own
environment gives that model's greedy answers. Shared by ``tests/test_tinker_cookbook.py`` and the
service benchmark.

The warm-up is ``trident sft`` on the recipe's own problems, laid out token for token as the
recipe will send them: ``ArithmeticDataset``'s problems (its few-shot prefix, its question), the
``role_colon`` renderer's generation prompt, and the answer as that renderer writes an assistant
turn (`` 132\\n\\n``) followed by its stop sequence's ``User:``, so the warm model also learns to
stop where the recipe's sampler stops. ``trident sft`` renders prompts with the checkpoint's chat
template, so the warm-up's base is a copy of the tiny model whose template is ``role_colon``
(:data:`ROLE_COLON_TEMPLATE`); :func:`sft_rows` checks that the ids ``sft`` trains on are the
renderer's, so a change on either side fails there rather than as a silently weaker warm-up.

Problems are drawn from dataset batches far past any a short RL run reads (``math_rl`` reads
batch ``i`` at step ``i``), so the warm-up does not see the run's prompts. The reward is the
environment's: ``correct - 0.1 * (1 - format)``, format meaning the answer ended on the stop
sequence.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Jinja for transformers' apply_chat_template: ``{Role}: {content}\n\n`` per message, then
# ``Assistant:`` (RoleColonRenderer.render_message / build_generation_prompt as text).
ROLE_COLON_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
STOP = "\n\nUser:"  # RoleColonRenderer.get_stop_sequences()
WARM_UP_BATCHES = 10_000  # the first dataset batch the warm-up draws from
# Measured 2026-12-07 on the 2-core dev host (load ~11 from other jobs: 16 min wall, 8 min CPU):
# SFT loss 6.2 -> 0.34; on the run's first 64 problems, greedy, the cookbook's environment gives
# format 1.0 (every answer ends on the stop sequence), correct 0.0625, reward 0.0625. Below the
# 20-60% a reward rise wants: the sums' digits need more steps than this (follow-up: measure a
# longer warm-up on an idle host, or start from the demo's SFT checkpoint, which can add).
WARM_UP = dict(rows=2048, steps=300, batch_size=32, lr=3e-3)


@dataclass(frozen=True)
class Problem:
    """One ``ArithmeticEnv``: its conversation up to the question, and its answer."""

    env: Any  # tinker_cookbook's ArithmeticEnv
    convo: list[Any]  # the cookbook's Messages
    answer: str


def renderer(model_dir: str | Path) -> Any:
    """The cookbook's ``role_colon`` renderer over the model's tokenizer (``get_tokenizer`` takes
    a local directory, as ``math_rl model_name=<dir>`` does)."""
    from tinker_cookbook import renderers
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    return renderers.get_renderer("role_colon", tokenizer=get_tokenizer(str(model_dir)))


def problems(
    model_dir: str | Path, n: int, first_batch: int, batch_size: int = 64
) -> list[Problem]:
    """``n`` problems of ``math_rl env=arithmetic``'s dataset, from batch ``first_batch`` on."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDataset
    from tinker_cookbook.rl.problem_env import ProblemGroupBuilder

    dataset = ArithmeticDataset(batch_size, renderer(model_dir), group_size=1, n_batches=1 << 30)
    out: list[Problem] = []
    index = first_batch
    while len(out) < n:
        for builder in dataset.get_batch(index):
            assert isinstance(builder, ProblemGroupBuilder)
            env = builder.env_thunk()
            convo = [*env.convo_prefix, {"role": "user", "content": env.get_question()}]
            out.append(Problem(env, convo, env.get_reference_answer()))
        index += 1
    return out[:n]


def role_colon_base(tiny_dir: str | Path, out_dir: str | Path) -> Path:
    """A copy of ``tiny_dir`` whose chat template is ``role_colon`` (module docstring)."""
    out = Path(out_dir)
    shutil.copytree(tiny_dir, out, dirs_exist_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ROLE_COLON_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # a file would win over the config
    return out


def sft_rows(model_dir: str | Path, n: int) -> list[dict[str, Any]]:
    """``trident sft`` rows (``prompt`` messages + ``response``) of ``n`` warm-up problems,
    checked to encode to the renderer's own token ids (``model_dir`` has the role_colon
    template)."""
    from trident.models.load import load_tokenizer
    from trident.train.sft import encode_example

    render, tokenizer = renderer(model_dir), load_tokenizer(str(model_dir))
    rows = []
    for k, problem in enumerate(problems(model_dir, n, WARM_UP_BATCHES)):
        row = {"id": k, "prompt": problem.convo, "answer": problem.answer}
        row["response"] = f" {problem.answer}\n\nUser:"
        rows.append(row)
        if k < 8:  # the layout is the same for every row; a few prove it
            ids, mask = encode_example(tokenizer, row)
            prompt = render.build_generation_prompt(problem.convo).to_ints()
            said = render.tokenizer.encode(row["response"], add_special_tokens=False)
            expected = [*prompt, *said, tokenizer.eos_token_id]
            if ids != expected or mask != [0] * len(prompt) + [1] * (len(said) + 1):
                raise AssertionError(
                    f"trident sft lays out {ids} for problem {k}, the role_colon renderer {expected}"
                )
    return rows


def warm_model(tiny_dir: str | Path, work_dir: str | Path, **settings: Any) -> Path:
    """``trident sft`` of the tiny model on the recipe's problems (``WARM_UP``, overridable);
    the warm checkpoint's directory (``<work_dir>/sft/model``)."""
    from trident.config import load_config
    from trident.data.loaders import write_jsonl
    from trident.train.sft import run_sft

    s = {**WARM_UP, **settings}
    work = Path(work_dir)
    base = role_colon_base(tiny_dir, work / "base")
    data = write_jsonl(sft_rows(base, s["rows"]), work / "arithmetic_sft.jsonl")
    overrides = [
        f"model.path={base}",
        f"run.dir={work}",
        "run.name=sft",
        "telemetry.progress=false",
        "data.task=",
        f"data.train_path={data}",
        f"sft.steps={s['steps']}",
        f"sft.batch_size={s['batch_size']}",
        f"sft.lr={s['lr']}",
        "sft.warmup_steps=10",
    ]
    return run_sft(load_config([], overrides))


def greedy_answers(model_dir: str | Path, convos: list[list[dict]], max_tokens: int) -> list:
    """Each conversation's greedy continuation as token ids, cut after the stop sequence as the
    recipe's sampler cuts it (HF ``generate`` in this process)."""
    import torch
    from transformers import AutoModelForCausalLM

    render = renderer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.eval()
    tokenizer = render.tokenizer
    out = []
    for convo in convos:
        prompt = render.build_generation_prompt(convo).to_ints()
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        for end in range(1, len(ids) + 1):  # the stop string ends the sample, included
            if tokenizer.decode(ids[:end]).endswith(STOP):
                ids = ids[:end]
                break
        out.append(ids)
    return out


def greedy_reward(
    model_dir: str | Path, n: int = 64, first_batch: int = 0, max_tokens: int = 10
) -> dict[str, float]:
    """The cookbook environment's mean ``reward``, ``correct`` and ``format`` on the model's
    greedy answers to ``n`` problems of the recipe's batches from ``first_batch`` (batch 0 on:
    the ones an RL run trains on)."""
    batch = problems(model_dir, n, first_batch)
    answers = greedy_answers(model_dir, [p.convo for p in batch], max_tokens)

    async def score() -> list[Any]:
        return [await p.env.step(ids) for p, ids in zip(batch, answers, strict=True)]

    steps = asyncio.run(score())
    return {
        "reward": sum(s.reward for s in steps) / n,
        "correct": sum(s.metrics["correct"] for s in steps) / n,
        "format": sum(s.metrics["format"] for s in steps) / n,
    }


# -- the service and the recipe as processes --------------------------------------------------

REWARD_KEY = "env/all/reward/total"  # math_rl's metrics.jsonl (rl/metric_util.py)
CORRECT_KEY = "env/all/correct"
FAULT = "tinker_forward_backward"  # trident.weights.faults: between a step's two halves
# The recipe's sizes here: small enough for a few minutes on 2 cores, a group big enough that
# importance sampling sees a spread of rewards. max_tokens covers the longest answer
# (" 200" and the stop "\n\nUser:" are 10 tokens of the tiny tokenizer).
RL_RUN = dict(group_size=4, groups_per_batch=8, max_tokens=10, learning_rate=1e-3, lora_rank=8)


def client_env() -> dict[str, str]:
    """The environment a cookbook process runs in here: offline, no telemetry, a test key."""
    import os

    keep = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    return {**keep, "TINKER_API_KEY": "tml-test", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}


class Served:
    """``trident tinker serve`` in its own process group (so a kill takes every process it
    started), its output appended to ``log``; ``fault_dir`` is its ``TRIDENT_FAULT_DIR``."""

    def __init__(self, state_dir: Path, port: int, models: dict[str, str], log: Path,
                 fault_dir: Path | None = None, overrides: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.port, self.log, self.fault_dir = port, log, fault_dir
        self.command = [
            sys.executable, "-m", "trident.cli", "tinker", "serve", "-c", "configs/tinker.yaml",
            f"tinker.port={port}", f"tinker.state_dir={state_dir}", f"run.dir={state_dir.parent}",
            "tinker.models={" + ", ".join(f"{n}: {p}" for n, p in models.items()) + "}",
            # replay is bitwise only so (trident.tinker.models)
            "run.deterministic=true", "trainer.cpu_threads=1", "telemetry.progress=false",
            *overrides,
        ]  # fmt: skip
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300) -> None:
        import urllib.request

        env = client_env()
        if self.fault_dir is not None:
            env["TRIDENT_FAULT_DIR"] = str(self.fault_dir)
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                self.command, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=Path(__file__).resolve().parents[1],
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"trident tinker serve did not come up: {tail}")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the server's whole process group, and reap it."""
        import os
        import signal

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self, timeout: float = 60) -> None:
        """End it as a user does (SIGINT), SIGKILL past ``timeout``."""
        import os
        import signal

        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()


def math_rl_command(base_url: str, model_dir: str | Path, log_path: Path, steps: int,
                    save_every: int = 2, **sizes: Any) -> list[str]:  # fmt: skip
    """``python -m tinker_cookbook.recipes.math_rl.train`` as issue #51 runs it, unmodified."""
    s = {**RL_RUN, **sizes}
    return [
        sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train",
        f"base_url={base_url}", f"model_name={model_dir}", "renderer_name=role_colon",
        "env=arithmetic", "loss_fn=importance_sampling",
        *(f"{key}={value}" for key, value in s.items()),
        f"max_steps={steps}", f"save_every={save_every}", "eval_every=0",
        "behavior_if_log_dir_exists=delete", f"log_path={log_path}",
    ]  # fmt: skip


def logged_metrics(log_path: Path) -> list[dict[str, Any]]:
    """The recipe's per-step training metrics (``<log_path>/metrics.jsonl``), one dict a step:
    the lines with a reward (the recipe's last line holds only the final save's timings)."""
    path = log_path / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in lines if REWARD_KEY in m]


def supervised_rows(model_dir: str | Path, n: int, first_batch: int) -> list[Any]:
    """``sl_loop``'s datums (``conversation_to_datum``, weights normalised per example) of ``n``
    of the recipe's problems answered right, as the cookbook builds them."""
    from tinker_cookbook.supervised.data import conversation_to_datum

    render = renderer(model_dir)
    return [
        conversation_to_datum(
            [*p.convo, {"role": "assistant", "content": p.answer}], render, max_length=None
        )
        for p in problems(model_dir, n, first_batch)
    ]


def supervised_loop(base_url: str, base_model: str, steps: int, batch: int = 8,
                    lr: float = 1e-3, rank: int = 8) -> str:  # fmt: skip
    """An ``sl_loop``-style client: a LoRA model, then ``steps`` of ``forward_backward``
    (cross_entropy) + ``optim_step`` on the recipe's problems, then ``save_state("final")``;
    the saved state's ``tinker://`` path. Rides out a server restart on the SDK's own
    retries."""
    import tinker

    data = supervised_rows(base_model, steps * batch, WARM_UP_BATCHES // 2)
    with tinker.ServiceClient(base_url=base_url, api_key="tml-test") as service:
        trainer = service.create_lora_training_client(base_model=base_model, rank=rank).result()
        adam = tinker.types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8)
        for step in range(steps):
            chunk = data[step * batch : (step + 1) * batch]
            trainer.forward_backward(chunk, "cross_entropy").result()
            trainer.optim_step(adam).result()
        return trainer.save_state("final").result().path
