"""FSDP2 plumbing shared by SFT and the RL trainer: process groups, sharding, full state dicts.

One rank is a real (world size 1) FSDP2 run, so the code path is the same at 1 and N ranks.
gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist

from trident.cluster.process import cores_each
from trident.weights.tensors import full_tensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        )
    return torch.device("cpu")


def set_cpu_threads(n: int, sharing: int = 1) -> None:
    """Torch intra-op threads for this rank on a CPU host: ``n`` when ``n > 0``; ``n = 0`` (auto)
    splits this host's cores among the ``sharing`` processes that compute at the same time.
    Oversubscribed threads spin against each other (one per rank was 2-5x faster than torch's
    default beside busy rollout servers), while a rank alone on its cores trains ~1.4x faster
    with all of them (demo recipe, 2 cores, sync mode: train 0.88-1.05 s vs 1.30-1.48 s)."""
    if torch.cuda.is_available():
        return
    torch.set_num_threads(n or cores_each(sharing))


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """Join the ranks' process group at ``master_addr:master_port`` (rank 0 hosts its store).
    A single rank has no one to meet: its store is in memory, so no port is bound, none that
    another process could have taken since it was picked (seen: EADDRINUSE while servers
    restarted)."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(device())
    timeout = datetime.timedelta(minutes=10)
    if world_size == 1:
        store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]  (documented API)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(
        backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


# What the trained weights and their optimizer state are kept in, whatever model.dtype: in half
# precision ``shard`` computes in it over these float32 master weights, on GPUs and CPUs alike.
# AdamW on half-precision weights drops every update under a weight's resolution (bfloat16 keeps
# 8 bits: at lr 1e-6 nothing moves).
MASTER_DTYPE = "float32"


def checkpoint_activations(model: ModuleT, enabled: bool) -> ModuleT:
    """``trainer.activation_checkpointing``: each decoder layer is recomputed in the backward
    pass from its saved input (transformers' ``gradient_checkpointing_enable``, non-reentrant,
    which composes with FSDP2's hooks). transformers recomputes only in training mode, so the
    model is put in it (the config's dropout, 0 in the usual LM configs, then applies). Call
    before ``shard``."""
    if enabled:
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(
                f"trainer.activation_checkpointing: {type(model).__name__} does not support "
                "gradient checkpointing"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    return model


def adamw(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.01,
) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel (transformers' default ``adamw_torch_fused``, so TRL's):
    one pass over every tensor, where torch's default on a CPU loops over the tensors in Python
    ops. One step over the ``small`` preset's 25.7 M float32 parameters, 2 cores: 75 ms as a
    loop, 18 ms fused. FSDP2's DTensor parameters run it on their local shards."""
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True)


def clip_and_step(model: torch.nn.Module, opt: torch.optim.Optimizer, max_norm: float) -> float:
    """Clip the gradients to the global norm ``max_norm`` (``math.inf``: no clipping; the
    gradients are then scaled by exactly 1), step ``opt`` and drop the gradients; returns the
    norm before clipping (collective: the norm is gathered over the ranks' shards)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = full_tensor(grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(grad_norm)


def deterministic_kernels() -> None:
    """``run.deterministic``: torch's deterministic kernels, without its NaN-filling of every new
    tensor, a debugging aid that changes no result of code that reads what it wrote: 7% of the
    small preset's bfloat16 step on CPU (3.49 s against 3.24 s, interleaved; 3.14 s without
    deterministic kernels). The module is an object with this documented property, which
    pyright cannot see.

    On CUDA, torch's deterministic mode raises at the first cuBLAS matmul unless cuBLAS runs
    with a fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, NVIDIA's cuBLAS docs, "Results
    reproducibility"). The workspace is sized at the process's first cuBLAS call, so it is set
    here, before a rank's first matmul; a value the user set is kept."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    deterministic = torch.utils.deterministic
    deterministic.fill_uninitialized_memory = False  # pyright: ignore[reportAttributeAccessIssue]


PER_LAYER_PARAMS = 100_000_000  # on one rank, wrap each decoder layer from this size on


