"""A real two-node run on one machine: ``ray.cluster_utils.Cluster`` starts two raylets, the
two rollout servers are pinned to one and the two FSDP2 trainer ranks to the other
(``cluster.role_resources``), so rank 0 and the servers are on different Ray nodes. The ranks
rendezvous on rank 0's node; every sync goes through the cross-host transport (each server
fetches each checksummed bucket over HTTP from the trainer's node) and is verified by the probe
on both servers, through the whole loop of ``trident train``: the 2-rank, 2-server run end to
end."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ray.cluster_utils import Cluster

from tests.conftest import REPO, run_cli
from trident.telemetry.metrics import read_metrics

STEPS = 3


@pytest.fixture
def two_nodes():
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"rollout_node": 1},
            "include_dashboard": False,
        },
    )
    try:
        cluster.add_node(num_cpus=2, resources={"trainer_node": 1})
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()


def test_servers_on_one_node_and_the_trainer_on_the_other(two_nodes, tiny_model, tmp_path):
    r = run_cli(
        "train", f"model.path={tiny_model}", f"run.dir={tmp_path}", "run.name=two",
        f"cluster.address={two_nodes}", "trainer.num_ranks=2", "rollout.num_servers=2",
        "cluster.role_resources={trainer: {trainer_node: 0.01}, rollout: {rollout_node: 0.01}}",
        f"pipeline.steps={STEPS}", "pipeline.prompts_per_step=4", "rollout.n=4",
        "rollout.max_tokens=12", "eval.before_after=false", "telemetry.progress=false",
        "trainer.cpu_threads=1", timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_metrics(tmp_path / "two")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["sync/http_servers"] == 2 for m in metrics)  # both servers on another host
    assert all(m["sync/max_abs_dlogp"] < 1e-3 for m in metrics)  # every sync verified on both
    for i in range(2):
        log = (tmp_path / "two" / "logs" / f"vllm_server_{i}.log").read_text()
        assert log.count("buckets via http") == STEPS + 1  # the first install, then every step
        assert "buckets via shm" not in log


CHECK = """
import sys, ray
from trident.cluster.placement import PlacementError
from trident.cluster.ray_cluster import check_shared
ray.init(address=sys.argv[1])
check_shared({"model.path": sys.argv[2]})  # every node sees it
try:
    check_shared({"model.path": sys.argv[2], "run.dir": "/nonexistent/run/config.yaml"})
except PlacementError as e:
    print(e)
"""


def test_a_path_another_node_does_not_see_fails_before_anything_starts(two_nodes, tiny_model):
    """``check_shared`` asks each other node (a task pinned to it) whether it sees the paths."""
    r = subprocess.run(
        [sys.executable, "-c", CHECK, two_nodes, tiny_model],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    line = r.stdout.strip().splitlines()[-1]
    assert line.startswith("node ") and "does not see run.dir=/nonexistent/run/config.yaml" in line
    assert "model.path" not in line.split(":", 1)[0] and "every node" in line
