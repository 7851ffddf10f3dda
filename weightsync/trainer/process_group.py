"""The trainer's process group and the FSDP2 (DTensor v2) sharding of a model, for callers that
do not bring their own: `init_trainer_group` / `close_trainer_group` and `shard_model`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn


def init_trainer_group(
    *,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 300.0,
    rank0_hosts_store: bool = True,
    device: str | None = None,
) -> str:
    """Join the trainer's process group (gloo on CPU, NCCL on GPU); returns the device type.

    `device`: "cpu" (gloo) or "cuda" (NCCL, one GPU a rank); default "cuda" where a GPU is
    visible. A CPU trainer on a machine with GPUs passes "cpu".

    The group meets at a TCPStore on (`master_addr`, `master_port`). With `rank0_hosts_store`,
    rank 0 hosts it there; otherwise it already runs (the driver's `TrainerGroup` hosts it, on a
    port the kernel chose: `weightsync.transports.rendezvous.host_store`) and every rank joins it. Either
    way the store listens on `master_addr` only, and this process's gloo groups on the
    interface that reaches it (GLOO_SOCKET_IFNAME, unless set)."""
    import datetime

    import torch.distributed as dist

    from weightsync.transports.rendezvous import host_store, use_gloo_interface_for

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(
            f"device={device!r}: pass 'cpu' (gloo) or 'cuda' (NCCL), or None for "
            f"'cuda' where a GPU is visible"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no GPU is visible here; pass device='cpu' (gloo)")
    if not dist.is_initialized():
        if rank0_hosts_store and master_port == 0:
            raise ValueError(
                "master_port=0 with rank0_hosts_store=True: the other ranks cannot "
                "learn the port; host the store first (weightsync.transports.rendezvous."
                "host_store) and pass its port with rank0_hosts_store=False"
            )
        use_gloo_interface_for(master_addr)
        if rank == 0 and rank0_hosts_store:
            store = host_store(
                master_addr, port=master_port, timeout_s=timeout_s, world_size=world_size
            )
        else:
            store = dist.TCPStore(
                master_addr,
                master_port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    return device


def close_trainer_group() -> None:
    """Leave every process group of this rank (`weightsync.trainer.sync_group.leave_group`, in
    group-name order; not those a failed sync abandoned), so ranks that share several groups meet in each in the same order), then
    destroy them all. All ranks call it, after their last collective."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from weightsync.trainer.sync_group import abandoned, leave_group

    if not dist.is_initialized():
        return
    for group in sorted(_world.pg_names, key=_world.pg_names.__getitem__):
        if not abandoned(group):  # left out of step by a failed sync: no collective there
            leave_group(group)
    dist.destroy_process_group()


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose class names a transformer block ("...Block",
    "...DecoderLayer"), in module order. A block nested in one of them (a MoE layer's
    "Qwen3MoeSparseMoeBlock") is not a block of its own: its parameters are its layer's."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in taken):
            continue
        if type(module).__name__.endswith(("Block", "DecoderLayer")):
            blocks.append(module)
            taken.append(name + ".")
    return blocks


def shard_model(model: nn.Module, *, device: str = "cpu") -> nn.Module:
    """FSDP2-shard `model` over all ranks the way nemo-automodel does: each transformer block,
    then the root. Parameters become DTensors sharded on dim 0 (a MoE layer's grouped expert
    tensors, (experts, rows, cols), on the expert dim)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    model.to(device)
    # Outermost blocks only: fully_shard of a module nested in a sharded block would take its
    # parameters, already DTensors, for tensor-parallel ones and fail in
    # DeviceMesh._concatenate (the 1-D mesh has no dim names).
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
