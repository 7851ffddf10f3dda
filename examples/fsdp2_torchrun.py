"""A plain FSDP2 training loop, started with torchrun (no Ray on the trainer side), that keeps a
vLLM engine in step through `weightsync.TrainerSync`.

    .venv/bin/torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --steps 4

The loop is the framework's own: its model (transformers + `fully_shard`), its optimizer, its
process group. weightsync adds three calls: `TrainerSync(model)`, `connect`, `sync`. Rank 0 also
starts the engine, a Ray actor in the engine's own environment (built on first use). Exit code 0
only if every sync was verified.
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import weightsync
from weightsync.apps.models import (  # a tiny checkpoint, no downloads
    make_tiny_model,
    make_tokenizer,
)

TEXT = "the engines follow the trainer, step by step."


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # torchrun's variables say who is who
    rank, world_size = dist.get_rank(), dist.get_world_size()
    path = [
        make_tiny_model(tempfile.mkdtemp(prefix="ws-example-"), arch="opt") if rank == 0 else None
    ]
    dist.broadcast_object_list(path, src=0)
    model_path = path[0]

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.decoder.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    sync = weightsync.TrainerSync(model, options=weightsync.SyncOptions(verify=True))
    engines = {}
    if rank == 0:
        weightsync.init_ray(num_cpus=2)
        engines["vllm"] = weightsync.launch(
            "weightsync.backends.vllm.engine.VllmEngineActor", model_path
        )
    sync.connect(engines)  # rank 0 checks refit info with the engine; others take part only

    batch = torch.tensor([make_tokenizer()(TEXT).input_ids] * 2)
    all_verified = True
    for step in range(1, args.steps + 1):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report = sync.sync(f"step-{step}")  # every rank: each writes its own shards
        if report is not None:  # rank 0's SyncReport
            verified = report.verify is not None and bool(report.verify["vllm"].verified)
            all_verified &= verified
            print(
                f"step {step}  loss {loss.item():.3f}  sync {report.sync_s * 1e3:.1f} ms "
                f"({report.path})  verified {verified}",
                flush=True,
            )
            # One flat dict per sync, what a framework hands its logger (wandb.log, TensorBoard).
            print(f"metrics {json.dumps(report.metrics())}", flush=True)

    if rank == 0:
        import ray

        prompt = make_tokenizer()("the engines").input_ids
        out = ray.get(engines["vllm"].generate.remote([prompt], max_new_tokens=8))
        print(f"engine serves {out['weight_version']}: continuation {out['tokens'][0]}")
        ray.get(engines["vllm"].shutdown.remote())
        ray.shutdown()
    sync.close()
    dist.destroy_process_group()
    return 0 if all_verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
