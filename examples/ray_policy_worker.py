"""A framework-style Ray policy worker that owns its model and keeps a vLLM engine in step
through `weightsync.TrainerSync`.

    .venv/bin/python examples/ray_policy_worker.py --steps 3

RL frameworks run one policy worker actor per trainer rank, each owning its shard of the model
and its optimizer. `PolicyWorker` is such a class: the framework creates it with plain
`ray.remote`, in its own environment; weightsync adds a `TrainerSync` next to the optimizer. The
engine is a Ray actor in the engine's own environment (`weightsync.launch`). Exit code 0 only if
every sync was verified and the engine then serves the last version.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

import ray
import torch

import weightsync
from weightsync.apps.models import (  # a tiny checkpoint, no downloads
    make_tiny_model,
    make_tokenizer,
)


class PolicyWorker:
    """One trainer rank: model shard, optimizer, and the weight sync beside them."""

    def __init__(self, *, rank: int, world_size: int, master_port: int, model_path: str) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        weightsync.init_trainer_group(
            rank=rank,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=master_port,
            rank0_hosts_store=False,
        )
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in self.model.model.decoder.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.weights = weightsync.TrainerSync(self.model, options=weightsync.SyncOptions())

    def connect(self, engines: dict[str, Any]) -> None:
        self.weights.connect(engines)

    def train_step(self, token_ids: list[list[int]]) -> float:
        batch = torch.tensor(token_ids)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def sync_weights(self, version: str) -> dict[str, Any] | None:
        # Rank 0's report, as plain data: what a Ray call should carry (the driver may run in
        # another env); the other ranks return None.
        report = self.weights.sync(version, verify=True)
        return None if report is None else report.to_dict()

    def close(self) -> None:
        import torch.distributed as dist

        self.weights.close()
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()

    model_path = make_tiny_model(tempfile.mkdtemp(prefix="ws-example-"), arch="opt")
    weightsync.init_ray(num_cpus=2)
    engine = weightsync.launch("weightsync.backends.vllm.engine.VllmEngineActor", model_path)
    store = weightsync.host_store(
        "127.0.0.1"
    )  # the trainer group's rendezvous, on a port of its own
    workers = [
        ray.remote(PolicyWorker)
        .options(num_cpus=0)
        .remote(rank=r, world_size=args.world_size, master_port=store.port, model_path=model_path)
        for r in range(args.world_size)
    ]

    def on_all(method: str, *call_args: Any) -> Any:  # every rank at once; rank 0's answer
        return ray.get([getattr(w, method).remote(*call_args) for w in workers])[0]

    on_all("connect", {"vllm": engine})
    batch = [make_tokenizer()("the engines follow the trainer").input_ids] * 2
    all_verified = True
    for step in range(1, args.steps + 1):
        loss = on_all("train_step", batch)
        report = weightsync.SyncReport.from_dict(on_all("sync_weights", f"step-{step}"))
        verified = report.verify is not None and bool(report.verify["vllm"].verified)
        all_verified &= verified
        print(
            f"step {step}  loss {loss:.3f}  sync {report.sync_s * 1e3:.1f} ms "
            f"({report.path})  verified {verified}",
            flush=True,
        )
        # One flat dict per sync, what a framework hands its logger (wandb.log, TensorBoard).
        print(f"metrics {json.dumps(report.metrics())}", flush=True)
    served = ray.get(engine.generate.remote([batch[0][:4]]))["weight_version"]
    print(f"engine serves {served}")
    on_all("close")
    ray.get(engine.shutdown.remote())
    ray.shutdown()
    return 0 if all_verified and served == f"step-{args.steps}" else 1


if __name__ == "__main__":
    raise SystemExit(main())
