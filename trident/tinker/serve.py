"""``trident tinker serve``: the Tinker API service on trident's own parts (issue #51): the
trainer (in-process for ``trainer.num_ranks=1``, a Ray group of ranks otherwise), the vLLM
servers (started here as a ``RolloutFleet``, or attached: ``rollout.server_urls``, e.g. from
``trident rollout serve``, so a restart needs no vLLM cold start), the ``TinkerService`` on
``tinker.state_dir`` and uvicorn on ``tinker.host:tinker.port``.

One vLLM model per server: the servers serve the local checkpoint that ``tinker.models`` names
(every alias must name the same one), and a ``create_model`` of another base model is refused.
Everything is checked before anything starts; everything started is stopped on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.config import ConfigError, TridentConfig
from trident.train.datum import LoraShape

if TYPE_CHECKING:
    from trident.cluster.placement import Plan
    from trident.tinker.sampling import Sampling
    from trident.train.tinker_ops import Trainer


def served_checkpoint(cfg: TridentConfig) -> str:
    """The one local checkpoint the ``tinker.models`` aliases name; a ``ConfigError`` if
    there is none, several, or it is not a checkpoint directory."""
    paths = {str(Path(p).resolve()) for p in cfg.tinker.models.values()}
    if len(paths) != 1:
        raise ConfigError(
            "tinker.models must name one local checkpoint (one vLLM model per server), e.g. "
            f"tinker.models='{{tiny: runs/tiny}}'; got {dict(cfg.tinker.models) or 'none'}"
        )
    path = paths.pop()
    if not Path(path, "config.json").is_file():
        raise ConfigError(f"tinker.models: {path} is not a model checkpoint (no config.json)")
    return path


def serve(cfg: TridentConfig) -> None:
    """Start everything, serve until Ctrl-C or SIGTERM, stop everything."""
    base_path = served_checkpoint(cfg)  # before anything starts
    import ray

    from trident.cluster.placement import plan_for, reserve
    from trident.cluster.ray_cluster import init_ray
    from trident.rollout.engine import SERVED_MODEL
    from trident.rollout.fleet import RolloutFleet, attach, clients
    from trident.rollout.router import Router
    from trident.tinker.sampling import Sampling
    from trident.weights.backend import SERVER_BACKENDS, served_model, weight_backend

    attached = bool(cfg.rollout.server_urls)
    backend = weight_backend(cfg.sync, None, cfg.model.lora)
    model = served_model(backend)
    # Ray places the servers trident starts and the ranks of a group; attached servers and an
    # in-process trainer need none (a restart then takes seconds)
    uses_ray = not attached or cfg.trainer.num_ranks > 1
    if uses_ray:
        init_ray(cfg.cluster)
    try:
        with contextlib.ExitStack() as stack:
            plan = None  # an in-process trainer takes no place in Ray's plan
            if cfg.trainer.num_ranks > 1:
                plan = stack.enter_context(reserve(plan_for(cfg, ray.cluster_resources())))
            if attached:
                router = attach(cfg, model)
            else:
                run_dir = cfg.derived.run_dir
                fleet = RolloutFleet(cfg, base_path, run_dir, SERVER_BACKENDS[backend], plan, model)
                print(f"starting {cfg.rollout.num_servers} rollout server(s)", file=sys.stderr)
                router = stack.enter_context(fleet).router
            base_router = None
            if model != SERVED_MODEL:  # adapters: the base model is asked for by its own name
                base_router = Router(clients(cfg, router.urls, SERVED_MODEL))
            sampling = Sampling(
                router, backend, base_path, base_router, fresh=not attached,
                default_max_tokens=cfg.rollout.max_tokens,
            )  # fmt: skip
            asyncio.run(_serve(cfg, sampling, plan))
    finally:
        if uses_ray and not cfg.cluster.address:
            ray.shutdown()


async def _serve(cfg: TridentConfig, sampling: Sampling, plan: Plan | None) -> None:
    import uvicorn

    from trident.tinker import wire
    from trident.tinker.server import create_app
    from trident.tinker.service import ServiceSettings, TinkerService
    from trident.train.tinker_ops import local_trainer

    tc = cfg.tinker

    def make_trainer(base: str, lora: LoraShape | None) -> Trainer:
        if cfg.trainer.num_ranks == 1:
            return local_trainer(base, lora, cfg)
        from trident.train.tinker_group import group_trainer

        return group_trainer(base, lora, cfg, plan)

    def decode(kind: str, body: bytes) -> Any:
        return wire.decode_call(kind, body, lora_alpha=tc.lora_alpha).args

    settings = ServiceSettings(Path(tc.state_dir), dict(tc.models), tc.snapshot_every)
    service = TinkerService(settings, make_trainer, decode, sampling)
    await service.start()  # a restart's replay and re-push begin before the first request
    server = uvicorn.Server(
        uvicorn.Config(create_app(service, tc), host=tc.host, port=tc.port, log_level="warning")
    )
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        if server.started:  # else the serve task's own error follows
            url = f"http://{tc.host}:{tc.port}"
            key = tc.api_keys[0] if tc.api_keys else "tml-local"
            print(
                f"tinker service at {url}: export TINKER_BASE_URL={url} TINKER_API_KEY={key}",
                flush=True,
            )
        await serving
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        await service.close()
