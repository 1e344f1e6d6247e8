"""Placement: which role runs on which device, reserved as one Ray placement group.

A plan has one bundle per device and a slot per actor (trainer rank or rollout server), naming
its bundle and the share of it the actor asks for (``cluster.placement``):

- ``colocated``: trainer rank i and rollout server i share device i (half a GPU each, so Ray
  gives both the same device; the engine keeps to ``rollout.gpu_memory_utilization`` of its
  memory and the trainer has the rest). ``max(ranks, servers)`` devices.
- ``disaggregated``: a trainer pool and a rollout pool, one whole device per actor.
  ``ranks + servers`` devices.
- ``auto`` (the default): ``disaggregated`` when the cluster has a device for every actor,
  ``colocated`` otherwise, so a one-GPU box runs colocated.

Reward models (``reward_model`` entries of ``reward.fns``) share one more bundle, the last,
holding what their actors ask for (their ``num_gpus``, ``num_cpus``): the run's group is named
``RUN_PLACEMENT_GROUP`` and a reward model's actor is scheduled into its last bundle
(``trident.rewards.model``), so a plan that reserves every GPU still has room for it.

On a cluster without GPUs every actor gets a bundle of half a CPU (the OS, not Ray, shares the
cores of a laptop between them). ``reserve`` checks the plan against ``ray.cluster_resources()``
and fails in seconds with what is missing, then waits a bounded time for the group (a bundle
must fit on one node, which the totals do not show). ``trident train --dry-run`` prints the
plan (``describe``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from trident.config import TridentConfig

DeviceRole = Literal["trainer", "rollout"]  # the roles cluster.role_resources names
Role = Literal[DeviceRole, "reward"]
RESERVE_TIMEOUT_S = 30.0
_ROLE_NAMES = {"trainer": "trainer rank", "rollout": "rollout server", "reward": "reward model"}


class PlacementError(RuntimeError):
    """The roles a run asks for do not fit the cluster's resources."""


@dataclass(frozen=True)
class Slot:
    role: Role
    index: int  # trainer rank or server index
    bundle: int
    resources: dict[str, float]  # Ray actor options: num_gpus, num_cpus
    custom: dict[str, float] = field(default_factory=dict)  # cluster.role_resources


@dataclass(frozen=True)
class Plan:
    mode: Literal["colocated", "disaggregated", "cpu"]
    bundles: list[dict[str, float]]  # Ray resources of each bundle: {"GPU": 1, "CPU": 2}
    slots: list[Slot]
    group: Any = field(default=None, compare=False)  # the reserved PlacementGroup, if any

    def slot(self, role: Role, index: int) -> Slot:
        return next(s for s in self.slots if s.role == role and s.index == index)

    def actor_options(self, role: Role, index: int) -> dict[str, Any]:
        """Ray ``.options(...)`` for the actor of ``role`` number ``index``: its share of its
        bundle, in the reserved group when there is one."""
        slot = self.slot(role, index)
        options: dict[str, Any] = dict(slot.resources)
        if slot.custom:
            options["resources"] = dict(slot.custom)
        if self.group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self.group, placement_group_bundle_index=slot.bundle
            )
        return options

    def describe(self) -> str:
        """The plan as a user reads it: one line per bundle, with the actors on it."""
        devices = "GPU" if self.mode != "cpu" else "CPU bundle"
        lines = [f"placement: {self.mode}, {len(self.bundles)} {devices}(s)"]
        for b, resources in enumerate(self.bundles):
            on = [
                f"{_ROLE_NAMES[s.role]} {s.index} ({_share(s.resources | s.custom)})"
                for s in self.slots
                if s.bundle == b
            ]
            lines.append(f"  bundle {b} {_share(resources)}: {', '.join(on)}")
        return "\n".join(lines)


def _share(resources: Mapping[str, float]) -> str:
    names = {"num_gpus": "GPU", "num_cpus": "CPU"}
    return ", ".join(f"{v:g} {names.get(k, k)}" for k, v in resources.items())


def make_plan(
    placement: str,
    num_ranks: int,
    num_servers: int,
    cluster: Mapping[str, float],
    custom: Mapping[DeviceRole, Mapping[str, float]] | None = None,
    reward_models: Sequence[Mapping[str, float]] = (),
) -> Plan:
    """The plan for ``num_ranks`` trainer ranks and ``num_servers`` rollout servers on a
    cluster with ``cluster`` resources (``ray.cluster_resources()``); ``custom``: the extra
    Ray resources each actor of a role asks for (``cluster.role_resources``), which its
    bundle then holds; ``reward_models``: each reward model actor's ``num_gpus``/``num_cpus``."""
    reward_gpus = sum(r.get("num_gpus", 0.0) for r in reward_models)
    plan = _with_reward_models(
        _devices_plan(placement, num_ranks, num_servers, cluster, reward_gpus), reward_models
    )
    if not custom:
        return plan
    slots = [
        Slot(s.role, s.index, s.bundle, s.resources, dict(custom.get(s.role, {})))
        if s.role != "reward"
        else s
        for s in plan.slots
    ]
    bundles = [dict(b) for b in plan.bundles]
    for slot in slots:
        for k, v in slot.custom.items():
            bundles[slot.bundle][k] = bundles[slot.bundle].get(k, 0.0) + v
    return Plan(plan.mode, bundles, slots)


