from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

# Suites whose every test runs a real engine (each suite runs in the env it needs).
ENGINE_SUITES = {"sglang", "vllm", "e2e", "reliability"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`engine` on every test of an engine suite; `gpu` tests skipped where CUDA is absent."""
    cuda: bool | None = None
    for item in items:
        if Path(str(item.path)).parent.name in ENGINE_SUITES:
            item.add_marker(pytest.mark.engine)
        if item.get_closest_marker("gpu") is not None:
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


logging.getLogger("weightsync").setLevel(logging.INFO)
