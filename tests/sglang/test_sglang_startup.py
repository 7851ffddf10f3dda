"""An SGLang engine that cannot start says why, within seconds, to the caller (real Ray, the real
sglang env, CPU): known unsupported combinations are refused before the engine starts, and an
error raised while the actor starts reaches the caller's first call as itself."""

from __future__ import annotations

import os
import time

import pytest
import ray

from weightsync.apps.models import make_tiny_model
from weightsync.driver import envs, launcher

SGL = "weightsync.backends.sglang.engine.SglEngineActor"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    launcher.init_ray(num_cpus=2)
    yield {arch: make_tiny_model(str(root / arch), arch=arch) for arch in ("qwen2", "opt")}
    ray.shutdown()


def test_rope_model_on_cpu_is_refused_at_launch_naming_the_architecture_and_the_fix(models):
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"(?s)Qwen2ForCausalLM.*rotary position embeddings"
        r".*rope_parameters.*vLLM on CPU.*CUDA GPU",
    ):
        launcher.launch(SGL, models["qwen2"])
    assert time.monotonic() - start < 2


def test_tp_size_2_on_cpu_is_refused_at_launch(models):
    with pytest.raises(ValueError, match=r"sglang on CPU cannot run tp_size=2.*Use tp_size=1"):
        launcher.launch(SGL, models["opt"], engine_args={"tp_size": 2})


def test_the_engine_actor_itself_refuses_a_rope_model_on_cpu(models):
    # The actor checks again in its own process (e.g. when the driver cannot read the model):
    # started here without the launcher's check, the first call raises the refusal.
    start = time.monotonic()
    host = (
        ray.remote(launcher.ActorHost)
        .options(
            num_cpus=0,
            runtime_env={"py_executable": str(envs.python_path("sglang"))},
        )
        .remote(SGL, (models["qwen2"],), {})
    )
    proxy = launcher.ActorProxy(handle=host, qualname=SGL, env="sglang")
    with pytest.raises(ValueError, match=r"(?s)Qwen2ForCausalLM.*rotary.*vLLM on CPU"):
        ray.get(proxy.weight_version.remote(), timeout=120)
    print(f"refused by the actor {time.monotonic() - start:.1f} s after it was created")
    assert time.monotonic() - start < 60
    ray.kill(host)


def test_an_error_raised_while_the_actor_starts_reaches_the_first_call_as_itself(models):
    start = time.monotonic()
    proxy = launcher.launch(SGL, "/nonexistent/checkpoint")
    with pytest.raises(FileNotFoundError) as info:
        ray.get(proxy.weight_version.remote(), timeout=120)
    message = str(info.value)
    assert "no checkpoint folder at '/nonexistent/checkpoint'" in message
    assert "SglEngineActor(...) in its actor" in message  # the note naming who raised it
    assert "refuse_unsupported_sglang" in message  # the constructor's frames
    # Later calls say the same instead of "actor died".
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        ray.get(proxy.generate.remote([[5, 6]]), timeout=60)
    print(f"constructor error at the caller {time.monotonic() - start:.1f} s after launch")
    assert time.monotonic() - start < 60
    ray.kill(proxy.handle)


def test_a_scheduler_that_dies_at_start_up_surfaces_its_exception(models, tmp_path):
    # A checkpoint the launcher accepts but whose weights SGLang's scheduler cannot read: the
    # scheduler process fails, and SGLang's own handler would kill the actor with it.
    broken = make_tiny_model(str(tmp_path / "broken"), arch="opt")
    weights = os.path.join(broken, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    start = time.monotonic()
    proxy = launcher.launch(SGL, broken)
    with pytest.raises(
        RuntimeError,
        match=r"(?s)failed to start.*its scheduler raised:.*"
        r"SafetensorError: Error while deserializing header",
    ):
        ray.get(proxy.weight_version.remote(), timeout=400)
    print(f"scheduler failure at the caller {time.monotonic() - start:.1f} s after launch")
    ray.kill(proxy.handle)


def test_an_api_key_that_starts_with_a_dash_reaches_sglang_as_the_key(tmp_path):
    from sglang.srt.server_args import prepare_server_args

    from weightsync.backends.sglang.serve import server_argv

    args = prepare_server_args(server_argv(["--model-path", str(tmp_path)], "-Ab3_x"))
    assert args.api_key == "-Ab3_x"
