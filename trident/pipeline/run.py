"""``trident train``: Ray, the rollout servers, the trainer, the run harness and the driver that
``pipeline.mode`` selects. Everything started here is stopped on normal exit, exception and
Ctrl-C; the run directory holds the config, metrics, trace, evals and checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import ray

from trident.cluster.placement import plan_for, reserve
from trident.cluster.process import collector_paused
from trident.cluster.ray_cluster import check_shared, init_ray
from trident.config import TridentConfig, save_config
from trident.pipeline import checkpoint, colocate_async, separate_async, sync
from trident.pipeline.harness import RunHarness, RunTrainer
from trident.pipeline.recovery import ServerRestarter
from trident.rollout.fleet import RolloutFleet, attach
from trident.rollout.router import Router
from trident.telemetry.metrics import MetricsLogger
from trident.train.group import TrainerGroup, TrainerOutOfMemory, TrainerRankError
from trident.weights.backend import SERVER_BACKENDS, served_model, weight_backend

DRIVERS: dict[str, Callable[[RunHarness], Awaitable[None]]] = {
    "sync": sync.train,
    "colocate_async": colocate_async.train,
    "separate_async": separate_async.train,
}


def run_train(cfg: TridentConfig, own_ray: bool = False) -> dict[str, Any]:
    """Start Ray, the servers and the trainer; run the harness and the driver; stop everything.
    Returns the harness's results (evals before/after, final checkpoint, pipeline summary).
    ``own_ray``: the caller started Ray for this run (``trident train`` does, while it imports
    this module); it is shut down at the end like one started here.

    A trainer rank that dies stops the run with the checkpoint to resume from; with
    ``run.max_restarts`` the run resumes from it by itself (everything restarted: exact, like
    ``--resume``), that many times, or starts over when it died before the first checkpoint
    (what the attempt wrote is set aside in ``attempts/``, like ``--resume`` does)."""
    for restart in range(cfg.run.max_restarts + 1):
        try:
            return _run_once(cfg, own_ray)
        except TrainerRankError as e:
            if restart == cfg.run.max_restarts or isinstance(e, TrainerOutOfMemory):
                raise  # out of memory: it would run out again
            ckpt = checkpoint.newest(Path(cfg.derived.run_dir))
            where = f"from {ckpt}" if ckpt else "from the start"
            print(
                f"{e}: restarting {where} ({restart + 1}/{cfg.run.max_restarts})",
                file=sys.stderr,
            )
            cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"resume": "auto"})})
    raise AssertionError("unreachable")


def _run_once(cfg: TridentConfig, own_ray: bool) -> dict[str, Any]:
    run_dir = Path(cfg.derived.run_dir)
    resume_from = checkpoint.prepare_run_dir(cfg)  # refuse, empty or resume: before anything
    save_config(cfg, run_dir)  # the run directory is complete whatever started the run
    t = cfg.telemetry
    log = MetricsLogger(
        run_dir,
        t.tensorboard,
        t.wandb_project,
        cfg.model_dump(mode="json"),
        t.mlflow_uri,
        resume_step=None if resume_from is None else checkpoint.manifest(resume_from)["step"],
    )
    started_ray = own_ray or not ray.is_initialized()
    init_ray(cfg.cluster)
    attached = bool(cfg.rollout.server_urls)  # servers started elsewhere: none of ours
    try:
        # every node must see the model and the run directory: checked in seconds, on each
        shared = {"run.dir": str((run_dir / "config.yaml").resolve())}
        if Path(cfg.model.path).exists():  # a local checkpoint (not a hub id)
            shared["model.path"] = str(Path(cfg.model.path).resolve())
        check_shared(shared)
        with contextlib.ExitStack() as stack:
            # checked in seconds, before anything starts; every role's actors go in the group
            plan = stack.enter_context(reserve(plan_for(cfg, ray.cluster_resources())))
            stack.enter_context(_resumable(run_dir))
            # attached servers were not placed here: GPUs on this cluster or not
            backend = weight_backend(cfg.sync, None if attached else plan, cfg.model.lora)
            model = served_model(backend)
            fleet, router = None, attach(cfg, model) if attached else None
            if not attached:
                server = SERVER_BACKENDS[backend]
                fleet = RolloutFleet(cfg, cfg.model.path, run_dir, server, plan, model)
            trainer = TrainerGroup(cfg, plan)
            # Both start at once (their imports and loading overlap), except where they share
            # a GPU: vLLM sizes its KV cache from the memory free while it profiles.
            _start(
                stack, trainer, fleet, together=plan.mode != "colocated",
                meanwhile=_import_transformers,
            )  # fmt: skip
            if fleet is not None:
                router = fleet.router
            assert router is not None
            pids = (fleet.pids() if fleet else {}) | trainer.pids
            results = asyncio.run(
                run(cfg, router, trainer, log, backend, resume_from, pids, fleet=fleet)
            )
    finally:
        log.close()
        if started_ray and not cfg.cluster.address:
            ray.shutdown()
    for key in ("before", "after"):
        if key in results:
            (run_dir / f"eval_{key}.json").write_text(json.dumps(results[key], indent=2) + "\n")
    return results


def _start(
    stack: contextlib.ExitStack,
    trainer: TrainerGroup,
    fleet: RolloutFleet | None,
    together: bool,
    meanwhile: Callable[[], object],
) -> None:
    """Start the servers (unless attached) and the trainer ranks, stopped by ``stack`` on exit;
    ``together``: launch both before waiting for either. Says what is starting and how long
    each took (start-up is most of a short run's time: a user should see where it goes).

    ``meanwhile`` (the driver's own start-up) runs once the first part, the servers, is
    launched, and before the trainer is: the servers' start is the critical path, and on a
    small host three imports at once slow it (demo on 2 cores, command to first step: 17.9 s
    launching the trainer first, 16.2 s after, mean of 3 each; the trainer is up seconds
    before the servers either way)."""
    parts: list[tuple[str, RolloutFleet | TrainerGroup]] = [
        (f"{trainer.cfg.trainer.num_ranks} trainer rank(s)", trainer)
    ]
    if fleet is not None:
        parts.insert(0, (f"{fleet.cfg.rollout.num_servers} rollout server(s)", fleet))
    launched: dict[str, float] = {}
    for i, (what, part) in enumerate(parts):
        stack.push(part)  # its __exit__ stops whatever it launched
        print(f"starting {what}", file=sys.stderr, flush=True)
        launched[what] = time.monotonic()
        part.launch()
        if i == 0:
            meanwhile()
        if not together:
            _ready(what, part, launched[what])
    if together:
        for what, part in sorted(parts, key=lambda p: p[1] is fleet):  # the trainer: sooner
            _ready(what, part, launched[what])


def _import_transformers() -> None:
    """Import what ``RunHarness`` loads its tokenizer with (transformers' tokenizer classes:
    ~6 s on 2 cores), so that the harness finds it imported."""
    with collector_paused():
        from transformers import AutoTokenizer  # noqa: F401


def _ready(what: str, part: RolloutFleet | TrainerGroup, launched: float) -> None:
    part.ready()
    print(f"{what} up in {time.monotonic() - launched:.1f} s", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _resumable(run_dir: Path) -> Iterator[None]:
    """A trainer rank's death ends the run with the checkpoint to resume from."""
    try:
        yield
    except TrainerRankError as e:
        ckpt = checkpoint.newest(run_dir)
        where = f"resume from {ckpt} with --resume" if ckpt else "no checkpoint to resume from yet"
        raise type(e)(f"{e}; {where}") from None


async def run(
    cfg: TridentConfig,
    router: Router,
    trainer: RunTrainer,
    log: MetricsLogger,
    backend: str,
    resume_from: Path | None = None,
    pids: dict[str, int] | None = None,
    fleet: ServerRestarter | None = None,
) -> dict[str, Any]:
    """The run on servers and a trainer that are up: begin (from ``resume_from``, a
    checkpoint, when given), the schedule, finish; all under the hang watchdog (``pids``: the
    processes whose stacks it dumps). ``backend``: the weight backend (``weight_backend``, the
    servers started for it); ``fleet`` restarts a server that dies."""
    harness = RunHarness(cfg, router, trainer, log, backend, pids, fleet)

    async def body() -> dict[str, Any]:
        try:
            await harness.begin(resume_from)
            await DRIVERS[cfg.pipeline.mode](harness)
            return await harness.finish()
        finally:
            await harness.close()

    return await harness.watchdog.guard(body())
