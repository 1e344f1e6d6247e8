"""The rollout servers as Ray actors: ``RolloutFleet`` starts ``rollout.num_servers`` vLLM
servers inside ``RolloutServerActor``s (so they land on whichever node has room), hands out a
``Router`` over them, restarts one that died (``restart``: same node, same port), and stops them
on exit, exception or Ctrl-C."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from trident.cluster.net import check_port_free, node_ip, single_node
from trident.cluster.placement import Plan, make_plan
from trident.config import TridentConfig
from trident.rollout.engine import ADAPTER_MODEL, SERVED_MODEL, VLLMClient
from trident.rollout.router import Router
from trident.rollout.vllm_server import ServerStartError, lora_server_args


def server_options(
    cfg: TridentConfig, weight_transfer: str | None, model: str = SERVED_MODEL
) -> dict[str, Any]:
    """``VLLMServer``'s options from the config (the fleet's servers and ``trident rollout
    serve``'s are started alike); ``model``: the name the policy is served under, resolved with
    the weight backend (``trident.weights.backend.served_model``)."""
    rc = cfg.rollout
    args, env = list(rc.extra_server_args), {}
    if model == ADAPTER_MODEL:  # the servers load the policy's adapters
        assert cfg.model.lora is not None
        lora_args, env = lora_server_args(cfg.model.lora.r)
        args = lora_args + args
    if rc.sleep_level:  # the engine frees its GPU memory while the trainer trains
        args = ["--enable-sleep-mode", *args]
    return dict(
        dtype=cfg.model.dtype,
        max_model_len=rc.max_model_len,
        kv_cache_gib=rc.kv_cache_gib,
        gpu_memory_utilization=rc.gpu_memory_utilization,
        weight_transfer_backend=weight_transfer,
        extra_args=args,
        extra_env=env,
        seed=cfg.run.seed,
        cpu_threads=rc.cpu_threads,
        # sync mode: the trainer ranks idle while the servers generate
        cpu_sharing=rc.num_servers + (cfg.trainer.num_ranks if cfg.pipeline.mode != "sync" else 0),
    )


def clients(cfg: TridentConfig, urls: list[str], model: str = SERVED_MODEL) -> list[VLLMClient]:
    """A client per server, for the rollout's requests, which ask for ``model``."""
    timeout = cfg.rollout.request_timeout_s
    return [VLLMClient(u, timeout_s=timeout, model=model) for u in urls]


def attach(cfg: TridentConfig, model: str = SERVED_MODEL) -> Router:
    """A ``Router`` over ``rollout.server_urls``, servers trident did not start: each must
    answer ``/health``, serve trident's model name and report a weight version (trident's
    weight-transfer plugin, which ``trident rollout serve`` loads). Raises ``ServerStartError``
    naming the server and what is missing."""
    import httpx

    rc = cfg.rollout
    for url in rc.server_urls:
        url = url.rstrip("/")
        try:
            httpx.get(f"{url}/health", timeout=10).raise_for_status()
            models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
            info = httpx.get(f"{url}/weight_info", timeout=10)
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise ServerStartError(
                f"rollout server {url} (rollout.server_urls) does not answer: {e}"
            ) from None
        names = [m["id"] for m in models]
        if SERVED_MODEL not in names or info.status_code != 200:
            raise ServerStartError(
                f"rollout server {url} (rollout.server_urls) was not started by `trident rollout "
                f"serve`: it serves {names}, weight info {info.status_code} (needs model name "
                f"{SERVED_MODEL!r} and trident's weight transfer)"
            )
        root = next(m.get("root") for m in models if m["id"] == SERVED_MODEL)
        version = info.json().get("weight_version")
        print(f"attached to rollout server {url} ({root}, weight version {version})", flush=True)
    return Router(clients(cfg, rc.server_urls, model))


@ray.remote
class RolloutServerActor:
    """Hosts one VLLMServer process on the node Ray placed this actor on."""

    def __init__(self, model_path: str, log_path: str, options: dict[str, Any]) -> None:
        from trident.rollout.vllm_server import VLLMServer

        self.server = VLLMServer(model_path, log_path, host=node_ip(), **options)

    def start(self, timeout_s: float) -> str:
        return self.server.start(timeout_s)

    def restart(self, timeout_s: float) -> str:
        """Stop what is left of the server (its whole process group) and start it again on
        the same port, from the model path (the caller then pushes the served weights)."""
        self.server.stop()
        return self.server.start(timeout_s)

    def stop(self) -> None:
        self.server.stop()

    def node(self) -> str:
        """The Ray node this server runs on."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """The vLLM API server's process id (for stack dumps)."""
        return self.server.proc.pid if self.server.proc is not None else -1


