"""CUDA IPC and NCCL transports through the real sender and a receiving process (GPU only;
skipped where there is no GPU, as in CI)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bench():
    # A plain import, so that spawned receiver processes can import it too.
    sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "scripts"))
    import gpu_bench

    return gpu_bench


@needs_gpu
def test_cuda_ipc_sync_into_another_process_is_verified():
    result = _bench().run("ipc", 0.5, repeats=1, bucket_bytes=128 << 20)
    assert result["verified"] and result["sync_gbps"] > 0


@needs_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_sync_to_another_gpu_is_verified():
    result = _bench().run("nccl", 0.5, repeats=1, bucket_bytes=128 << 20)
    assert result["verified"] and result["sync_gbps"] > 0
