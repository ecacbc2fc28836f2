"""verl-sat on a Ray cluster (docs/cluster.md), on this one CPU machine: raylets, each declaring its
own resources, started here and stopped here (tests/ray_nodes.py), with Ray 2.60's default token
authentication (the head started as `ray start --head` runs by default, the other node and the
drivers with ``RAY_AUTH_MODE=token``, as docs/cluster.md says).

The default run's cluster test (``small_cluster``: two nodes of 2 CPUs and 1 "GPU" slot): the job
joins with the token by itself and refuses, before training, pools the nodes cannot hold; a
driver without the token is refused with one line; a placement group Ray cannot place stops the
driver (``PlacementWatch``).

The extended tests' cluster (``cluster``):

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


@pytest.fixture(scope="module")
def small_cluster():
    """Two raylets of 2 CPUs and 1 "GPU" slot each, with Ray's default token authentication: too
    small for the default job's trainer pool (1 GPU + 3 CPU a node)."""
    local = LocalCluster(Path(f"/tmp/vss{os.getpid()}"))  # short: Ray's socket paths have a length limit
    start = time.monotonic()
    try:
        local.start_head(num_cpus=2, num_gpus=1)
        local.add_node(num_cpus=2, num_gpus=1)
        local.wait_for_nodes(2)
        print(f"[cluster] two small raylets up in {time.monotonic() - start:.0f}s at {local.address}")
        yield local
    finally:
        local.stop()
        shutil.rmtree(local.temp_dir, ignore_errors=True)


# A driver (RAY_AUTH_MODE=token exported) whose token file is missing, then present: the first
# connection is refused with one line; the second waits on a placement group no node can hold
# (1 GPU + 3 CPU, as verl's trainer pool asks) under a PlacementWatch of 2 s, which stops it.
REFUSED_THEN_NOT_PLACED = """
import os, sys, ray
from ray._raylet import AuthenticationTokenLoader
from ray.util import placement_group
from verl_sat.preflight.cluster import PlacementWatch, connect
address, token = sys.argv[1:]
try:
    connect(address)
except SystemExit as refused:
    print(refused.code, flush=True)
os.environ["RAY_AUTH_TOKEN_PATH"] = token
AuthenticationTokenLoader.instance().reset_cache()
connect(address)
pg = placement_group([{"GPU": 1, "CPU": 3}], strategy="STRICT_PACK", name="trainer_poolverl_group_1:0")
with PlacementWatch(timeout_s=2, interval=0.5):
    ray.get(pg.ready())
print("placed", flush=True)
"""


