"""`DTensorV2WeightSyncWorker`: a trainer rank as a Ray actor, for the demo, tests and benches.

It builds an FSDP2 (DTensor) model from a HF checkpoint directory (with transformers, or with
nemo-automodel's model classes and parallelizer where that env has it), trains it with plain
next-token loss, and keeps engines in step through `TrainerSync`, which does all of the weight
sync. A training framework with its own model uses `TrainerSync` directly (README, examples/).
The launcher starts one per rank (`launcher.TrainerGroup`); `backends/*/worker.py` name the
subclasses that run in each engine's env.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Literal

import torch

from weightsync import (
    SyncOptions,
    TrainerSync,
    close_trainer_group,
    init_trainer_group,
    shard_model,
)

logger = logging.getLogger(__name__)


class DTensorV2WeightSyncWorker:
    """One trainer rank. The driver calls every method on all ranks at once (`TrainerGroup`).

    `sync_options`: the fields of `SyncOptions` (transport, bucket_bytes, ...). `test_pause`:
    (what, index, seconds) makes rank 0 sleep before writing bucket or one-copy piece `index`
    (what = "bucket" | "piece"), so the reliability suite can kill a process mid-sync."""

    engine_env: str | None = None

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
        test_pause: tuple[str, int, float] | None = None,
        **sync_options: Any,
    ) -> None:
        options = SyncOptions(**sync_options)  # bad options fail before anything starts
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
        self.weights = TrainerSync(
            self.model, options=options, before_write=_pause_hook(test_pause, rank)
        )

    # ---- weight sync: TrainerSync's -------------------------------------------------------
    def refit_info(self) -> list[dict]:
        return self.weights.refit_info()

    def connect(self, engines: dict[str, Any]) -> dict[str, Any]:
        return self.weights.connect(engines)

    def sync(
        self,
        version: str | None = None,
        *,
        verify: bool | None = None,
        engines: list[str] | None = None,
    ) -> dict[str, Any]:
        return self.weights.sync(version, verify=verify, engines=engines)

    def verify(self, engines: list[str] | None = None) -> dict[str, Any]:
        return self.weights.verify(engines)

    # ---- training and references, for tests and the demo ----------------------------------
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

    def tensor_fingerprints(self) -> dict[str, list[int]]:
        """{HF name: fingerprint} of what a sync sends (all ranks; meaningful on rank 0)."""
        from weightsync.wire.fingerprint import fingerprint  # a test aid, not a sync path

        return {name: list(fingerprint(t)) for name, t in self.weights.source.tensors()}

    def reference_generate(self, prompts: list[list[int]], *, max_new_tokens: int) -> Any:
        """Greedy continuations from an unsharded float32 copy of the current weights, on rank
        0 ({"tokens", "logprobs"}); None elsewhere."""
        from weightsync.apps.reference import reference_generate

        state = self.full_state()
        if self.rank != 0:
            return None
        return reference_generate(self.model_path, state, prompts, max_new_tokens=max_new_tokens)

    def set_weights_from(self, other_seed: int) -> None:
        """Overwrite the model with another seed's random weights (tests: a big change)."""
        with torch.no_grad():
            gen = torch.Generator().manual_seed(other_seed)
            for param in self.model.parameters():
                local = param.to_local() if hasattr(param, "to_local") else param
                local.copy_(torch.randn(local.shape, generator=gen) * 0.05)

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

    def shutdown(self) -> None:
        self.weights.close()
        close_trainer_group()

    def process_stats(self) -> dict[str, int]:
        from weightsync.launch.procstats import process_tree_stats

        return process_tree_stats()

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "torch": str(torch.__version__)}


def _pause_hook(pause: tuple[str, int, float] | None, rank: int) -> Any:
    if pause is None:
        return None
    what, index, seconds = pause
    if what not in ("bucket", "piece"):
        raise ValueError(f"test_pause={pause!r}: expected ('bucket' | 'piece', index, seconds)")

    def hook(kind: str, at: int) -> None:
        if kind == what and at == int(index):
            logger.warning("[rank %d] test pause: %.0f s before %s %d", rank, seconds, kind, at)
            time.sleep(seconds)

    return hook
