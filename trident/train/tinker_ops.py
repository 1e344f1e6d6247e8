"""The trainer primitives a training service composes (the Tinker API's ``forward_backward``,
``optim_step``, ``save_state``/``load_state``), beside :class:`~trident.train.policy.
PolicyWorker` rather than inside its ``train_step``: the caller's loop decides what a step is.

One :class:`TinkerModel` is one trained model on one of ``world`` FSDP2 ranks (each given the
same calls; a rank scores every ``world``-th datum), built from the policy's own parts:
``load_causal_lm`` in float32 master weights, LoRA by :func:`trident.train.lora.wrap` (rank 0:
full fine-tuning), FSDP2 by ``fsdp.shard`` in ``model.dtype``, AdamW by ``fsdp.adamw``,
logprobs by ``token_logprobs`` (vocabulary chunks, temperature 1.0), checkpoints by
``fsdp.save_training_state``. Its rules:

- ``forward_backward`` scores each datum's ``target_tokens`` (already aligned by the caller:
  position i of ``input_tokens`` predicts ``target_tokens[i]``), takes the named loss of
  :mod:`trident.algorithms.tinker_losses` (a plain sum) and **adds** its gradient to ``.grad``:
  gradients accumulate across calls until ``optim_step``, so splitting a batch over calls
  changes nothing but float rounding. Micro-batches of at most ``trainer.micro_batch_tokens``
  (padded) depend only on the call's datums, so a replayed call computes the same thing.
  ``forward_only`` runs under ``no_grad`` and touches no gradient.
- ``optim_step`` sets the call's AdamW parameters on every param group (no schedule), clips
  only when ``grad_clip_norm`` > 0, returns the pre-clip ``grad_norm`` and drops the gradients.
- ``save_state`` writes the trained weights, the Adam moments and the RNG; a continuation after
  ``load_state`` equals one without the round trip, bitwise (with ``run.deterministic``).
  An optimizer that has not stepped is saved as none (torch's state-dict API would otherwise
  step it with zero gradients, which counts as a step in Adam's bias correction).
- ``push`` is ``trident train``'s verified push (``WeightSender``: the probe checked on every
  server), its sender connected to the servers at the first push.

:class:`LocalTrainer` is the async :class:`Trainer` over one in-process model (world size 1,
an in-memory process group): every call runs in one worker thread, in the order the calls are
made, so the event loop stays free.

Simplifications: N ranks are N processes' :class:`TinkerModel`, but no Ray group drives them
yet; on a model whose embeddings are tied, ``train_unembed`` puts no adapter on ``lm_head``
(the head is the embedding matrix, and an HF export or a vLLM load would tie the delta away).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from trident.algorithms.tinker_losses import check_loss, required_inputs, tinker_loss
from trident.config import TridentConfig
from trident.config.schema import LoraConfig
from trident.models.load import load_causal_lm, load_tokenizer
from trident.train import fsdp, lora
from trident.train.batch import Batch
from trident.train.datum import AdamParams, Datum, LoraShape
from trident.train.recompute import even_micro_batches, token_logprobs
from trident.train.weight_sender import WeightSender

Outputs = tuple[list[dict[str, torch.Tensor]], dict[str, float]]
T = TypeVar("T")

# one model built at a time in a process, so two trainers' threads cannot interleave draws
_BUILDING = threading.Lock()
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class Trainer(Protocol):
    """One model a training service trains; each call is awaited in the caller's order."""

    async def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float],
        forward_only: bool,
    ) -> Outputs:
        """On each ``forward_backward`` (and ``forward``) request: per-datum ``logprobs`` and
        ``elementwise_loss`` [T] float32, metrics ``{"loss:sum": ...}``; the gradients add up
        until ``optim_step`` (``forward_only``: untouched)."""
        ...

    async def optim_step(self, adam: AdamParams) -> dict[str, float]:
        """On ``optim_step``: one AdamW step with ``adam``; metrics include ``grad_norm``."""
        ...

    async def save_state(self, out_dir: str) -> None:
        """On ``save_weights`` (and snapshots): weights, Adam moments, RNG into ``out_dir``."""
        ...

    async def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        """On ``load_weights``: what ``save_state`` wrote (``optimizer`` False: fresh moments)."""
        ...

    async def save_hf(self, out_dir: str) -> str:
        """On a named ``save_weights_for_sampler``: an HF checkpoint (LoRA merged)."""
        ...

    async def push(self, version: int, urls: list[str], backend: str) -> dict[str, float]:
        """On ``save_weights_for_sampler`` (and after a restart's replay): the current weights
        to the servers ``urls`` as ``version``, verified (``WeightSender``, connected to them
        at the first push)."""
        ...

    async def close(self) -> None:
        """When the model is unloaded: frees it; no call may follow."""
        ...