def test_job_joins_with_the_token_and_refuses_pools_the_nodes_cannot_hold(small_cluster, tmp_path):
    """The default run's cluster test. Nodes started as docs/cluster.md says (Ray's default token
    authentication). The job, given the cluster's address and RAY_AUTH_MODE unset, turns token mode
    on (Ray does not for an explicit address), connects, and refuses verl's pools before training,
    naming the pool, the resources asked and the largest node (it would otherwise wait forever).
    A driver without the token is refused in one line naming RAY_AUTH_MODE and the token's path;
    a placement group Ray cannot place stops the driver (exit 5) with a line naming it."""
    local = small_cluster
    head, other = (n["id"] for n in local.nodes(2))
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")  # only its existence is checked before the refusal; no model is built
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.main",
        f"ray_kwargs.ray_init.address={local.address}",
        "trainer.nnodes=2",
        "actor_rollout_ref.model.path=Qwen/not-downloaded",  # a Hub id: never fetched before the refusal
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"sat.run_dir={tmp_path / 'run'}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=local.driver_env())
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-5000:]
    assert "[verl-sat] joining with Ray's token authentication (RAY_AUTH_MODE=token" in text, text[-5000:]
    [line] = [x for x in text.splitlines() if x.startswith("[verl-sat] error: verl's pools do not fit")]
    assert "pool trainer: 2 group(s) of 1 GPU + 3 CPU" in line and "pool rollout: 1 group(s) of 1 GPU + 2 CPU" in line
    assert f"the largest node, {head[:12]}" in line and "has 1 GPU + 2 CPU" in line, line
    assert "pool trainer's 1 GPU + 3 CPU exceed(s) every node" in line, line
    assert "Traceback" not in text and not (tmp_path / "run" / "metrics.jsonl").exists()

    missing = tmp_path / "no_token"
    env = local.driver_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(missing))
    code = [sys.executable, "-c", REFUSED_THEN_NOT_PLACED, local.address, str(local.token_path)]
    out = subprocess.run(code, capture_output=True, text=True, timeout=300, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 5, text[-5000:]
    refused, *rest = out.stdout.splitlines()
    assert refused.startswith(f"[verl-sat] error: the Ray cluster at {local.address} refused this job"), refused
    assert f"RAY_AUTH_MODE=token (yours), no token at {missing}" in refused, refused
    assert "export RAY_AUTH_MODE=token" in refused
    [stop] = [x for x in rest if x.startswith("[verl-sat] error: verl's placement group")]
    assert "trainer_poolverl_group_1:0 (pool trainer_pool: 1 bundle(s) of {CPU 3, GPU 1}, STRICT_PACK)" in stop, stop
    assert "not placed after 2 s" in stop and "has 1 GPU + 2 CPU" in stop and "(exit 5)" in stop, stop
    assert "placed" not in rest


@pytest.mark.extended  # tests/README.md: Ray retries a refused connection for ~20 s
def test_a_job_without_the_clusters_token_stops_in_one_line(small_cluster, tmp_path):
    """The user's case: RAY_AUTH_MODE unset and no token where Ray looks (a node without the head's
    ~/.ray/auth_token). Ray retries, then raises ConnectionError over its AuthenticationError; the
    launch ends with one line naming RAY_AUTH_MODE and the token's path, and no traceback."""
    local = small_cluster
    missing = tmp_path / "home" / ".ray" / "auth_token"
    cmd = [sys.executable, "-m", "verl_sat.main", f"ray_kwargs.ray_init.address={local.address}"]
    cmd += ["actor_rollout_ref.model.path=Qwen/not-downloaded", f"sat.run_dir={tmp_path / 'run'}"]
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    cmd += [f"data.train_files={data}", f"data.val_files={data}"]
    env = local.driver_env(RAY_AUTH_TOKEN_PATH="", HOME=str(tmp_path / "home"))
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    print(f"[cluster] refused in {time.monotonic() - start:.0f}s")
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-5000:]
    [line] = [x for x in text.splitlines() if x.startswith("[verl-sat] error: the Ray cluster at")]
    assert f"(RAY_AUTH_MODE unset, no token at {missing})" in line and "export RAY_AUTH_MODE=token" in line, line
    assert "Traceback" not in text, text[-5000:]


def node_ids(local: LocalCluster) -> tuple[str, str]:
    """(head, node B) ids of the cluster, from a driver subprocess."""
    head, other = local.nodes(2)
    return head["id"], other["id"]


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
def test_cluster_preflight_names_the_node_with_another_version_and_without_the_run_dir(cluster):
    local, base = cluster
    head, other = node_ids(local)
    run_dir = base / "private" / "run"
    cmd = [
        sys.executable,
        "-m",
        "verl_sat.preflight",
        f"--address={local.address}",
        f"--run-dir={run_dir}",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=local.driver_env())
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
    _, other = node_ids(local)
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
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=base, env=local.driver_env())
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert f"sat.run_dir: {run_dir} does not exist on node {other[:12]}" in text, text[-3000:]
    assert not (run_dir / "metrics.jsonl").exists()


# Where the job's actors ran (Ray's state API, through the dashboard): class name, node id.
ACTORS = """
import json, sys
from ray.util.state import list_actors
print(json.dumps([[a.class_name, a.node_id] for a in list_actors(address=sys.argv[1], detail=True, limit=2000)]))
"""


@pytest.mark.extended  # tests/README.md: left out of the default run for CI time
@pytest.mark.e2e
def test_default_job_trains_on_two_nodes(cluster, assets, monkeypatch):
    """The default job (separate_async, lag 2) with trainer.nnodes=2 joining by the head's address,
    RAY_AUTH_MODE unset (the job turns token mode on: the token's file is named): a rank on each
    node, the rollout where Ray puts it, SAT's metrics and a checkpoint; the micro-batches filled
    from DP 2; Ray's state API shows the workers on both nodes."""
    local, base = cluster
    head, other = node_ids(local)
    run_dir = base / "run"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # the job's environment is this process's (run_main)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(local.token_path))
    start = time.monotonic()
    rows, console = run_main(
        assets, run_dir, f"ray_kwargs.ray_init.address={local.address}", "trainer.nnodes=2", "trainer.save_freq=2"
    )
    print(f"[cluster] two-node run: {time.monotonic() - start:.0f}s")
    check_sat_run(rows, lag=2)
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
    assert "is not passed to ray.init" in console  # the local-cluster keys were dropped
    assert "joining with Ray's token authentication" in console
    # a mini-batch of 8 prompts x 4 samples over two data-parallel ranks: 16 a rank
    filled = json.loads((run_dir / "run.json").read_text())["filled_by_default"]
    micro = (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    )
    assert {k: filled[k] for k in micro} == dict.fromkeys(micro, 16)
    # verl's trainer workers are WorkerDicts (class "create_colocated_worker_cls.<locals>.WorkerDict")
    everything = json.loads(local.run_driver(ACTORS, local.address))
    trainer = [node for cls, node in everything if cls.endswith("WorkerDict")]
    print(f"[cluster] head {head[:12]}, node B {other[:12]}; trainer ranks on: {trainer}")
    assert len(trainer) == 2 and set(trainer) == {head, other}, trainer
    print(f"[cluster] actors (class, node): {sorted({(c, n[:12]) for c, n in everything})}")
    rollout = {n for c, n in everything if c in ("HFRolloutServer", "CheckpointEngineWorker")}
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


