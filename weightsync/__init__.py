"""weightsync: keep inference engines in step with a sharded PyTorch trainer across environments.

The public API, imported lazily (the CLI starts without torch):
  trainer side:  TrainerSync, SyncOptions, init_trainer_group, DTensorV2Source
  engines:       init_ray, launch, register_actor, TrainerGroup (Ray actors in their own envs)
  building your own: WeightSender, WeightReceiver, ModuleWeightReceiver, Endpoint, RayEndpoint
The core needs only torch (and ray where it launches actors); engines live in `backends/`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "TrainerSync": "weightsync.trainer",
    "SyncOptions": "weightsync.trainer",
    "init_trainer_group": "weightsync.dtensor",
    "DTensorV2Source": "weightsync.dtensor",
    "init_ray": "weightsync.launcher",
    "launch": "weightsync.launcher",
    "register_actor": "weightsync.launcher",
    "TrainerGroup": "weightsync.launcher",
    "WeightSender": "weightsync.sender",
    "WeightReceiver": "weightsync.receiver",
    "ModuleWeightReceiver": "weightsync.receiver",
    "Endpoint": "weightsync.endpoint",
    "RayEndpoint": "weightsync.endpoint",
}
__all__ = [
    "DTensorV2Source", "Endpoint", "ModuleWeightReceiver", "RayEndpoint", "SyncOptions",
    "TrainerGroup", "TrainerSync", "WeightReceiver", "WeightSender", "init_ray",
    "init_trainer_group", "launch", "register_actor",
]

if TYPE_CHECKING:
    from weightsync.dtensor import DTensorV2Source, init_trainer_group
    from weightsync.endpoint import Endpoint, RayEndpoint
    from weightsync.launcher import TrainerGroup, init_ray, launch, register_actor
    from weightsync.receiver import ModuleWeightReceiver, WeightReceiver
    from weightsync.sender import WeightSender
    from weightsync.trainer import SyncOptions, TrainerSync


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
