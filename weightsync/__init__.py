"""weightsync: keep inference engines in step with a sharded PyTorch trainer across environments.

The public API, imported lazily (the CLI starts without torch):
  trainer side:  TrainerSync, SyncOptions, Probe, init_trainer_group, host_store, shard_model,
                 close_trainer_group, DTensorV2Source
  engines:       init_ray, launch, register_actor, TrainerGroup (Ray actors in their own envs)
  results:       SyncReport, VerifyReport, ProbeFailed (typed; to_dict()/from_dict() for plain data,
                 metrics() as one flat dict for a metrics logger)
  building your own: WeightSyncWorker, WeightSender, WeightReceiver, ModuleWeightReceiver,
                 Endpoint, RayEndpoint
The core needs only torch (and ray where it launches actors). The engine backends import as
`weightsync.backends`: a wheel installs them there, a source checkout keeps them in `backends/`
at the top of the repository (mapped below).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "TrainerSync": "weightsync.trainer.sync",
    "SyncOptions": "weightsync.trainer.sync",
    "Probe": "weightsync.trainer.probe",
    "ProbeFailed": "weightsync.wire.errors",
    "init_trainer_group": "weightsync.trainer.process_group",
    "shard_model": "weightsync.trainer.process_group",
    "close_trainer_group": "weightsync.trainer.process_group",
    "host_store": "weightsync.transports.rendezvous",
    "DTensorV2Source": "weightsync.trainer.source",
    "init_ray": "weightsync.driver.launcher",
    "launch": "weightsync.driver.launcher",
    "register_actor": "weightsync.driver.launcher",
    "TrainerGroup": "weightsync.driver.launcher",
    "WeightSender": "weightsync.trainer.sender",
    "WeightReceiver": "weightsync.engine.session",
    "ModuleWeightReceiver": "weightsync.engine.module_receiver",
    "Endpoint": "weightsync.trainer.endpoint",
    "RayEndpoint": "weightsync.trainer.endpoint",
    "SyncReport": "weightsync.wire.protocol",
    "VerifyReport": "weightsync.wire.protocol",
    "WeightSyncWorker": "weightsync.trainer.worker",
}
__all__ = [
    "DTensorV2Source",
    "close_trainer_group",
    "shard_model",
    "Endpoint",
    "ModuleWeightReceiver",
    "Probe",
    "ProbeFailed",
    "RayEndpoint",
    "SyncOptions",
    "SyncReport",
    "TrainerGroup",
    "TrainerSync",
    "WeightReceiver",
    "WeightSender",
    "WeightSyncWorker",
    "VerifyReport",
    "host_store",
    "init_ray",
    "init_trainer_group",
    "launch",
    "register_actor",
]

if TYPE_CHECKING:
    from weightsync.driver.launcher import TrainerGroup, init_ray, launch, register_actor
    from weightsync.engine.module_receiver import ModuleWeightReceiver
    from weightsync.engine.session import WeightReceiver
    from weightsync.trainer.endpoint import Endpoint, RayEndpoint
    from weightsync.trainer.probe import Probe
    from weightsync.trainer.process_group import (
        close_trainer_group,
        init_trainer_group,
        shard_model,
    )
    from weightsync.trainer.sender import WeightSender
    from weightsync.trainer.source import DTensorV2Source
    from weightsync.trainer.sync import SyncOptions, TrainerSync
    from weightsync.trainer.worker import WeightSyncWorker
    from weightsync.transports.rendezvous import host_store
    from weightsync.wire.errors import ProbeFailed
    from weightsync.wire.protocol import SyncReport, VerifyReport


def _map_checkout_backends() -> None:
    """In a source checkout, make <repo>/backends importable as `weightsync.backends` (the
    wheel puts the same folder at weightsync/backends, where the import system finds it)."""
    here = Path(__file__).resolve().parent
    folder = here.parent / "backends"
    if (here / "backends").is_dir() or not (folder / "__init__.py").is_file():
        return
    spec = importlib.util.spec_from_file_location(
        f"{__name__}.backends", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the engine backends from {folder}: no loader for it")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_map_checkout_backends()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
