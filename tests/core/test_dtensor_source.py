"""The DTensor source under a real 2-process gloo FSDP2 group."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from tests.conftest import free_port
from weightsync.apps.models import build_model
from weightsync.trainer.process_group import close_trainer_group, init_trainer_group, shard_model
from weightsync.trainer.source import DTensorV2Source


def _rank_main(rank, world_size, port, arch, results):
    init_trainer_group(
        rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    model = shard_model(build_model(arch, "tiny", seed=3), device="cpu")
    source = DTensorV2Source(model, dtype="bfloat16")
    specs = source.specs()
    is_dtensor = any(type(p).__name__ == "DTensor" for p in model.parameters())
    full = dict(source.tensors())
    if rank == 0:
        results.put(
            {
                "specs": [s.to_dict() for s in specs],
                "aliases": source.aliases,
                "is_dtensor": is_dtensor,
                # numpy, not torch: torch would pass shared-memory handles that die with us
                "full": {k: v.view(torch.int16).numpy().copy() for k, v in full.items()},
            }
        )
    close_trainer_group()


def _gather(arch):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, arch, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = results.get(timeout=240)
    out["full"] = {k: torch.from_numpy(v).view(torch.bfloat16) for k, v in out["full"].items()}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def test_fsdp2_full_tensors_equal_the_unsharded_model_gpt2():
    out = _gather("gpt2")
    assert out["is_dtensor"]
    reference = build_model("gpt2", "tiny", seed=3).state_dict()
    # GPT-2 ties lm_head to wte: only the embedding is sent, once.
    assert out["aliases"] == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" not in out["full"]
    assert set(out["full"]) == set(reference) - {"lm_head.weight"}
    for name, tensor in out["full"].items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].bfloat16()), name
    assert [s["name"] for s in out["specs"]] == list(out["full"])
    assert all(tuple(s["shape"]) == tuple(out["full"][s["name"]].shape) for s in out["specs"])


def test_fsdp2_full_tensors_equal_the_unsharded_model_opt():
    out = _gather("opt")
    reference = build_model("opt", "tiny", seed=3).state_dict()
    assert out["aliases"] == {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    assert set(out["full"]) == set(reference) - {"lm_head.weight"}
    for name, tensor in out["full"].items():
        assert torch.equal(tensor, reference[name].bfloat16()), name


class _Adapter:
    """nemo-automodel's convention: `model.state_dict_adapter.to_hf(state_dict)`."""

    def to_hf(self, state):
        return {f"hf.{k}": v for k, v in state.items()}


def test_state_dict_adapter_renames_to_hf():
    model = build_model("opt", "tiny")
    model.state_dict_adapter = _Adapter()
    names = [s.name for s in DTensorV2Source(model).specs()]
    assert names and all(n.startswith("hf.") for n in names)
    assert "hf.lm_head.weight" not in names


def _pieces_main(rank, world_size, port, results):
    from weightsync.trainer.source import ShardPieces

    init_trainer_group(
        rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port, device="cpu"
    )
    model = shard_model(build_model("gpt2", "tiny", seed=5), device="cpu")
    source = DTensorV2Source(model)
    out = []
    for name, data, offset in ShardPieces(source, rank=rank):
        out.append(
            (
                name,
                None if data is None else data.reshape(-1).view(torch.uint8).numpy().copy(),
                offset,
            )
        )
    results.put((rank, out))
    close_trainer_group()


def test_shard_pieces_written_at_their_offsets_rebuild_every_full_tensor():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_pieces_main, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    by_rank = dict(results.get(timeout=240) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    reference = build_model("gpt2", "tiny", seed=5).state_dict()
    names = [n for n, _, _ in by_rank[0]]
    assert names == [n for n, _, _ in by_rank[1]]
    assert "lm_head.weight" not in names
    for i, name in enumerate(names):
        want = reference[name].contiguous()
        buf = torch.zeros(want.numel() * want.element_size(), dtype=torch.uint8)
        written = 0
        for rank in (0, 1):
            _, data, offset = by_rank[rank][i]
            if data is not None:
                buf[offset : offset + data.size] = torch.from_numpy(data)
                written += data.size
        assert written == buf.numel(), name  # each byte written exactly once
        assert torch.equal(buf.view(want.dtype).view(want.shape), want), name
