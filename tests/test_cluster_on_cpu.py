"""verl-sat on a Ray cluster (docs/cluster.md), on this one CPU machine: two raylets, each
declaring its own resources, started here and stopped here (tests/ray_nodes.py).

- head: 8 CPUs, 2 "GPU" slots (a trainer rank and the standalone rollout fit);
- node B: 8 CPUs, 1 "GPU" slot, a private mount namespace in which ``private/`` is an empty tmpfs
  (what the driver writes there, B cannot see: a node without the shared file system), and a
  ``PYTHONPATH`` whose first entry holds another megatron-bridge's metadata (B reports another
  version of a package the preflight compares).

The default job runs there with ``trainer.nnodes=2`` (one trainer rank a node) through verl's real
trainer; Ray's state API says where its workers ran. The cluster preflight and the driver's path
check fail, naming node B.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import DictConfig, OmegaConf
from ray_nodes import LocalCluster
from test_main_e2e import check_sat_run, run_main

from verl_sat.preflight.checks import check_layout, check_same_versions
from verl_sat.preflight.cluster import Node
from verl_sat.preflight.estimates import pool_bundles
from verl_sat.preflight.facts import Facts

OTHER_BRIDGE = "0.0.1+other"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two raylets on this machine (module-scoped: started once, stopped after the module)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("node B's private mount namespace needs root and unshare")
    base = tmp_path_factory.mktemp("cluster")
    (base / "private").mkdir()
    fake_site = base / "fake_site"
    dist = fake_site / f"megatron_bridge-{OTHER_BRIDGE}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-bridge\nVersion: {OTHER_BRIDGE}\n")
    pythonpath = os.pathsep.join(p for p in (str(fake_site), os.environ.get("PYTHONPATH", "")) if p)
    local = LocalCluster(Path(f"/tmp/vsc{os.getpid()}"))  # short: Ray's socket paths have a length limit
    start = time.monotonic()
    try:
        local.start_head(num_cpus=8, num_gpus=2, dashboard=True)
        local.wait_for_nodes(1)
        local.add_node(num_cpus=8, num_gpus=1, env={"PYTHONPATH": pythonpath}, hide=(base / "private",))
        local.wait_for_nodes(2)
        print(f"[cluster] two raylets up in {time.monotonic() - start:.0f}s at {local.address}")
        yield local, base
    finally:
        local.stop()
        shutil.rmtree(local.temp_dir, ignore_errors=True)


def node_ids(address: str) -> tuple[str, str]:
    """(head, node B) ids of the cluster, from a short driver connection."""
    import ray

    from verl_sat.preflight.cluster import alive_nodes

    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
    try:
        head, other = alive_nodes()
    finally:
        ray.shutdown()
    return head.node_id, other.node_id


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
def test_cluster_preflight_names_the_node_with_another_version_and_without_the_run_dir(cluster):
    local, base = cluster
    head, other = node_ids(local.address)
    run_dir = base / "private" / "run"
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.preflight",
        f"--address={local.address}",
        f"--run-dir={run_dir}",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert [n["node_id"] for n in report["nodes"]] == [head, other]
    versions = [f for f in report["findings"] if f["check"] == "cluster_versions"]
    assert [f["key"] for f in versions] == ["megatron-bridge"], versions
    assert f"megatron-bridge {OTHER_BRIDGE} on node {other[:12]}" in versions[0]["message"]
    assert f"on node {head[:12]}" in versions[0]["message"]  # both nodes named
    # the driver wrote the run and checkpoint directories; node B, without the shared file system, lacks both
    shared = [f for f in report["findings"] if f["check"] == "cluster_shared_dir"]
    assert [f["key"] for f in shared] == ["sat.run_dir", "trainer.default_local_dir"], shared
    assert shared[0]["message"].startswith(f"sat.run_dir: {run_dir} does not exist on node {other[:12]}")
    assert all(f"does not exist on node {other[:12]}" in f["message"] for f in shared), shared
    assert not [f for f in report["findings"] if f["check"] == "cluster_layout"]  # the default job fits
    assert report["nodes"][1]["versions"]["megatron-bridge"] == OTHER_BRIDGE


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
def test_driver_refuses_a_run_dir_another_node_cannot_see(cluster, assets):
    """Before training: the key, the node and the path."""
    local, base = cluster
    _, other = node_ids(local.address)
    run_dir = base / "private" / "run_main"
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.main",
        f"sat.assets_dir={assets}",
        f"sat.run_dir={run_dir}",
        f"ray_kwargs.ray_init.address={local.address}",
        "trainer.nnodes=2",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=base)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"sat.run_dir: {run_dir} does not exist on node {other[:12]}" in text, text[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
@pytest.mark.e2e
def test_default_job_trains_on_two_nodes(cluster, assets):
    """The default job (separate_async, lag 2) with trainer.nnodes=2: a rank on each node, the rollout
    where Ray puts it, SAT's metrics and a checkpoint; Ray's state API shows the workers on both nodes."""
    from ray.util.state import list_actors

    local, base = cluster
    head, other = node_ids(local.address)
    run_dir = base / "run"
    start = time.monotonic()
    rows, console = run_main(
        assets,
        run_dir,
        f"ray_kwargs.ray_init.address={local.address}",
        "trainer.nnodes=2",
        "trainer.save_freq=2",
        # a mini-batch of 8 prompts x 4 samples over two data-parallel ranks: 16 a rank
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    )
    print(f"[cluster] two-node run: {time.monotonic() - start:.0f}s")
    check_sat_run(rows, lag=2)
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
    assert "is not passed to ray.init" in console  # the local-cluster keys were dropped
    # verl's trainer workers are WorkerDicts (class "create_colocated_worker_cls.<locals>.WorkerDict")
    everything = list_actors(address=local.address, detail=True, limit=2000)
    trainer = {a.name: a.node_id for a in everything if a.class_name.endswith("WorkerDict")}
    print(f"[cluster] head {head[:12]}, node B {other[:12]}; trainer ranks: {trainer}")
    assert len(trainer) == 2 and set(trainer.values()) == {head, other}, trainer
    where = {(a.class_name, a.node_id[:12]) for a in everything}
    print(f"[cluster] actors (class, node): {sorted(where)}")
    rollout = {a.node_id for a in everything if a.class_name in ("HFRolloutServer", "CheckpointEngineWorker")}
    assert rollout and rollout <= {head, other}


# ---------------------------------------------------------------------------------------------
# the pure checks, without a cluster
# ---------------------------------------------------------------------------------------------
def fake_node(node_id: str, gpus: int, cpus: int = 64, head: bool = False) -> Node:
    resources = {"GPU": gpus, "CPU": cpus, **({"node:__internal_head__": 1} if head else {})}
    return Node(node_id, "10.0.0.1", "h", resources)


def paper_layout(**over: int) -> DictConfig:
    """The paper's layout (4 trainer GPUs, a standalone rollout of 4 in TP-2 replicas); ``a__b=v`` sets ``a.b``."""
    cfg = OmegaConf.create(
        {
            "trainer": {"nnodes": 1, "n_gpus_per_node": 4, "v1": {"trainer_mode": "separate_async"}},
            "actor_rollout_ref": {
                "hybrid_engine": False,
                "rollout": {"nnodes": 1, "n_gpus_per_node": 4, "tensor_model_parallel_size": 2},
            },
        }
    )
    for key, value in over.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