def lora_config(shape: LoraShape, tied: bool) -> LoraConfig | None:
    """The adapters of ``shape`` as ``model.lora`` settings (None: full fine-tuning)."""
    if shape.rank == 0:
        return None
    targets = [*(ATTENTION if shape.train_attn else ()), *(MLP if shape.train_mlp else ())]
    if shape.train_unembed and not tied:
        targets.append("lm_head")
    if not targets:
        raise ValueError("LoRA rank > 0 with nothing to train: set train_attn, train_mlp or both")
    if not float(shape.alpha).is_integer():
        raise ValueError(f"LoRA alpha {shape.alpha}: trident takes whole numbers")
    return LoraConfig(r=shape.rank, alpha=int(shape.alpha), dropout=0.0, target_modules=targets)


class TinkerModel:
    """One trained model on this rank; blocking calls (:class:`LocalTrainer` runs them)."""

    def __init__(
        self,
        base_path: str,
        shape: LoraShape | None,
        cfg: TridentConfig,
        rank: int = 0,
        world: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
    ) -> None:
        """Rank ``rank`` of ``world`` (one rank: an in-memory process group, no port)."""
        fsdp.init_distributed(rank, world, master_addr, master_port)
        fsdp.set_cpu_threads(cfg.trainer.cpu_threads, sharing=world)
        self.rank, self.world = rank, world
        if cfg.run.deterministic:
            fsdp.deterministic_kernels()
        self.cfg, self.device = cfg, fsdp.device()
        # one build at a time: the adapters' initial values come from the seeded (global) RNG,
        # and two threads importing transformers' lazy modules at once can fail (seen: two
        # models restored together)
        with _BUILDING:
            self.tokenizer = load_tokenizer(base_path)
            torch.manual_seed(cfg.run.seed)
            model = load_causal_lm(base_path, fsdp.MASTER_DTYPE, self.device)
            self.vocab = int(model.config.vocab_size)  # the embedding's rows
            tied = bool(getattr(model.config, "tie_word_embeddings", False))
            model = fsdp.checkpoint_activations(model, cfg.trainer.activation_checkpointing)
            adapters = lora_config(shape, tied) if shape is not None else None
            if adapters is not None:  # the adapters train, the base weights are frozen
                model = lora.wrap(model, adapters)
        self.model = fsdp.shard(model, cfg.model.dtype)
        self.opt = self._new_optimizer()
        self.sender: WeightSender | None = None  # the weight push, made by the first push

    def _new_optimizer(self) -> torch.optim.AdamW:
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return fsdp.adamw(trained, lr=0.0)  # every hyperparameter comes with each optim_step

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float],
        forward_only: bool,
    ) -> Outputs:
        """Every rank is given the same ``data``, scores ``data[rank::world]`` and returns the
        outputs of all (collective)."""
        check_loss(loss_fn, loss_fn_config)
        needed = required_inputs(loss_fn)
        for i, datum in enumerate(data):
            _check_datum(i, datum, needed, self.vocab)
        mine = list(range(self.rank, len(data), self.world))
        lengths = [len(data[i].input_tokens) for i in mine]
        budget = self.cfg.trainer.micro_batch_tokens
        local: dict[int, dict[str, torch.Tensor]] = {}
        with torch.no_grad() if forward_only else nullcontext():
            for part in even_micro_batches(lengths, budget, self.world, self.device):
                # None: a zero-weight pass (on datum 0) that keeps the FSDP collectives in step
                rows = [0] if part is None else [mine[k] for k in part]
                total = self._pass(data, rows, loss_fn, loss_fn_config)
                if part is not None:
                    local.update(total[1])
                if not forward_only:
                    # FSDP averages the ranks' gradients; each rank's loss is its share of a sum
                    (total[0] * (0.0 if part is None else self.world)).backward()
        if forward_only:
            fsdp.reshard(self.model)  # no backward pass did it
        outputs = self._gathered(local, len(data))
        loss_sum = math.fsum(float(o["elementwise_loss"].double().sum()) for o in outputs)
        return outputs, {"loss:sum": loss_sum}

    def _pass(
        self, data: Sequence[Datum], rows: list[int], loss_fn: str, config: dict[str, float]
    ) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
        """One micro-batch: the loss of ``rows`` (summed) and each row's outputs."""
        logp = self._logprobs([data[i] for i in rows])
        total = logp.new_zeros(())
        outputs = {}
        for k, i in enumerate(rows):
            mine = logp[k, : len(data[i].input_tokens)]
            loss = tinker_loss(loss_fn, mine, data[i].loss_inputs, config)
            total = total + loss.sum()
            outputs[i] = {
                "logprobs": mine.detach().float().cpu(),
                "elementwise_loss": loss.detach().float().cpu(),
            }
        return total, outputs

    def _gathered(
        self, local: dict[int, dict[str, torch.Tensor]], n: int
    ) -> list[dict[str, torch.Tensor]]:
        """Every rank's outputs, in datum order (collective when ``world`` > 1)."""
        parts: list[Any] = [local]
        if self.world > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, local)
        merged = {i: out for part in parts for i, out in part.items()}
        return [merged[i] for i in range(n)]

    def _logprobs(self, data: list[Datum]) -> torch.Tensor:
        """[b, W] logprobs of each datum's targets, right-padded to the longest."""
        width = max(len(d.input_tokens) for d in data)
        ids = torch.zeros((len(data), width), dtype=torch.long)
        attention = torch.zeros_like(ids)
        targets = torch.zeros_like(ids)
        for k, d in enumerate(data):
            n = len(d.input_tokens)
            ids[k, :n], attention[k, :n] = d.input_tokens, 1
            targets[k, :n] = d.loss_inputs["target_tokens"]
        unused = torch.zeros((len(data), width - 1))  # the Sample-side columns: not read here
        batch = Batch(ids, attention, unused, unused, unused.long()).to(self.device)
        logp, _ = token_logprobs(
            self.model, batch, 1.0, chunk_tokens=self.cfg.trainer.logprob_chunk_tokens,
            targets=targets.to(self.device),
        )  # fmt: skip
        return logp

    def optim_step(self, adam: AdamParams) -> dict[str, float]:
        for group in self.opt.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        # clip_grad_norm_ at an infinite norm scales by exactly 1: the norm, and no clip
        max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
        return {"grad_norm": fsdp.clip_and_step(self.model, self.opt, max_norm)}

    def save_state(self, out_dir: str) -> None:
        stepped = bool(self.opt.state)
        extra = {"optimizer": stepped, "torch_rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            extra["cuda_rng"] = torch.cuda.get_rng_state_all()
        parts = {"model": (self.model, self.opt if stepped else None)}
        fsdp.save_training_state(out_dir, parts, extra)

    def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        extra = fsdp.load_extra(ckpt_dir)
        # pending gradients belong to the state being replaced; and torch's state-dict API
        # gives a fresh optimizer its (zero) moments only when no gradient is set
        self.model.zero_grad(set_to_none=True)
        self.opt = self._new_optimizer()
        with_moments = optimizer and extra["optimizer"]
        fsdp.load_training_state(
            ckpt_dir, {"model": (self.model, self.opt if with_moments else None)}
        )
        torch.set_rng_state(extra["torch_rng"])
        if "cuda_rng" in extra and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(extra["cuda_rng"])

    def save_hf(self, out_dir: str) -> str:
        return str(lora.save_hf(self.model, self.tokenizer, out_dir))

    def push(self, version: int, urls: list[str], backend: str) -> dict[str, float]:
        """``WeightSender.push`` of the current weights as ``version`` (collective), verified
        by the probe; the sender is connected to ``urls`` under ``backend`` (resolved:
        ``weights.backend.weight_backend``) at the first push."""
        if self.sender is None:
            c = self.cfg
            self.sender = WeightSender(
                self.rank, self.model, self.tokenizer, c.sync, c.derived.run_dir, backend,
                engine_dtype=c.model.dtype, seed=c.run.seed,
            )  # fmt: skip
            self.sender.connect(urls)
        return self.sender.push(version, urls)

    def pid(self) -> int:
        """This rank's process (a Ray group names it when the rank dies)."""
        return os.getpid()

    def release(self) -> None:
        """Before a Ray group kills the rank (and when a local trainer closes): the weight
        sync's bucket files."""
        if self.sender is not None:
            self.sender.close()


def _check_datum(i: int, datum: Datum, needed: Sequence[str], vocab: int) -> None:
    """A datum the model can score: 1-D tokens in the vocabulary, one target per input."""
    tokens = datum.input_tokens
    if tokens.dim() != 1 or len(tokens) == 0:
        raise ValueError(f"datum {i}: input_tokens must be a non-empty 1-D tensor")
    for key in needed:
        if key not in datum.loss_inputs:
            raise ValueError(f"datum {i}: loss_fn_inputs lacks {key!r} (needs {list(needed)})")
        if datum.loss_inputs[key].shape != tokens.shape:
            raise ValueError(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape "
                f"{list(datum.loss_inputs[key].shape)}, input_tokens {list(tokens.shape)}"
            )
    for name, ids in (("input_tokens", tokens), ("target_tokens", datum.loss_inputs[needed[0]])):
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"datum {i}: {name} outside the model's vocabulary of {vocab}")