def test_layout_refusal_names_the_pool_the_resources_and_the_largest_node():
    """The job's refusal (``layout_refusal``) places as the preflight's ``cluster_layout`` does."""
    from verl_sat.preflight.cluster import layout_refusal

    cfg = paper_layout()  # trainer 4 GPU + 12 CPU, two rollout replicas of 2 GPU + 4 CPU
    assert layout_refusal(cfg, [fake_node("a", 8)]) is None
    small = [fake_node("a" * 16, 4, cpus=8, head=True), fake_node("b" * 16, 2, cpus=16)]
    line = layout_refusal(cfg, small)
    assert line.startswith("verl's pools do not fit this Ray cluster")
    assert "pool trainer: 1 group(s) of 4 GPU + 12 CPU" in line and "pool rollout: 2 group(s) of 2 GPU + 4 CPU" in line
    assert f"the largest node, {small[0].name}, has 4 GPU + 8 CPU" in line
    assert "pool trainer's 4 GPU + 12 CPU exceed(s) every node" in line
    # each group fits some node, but not all of them together
    two = [fake_node("a", 4, cpus=12), fake_node("b", 2, cpus=4)]
    assert "together they exceed the 2 node(s)" in layout_refusal(cfg, two)
    assert [f.message for f in check_layout(cfg, small)] == [line] and check_layout(cfg, two)  # the preflight's


def test_micro_batches_follow_the_data_parallel_size_and_keep_what_the_user_set():
    """The embedded default's micro-batches (null in sat_gspo_cpu.yaml): a rank's share of a
    mini-batch, 8 prompts x 4 responses / DP; a value the user passed, verl's global form, or
    dynamic batching leaves a key alone."""
    from hydra import compose, initialize_config_dir

    from verl_sat.files import hydra_config_dir
    from verl_sat.trainer.launch import MICRO_BATCH_KEYS, fill_micro_batches
    from verl_sat.trainer.recipe import trainer_dp_size

    actor, log_prob = MICRO_BATCH_KEYS

    def cfg(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(hydra_config_dir()), version_base=None):
            return compose(config_name="sat_gspo_cpu", overrides=list(overrides))

    one = cfg()
    assert fill_micro_batches(one) == {actor: 32, log_prob: 32}
    assert OmegaConf.select(one, actor) == 32
    two = cfg("trainer.nnodes=2")
    assert trainer_dp_size(two) == 2 and fill_micro_batches(two) == {actor: 16, log_prob: 16}
    four = cfg(
        "trainer.nnodes=2", "trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"
    )
    assert trainer_dp_size(four) == 4 and fill_micro_batches(four) == {actor: 8, log_prob: 8}
    mine = cfg("trainer.nnodes=2", f"{actor}=4")
    assert fill_micro_batches(mine) == {log_prob: 16} and OmegaConf.select(mine, actor) == 4
    legacy = cfg("actor_rollout_ref.rollout.log_prob_micro_batch_size=8")
    assert fill_micro_batches(legacy) == {actor: 32}
    dynamic = cfg("actor_rollout_ref.actor.use_dynamic_bsz=true")
    assert fill_micro_batches(dynamic) == {}  # the rollout's log_prob_use_dynamic_bsz follows the actor's
    megatron = OmegaConf.create(
        {
            "trainer": {"nnodes": 2, "n_gpus_per_node": 8},
            "actor_rollout_ref": {
                "actor": {"strategy": "megatron", "megatron": {"tensor_model_parallel_size": 4}},
            },
        }
    )
    assert trainer_dp_size(megatron) == 4


