"""Two Ray nodes (two raylets on this machine): an engine placed on the other node gets its env
built there, from files Ray ships (not from this checkout), and is synced over gloo."""

from __future__ import annotations

import shutil

import pytest
import ray

from tests.engine_checks import assert_engine_matches_reference
from weightsync.apps.models import make_tiny_model
from weightsync.driver import envs, launcher

pytestmark = pytest.mark.slow  # a whole demo or a second Ray node: minutes

NAME = "sglang"


def test_an_engine_on_another_node_is_built_there_and_kept_in_step(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    model = make_tiny_model(str(tmp_path / "model"), arch="opt", seed=0)
    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # Each node's processes see their own node-local folder: what a separate machine without
    # this checkout would use.
    head_dir = tmp_path / "head-node"
    monkeypatch.setenv("WEIGHTSYNC_NODE_DIR", str(head_dir))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    other_dir = tmp_path / "other-node"
    monkeypatch.setenv("WEIGHTSYNC_NODE_DIR", str(other_dir))
    other = cluster.add_node(num_cpus=2)
    monkeypatch.delenv("WEIGHTSYNC_NODE_DIR")
    try:
        launcher.init_ray(address=cluster.address)
        head_id = ray.get_runtime_context().get_node_id()
        assert other.node_id != head_id and len([n for n in ray.nodes() if n["Alive"]]) == 2

        every = launcher.build_env_on_all_nodes(NAME)
        assert set(every) == {head_id, other.node_id}
        assert every[head_id]["python"].startswith(str(head_dir))
        built = every[other.node_id]
        print(
            f"env {NAME} on the other node: {built['action']} in {built['seconds']:.1f} s, "
            f"{built['python']}"
        )
        assert built["node_id"] == other.node_id
        assert built["python"].startswith(str(other_dir))
        assert not built["python"].startswith(str(envs.REPO_ROOT))

        engine = launcher.launch(
            "weightsync.backends.sglang.engine.SglEngineActor", model, node_id=other.node_id
        )
        where = ray.get(engine.handle.where.remote(), timeout=600)
        assert where["node_id"] == other.node_id
        assert where["python"] == built["python"]

        # The trainer stays on the driver's node; bytes cross nodes over gloo (no shared memory).
        trainer = launcher.TrainerGroup(
            "weightsync.backends.sglang.worker.SglDTensorV2WeightSyncWorker",
            model_path=model,
            bucket_bytes=1 << 20,
            seed=0,
            transport="gloo",
            node_id=head_id,
            collective_host=ray.util.get_node_ip_address(),
        )
        assert all(ray.get(r.handle.where.remote())["node_id"] == head_id for r in trainer.ranks)
        trainer.call("connect", {NAME: engine})
        trainer.call("train_step", [[5, 6, 7, 8, 9, 10, 11, 12]] * 2)
        report = trainer.call("sync", "across-nodes", verify=True)
        assert report["verify"][NAME]["verified"], report["verify"]
        assert_engine_matches_reference(engine, trainer)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(other_dir, ignore_errors=True)
        shutil.rmtree(head_dir, ignore_errors=True)
