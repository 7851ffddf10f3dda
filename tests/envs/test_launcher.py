"""One Ray job, actors in two environments that could never share one."""

from __future__ import annotations

import pytest
import ray

from weightsync import envs, launcher


@pytest.fixture(scope="module")
def ray_job():
    launcher.init_ray(num_cpus=2)
    yield
    ray.shutdown()


def test_actors_in_sglang_and_vllm_envs_report_their_own_versions(ray_job):
    vllm_env = envs.default_vllm_env()
    sgl = launcher.launch("weightsync.launcher.EnvProbe", env="sglang")
    vll = launcher.launch("weightsync.launcher.EnvProbe", env=vllm_env)
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
        launcher.launch("weightsync.launcher.EnvProbe", env="sglang2")


def test_unregistered_class_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'my.Actor' is not registered.*register_actor"):
        launcher.launch("my.Actor")
