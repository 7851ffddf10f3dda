"""The engine envs' trainer workers (backends/*/worker.py) refuse to start outside their env,
before they build anything, naming the env and the fix. That each starts in its own env is
checked by tests/sglang and tests/vllm, which run there."""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec

import pytest
import torch.distributed as dist

from weightsync.backends.sglang.worker import SglDTensorV2WeightSyncWorker
from weightsync.backends.vllm.worker import VllmDTensorV2WeightSyncWorker

# Never reached: the env check comes first.
WORKER_ARGS = {
    "rank": 0,
    "world_size": 1,
    "master_addr": "127.0.0.1",
    "master_port": 1,
    "model_path": "/nonexistent",
}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.skipif(_installed("sglang"), reason="this env has sglang")
def test_the_sglang_trainer_worker_refuses_an_env_without_sglang():
    with pytest.raises(
        RuntimeError,
        match=r"SglDTensorV2WeightSyncWorker runs in env 'sglang', but this process \(.*\) "
        r"cannot import 'sglang': launch it through weightsync.driver.launcher .*"
        r"envs/sglang/.venv/bin/python; `weightsync env build sglang` builds the env",
    ):
        SglDTensorV2WeightSyncWorker(**WORKER_ARGS)
    assert not dist.is_initialized()


@pytest.mark.skipif(_installed("vllm"), reason="this env has vllm")
def test_the_vllm_trainer_worker_refuses_an_env_without_vllm():
    with pytest.raises(
        RuntimeError,
        match=r"VllmDTensorV2WeightSyncWorker runs in env 'vllm' or 'vllm-cpu', but this "
        r"process \(.*\) cannot import 'vllm'",
    ):
        VllmDTensorV2WeightSyncWorker(**WORKER_ARGS)
    assert not dist.is_initialized()


def test_an_engine_worker_refuses_an_engine_installed_beside_another_torch(monkeypatch):
    elsewhere = ModuleSpec("sglang", None, origin="/elsewhere/site-packages/sglang/__init__.py")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: elsewhere if name == "sglang" else find_spec(name, *a),
    )
    with pytest.raises(
        RuntimeError,
        match=r"SglDTensorV2WeightSyncWorker: 'sglang' is installed in /elsewhere/site-packages, "
        r"but this process \(.*\) runs torch .* from .*, not the engine's",
    ):
        SglDTensorV2WeightSyncWorker(**WORKER_ARGS)
