"""LoRA on the policy (``model.lora``, peft): the adapters train; the servers get the adapters
(``model.lora.sync=adapter``: ``adapter_tensors``, ``trident.weights.adapter``) or the merged
weights.

``wrap`` puts peft's LoRA layers on the loaded model before FSDP2 shards it: the base weights
are frozen (``requires_grad=False``, which FSDP2 allows beside trainable adapters in one unit),
so the optimizer, which takes only parameters that require a gradient, holds state for the
adapters alone.

The merged sync (``model.lora.sync=merged``) and the HF export send the merged model under the
base model's names: ``MergedWeights`` yields, for each adapted linear layer, ``W + (B @ A) * alpha / r`` as ``<layer>.weight`` (peft's
``scaling``), the base layer's bias as ``<layer>.bias``, drops the ``lora_*`` tensors and strips
peft's ``base_model.model.`` prefix. The weight sync streams it to servers that then need know
nothing of adapters, and the HF export saves it, so ``from_pretrained`` loads a plain model.
Either way the probe the servers must reproduce comes from the adapter model itself, so a wrong
merge or a wrongly loaded adapter fails the sync's verification.

Simplifications: adapters on ``nn.Linear`` layers only (peft's embedding and convolution
adapters are refused); one active adapter; the merge is computed in float32, one layer at a
time as the stream reaches it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from trident.weights.tensors import full_tensor

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from trident.config.schema import LoraConfig

PREFIX = "base_model.model."  # what peft's PeftModel puts before the base model's names
_LORA = (".lora_A.", ".lora_B.", ".lora_embedding_", ".lora_magnitude_vector")


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` inside peft's ``PeftModel`` with LoRA adapters on ``cfg.target_modules``; the
    base weights are frozen. Call before ``fsdp.shard``."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.tuners.lora import Linear, LoraLayer

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(cast("PreTrainedModel", model), peft_cfg)
    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, Linear):
            raise ValueError(
                f"model.lora.target_modules: {name} is a {type(module).__name__}; trident "
                "merges adapters on nn.Linear layers only"
            )
    return wrapped


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``wrap``-ped (peft) model."""
    return callable(getattr(model, "get_base_model", None))


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft model (its layers carry the adapters), or
    ``model``."""
    get = getattr(model, "get_base_model", None)
    return cast(torch.nn.Module, get()) if callable(get) else model


def base_name(name: str) -> str:
    """The base model's name of a peft parameter name."""
    return name.removeprefix(PREFIX).replace(".base_layer.", ".")


class MergedWeights:
    """The merged model as ``(base name, tensor)`` pairs, in state-dict order; iterable again
    and again (a GPU backend sends the stream once per server).

    Unadapted tensors are yielded as they are. An adapted layer's weight is merged shard by
    shard: FSDP2 shards W [out, in] and B [out, r] alike along ``out``, so this rank's rows of
    the merged weight are ``W_local + (B_local @ A) * scaling`` with A whole, and it is yielded
    as a DTensor with W's layout. Iterating therefore runs no collective: the consumer gathers
    each tensor when it sends it (``full_tensor``), in the stream's order on every rank, as for
    the plain model. The adapters' A are gathered once, by the constructor (collective: every
    rank constructs it at the same point)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.state = model.state_dict()
        self.a: dict[str, torch.Tensor] = {}  # adapted layer -> its whole A (float32)
        self.scaling: dict[str, float] = {}
        for name in self.state:
            layer, _, leaf = name.rpartition(".base_layer.")
            if layer and leaf == "weight":
                module = cast("LoraLayer", self.model.get_submodule(layer))
                (adapter,) = module.active_adapters
                self.a[layer] = full_tensor(self.state[f"{layer}.lora_A.{adapter}.weight"]).float()
                self.scaling[layer] = float(module.scaling[adapter])
                self.b_name = f"lora_B.{adapter}.weight"

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.state.items():
            if any(marker in name for marker in _LORA):
                continue
            layer, _, leaf = name.rpartition(".base_layer.")
            if layer in self.a and leaf == "weight":
                b = self.state[f"{layer}.{self.b_name}"]
                yield base_name(name), _merge(tensor, b, self.a[layer], self.scaling[layer])
            else:
                yield base_name(name), tensor.detach()


def _merge(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + (B @ A) * scaling, on this rank's rows when W and B are FSDP2 shards."""
    from torch.distributed.tensor import DTensor

    if not isinstance(w, DTensor):
        return (w.detach().float() + (b.detach().float() @ a) * scaling).to(w.dtype)
    if not isinstance(b, DTensor) or b.placements != w.placements:
        raise ValueError(f"LoRA merge: B is not sharded like W ({b} vs {w.placements})")
    local = w.to_local().detach()
    merged = local.float() + (b.to_local().detach().float() @ a.to(local.device)) * scaling
    return DTensor.from_local(
        merged.to(local.dtype), w.device_mesh, w.placements, run_check=False,
        shape=w.shape, stride=w.stride(),
    )  # fmt: skip


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters alone, as peft saves them (``...lora_A.weight``: the adapter's name dropped,
    peft's prefix kept), in state-dict order; FSDP2 shards as they are (the consumer gathers
    each: ``trident.weights.adapter``)."""
    for name, tensor in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            layer, kind, leaf = name.rpartition(".lora_A." if ".lora_A." in name else ".lora_B.")
            yield f"{layer}{kind}{leaf.split('.', 1)[1]}", tensor.detach()


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """peft's ``adapter_config.json`` of the policy's one adapter, which vLLM reads."""
    (config,) = cast("Any", model).peft_config.values()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}


def save_hf(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path
) -> Path:
    """``model`` as an HF checkpoint in ``out_dir``, a LoRA model merged into its base, so
    ``from_pretrained`` loads a plain model (collective)."""
    from trident.train import fsdp

    merged = merged_state_dict(model) if is_lora(model) else None
    base = cast("PreTrainedModel", base_model(model))
    return fsdp.save_hf(base, tokenizer, out_dir, state=merged)


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole merged model on CPU, under the base model's names (collective)."""
    return {name: full_tensor(t).cpu() for name, t in MergedWeights(model)}