class RolloutFleet(AbstractContextManager):
    """Starts ``rollout.num_servers`` vLLM servers; ``.router`` talks to them; stops them on exit."""

    def __init__(
        self,
        cfg: TridentConfig,
        model_path: str,
        run_dir: str | Path,
        weight_transfer: str | None = None,
        plan: Plan | None = None,
        model: str = SERVED_MODEL,
    ) -> None:
        """``plan``: where the servers run (``trident.cluster.placement``); by default each
        asks for its share of a device of the cluster, outside any placement group; ``model``:
        the name the policy is served under (``server_options``)."""
        self.cfg, self.model_path, self.model = cfg, model_path, model
        self.plan = plan
        self.log_dir = Path(run_dir) / "logs"
        self.weight_transfer = weight_transfer
        self.actors: list[Any] = []
        self._starts: list[Any] = []  # each actor's start call (launch), awaited by ready
        self.nodes: dict[str, str] = {}  # url -> Ray node id (a restart keeps both)
        self._router: Router | None = None

    def __enter__(self) -> RolloutFleet:
        self.launch()
        return self.ready()

    def launch(self) -> None:
        """Create the server actors and ask each to start its server; returns at once
        (``ready`` waits), so that the trainer can start meanwhile."""
        rc = self.cfg.rollout
        options = server_options(self.cfg, self.weight_transfer, self.model)
        c = self.cfg.cluster
        plan = self.plan = self.plan or make_plan(
            c.placement, 0, rc.num_servers, ray.cluster_resources(), c.role_resources
        )
        ports = [rc.base_port + i if rc.base_port else 0 for i in range(rc.num_servers)]
        if single_node():  # fail before any actor starts; on a cluster the actor's node checks
            for port in filter(None, ports):
                check_port_free(port)
        for i, port in enumerate(ports):
            log = str(self.log_path(i).resolve())
            actor = RolloutServerActor.options(**plan.actor_options("rollout", i)).remote(
                self.model_path, log, {**options, "port": port}
            )
            self.actors.append(actor)
        self._starts = [a.start.remote(rc.startup_timeout_s) for a in self.actors]

    def ready(self) -> RolloutFleet:
        """Wait until every server launched answers (stopping them all if one does not)."""
        rc = self.cfg.rollout
        try:
            # bounded even when an actor cannot be placed (its own start has the same timeout)
            urls = ray.get(self._starts, timeout=rc.startup_timeout_s + 60)
        except RayTaskError as e:
            self.__exit__(None, None, None)
            raise e.as_instanceof_cause() from None
        except GetTimeoutError:
            self.__exit__(None, None, None)
            res = self.plan.slot("rollout", 0).resources if self.plan and rc.num_servers else {}
            raise ServerStartError(
                f"{rc.num_servers} rollout server(s) asking for {res} each were not up within "
                f"{rc.startup_timeout_s + 60:.0f} s; cluster resources: {ray.cluster_resources()}"
            ) from None
        nodes = ray.get([a.node.remote() for a in self.actors], timeout=30)
        self.nodes = dict(zip(urls, nodes, strict=True))
        self._router = Router(clients(self.cfg, urls, self.model))
        return self

    async def restart(self, i: int) -> VLLMClient:
        """Restart server ``i`` (same url); a client for it once it answers ``/health``. Raises
        ``ServerStartError`` with its log tail if it does not come back."""
        rc = self.cfg.rollout
        try:
            url = await self.actors[i].restart.remote(rc.startup_timeout_s)
        except RayTaskError as e:
            raise e.as_instanceof_cause() from None
        return clients(self.cfg, [url], self.model)[0]

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"vllm_server_{i}.log"

    def pids(self) -> dict[str, int]:
        """Each server's process id, by log name (read once, while the servers answer)."""
        pids = ray.get([a.pid.remote() for a in self.actors], timeout=30)
        return {f"vllm_server_{i}": pid for i, pid in enumerate(pids)}

    @property
    def router(self) -> Router:
        """The ``Router`` over the started servers (inside the ``with`` block only)."""
        if self._router is None:
            raise RuntimeError("the rollout fleet is not started (use it as a context manager)")
        return self._router

    def __exit__(self, *exc: object) -> None:
        self._router = None  # its HTTP clients belong to the event loops that used them
        for a in self.actors:
            # The actor may already be dead; killing it kills its server too (PR_SET_PDEATHSIG).
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(), timeout=30)
            ray.kill(a)
        self.actors = []