class LocalTrainer:
    """The async :class:`Trainer` over one :class:`TinkerModel` in this process. The model is
    built in the worker thread as soon as this is made (a failure is raised by the first call),
    and every call runs there after the ones made before it."""

    def __init__(self, build: Callable[[], TinkerModel]) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tinker-trainer")
        self._model = self._pool.submit(build)

    async def _run(self, call: Callable[[TinkerModel], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: call(self._model.result()))

    async def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float],
        forward_only: bool,
    ) -> Outputs:
        return await self._run(
            lambda m: m.forward_backward(data, loss_fn, loss_fn_config, forward_only)
        )

    async def optim_step(self, adam: AdamParams) -> dict[str, float]:
        return await self._run(lambda m: m.optim_step(adam))

    async def save_state(self, out_dir: str) -> None:
        await self._run(lambda m: m.save_state(out_dir))

    async def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        await self._run(lambda m: m.load_state(ckpt_dir, optimizer))

    async def save_hf(self, out_dir: str) -> str:
        return await self._run(lambda m: m.save_hf(out_dir))

    async def push(self, version: int, urls: list[str], backend: str) -> dict[str, float]:
        return await self._run(lambda m: m.push(version, urls, backend))

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._release)
        self._pool.shutdown(wait=True)

    def _release(self) -> None:
        """In the worker thread, after every call before it: drop the model (and its
        optimizer), so its memory goes back; the process group stays for the next model."""
        if self._model.done() and self._model.exception() is None:
            self._model.result().release()
        closed: Future[TinkerModel] = Future()
        closed.set_exception(RuntimeError("this trainer was closed"))
        self._model = closed
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def local_trainer(base_path: str, lora_shape: LoraShape | None, cfg: TridentConfig) -> Trainer:
    """An in-process trainer (world size 1) of ``base_path`` with the adapters of
    ``lora_shape`` (None or rank 0: full fine-tuning), under ``cfg``'s ``trainer``, ``model``
    (dtype) and ``run`` (seed, deterministic) settings. Returns at once; the model loads in the
    trainer's thread."""
    return LocalTrainer(lambda: TinkerModel(base_path, lora_shape, cfg))
