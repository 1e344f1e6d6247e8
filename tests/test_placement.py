"""Placement plans (``trident.cluster.placement``), role by role, reserved on a local Ray instance
that declares GPUs it does not have: Ray hands out device ids by the declared resources, so which
device each actor would get is real even on a CPU machine. A plan that does not fit fails in
seconds with the message; ``trident train --dry-run`` prints the plan."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch

from tests.conftest import run_cli
from trident.cluster.placement import PlacementError, make_plan, plan_for, reserve
from trident.cluster.process import JEMALLOC_BELOW_BYTES, JEMALLOC_CONF, jemalloc_env
from trident.config import load_config
from trident.rollout.vllm_server import VLLMServer
from trident.telemetry.metrics import read_metrics


@pytest.fixture(scope="module")
def fake_gpus():
    assert not ray.is_initialized()
    ray.init(num_cpus=16, num_gpus=8, include_dashboard=False, log_to_driver=False)
    yield ray.cluster_resources()
    ray.shutdown()


@ray.remote
def _devices() -> list[str]:
    return [str(d) for d in ray.get_runtime_context().get_accelerator_ids()["GPU"]]


def _where(plan, role: str, n: int) -> list[list[str]]:
    """The GPU ids a task placed like actor ``role`` 0..n-1 of the plan is given."""
    return ray.get(
        [_devices.options(**plan.actor_options(role, i)).remote() for i in range(n)], timeout=120
    )


def test_one_gpu_colocates_the_trainer_and_the_server(fake_gpus):
    with reserve(make_plan("auto", 1, 1, {"GPU": 1, "CPU": 16})) as plan:
        assert plan.mode == "colocated" and len(plan.bundles) == 1
        assert plan.slot("trainer", 0).resources["num_gpus"] == 0.5
        (trainer,), (server,) = _where(plan, "trainer", 1), _where(plan, "rollout", 1)
        assert len(trainer) == 1 and trainer == server  # the same device, shared


def test_eight_gpus_four_and_four_disaggregated(fake_gpus):
    with reserve(make_plan("auto", 4, 4, fake_gpus)) as plan:
        assert plan.mode == "disaggregated" and len(plan.bundles) == 8
        trainer = [d for ds in _where(plan, "trainer", 4) for d in ds]
        servers = [d for ds in _where(plan, "rollout", 4) for d in ds]
        assert len(set(trainer)) == len(trainer) == 4  # a whole device each
        assert len(set(servers)) == len(servers) == 4
        assert not set(trainer) & set(servers)  # two pools


def test_eight_gpus_colocated(fake_gpus):
    with reserve(make_plan("colocated", 8, 8, fake_gpus)) as plan:
        assert len(plan.bundles) == 8
        trainer, servers = _where(plan, "trainer", 8), _where(plan, "rollout", 8)
        assert trainer == servers  # rank i and server i share device i
        assert len({d for ds in trainer for d in ds}) == 8


def test_a_plan_that_does_not_fit_fails_in_seconds_saying_what_is_missing(fake_gpus):
    start = time.monotonic()
    with pytest.raises(PlacementError) as err, reserve(make_plan("disaggregated", 8, 8, fake_gpus)):
        raise AssertionError("a plan that does not fit was reserved")
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert "8 rollout servers + 8 trainer ranks" in message
    assert "16 GPU needed, 8 in the cluster" in message


def test_on_cpus_every_actor_shares_the_cores():
    plan = make_plan("auto", 2, 2, {"CPU": 4})
    assert plan.mode == "cpu" and len(plan.bundles) == 4
    assert all(s.resources == {"num_cpus": 0.5} for s in plan.slots)
    with pytest.raises(ValueError, match="cluster.placement"):
        make_plan("everywhere", 1, 1, {"GPU": 2})


def test_dry_run_prints_the_placement_plan():
    r = run_cli("train", "--dry-run", "trainer.num_ranks=2", "rollout.num_servers=2", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "placement: cpu, 4 CPU bundle(s)" in r.stderr
    assert "bundle 1 0.5 CPU: trainer rank 1 (0.5 CPU)" in r.stderr
    assert "bundle 3 0.5 CPU: rollout server 1 (0.5 CPU)" in r.stderr


@pytest.mark.parametrize(
    ("gpus", "ranks", "servers", "placement", "backend"),
    [
        (0, 1, 1, "auto", "shm"),  # CPU: shared-memory buckets
        (1, 1, 1, "auto", "ipc"),  # one GPU, colocated: NCCL would put two ranks on one device
        (2, 2, 2, "colocated", "shm"),  # server 0 on rank 0's GPU, server 1 on another
        (4, 2, 2, "auto", "nccl"),  # every actor its own GPU
    ],
)
def test_the_sync_backend_is_one_the_placement_allows(gpus, ranks, servers, placement, backend):
    from trident.config.schema import LoraConfig, SyncConfig
    from trident.weights.backend import weight_backend

    plan = make_plan(placement, ranks, servers, {"GPU": gpus, "CPU": 16})
    assert weight_backend(SyncConfig(), plan) == backend
    assert weight_backend(SyncConfig(backend="nccl"), plan) == "nccl"  # as the user set it
    # a LoRA policy's adapters alone, wherever it runs; merged, the placement's backend
    assert weight_backend(SyncConfig(), plan, LoraConfig()) == "adapter"
    assert weight_backend(SyncConfig(), plan, LoraConfig(sync="merged")) == backend


def test_engines_sleep_only_beside_a_trainer_rank_on_their_gpu():
    """``rollout.sleep_level`` lends an engine's GPU memory to the trainer rank colocated with
    it: any other plan fails at once, saying so (here on CPU too, before anything starts)."""
    cfg = load_config([], ["rollout.sleep_level=1"])
    assert plan_for(cfg, {"GPU": 1, "CPU": 16}).mode == "colocated"
    for cluster in ({"CPU": 4}, {"GPU": 2, "CPU": 16}):  # cpu; disaggregated (a GPU each)
        with pytest.raises(PlacementError, match="rollout.sleep_level=1: an engine sleeps"):
            plan_for(cfg, cluster)
    r = run_cli("train", "--dry-run", "rollout.sleep_level=1", timeout=60)
    assert r.returncode != 0 and "this plan is cpu" in r.stderr, r.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("level", [1, 2])
def test_engines_sleep_through_the_train_stage_and_every_sync_verifies(level, tiny_model, tmp_path):
    """Colocated on one GPU, ``sync`` mode: the engine sleeps while the trainer trains (vLLM
    frees its memory) and wakes for each install, which is verified as always."""
    r = run_cli(
        "train", f"model.path={tiny_model}", f"run.dir={tmp_path}", "run.name=sleep",
        "model.dtype=bfloat16", "cluster.placement=colocated", f"rollout.sleep_level={level}",
        "rollout.gpu_memory_utilization=0.3", "sync.tolerance=0.1", "pipeline.steps=3",
        "pipeline.prompts_per_step=4", "rollout.n=4", "eval.before_after=false",
        "telemetry.progress=false", timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(tmp_path / "sleep")
    assert all(m["sync/max_abs_dlogp"] < 0.1 for m in metrics)  # woken, synced, verified
    log = (tmp_path / "sleep" / "logs" / "vllm_server_0.log").read_text()
    assert log.count("Sleep mode freed") == 3  # once per train stage


def test_a_cpu_servers_engine_threads(tmp_path):
    """rollout.cpu_threads=0: one thread for a narrow model, else the cores split among the
    processes generating at once; a number given is taken as it is."""
    for hidden in (128, 512):
        (tmp_path / str(hidden)).mkdir()
        (tmp_path / str(hidden) / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    cores = len(os.sched_getaffinity(0))

    def threads(hidden: int, **options) -> str:
        server = VLLMServer(str(tmp_path / str(hidden)), tmp_path / "log", port=1, **options)
        return server.env["OMP_NUM_THREADS"]

    assert threads(128) == threads(128, cpu_sharing=3) == "1"
    assert threads(512) == str(cores)
    assert threads(512, cpu_sharing=cores + 1) == "1"
    assert threads(128, cpu_threads=3) == threads(512, cpu_threads=3) == "3"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without GPU device files")
def test_a_server_on_a_host_without_gpus_starts_without_importing_torch(tmp_path):
    """Where no GPU device file exists, the server's CPU options are chosen without importing
    torch first (~1.2 s before a Ray actor could launch the server)."""
    code = (
        "import sys; from trident.rollout.vllm_server import VLLMServer\n"
        f"server = VLLMServer({str(tmp_path)!r}, {str(tmp_path / 'log')!r}, port=1)\n"
        "print('--enforce-eager' in server.args, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"], out


def test_jemalloc_only_for_a_model_whose_weights_are_small(tmp_path):
    """A trainer rank or server keeps its freed pages (jemalloc) for a model under 400 MB of
    weights; a larger one, whose memory is what binds on a CPU host, keeps the system allocator;
    a hub id (nothing local to size) too."""
    for name, size in (("small", 1_000), ("large", JEMALLOC_BELOW_BYTES)):
        (tmp_path / name).mkdir()
        with (tmp_path / name / "model.safetensors").open("wb") as f:
            f.truncate(size)  # sparse: no disk used
    env = jemalloc_env(str(tmp_path / "small"))
    assert Path(env["LD_PRELOAD"]).is_file() and env["MALLOC_CONF"] == JEMALLOC_CONF
    assert jemalloc_env(str(tmp_path / "large")) == {} == jemalloc_env("Qwen/Qwen2.5-0.5B")
