"""`DTensorV2WeightSyncWorker`: a trainer rank as a Ray actor, for the demo, tests and benches.

It builds an FSDP2 (DTensor) model from a HF checkpoint directory (with transformers, or with
nemo-automodel's model classes and parallelizer where that env has it), trains it with plain
next-token loss, and keeps engines in step through `TrainerSync`, which does all of the weight
sync; its weight-sync calls are `WeightSyncWorker`'s (weightsync/trainer/worker.py), answered as
plain data. A training framework with its own model uses `TrainerSync` directly (README,
examples/). The launcher starts one per rank (`launcher.TrainerGroup`) in the driver's env;
`backends/*/worker.py` subclass it to run in an engine's env, and each checks at construction
that it does (`check_engine_env`).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal

import torch

from weightsync import (
    Probe,
    SyncOptions,
    TrainerSync,
    close_trainer_group,
    init_trainer_group,
    shard_model,
)
from weightsync.trainer.shard_writes import BeforeWrite
from weightsync.trainer.worker import WeightSyncWorker
from weightsync.wire.specs import as_plain

logger = logging.getLogger(__name__)


class DTensorV2WeightSyncWorker(WeightSyncWorker):
    """One trainer rank. The driver calls every method on all ranks at once (`TrainerGroup`):
    the weight-sync calls of `WeightSyncWorker` (whose docstrings say when), and the training
    and reference calls the tests, the demo and the bench drive the model with.

    `sync_options`: the fields of `SyncOptions` (transport, bucket_bytes, ...)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        model_path: str,
        rank0_hosts_store: bool = True,
        dtype: str = "float32",
        lr: float = 1e-3,
        seed: int = 0,
        model_builder: Literal["transformers", "nemo_automodel"] = "transformers",
        **sync_options: Any,
    ) -> None:
        # A probe arrives as plain data (its fields, or True) across the environment boundary.
        probe = Probe.of(sync_options.pop("probe", None))
        options = SyncOptions(
            **sync_options, probe=probe
        )  # bad options fail before anything starts
        torch.manual_seed(seed)
        self.rank = rank
        self.device = init_trainer_group(
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            rank0_hosts_store=rank0_hosts_store,
        )
        self.model_path = model_path
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype={dtype!r}: not a torch dtype name (e.g. 'float32')")
        if model_builder == "transformers":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
            self.model = shard_model(model, device=self.device)
        elif model_builder == "nemo_automodel":
            from weightsync.apps.automodel import build_automodel

            self.model = build_automodel(model_path, dtype=dtype, device=self.device)
        else:
            raise ValueError(
                f"model_builder={model_builder!r}: expected 'transformers' or 'nemo_automodel'"
            )
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.weights = TrainerSync(self.model, options=options)
        self._kept: dict[str, torch.Tensor] = {}  # `keep_weights`

    def refit_info(self) -> list[dict[str, Any]]:
        return self.weights.refit_info()

    def connect(self, engines: dict[str, Any]) -> dict[str, Any] | None:
        answers = self.weights.connect(engines)
        if answers is None:
            return None
        return {
            name: {
                "num_params": a.num_params,
                "num_receivers": a.num_receivers,
                **({"unverifiable": a.unverifiable} if a.unverifiable else {}),
                **({"accepted": a.accepted} if a.accepted else {}),
            }
            for name, a in answers.items()
        }

    def sync(
        self,
        version: str | None = None,
        *,
        verify: bool | None = None,
        engines: list[str] | None = None,
    ) -> dict[str, Any] | None:
        report = self.weights.sync(version, verify=verify, engines=engines)
        return None if report is None else as_plain(report.to_dict())

    def verify(self, engines: list[str] | None = None) -> dict[str, Any] | None:
        report = self.weights.verify(engines)
        return None if report is None else as_plain(report.to_dict())

    def revert(self, engines: list[str] | None = None) -> dict[str, Any] | None:
        """`TrainerSync.revert`: rank 0 answers {engine: `EndReport.to_dict()`}."""
        reports = self.weights.revert(engines)
        return None if reports is None else {n: as_plain(r.to_dict()) for n, r in reports.items()}

    def shutdown(self) -> None:
        self.weights.close()
        close_trainer_group()

    def pause_before_write(self, what: str, index: int, seconds: float) -> None:
        """Tests: from now on rank 0 sleeps `seconds` before it writes bucket (`what`
        "bucket") or one-copy piece ("piece") `index` of each sync, so that the reliability
        suite can kill a process mid-sync. Every rank may be called; only rank 0 pauses."""
        hook = _pause_hook((what, index, seconds), self.rank)
        self.weights.buckets.before_write = hook
        self.weights.one_copy_path.writer.before_write = hook

    def train_step(self, token_ids: list[list[int]]) -> float:
        """One optimizer step of next-token loss on `token_ids` (same batch on every rank)."""
        self.model.train()
        batch = torch.tensor(token_ids, device=self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return float(loss.detach())

    def grpo_step(self, rollouts: list[dict[str, Any]], **options: Any) -> dict[str, Any]:
        """Clipped policy-gradient updates on sampled rollouts (all ranks, same list); returns
        the learner's float32 log-probabilities of the sampled tokens before the update
        (`weightsync.apps.grpo.policy_step`)."""
        from weightsync.apps.grpo import policy_step

        return policy_step(self.model, self.optimizer, rollouts, **options)

    def full_state(self) -> dict[str, torch.Tensor]:
        return dict(self.weights.source.tensors())

    def reference_generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> Any:
        """Greedy continuations from an unsharded float32 copy of the current weights, on rank
        0 ({"tokens", "logprobs"}); None elsewhere."""
        from weightsync.apps.reference import reference_generate

        state = self.full_state()
        if self.rank != 0:
            return None
        return reference_generate(self.model_path, state, prompts, max_new_tokens=max_new_tokens)

    def reference_margins(self, sequences: list[list[int]], starts: list[int]) -> Any:
        """`weightsync.apps.reference.reference_margins` of the current weights, on rank 0;
        None elsewhere."""
        from weightsync.apps.reference import reference_margins

        state = self.full_state()
        if self.rank != 0:
            return None
        return reference_margins(self.model_path, state, sequences, starts)

    def set_weights_from(self, other_seed: int) -> None:
        """Overwrite the model with another seed's random weights (tests: a big change)."""
        with torch.no_grad():
            gen = torch.Generator().manual_seed(other_seed)
            for param in self.model.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(local.shape, generator=gen) * 0.05)

    def keep_weights(self) -> None:
        """Keep a copy of this rank's shards of the current weights (`restore_weights`)."""
        self._kept = {
            name: _local(param).detach().clone() for name, param in self.model.named_parameters()
        }

    def restore_weights(self) -> None:
        """Put back the weights `keep_weights` kept (tests: the weights an engine started from)."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                _local(param).copy_(self._kept[name])

    def scale_weights(self, suffix: str, factor: float) -> int:
        """Multiply every parameter whose name ends with `suffix` by `factor` (tests: weights
        that dominate what the model computes); how many there were."""
        count = 0
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name.endswith(suffix):
                    local = param.to_local() if hasattr(param, "to_local") else param
                    local.mul_(factor)
                    count += 1
        return count

    def model_info(self) -> dict[str, Any]:
        """Which class holds the weights and how many parameters are DTensors (plain data)."""
        params = list(self.model.parameters())
        # fully_shard swaps in a subclass ("FSDP<name>"): report the model's own class.
        cls = next(
            c for c in type(self.model).__mro__ if not c.__module__.startswith("torch.distributed")
        )
        return {
            "module": cls.__module__,
            "class": cls.__name__,
            "num_params": len(params),
            "num_dtensor_params": sum(type(p).__name__ == "DTensor" for p in params),
        }

    def process_stats(self) -> dict[str, int]:
        from weightsync.driver.procstats import process_tree_stats

        return process_tree_stats()


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `param` (a DTensor's local tensor, or `param` itself)."""
    return param.to_local() if hasattr(param, "to_local") else param