def shard(model: ModuleT, compute_dtype: str = "float32") -> ModuleT:
    """fully_shard each decoder layer, then the root (the usual FSDP2 wrapping of an HF LM).
    With a half-precision ``compute_dtype`` the (float32, ``MASTER_DTYPE``) parameters are cast
    to it for forward and backward and gradients are reduced in float32 (FSDP2's
    ``MixedPrecisionPolicy``, on GPUs and CPUs); logprobs are taken in float32 either way
    (``token_logprobs``). On a CPU with AMX, bfloat16 trained the ``small`` preset's step 1.8x
    faster than float32 (4.3 s vs 7.8 s, 2 cores).

    On one rank FSDP2 shards nothing, and its DTensor parameters cost the optimizer and the
    gradient clip their per-tensor dispatch: there a model under ``PER_LAYER_PARAMS`` is left
    unwrapped unless it computes in a half precision over float32 master weights (the
    mixed-precision policy is FSDP2's). On the demo recipe's grids the step was 1.17x its
    plain-PyTorch floor wrapped and 1.09x unwrapped (median of 12, interleaved, 2 runs each).
    Wrapped on one rank, a small model has only the root wrapped (per-layer hooks cost ~25% of a
    tiny model's step on CPU); a large one is wrapped per layer: the root alone keeps an
    unsharded copy of every parameter and of every gradient through the whole backward pass
    (measured at Qwen2.5-0.5B's shape: the rank reached 14 GB and was killed; per layer, one
    layer's copies at a time)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if compute_dtype != "float32":
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, compute_dtype), reduce_dtype=torch.float32
        )
    large = sum(p.numel() for p in model.parameters()) >= PER_LAYER_PARAMS
    if dist.get_world_size() == 1 and not kwargs and not large:
        return model
    if dist.get_world_size() > 1 or large:
        for layer in _decoder_layers(model):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def reshard(model: torch.nn.Module) -> None:
    """Return every FSDP2 unit of ``model`` to its sharded state. FSDP2 leaves the root
    unsharded after a forward pass, for the backward pass it expects; after a forward pass with
    none, the root's registered parameters would stay the unsharded ones, which hold no
    gradient, so a gradient norm or a state dict taken then would miss the sharded ones."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """An HF causal LM's decoder layers (``model.model.layers``), inside a peft model too."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return list(getattr(getattr(base, "model", base), "layers", []))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (collective: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return cast(dict[str, torch.Tensor], state)  # full_state_dict: whole tensors, no shards


def save_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save an HF-format checkpoint (collective; rank 0 writes) of ``model``'s weights, or of
    ``state`` (whole tensors under ``model``'s names: a LoRA policy's merged weights)."""
    state = full_state_dict(model) if state is None else state
    out = Path(out_dir)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
    dist.barrier()
    return out


def _trained_only(model: torch.nn.Module):
    """Checkpoints hold the trained parameters only: frozen ones (a LoRA policy's base weights)
    are the checkpoint the model was loaded from, and are loaded from it again on resume (so
    only a model with none is loaded strictly)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


# a model and its optimizer; None: the model alone (an optimizer that has not stepped yet has
# no moments, and torch's state-dict API would give it some by stepping it with zero gradients)
Parts = Mapping[str, tuple[torch.nn.Module, torch.optim.Optimizer | None]]


def _state_dicts(parts: Parts) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    state: dict = {}
    for name, (model, opt) in parts.items():
        if opt is None:
            state[f"{name}.model"] = get_model_state_dict(model, options=_trained_only(model))
        else:
            state[f"{name}.model"], state[f"{name}.optim"] = get_state_dict(
                model, opt, options=_trained_only(model)
            )
    return state


def save_training_state(path: str | Path, parts: Parts, extra: dict) -> None:
    """Every model and optimizer of ``parts`` with ``torch.distributed.checkpoint`` (each rank
    writes its own shards, so N ranks save and load without a gather), plus this rank's
    non-tensor state ``extra`` (schedulers, controllers, RNG) beside them. Collective."""
    from torch.distributed.checkpoint.state_dict_saver import save

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = _state_dicts(parts)
    save(state, checkpoint_id=str(out), no_dist=dist.get_world_size() == 1)
    torch.save(extra, out / f"extra_rank{dist.get_rank()}.pt")
    dist.barrier()


def load_training_state(path: str | Path, parts: Parts) -> dict:
    """Load what ``save_training_state`` wrote into ``parts`` (in place; a part's optimizer
    None: its model alone, whether or not one was saved); returns this rank's ``extra`` (rank
    0's when the run had fewer ranks). Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    src = Path(path)
    state = _state_dicts(parts)
    load(state, checkpoint_id=str(src))
    for name, (model, opt) in parts.items():
        if opt is None:
            set_model_state_dict(model, state[f"{name}.model"], options=_trained_only(model))
            continue
        set_state_dict(
            model,
            opt,
            model_state_dict=state[f"{name}.model"],
            optim_state_dict=state[f"{name}.optim"],
            options=_trained_only(model),
        )
    return load_extra(src)


def load_extra(path: str | Path) -> dict:
    """This rank's ``extra`` of what ``save_training_state`` wrote in ``path`` (rank 0's when
    the run had fewer ranks), without loading its tensors."""
    mine = Path(path) / f"extra_rank{dist.get_rank()}.pt"
    return torch.load(mine if mine.exists() else Path(path) / "extra_rank0.pt", weights_only=False)


def cosine_lr(step: int, total: int, warmup: int, schedule: str = "cosine") -> float:
    """Multiplier of the peak learning rate: linear warm-up, then cosine decay to 10% or constant."""
    import math

    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
