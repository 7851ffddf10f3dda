"""Two Ray nodes (two raylets on this machine): a tensor-parallel vLLM engine placed on the other
node gets its env built there, from files Ray ships (not from this checkout), is synced by
buckets over gloo, then takes the point-to-point path, each trainer rank sending its own shards
across the nodes."""

from __future__ import annotations

import shutil

import pytest
import ray

from tests.engine_checks import assert_engine_matches_reference, training_batch
from weightsync.apps.models import make_tiny_model
from weightsync.driver import envs, launcher

pytestmark = pytest.mark.slow  # a whole demo or a second Ray node: minutes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """A head node and another one, each seeing its own node-local folder: what a separate
    machine without this checkout would use."""
    from ray.cluster_utils import Cluster

    tmp_path = tmp_path_factory.mktemp("nodes")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        head_dir = tmp_path / "head-node"
        patch.setenv("WEIGHTSYNC_NODE_DIR", str(head_dir))
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
        other_dir = tmp_path / "other-node"
        patch.setenv("WEIGHTSYNC_NODE_DIR", str(other_dir))
        other = cluster.add_node(num_cpus=2)
        patch.delenv("WEIGHTSYNC_NODE_DIR")
        try:
            launcher.init_ray(address=cluster.address)
            head_id = ray.get_runtime_context().get_node_id()
            assert other.node_id != head_id and len([n for n in ray.nodes() if n["Alive"]]) == 2
            yield {
                "tmp": tmp_path,
                "head_id": head_id,
                "other_id": other.node_id,
                "head_dir": head_dir,
                "other_dir": other_dir,
            }
        finally:
            ray.shutdown()
            cluster.shutdown()
            shutil.rmtree(other_dir, ignore_errors=True)
            shutil.rmtree(head_dir, ignore_errors=True)


def _built_on_both(nodes, name: str) -> dict:
    every = launcher.build_env_on_all_nodes(name)
    assert set(every) == {nodes["head_id"], nodes["other_id"]}
    assert every[nodes["head_id"]]["python"].startswith(str(nodes["head_dir"]))
    built = every[nodes["other_id"]]
    print(
        f"env {name} on the other node: {built['action']} in {built['seconds']:.1f} s, "
        f"{built['python']}"
    )
    assert built["node_id"] == nodes["other_id"]
    assert built["python"].startswith(str(nodes["other_dir"]))
    assert not built["python"].startswith(str(envs.REPO_ROOT))
    return built


def test_an_engine_on_another_node_is_built_there_and_kept_in_step_point_to_point(nodes):
    """A TP=2 vLLM engine on the other node, run from the env built there; two FSDP2 ranks on
    the head node with `point_to_point=True`: a first sync by buckets over gloo (the store on the
    node IP: no shared memory crosses nodes), verified, tokens equal; then each rank sends its
    own pieces to both workers across the nodes (rank 0 hosts only the group's store), verified
    per worker, tokens equal; rank 0 sends about half of the bytes. (One engine for both paths:
    a second engine on the other node would cost minutes of CI.)"""
    model = make_tiny_model(str(nodes["tmp"] / "qwen2"), arch="qwen2", seed=0)
    name = envs.default_vllm_env()
    built = _built_on_both(nodes, name)
    engine = launcher.launch(
        "weightsync.backends.vllm.engine.VllmEngineActor",
        model,
        tensor_parallel_size=2,
        node_id=nodes["other_id"],
    )
    try:
        where = ray.get(engine.handle.where.remote(), timeout=600)
        assert where["node_id"] == nodes["other_id"] and where["python"] == built["python"]
        trainer = launcher.TrainerGroup(
            "weightsync.backends.vllm.worker.VllmDTensorV2WeightSyncWorker",
            model_path=model,
            bucket_bytes=1 << 20,
            seed=0,
            transport="gloo",
            point_to_point=True,
            node_id=nodes["head_id"],
            collective_host=ray.util.get_node_ip_address(),
        )
        assert all(
            ray.get(r.handle.where.remote())["node_id"] == nodes["head_id"] for r in trainer.ranks
        )
        trainer.call("connect", {"tp2": engine})
        first = trainer.sync("first", verify=True)
        assert first.path == "buckets" and first.verify["tp2"].verified, first
        assert_engine_matches_reference(engine, trainer)
        trainer.call("train_step", training_batch(1))
        report = trainer.sync("p2p", verify=True)
        assert report.path == "p2p" and report.verify["tp2"].verified, report
        assert report.verify["tp2"].num_checked == 2 * 17
        sent = report.bytes_written
        assert sum(report.rank_bytes) == sent and report.nbytes <= sent < 1.05 * report.nbytes
        assert abs(report.rank_bytes[0] - sent / 2) < 0.05 * sent, report.rank_bytes
        assert ray.get(engine.weight_version.remote()) == "p2p"
        assert_engine_matches_reference(engine, trainer)
        trainer.call("shutdown")
        trainer.kill()
    finally:
        ray.kill(engine.handle)