def _with_reward_models(plan: Plan, reward_models: Sequence[Mapping[str, float]]) -> Plan:
    """``plan`` and one last bundle holding every reward model's share."""
    if not reward_models:
        return plan
    names = {"num_cpus": "CPU", "num_gpus": "GPU"}
    shares = [{k: float(v) for k, v in r.items() if k == "num_cpus" or v} for r in reward_models]
    bundle = {names[k]: sum(s.get(k, 0.0) for s in shares) for k in names}
    bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.5}  # a bundle is never empty
    last = len(plan.bundles)
    slots = [Slot("reward", i, last, share) for i, share in enumerate(shares)]
    return Plan(plan.mode, [*plan.bundles, bundle], [*plan.slots, *slots])


def _devices_plan(
    placement: str,
    num_ranks: int,
    num_servers: int,
    cluster: Mapping[str, float],
    reward_gpus: float = 0.0,
) -> Plan:
    actors: list[tuple[Role, int]] = []
    actors.extend(("trainer", r) for r in range(num_ranks))
    actors.extend(("rollout", i) for i in range(num_servers))
    if cluster.get("GPU", 0) < 1:
        share = {"num_cpus": 0.5}
        slots = [Slot(role, i, b, share) for b, (role, i) in enumerate(actors)]
        return Plan("cpu", [{"CPU": 0.5}] * len(actors), slots)
    gpus = int(cluster["GPU"])
    if placement == "auto":
        placement = "disaggregated" if gpus >= len(actors) + reward_gpus else "colocated"
    if placement == "disaggregated":
        whole = {"num_gpus": 1.0, "num_cpus": 1.0}
        slots = [Slot(role, i, b, whole) for b, (role, i) in enumerate(actors)]
        return Plan("disaggregated", [{"GPU": 1.0, "CPU": 1.0}] * len(actors), slots)
    if placement != "colocated":
        raise ValueError(f"cluster.placement must be auto, colocated or disaggregated: {placement}")
    half = {"num_gpus": 0.5, "num_cpus": 1.0}
    slots = [Slot(role, i, i, half) for role, i in actors]
    bundles = [
        {"GPU": 1.0, "CPU": float(sum(s.bundle == b for s in slots))}
        for b in range(max(num_ranks, num_servers))
    ]
    return Plan("colocated", bundles, slots)


def plan_for(cfg: TridentConfig, cluster: Mapping[str, float]) -> Plan:
    """The run's plan: its trainer ranks, and its rollout servers unless it attaches to servers
    started elsewhere (``rollout.server_urls``)."""
    from trident.rewards.model import actor_resources

    servers = 0 if cfg.rollout.server_urls else cfg.rollout.num_servers
    c = cfg.cluster
    rms = [actor_resources(f.kwargs) for f in cfg.reward.fns if f.name == "reward_model"]
    plan = make_plan(c.placement, cfg.trainer.num_ranks, servers, cluster, c.role_resources, rms)
    if cfg.rollout.sleep_level and plan.mode != "colocated":
        raise PlacementError(
            f"rollout.sleep_level={cfg.rollout.sleep_level}: an engine sleeps to lend its GPU to "
            f"the trainer rank on the same device, and this plan is {plan.mode} (set "
            "cluster.placement=colocated on GPUs, or rollout.sleep_level=0)"
        )
    return plan


def check_fits(plan: Plan, cluster: Mapping[str, float]) -> None:
    """Fail at once when the plan's bundles add up to more than the cluster has."""
    need: dict[str, float] = {}
    for bundle in plan.bundles:
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v
    short = {k: (v, cluster.get(k, 0.0)) for k, v in need.items() if v > cluster.get(k, 0.0) + 1e-9}
    if short:
        counts = {role: sum(s.role == role for s in plan.slots) for role in _ROLE_NAMES}
        asked = " + ".join(
            f"{counts[role]} {name}s"
            for role, name in reversed(_ROLE_NAMES.items())
            if counts[role] or role != "reward"
        )
        missing = ", ".join(
            f"{v:g} {k} needed, {h:g} in the cluster" for k, (v, h) in short.items()
        )
        raise PlacementError(
            f"the run does not fit: {asked} {plan.mode}: {missing} "
            "(lower rollout.num_servers / trainer.num_ranks, set cluster.placement, or add nodes)"
        )


@contextmanager
def reserve(plan: Plan, timeout_s: float = RESERVE_TIMEOUT_S) -> Iterator[Plan]:
    """Reserve the plan's bundles as one placement group (``PACK``: on as few nodes as they
    fit) and yield the plan bound to it; the group is removed on exit. Fails in seconds when the
    totals do not fit, within ``timeout_s`` when the bundles cannot be placed node by node."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    cluster = ray.cluster_resources()
    check_fits(plan, cluster)
    if not plan.bundles:
        yield plan
        return
    from trident.rewards.model import RUN_PLACEMENT_GROUP

    group = placement_group(plan.bundles, strategy="PACK", name=RUN_PLACEMENT_GROUP)
    try:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            raise PlacementError(
                f"the run's {len(plan.bundles)} bundles ({plan.mode}) could not be placed "
                f"within {timeout_s:.0f} s: each bundle must fit on one node; cluster resources "
                f"{cluster}"
            ) from None
        yield Plan(plan.mode, plan.bundles, plan.slots, group)
    finally:
        remove_placement_group(group)


def local_resources() -> dict[str, float]:
    """What a local Ray instance would have, without starting one (for ``--dry-run``): the
    CPUs, and the GPUs ``nvidia-smi -L`` lists."""
    import os

    gpus = 0
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    return {"CPU": float(os.cpu_count() or 1), "GPU": float(gpus)}