def _pause_hook(pause: tuple[str, int, float], rank: int) -> BeforeWrite:
    what, index, seconds = pause
    if what not in ("bucket", "piece"):
        raise ValueError(
            f"pause_before_write{pause!r}: expected ('bucket' | 'piece', index, seconds)"
        )

    def hook(kind: str, at: int) -> None:
        if kind == what and at == int(index):
            logger.warning("[rank %d] test pause: %.0f s before %s %d", rank, seconds, kind, at)
            time.sleep(seconds)

    return hook


def check_engine_env(worker: str, engine_module: str) -> dict[str, str]:
    """In this process: that it runs in an env of the engine imported as `engine_module`
    (weightsync/driver/envs.py `ENVS`), i.e. the engine is installed beside the torch this
    process runs. Returns {"env", engine_module, "torch"}: the env and versions (plain data).
    Raises RuntimeError naming the env and the fix otherwise.

    The engine is found, not imported: its import takes seconds on every rank and starts
    machinery that a trainer rank does not use."""
    import importlib.util
    from importlib import metadata
    from pathlib import Path

    from weightsync.driver import envs

    specs = [spec for spec in envs.ENVS.values() if spec.engine_module == engine_module]
    names = " or ".join(repr(spec.name) for spec in specs)
    pythons = " or ".join(str(envs.python_path(spec.name)) for spec in specs)
    builds = " or ".join(f"`weightsync env build {spec.name}`" for spec in specs)
    fix = (
        f"launch it through weightsync.driver.launcher (launch() or TrainerGroup), which starts "
        f"it with its env's python ({pythons}; {builds} builds the env)"
    )
    found = importlib.util.find_spec(engine_module)
    if found is None or found.origin is None:
        raise RuntimeError(
            f"{worker} runs in env {names}, but this process ({sys.executable}) cannot import "
            f"{engine_module!r}: {fix}"
        )
    engine_site = Path(found.origin).resolve().parent.parent
    torch_site = Path(torch.__file__).resolve().parent.parent
    if engine_site != torch_site:
        raise RuntimeError(
            f"{worker}: {engine_module!r} is installed in {engine_site}, but this process "
            f"({sys.executable}) runs torch {torch.__version__} from {torch_site}, not the "
            f"engine's; its path mixes two environments (PYTHONPATH?): {fix}"
        )
    for spec in specs:
        try:
            version = metadata.version(spec.engine)
        except metadata.PackageNotFoundError:
            continue
        return {"env": spec.name, engine_module: version, "torch": str(torch.__version__)}
    raise RuntimeError(
        f"{worker}: {engine_module!r} imports from {engine_site}, but none of the "
        f"distributions {[spec.engine for spec in specs]} is installed there: {fix}"
    )
