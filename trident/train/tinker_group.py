"""The training service's :class:`~trident.train.tinker_ops.Trainer` over ``trainer.num_ranks``
FSDP2 ranks, each a Ray actor holding one :class:`~trident.train.tinker_ops.TinkerModel`.

The ranks are a :class:`~trident.train.group.TrainerGroup` of ``TinkerModel`` (its placement,
bounded start-up, one call on every rank with rank 0's answer, a dead rank named at once);
every rank gets the whole call and scores its share of the datums. Ray object refs are
awaitable, so the service's event loop stays free, and the group's calls are made in the
order they are awaited. Kept apart from :mod:`trident.train.tinker_ops` so that module and the
in-process trainer import no Ray.
"""

from __future__ import annotations

from trident.cluster.placement import Plan
from trident.config import TridentConfig
from trident.train.datum import AdamParams, Datum, LoraShape
from trident.train.group import TrainerGroup
from trident.train.tinker_ops import Outputs, TinkerModel, Trainer


class TinkerGroup:
    """The async Trainer over N rank actors; :func:`group_trainer` starts one."""

    def __init__(self, ranks: TrainerGroup) -> None:
        self.ranks = ranks

    async def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, float],
        forward_only: bool,
    ) -> Outputs:
        return await self.ranks.call(
            "forward_backward", data, loss_fn, loss_fn_config, forward_only
        )

    async def optim_step(self, adam: AdamParams) -> dict[str, float]:
        return await self.ranks.call("optim_step", adam)

    async def save_state(self, out_dir: str) -> None:
        await self.ranks.call("save_state", out_dir)

    async def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        await self.ranks.call("load_state", ckpt_dir, optimizer)

    async def save_hf(self, out_dir: str) -> str:
        return await self.ranks.call("save_hf", out_dir)

    async def push(self, version: int, urls: list[str], backend: str) -> dict[str, float]:
        return await self.ranks.call("push", version, urls, backend)

    async def close(self) -> None:
        self.ranks.__exit__(None, None, None)


def group_trainer(
    base_path: str, lora_shape: LoraShape | None, cfg: TridentConfig, plan: Plan | None = None
) -> Trainer:
    """``cfg.trainer.num_ranks`` ranks of ``base_path`` with the adapters of ``lora_shape``, on
    the Ray instance this process joined (``plan``: where; default, each rank's share of a
    device). Blocks until every rank has built its model (``START_TIMEOUT_S`` at most): call it
    off the event loop."""
    ranks = TrainerGroup(cfg, plan, worker=TinkerModel, worker_args=(base_path, lora_shape))
    return TinkerGroup(ranks.__enter__())
