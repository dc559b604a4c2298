"""The recipe on a two-node Ray cluster, started here as two Ray nodes on this machine.

The cluster is Ray's own `ray.cluster_utils.Cluster`: a head node and a worker node, each a
raylet with its own node id and 2 CPUs, so both workers would fit on one node: only the
recipe's placement (one bundle per node, STRICT_SPREAD) puts them on two. The
recipe joins it through RAY_ADDRESS, as it would join a cluster started with `ray start` under
Slurm or by KubeRay, and must leave it running; the test tears it down. A second case runs a
two-job Hydra multirun through conf/hydra/launcher/ray_cluster.yaml on the same cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.test_reliability import ROOT, SMALL, cli_env, descendants, grpo, steps_on_disk

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(run_cache):
    from ray.cluster_utils import Cluster

    # A private temp dir (short: Ray's socket paths must fit 107 bytes) keeps this cluster out of
    # /tmp/ray/ray_current_cluster, which any other `ray.init()` on this machine would read.
    temp = tempfile.mkdtemp(prefix="lrmn", dir="/tmp")
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TMPDIR", temp)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}})
    c.add_node(num_cpus=2, resources={"second": 1})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        c.shutdown()
        mp.undo()
        shutil.rmtree(temp, ignore_errors=True)


def node_ids(c) -> set[str]:
    return {c.head_node.node_id, *(n.node_id for n in c.worker_nodes)}


def alive_node_ids(c) -> set[str]:
    return {n["NodeID"] for n in c.global_state.node_table() if n["Alive"]}


def cluster_env(c, cache: Path) -> dict[str, str]:
    return cli_env(cache, RAY_ADDRESS=c.address, RAY_TMPDIR=os.environ["RAY_TMPDIR"])


def ray_workers() -> list[int]:
    """Worker actor processes below this process (the cluster's raylets are its children)."""
    return [pid for pid, cmd in descendants(os.getpid()).items() if cmd.startswith(b"ray::Worker")]


def assert_workers_gone(grace: float = 30) -> None:
    deadline = time.monotonic() + grace
    while ray_workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_workers(), "worker processes left on the cluster"


def init_row(run_dir: Path) -> dict:
    return next(r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] == 0)


def test_two_nodes_train_sync_checkpoint_and_leave_the_cluster_running(cluster, run_cache, tmp_path):
    run = tmp_path / "run"
    t0 = time.monotonic()
    out = grpo(
        run,
        run_cache,
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=1",
        "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_steps=2",
        "trainer.save_freq=2",
        env=cluster_env(cluster, run_cache),
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"two-node run: {time.monotonic() - t0:.0f} s")

    # Placement: one worker on each node, both nodes of this cluster (not a private Ray).
    init = init_row(run)
    placed = init["init/worker_node_ids"].split(",")
    assert init["init/num_nodes"] == 2 and len(placed) == 2
    assert set(placed) == node_ids(cluster), (placed, node_ids(cluster))
    log = (run / "grpo.log").read_text()
    assert "workers: 2 workers on 2 nodes: " in log and all(f"(node {n[:8]})" in log for n in placed), log

    # Trained, synced (exact adapter fingerprint on both ranks, parity probe), checkpointed.
    rows = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/kind"] == "adapter" and r["sync/adapter_match"] == 1.0, r
        assert "sync/logprob_diff_max" in r and "actor/pg_loss" in r
    assert init["init/sync/adapter_match"] == 1.0
    assert steps_on_disk(run / "checkpoints") == [2]
    assert (run / "final_adapter" / "adapter_model.safetensors").is_file()

    # Shut down: no worker left, the placement group removed, the cluster still up.
    assert_workers_gone()
    assert {g["state"] for g in cluster.global_state.placement_group_table().values()} <= {"REMOVED"}
    assert alive_node_ids(cluster) == node_ids(cluster)
    assert cluster.head_node.remaining_processes_alive()


def test_hydra_ray_launcher_runs_a_two_job_sweep_on_the_cluster(cluster, run_cache, tmp_path):
    """conf/hydra/launcher/ray_cluster.yaml: each job of the multirun is a Ray task on the
    cluster, and its workers join the same cluster."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra-ray-launcher is in the test extras")
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipes.grpo",
            "-m",
            "+backend=fsdp",
            "hydra/launcher=ray_cluster",
            f"hydra.sweep.dir={sweep}",
            *SMALL,
            "trainer.total_steps=1",
            "model.lora.rank=8,16",
        ],
        cwd=ROOT,
        env=cluster_env(cluster, run_cache),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    print(f"two-job sweep: {time.monotonic() - t0:.0f} s")
    jobs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert [j.name.split("_")[0] for j in jobs] == ["0", "1"], sorted(p.name for p in sweep.iterdir())
    for job, rank in zip(jobs, (8, 16)):
        assert job.name.endswith(f"_r{rank}"), job.name
        rows = [r for r in map(json.loads, (job / "metrics.jsonl").read_text().splitlines())]
        assert [r["step"] for r in rows if "reward/mean" in r] == [1]
        assert all(r["sync/adapter_match"] == 1.0 for r in rows if "reward/mean" in r)
        # Its worker ran on a node of this cluster, not in a Ray instance of its own.
        assert init_row(job)["init/worker_node_ids"] in node_ids(cluster)
        assert json.loads((job / "final_adapter" / "adapter_config.json").read_text())["r"] == rank
    summary = (sweep / "summary.md").read_text()
    assert "model.lora.rank=8" in summary and "model.lora.rank=16" in summary
    assert_workers_gone()
    assert alive_node_ids(cluster) == node_ids(cluster)
