"""One Ray job, actors in two environments that could never share one."""

from __future__ import annotations

import pytest
import ray

from weightsync.driver import envs, launcher


@pytest.fixture(scope="module")
def ray_job():
    # "accel": a custom resource standing in for GPUs (3 of them on this one node).
    launcher.init_ray(num_cpus=2, resources={"accel": 3})
    yield
    ray.shutdown()


def test_actors_in_sglang_and_vllm_envs_report_their_own_versions(ray_job):
    vllm_env = envs.default_vllm_env()
    sgl = launcher.launch("weightsync.driver.launcher.EnvProbe", env="sglang")
    vll = launcher.launch("weightsync.driver.launcher.EnvProbe", env=vllm_env)
    a, b = ray.get([sgl.versions.remote(), vll.versions.remote()], timeout=300)
    assert type(a["torch"]) is str and type(b["torch"]) is str
    assert a["sglang"] == envs.pins("sglang")["sglang"] and a["vllm"] is None
    assert a["torch"].split("+")[0] == envs.pins("sglang")["torch"]
    engine = envs.get(vllm_env).engine
    assert b[engine] == envs.pins(vllm_env)[engine] and b["sglang"] is None
    assert b["torch"].split("+")[0] == envs.pins(vllm_env)["torch"]
    assert a["torch"] != b["torch"]
    assert a["executable"].startswith(str(envs.env_dir("sglang")))
    assert b["executable"].startswith(str(envs.env_dir(vllm_env)))
    assert a["ray"] == b["ray"] == ray.__version__


def test_unknown_env_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown env 'sglang2'; valid: sglang, vllm, vllm-cpu"):
        launcher.launch("weightsync.driver.launcher.EnvProbe", env="sglang2")


def test_unregistered_class_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'my.Actor' is not registered.*register_actor"):
        launcher.launch("my.Actor")


def test_a_replica_holds_the_resources_of_its_workers_in_one_bundle(ray_job):
    from ray.util.placement_group import remove_placement_group

    bundle = launcher.replica_resources(2, {"accel": 1})  # a TP=2 replica, one per worker
    assert bundle == {"accel": 2}
    (slot,) = launcher.place(1, bundle)
    try:
        probe = launcher.launch("weightsync.driver.launcher.EnvProbe", placement=slot)
        assert (
            ray.get(probe.handle.where.remote(), timeout=120)["placement_group"]
            == slot.group.id.hex()
        )
        assert ray.available_resources().get("accel", 0) == 1
        # A second replica does not fit now: it fails within the timeout, naming what it
        # asked for and what is left, instead of waiting for ever.
        with pytest.raises(
            TimeoutError,
            match=r"could not place 1 x \{'accel': 2\} within "
            r"3 s; available now: .*'accel': 1\.0",
        ):
            launcher.place(1, bundle, timeout_s=3)
    finally:
        remove_placement_group(slot.group)


def test_a_replica_no_node_can_hold_is_refused_at_once(ray_job):
    import time

    start = time.perf_counter()
    with pytest.raises(
        ValueError,
        match=r"no Ray node has \{'accel': 8\} for one replica; "
        r"the nodes have \[\{.*'accel': 3\.0",
    ):
        launcher.place(2, launcher.replica_resources(8, {"accel": 1}))
    assert time.perf_counter() - start < 5
