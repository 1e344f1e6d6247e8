"""The run harness: one set-up, one metric definition and one step record for every mode.

``sync`` and ``separate_async`` at η = 0 are the same schedule written two ways (generate a
batch, train, install; versus streaming into a buffer that admits nothing beyond η = 0). Run on
the same seed, through the real stack (vLLM server, FSDP2 trainer on Ray), they must train the
same sample ids in the same steps, every token at staleness 0, and log the same metric keys.
One server serves both runs: each run begins by installing its own trainer's weights as
version 0 (verified), so the second run does not inherit the first one's weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import ray

from trident.cluster.process import jemalloc_env
from trident.cluster.ray_cluster import init_ray
from trident.config import load_config
from trident.pipeline.run import run
from trident.rollout.fleet import RolloutFleet
from trident.sample import Sample
from trident.telemetry.metrics import MetricsLogger, read_metrics
from trident.train.group import TrainerGroup
from trident.weights.backend import SERVER_BACKENDS, weight_backend

STEPS = 3


class RecordingTrainer:
    """The real ``TrainerGroup``, with the ids of the samples each step trained on written down
    (a recorder around the real trainer, not a stand-in for it)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group, self.steps = group, []

    async def connect(self, urls: list[str], backend: str, nodes: Mapping[str, str]) -> None:
        await self.group.connect(urls, backend, nodes)

    async def train_step(self, samples: list[Sample]) -> dict[str, float]:
        self.steps.append(sorted(s.id for s in samples))
        return await self.group.train_step(samples)

    async def sync_weights(self, version: int, urls: list[str]) -> dict[str, float]:
        return await self.group.sync_weights(version, urls)

    async def rejoin(self, url: str) -> dict[str, float]:
        return await self.group.rejoin(url)

    async def save(self, out_dir: Path) -> None:
        await self.group.save(out_dir)

    async def load(self, ckpt_dir: Path) -> None:
        await self.group.load(ckpt_dir)


def test_sync_and_separate_async_at_eta_zero_train_the_same_samples(tiny_model, tmp_path):
    def config(mode: str):
        return load_config(
            [],
            [
                f"model.path={tiny_model}",
                f"run.dir={tmp_path}",
                f"run.name={mode}",
                f"pipeline.mode={mode}",
                "pipeline.max_staleness=0",
                f"pipeline.steps={STEPS}",
                "pipeline.prompts_per_step=4",
                "rollout.n=4",
                "rollout.max_tokens=16",
                "eval.before_after=false",
                "telemetry.progress=false",
                "telemetry.tensorboard=false",
                "run.seed=7",
            ],
        )

    sync_cfg, async_cfg = config("sync"), config("separate_async")
    init_ray(sync_cfg.cluster)
    backend = weight_backend(sync_cfg.sync)
    trained, metrics = {}, {}
    try:
        with RolloutFleet(
            sync_cfg, tiny_model, tmp_path / "servers", SERVER_BACKENDS[backend]
        ) as fleet:
            for cfg in (sync_cfg, async_cfg):
                log = MetricsLogger(Path(cfg.derived.run_dir), tensorboard=False)
                with TrainerGroup(cfg) as group:
                    trainer = RecordingTrainer(group)
                    asyncio.run(run(cfg, fleet.router, trainer, log, backend))
                    sender = group.pids["trainer_rank0"]
                    assert list(Path("/dev/shm").glob(f"trident-weights-{sender}-*"))
                    # a rank and a server on CPUs allocate through jemalloc
                    if jemalloc_env(tiny_model):
                        for pid in (sender, *fleet.pids().values()):
                            assert "libjemalloc" in Path(f"/proc/{pid}/maps").read_text(), pid
                log.close()
                # the group's exit had rank 0 delete its bucket files before killing it
                assert not list(Path("/dev/shm").glob(f"trident-weights-{sender}-*"))
                trained[cfg.pipeline.mode] = trainer.steps
                metrics[cfg.pipeline.mode] = read_metrics(cfg.derived.run_dir)
    finally:
        ray.shutdown()

    assert len(trained["sync"]) == STEPS and all(len(ids) == 16 for ids in trained["sync"])
    assert trained["separate_async"] == trained["sync"]
    sync_log, async_log = metrics["sync"], metrics["separate_async"]
    assert [set(m) for m in async_log] == [set(m) for m in sync_log]
    for m in sync_log + async_log:
        assert m["staleness/max"] == 0 and m["sync/max_abs_dlogp"] <= sync_cfg.sync.tolerance
        assert m["trained_samples"] == 16 and m["generated/samples"] == 16
    assert [m["version"] for m in async_log] == [m["version"] for m in sync_log] == [1, 2, 3]
    for mode in ("sync", "separate_async"):  # every mode writes its timeline
        assert (Path(sync_cfg.derived.run_dir).parent / mode / "trace.json").exists()