def test_layout_fits_as_verl_places_its_pools():
    cfg = paper_layout()
    assert pool_bundles(cfg) == [("trainer", 4, 12), ("rollout", 2, 4), ("rollout", 2, 4)]
    assert check_layout(cfg, [fake_node("a", 8)]) == []  # the paper's one node of 8
    two = paper_layout(trainer__nnodes=2, trainer__n_gpus_per_node=8, actor_rollout_ref__rollout__n_gpus_per_node=8)
    findings = check_layout(two, [fake_node("a", 8), fake_node("b", 8)])
    assert findings and findings[0].check == "cluster_layout"  # 2 trainer nodes + a rollout node on 2 nodes
    assert check_layout(two, [fake_node(n, 8) for n in "abc"]) == []


def test_versions_that_differ_name_both_nodes():
    a, b = fake_node("a" * 16, 8, head=True), fake_node("b" * 16, 8)
    facts = {a: Facts(versions={"torch": "2.11.0"}), b: Facts(versions={"torch": "2.10.0"})}
    [finding] = check_same_versions(facts)
    assert finding.key == "torch" and "2.10.0 on node bbbbbbbbbbbb" in finding.message
    assert "2.11.0 on node aaaaaaaaaaaa" in finding.message


def test_grid_on_a_cluster_submits_each_cell_as_a_ray_job(tmp_path):
    """DRY_RUN of recipes/sat_paper/grid_cluster.sh: one `ray job submit` per cell, joining the
    cluster, and grid.sh's status table."""
    script = Path(__file__).resolve().parents[1] / "recipes/sat_paper/grid_cluster.sh"
    env = {**os.environ, "DRY_RUN": "1", "ONLY": "grpo:1 sat_gspo_r3:8", "NODE_GROUPS": "2", "RUNS_ROOT": str(tmp_path)}
    env["PYTHON"] = sys.executable
    out = subprocess.run(
        ["bash", str(script), "trainer.nnodes=2"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    submits = [line for line in out.stdout.splitlines() if line.startswith("ray job submit")]
    assert len(submits) == 2
    for cell in ("run.sh grpo 1 ", "run.sh sat_gspo_r3 8 "):
        [line] = [s for s in submits if cell in s]
        assert line.endswith("ray_kwargs.ray_init.address=auto trainer.nnodes=2") and "--submission-id" in line
    table = (tmp_path / "grid_status.tsv").read_text().splitlines()
    assert table[0] == "method\tlag\tstatus\texit\trun_dir"
    assert sorted(table[1:]) == sorted(
        [f"grpo\t1\tdry-run\t0\t{tmp_path}/grpo-lag1", f"sat_gspo_r3\t8\tdry-run\t0\t{tmp_path}/sat_gspo_r3-lag8"]
    )


def test_a_node_reports_the_paths_it_lacks_and_a_run_dir_that_is_not_the_drivers(tmp_path):
    """What each node's task answers (``seen_on_node``), and the lines the driver and the preflight
    print from it: a missing path names key, node and path; a directory there without the
    driver's token is not the driver's."""
    from verl_sat.preflight.cluster import Unseen, seen_on_node

    run_dir, data = tmp_path / "run", tmp_path / "train.parquet"
    run_dir.mkdir()
    token_file = run_dir / ".cluster_token"
    token_file.write_text("the driver's")
    paths = {"sat.run_dir": [str(run_dir)], "data.train_files": [str(data)]}
    seen = seen_on_node(paths, {"sat.run_dir": str(token_file)}, "the driver's")
    assert seen == {"missing": {"data.train_files": [str(data)]}, "unseen": {}}
    other = seen_on_node(paths, {"sat.run_dir": str(token_file)}, "another driver's")
    assert other["unseen"] == {"sat.run_dir": [str(run_dir)]}
    node = fake_node("b" * 16, 1)
    missing = Unseen("data.train_files", str(data), node, missing=True)
    unseen = Unseen("sat.run_dir", str(run_dir), node, missing=False)
    assert missing.line() == f"data.train_files: {data} does not exist on node {node.name}"
    assert unseen.line().startswith(f"sat.run_dir: {run_dir} on node {node.name} is not the driver's directory")