def test_the_job_keeps_the_auth_mode_the_user_set_and_names_the_token_it_lacks(monkeypatch, tmp_path):
    """``join_with_token`` never overrides RAY_AUTH_MODE; ``auth_refusal`` names the mode and the
    token's path; ``refused_for_auth`` finds Ray's refusal under the ConnectionError it raises."""
    from verl_sat.preflight.cluster import auth_refusal, join_with_token, refused_for_auth, token_source

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    (tmp_path / "token").write_text("x" * 32)
    assert join_with_token(log=None) is False and os.environ["RAY_AUTH_MODE"] == "disabled"
    assert token_source() == str(tmp_path / "token")
    line = auth_refusal("10.0.0.1:6379", "disabled")
    assert (
        "RAY_AUTH_MODE=disabled (yours)" in line and f"the token in {tmp_path / 'token'} is not the cluster's" in line
    )
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    monkeypatch.setenv("HOME", str(tmp_path))
    line = auth_refusal("10.0.0.1:6379", None)
    assert f"RAY_AUTH_MODE unset, no token at {tmp_path / '.ray' / 'auth_token'}" in line
    try:  # Ray's shape: ConnectionError from RuntimeError("... AuthenticationError: ... InvalidAuthToken ...")
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: AuthenticationError: RPC error")
        except RuntimeError as inner:
            raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from inner
    except ConnectionError as exc:
        assert refused_for_auth(exc)
    assert not refused_for_auth(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"))


@pytest.mark.extended  # ~45 s with its raylets' clean stop; the token join is the default run's cluster test
def test_slurm_script_starts_every_node_and_the_job_with_the_token(tmp_path):
    """recipes/sat_paper/slurm.sh under stand-ins for SLURM's srun and scontrol (which record each
    step and its RAY_AUTH_MODE): the head's token made by Ray's own CLI in ~/.ray/auth_token (a
    temporary HOME), then every `ray start` and the job with RAY_AUTH_MODE=token; a mode the user
    exported is kept."""
    script = Path(__file__).resolve().parents[1] / "recipes/sat_paper/slurm.sh"
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    stubs = {
        "srun": 'echo "${RAY_AUTH_MODE:-unset}|$*" >> "$STEPS"; [[ "$*" == *hostname* ]] && echo 10.0.0.1; true',
        "scontrol": "printf 'n1\\nn2\\nn3\\n'",
        "sleep": "true",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    path = f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env.update(PATH=path, HOME=str(home), SLURM_JOB_NUM_NODES="3", SLURM_JOB_NODELIST="n[1-3]")

    def steps(**extra: str) -> list[str]:
        log = tmp_path / f"steps{len(extra)}.log"
        run = {**env, "STEPS": str(log), **extra}
        out = subprocess.run(["bash", str(script), "grpo", "1"], capture_output=True, text=True, env=run, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return log.read_text().splitlines()

    lines = steps()
    assert (home / ".ray" / "auth_token").stat().st_size > 0  # `ray get-auth-token --generate`
    starts = [line for line in lines if "ray start" in line]
    assert len(starts) == 3 and "--head" in starts[0] and all("--address=10.0.0.1:6379" in x for x in starts[1:])
    [job] = [line for line in lines if "run.sh grpo 1" in line]
    assert all(line.startswith("token|") for line in [*starts, job]), lines
    assert "ray_kwargs.ray_init.address=10.0.0.1:6379" in job and "trainer.nnodes=2" in job
    kept = steps(RAY_AUTH_MODE="disabled")
    assert all(line.startswith("disabled|") for line in kept), kept


@pytest.mark.extended  # tests/README.md: a launch up to verl's placement, then the watch's timeout
def test_a_pool_ray_cannot_place_stops_the_job(assets, tmp_path):
    """verl's own trainer on a cluster of its own with 4 CPUs: the task runner (1 CPU) and the
    trainer's group (1 GPU + 3 CPU) take them all, so the rollout's group (1 GPU + 2 CPU) stays
    pending, where verl would wait forever; the job stops after VERL_SAT_PLACEMENT_TIMEOUT_S with
    the line naming the group, and exit 5."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_sat.main", f"sat.assets_dir={assets}", f"sat.run_dir={run_dir}"]
    cmd += ["ray_kwargs.ray_init.num_cpus=4", "trainer.total_training_steps=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FILE_LOGGER")}
    env["VERL_SAT_PLACEMENT_TIMEOUT_S"] = "20"
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    print(f"[cluster] stopped in {time.monotonic() - start:.0f}s")
    text = out.stdout + out.stderr
    assert out.returncode == 5, text[-5000:]
    [line] = [x for x in text.splitlines() if x.startswith("[verl-sat] error: verl's placement group")]
    assert "not placed after 2" in line and "(exit 5)" in line and "VERL_SAT_PLACEMENT_TIMEOUT_S" in line, line
    assert "bundle(s) of {CPU 2, GPU 1}" in line or "bundle(s) of {CPU 3, GPU 1}" in line, line
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text()
